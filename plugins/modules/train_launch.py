#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: train_launch
short_description: Start, restart or stop a training job under a reaping supervisor, and prove it started
version_added: 0.1.0
description:
  - Replaces C(nohup ./run.sh > train.log 2>&1 & disown) inside C(pct exec) (which either dies with
    the session or keeps it open) and C(ls train.log) as the only proof of start.
  - Every problem with the options is found before anything changes and reported at once, each naming
    its option (in RV(option_problems) too).
  - With O(backend=supervisor) the module daemonizes a small per-job supervisor (double fork,
    C(setsid), stdin from C(/dev/null), stdout and stderr to O(log_path), every other file descriptor
    closed), so the task returns at once and the job survives the end of the connection and a kill of
    the launcher's process group. The supervisor is the child subreaper of the job
    (C(PR_SET_CHILD_SUBREAPER)), so processes the job orphans are reaped by it and never pile up as
    zombies under a container init that does not reap. It starts the job in a process group of its
    own with the run's mark (C(GPUOPS_RELAUNCH_RUN)) in its environment, forwards SIGTERM to the
    members of that group that descend from it, one by one by (pid, start time), records the exit code or signal and the time atomically in
    the state directory, and exits when the job's whole tree is gone. It runs from a private copy in
    the state directory, so it does not depend on the module's temporary files (see the notes for
    containers whose init never reaps).
  - With O(backend=systemd) the job runs as a transient unit C(gpuops-NAME.service) started by
    C(systemd-run --collect -p KillMode=mixed). The unit's main process is the supervisor program's
    C(exec) mode (from the same private copy), which opens O(log_path) as the supervisor does, takes
    O(user) and O(group), and becomes the job (same pid). systemd itself never opens the log (no
    C(StandardOutput=append:PATH), which would have PID 1 open the path as root after every check,
    through whatever symlink the job's user put there meanwhile), and the unit holds no O(env) (a
    unit's environment is readable by every user) - only the run's mark. Its exit status is recorded
    by an C(ExecStopPost=) hook, because a collected unit can no longer be asked for it.
  - O(state=started) is idempotent like a service. The job's spec is hashed (command, shell, env,
    chdir, user, group). If the job runs with the same spec, backend and O(log_path) nothing changes;
    if it runs with another spec or log path it is restarted; if it does not run it is started.
  - O(state=restarted) always stops the job (if it runs) and starts it again.
  - O(state=stopped) sends SIGTERM to each proven member of the run (followed by SIGCONT, as systemd
    does, so that a member frozen by SIGSTOP runs its handler), waits up to O(term_timeout)
    seconds, sends SIGKILL, and waits until the whole tree is gone, leaving no zombie of the job behind.
  - Membership is proven, never taken from the records. A process belongs to the run if its
    environment carries the run's mark (C(GPUOPS_RELAUNCH_RUN=STATE_DIR/NAME:RUN_ID), set at spawn
    and inherited by everything the job starts) and it did not start before the run, or if it
    descends from the run's supervisor, itself proven by its own mark and start time, whatever its
    environment - or, with the systemd backend, if it runs in the control group of the job's unit
    (C(system.slice/gpuops-NAME.service) below systemd's root) and did not start before the run. The
    same proof says whether the run's main process runs (its recorded pid and start time, and
    membership), so a job whose command ends in C(exec env -i ...) (or C(su -), C(sudo -i), a container
    runtime) and so loses the mark is still the job - running, and left alone by a second
    O(state=started). Ancestry outranks marks; below the proven supervisor, only another job that is
    itself proven (its records believed, its recorded supervisor or run alive) keeps its subtree; a process
    whose marks merely name another job is this job's (RV(stop.mark_conflicts)). No process group is
    ever signalled as a whole; each member goes through the collection's signal gate, which
    never signals PID 1, the module and its ancestors, members of the module's own process group,
    kernel threads, or processes matching the default protected patterns of M(gpuops.relaunch.zombie_reap).
    A recorded pid that fails the proof (reused, restored, edited) is reported in RV(stop.ignored) and left alone.
  - Before anything is stopped or rotated, a start checks that it can work, in check mode exactly as
    for real (so the probe of the C(gpuops.relaunch.relaunch) role fails where the start would, and nothing is
    stopped) - asked as the job's user (a forked child takes the job's groups and user, enters O(chdir)
    as the start does and calls C(access)), since root reaches what the user cannot - O(chdir) can be
    entered, the program is found (on its C(PATH), or relative to O(chdir)) and can be executed, no
    argument or O(env) value holds a NUL byte,
    the directory of O(log_path) exists or can be created and can be written (a read-only file
    system is named), O(log_path) is not a symlink, FIFO, device or a file with other hard links, the
    job's state directory can be kept in O(state_dir), O(remove_paths) can be reached safely, and
    O(backend=systemd) has systemd as PID 1. Each problem names its option (RV(option_problems)).
    A job found running with this spec needs none of this - it is left running.
  - Paths are walked, not trusted. O(log_path), O(state_dir), O(remove_paths) and the job's records
    are reached one directory at a time from C(/), each opened without following a symlink; a symlink
    on the way is followed only where only root can change it (root's own link in a directory only
    root may write, or a sticky one like C(/tmp)), and any other - one the job's user planted, say - is
    refused, naming it. What is done there (rotate, set aside, create, read, remove) is done relative
    to that directory, so swapping a directory afterwards changes nothing.
  - Log lines are escaped before they leave the module - in RV(log_tail), RV(ready_line),
    RV(health.last_progress_line), RV(health.last_step), RV(health.reason) and the incident record -
    every control character but tab (C0, DEL, C1 such as C(U+009B)) and every byte that is not UTF-8
    is written as C(\xNN), so a job's escape sequences (a window title, a cleared screen, colours)
    never reach the operator's terminal.
  - A start first rotates an existing log (C(train.log) becomes C(train.log.1), keeping O(keep_logs)
    earlier logs; a log is never overwritten) - or, if that log is of a start that was never proven,
    sets it aside as C(train.log.failed) (one kept) so failed starts never push out a good run's
    log - then removes O(remove_paths), then launches the job and
    returns only when the proof of start holds - the job is still alive after O(min_uptime) seconds,
    the log exists and, if O(ready_regex) is set, a log line matches it. The task fails with the exit
    code or signal and the log tail when the job ends during startup, and with the log tail when
    O(startup_timeout) passes first. A job whose start was not proven is stopped again, so that a
    second run does not report a job that never proved itself as running.
  - Every call returns the job's RV(health) as the task found it, before it acted (also in check mode) -
    V(running) (alive, and progressing), V(stalled) (alive, but no new log line matching
    O(progress_regex) for O(stall_after) seconds), V(finished) (ended by itself with exit code 0),
    V(crashed) (a non-zero exit code, a signal, or the job's first start could not run it; with the log tail), V(missing)
    (no record of a run, or its main process is gone without an exit record, as after a reboot of the
    container), or V(stopped) (ended because this module stopped it while it was running and
    progressing). A run this module stopped while it was stalled, crashed or missing keeps that
    verdict (a failure stays one - the crash-loop guard counts it, and a relaunch resumes it).
    A start that fails before the job runs (its working directory, its user, its program cannot be
    taken) is the relaunch's own failure, not the job's - the job is judged as the run that start was
    to replace (a healthy run it stopped is V(stopped), never V(missing)), with the failed start named
    in RV(health.reason); the crash-loop guard does not count it, and no O(resume_args) are added for it.
  - O(state=probe) asks what O(state=started) would do, and whether the relaunch should act - it judges
    the job as every state does, plans what O(state=started) would do (RV(operation) V(none), V(start) or
    V(restart), or a refusal by the crash-loop guard) and returns that plan as O(state=started) renders
    it in check mode (RV(operation), RV(resumed), RV(rotated_log), RV(removed_paths), RV(relaunch_guard),
    RV(health), RV(backend), RV(spec_hash), RV(msg) C(would ...)), with RV(decision). It never stops,
    starts, rotates or removes anything and writes no incident record or relaunch history; C(changed) is
    false. A start that could not work fails it, as it fails the check-mode probe. Outside check mode it
    notes progress as O(state=health) does. It waits for the job's lock only when it writes a record
    (O(reset_guard)).
  - RV(decision) (with O(state=probe), V(started), V(restarted) and V(health)) is the relaunch's policy,
    decided in Python - V(relaunch) a job found V(crashed), V(stalled), V(missing) or V(stopped), or one
    that runs with another spec, log path or backend; V(none) for one that V(finished) or runs with this
    spec, unless O(force); V(refused) for a relaunch the crash-loop guard refuses. O(force) changes
    nothing but the decision.
  - O(state=absent) is for a job that is done with - it stops the job first if anything of it runs,
    exactly as O(state=stopped) does (the same proofs and the same signals, through the same gate), then
    ends the job's idle supervisor if one waits (SIGTERM to it alone, proven as this job's by its mark and
    start time; where PID 1 never reaps, it stays a zombie until the container restarts), then removes the
    job's records (O(state_dir)C(/NAME), walked from C(/); a symlink there is removed, never followed) and
    the live file they name (O(metrics_dir)). Logs are kept. Nothing is removed while anything of the job
    still runs - a stop that fails keeps the records, so a later task can still prove and stop what is left.
    It writes no incident record (it would be removed with the records). A second O(state=absent) changes
    nothing; in check mode it says what it would stop, end and remove (RV(removed)), and does none of it.
  - O(state=health) only asks - it returns the verdict, the crash-loop guard's view and the log tail,
    and changes nothing of the job. Outside check mode it notes, as every task does, when it first
    saw the last progress line (C(progress.json) with the job's records), so that a later verdict is
    tighter; C(changed) stays false.
  - A line the job prints is read by chunks and judged by its first 4 KiB (O(progress_regex) and
    O(ready_regex) see those); every line kept or returned (RV(log_tail), RV(ready_line),
    RV(health.last_progress_line), C(progress.json), the incident record) is cut to them before it is
    escaped, and marked as cut (a note at its end gives its whole length), so the records stay small whatever
    the job prints.
  - When the last progress line was written is taken as the tightest upper bound that can be proven -
    the log's modification time (exact when nothing but blank space follows the line), the time an
    earlier task outside check mode first saw that very line, or, before the first progress line, the
    start of the run - so V(stalled) is never premature. A job that keeps printing other lines while
    its steps stand still is found stalled once a task outside check mode has seen its last step.
    Wall-clock times are compared with the wall clock.
  - With O(progress_regex) and O(stall_after) set, O(state=started) restarts a stalled job like one
    that does not run. Like any job that does not run, a V(finished) one is started again by
    O(state=started) (from the start, without O(resume_args)); RV(decision) leaves it alone unless
    O(force).
  - Evidence before anything is signalled - the first changing task (O(state=started), V(restarted) or
    V(stopped), not in check mode) that finds the run V(stalled) or V(crashed) - or V(missing) while some
    of its tree is left to stop - writes an incident record
    C(STATE_DIR/NAME/incidents/incident-TIME-RUNID.json) (0600, atomically, never through a symlink)
    before it signals anything - the verdict, the last 200 log lines, every thread of every proven member
    of the run with its state and wchan, Python stacks from C(py-spy dump --pid) where py-spy is on the
    target's PATH (optional; 10 s per process, 30 s in all), and GPU memory per process where NVML or
    nvidia-smi answer. One record per run (a later task names the one there, in RV(incident)); the
    newest O(keep_logs) records are kept.
  - A relaunch after a failure - a start that replaces a run found V(crashed), V(stalled) or V(missing)
    - appends O(resume_args) to the command (never on a first launch, never after a V(finished) or
    V(stopped) run; RV(resumed) says so) and is counted in C(relaunches.json) with the job's records.
    With O(max_relaunches) set, a relaunch past that many within O(relaunch_window) seconds is refused
    before anything is stopped (the crash-loop guard); RV(relaunch_guard) says on every call whether
    it would be. Only relaunches that could be the job's crash loop count - not one after a failure the
    caller says the hardware caused (O(failure_cause)), nor one whose run got past the step the run before
    it reached (O(progress_regex)) - and one that counts can be made to wait, longer each time (O(relaunch_delay)).
  - The job does not inherit the environment of the Ansible connection. It gets C(PATH), C(HOME),
    C(USER), C(LOGNAME), C(LANG=C.UTF-8) and what O(env) sets.
author:
  - gpuops.relaunch maintainers (@gpuops)
options:
  name:
    description:
      - The job's name. Names its state directory (O(state_dir)/NAME) and, with the systemd backend,
        its unit (C(gpuops-NAME.service)).
      - Letters, digits, C(.), C(_) and C(-), starting with a letter or digit, at most 64 characters.
    type: str
    required: true
  state:
    description:
      - V(started) makes sure the job runs with this spec (and, with O(stall_after), progresses);
        V(restarted) always restarts it; V(stopped) ends it; V(health) only returns RV(health) and
        changes nothing; V(probe) returns what V(started) would do (the plan, as check mode renders it)
        and RV(decision), and changes nothing (see the description); V(absent) stops it as V(stopped)
        does, if anything of it runs, and removes what is left of it (see the description).
    type: str
    choices: [started, restarted, stopped, health, probe, absent]
    default: started
  command:
    description:
      - The job's argv as a list, for example V(['python3', 'train.py', '--config', 'a.yaml']).
      - A string only together with O(shell=true), which runs it through a shell (see O(shell)).
      - Required with O(state=started), O(state=restarted) and O(state=probe).
    type: raw
  shell:
    description:
      - Run O(command), a string, through a shell. Off unless asked for explicitly.
      - The shell is C(bash -o pipefail -c) where bash is installed (C(/bin/bash) or C(/usr/bin/bash)),
        otherwise C(/bin/sh -o pipefail -c) where that shell has pipefail (busybox sh has; dash 0.5.12, the
        C(/bin/sh) of Debian 12, has not), otherwise C(/bin/sh -c). With pipefail a pipeline such as C(python3 train.py | tee out.log)
        ends with the status of its last command that failed, so a trainer killed by SIGKILL (the OOM
        killer) ends the job with exit code 137 (128+9) and RV(health.state) is V(crashed). Without
        pipefail (a C(/bin/sh) like dash 0.5.12 and no bash) the pipeline's status is that of its last
        command (C(tee)'s 0), and such a crash is judged V(finished); there, avoid pipelines (the job's
        output goes to O(log_path) anyway) or end the command line with an explicit check.
      - The spec hash covers the command line, not the shell chosen (see RV(spec_hash)).
    type: bool
    default: false
  chdir:
    description:
      - Absolute path of the job's working directory. Defaults to V(/).
      - Entered as the job's user, after root was dropped (with both backends; systemd's
        C(WorkingDirectory=) is not used, as PID 1 would enter it as root), so a directory the user
        swapped for a link into a place only root may reach is refused, never entered. A job that
        runs as root has it walked as O(log_path) is (no symlink another user can change).
    type: path
  umask:
    description:
      - The job's file mode creation mask, a string of 3 or 4 octal digits from V(0000) to V(0777), quoted (an
        unquoted C(0022) is a YAML number, 18, and is refused). The default is systemd's for a
        service, so the job's checkpoints and outputs are readable by its group and others; V(0077) keeps them
        private to the job's user. The same with both backends (the supervisor itself keeps 0077 for its records).
      - Not part of the spec (see RV(spec_hash)), so a new value takes effect at the job's next start and never
        restarts a running job by itself (O(force) does).
    type: raw
    default: "0022"
  env:
    description:
      - Environment variables for the job, on top of the clean base described above.
    type: dict
    default: {}
  user:
    description:
      - Run the job as this user (with its primary group and supplementary groups). Needs root, and
        Python 3.9 or later on the target.
    type: str
  group:
    description:
      - Run the job with this group. Needs root.
    type: str
  log_path:
    description:
      - Absolute path of the job's log (stdout and stderr). A missing directory is created (mode 0755,
        owned by the user the module runs as); the directory must be writable by that user.
      - It must be a regular file of one link or not exist yet; a symlink, FIFO, device or a file with
        other hard links there is refused. It is opened without following links (nor a symlink on the
        way that another user than root can change) and chowned to O(user).
      - Two jobs cannot share a log. A start (and the probe, and check mode) is refused, naming the other
        job and before anything is stopped or rotated, when the log is the log of another job of the same
        O(state_dir) that runs (its records sound and its main process proven alive) or that another task
        works on now (its lock held), or shares that log's rotation (C(LOG.N), C(LOG.failed) in the same
        directory). Logs are compared as files (device and inode), not as spellings. A record of a run
        that ended blocks nothing. Jobs kept under another O(state_dir) are not seen. A start checks and
        claims its log in one step (a lock on O(state_dir)), so of two starts on one log at the same
        instant one is refused.
      - A new spelling of the log of a job that runs (C(/a//b), C(/a/./b), another name of the same file)
        is no change of its spec - the job is not restarted.
      - A log among a job's records (in O(state_dir)C(/NAME)) is refused.
      - Required with O(state=started), O(state=restarted) and O(state=probe).
    type: path
  keep_logs:
    description:
      - How many earlier logs to keep (C(LOG.1) is the newest). Between V(1) and V(1000).
    type: int
    default: 5
  state_dir:
    description:
      - Absolute path of the directory that holds one state directory per job (mode 0700, files 0600)
        with what was launched, what runs, and how the last run ended.
      - The records are read only as regular files and never trusted as proof of what to signal; one
        that is not sound is reported in RV(record_problems) and ignored. The path is walked like
        O(log_path) (a symlink another user than root can change is refused).
      - A start is refused when O(state_dir)C(/NAME) is, through a link, the same directory as another
        job's there.
      - The default is root's. A task whose user may not create, enter or read O(state_dir)C(/NAME) (a
        non-root C(become_user), say) fails naming O(state_dir) and the role variable C(job_launch_state_dir),
        in every state (a job whose records cannot be read is never taken for one without records); so
        does a log directory it may not create or write (O(log_path), C(job_launch_log_path)).
    type: path
    default: /var/lib/gpuops
  backend:
    description:
      - V(auto) picks V(systemd) where PID 1 is systemd (C(/run/systemd/system) exists and
        C(systemd-run) is installed), and V(supervisor) everywhere else. The choice is returned in RV(backend).
      - V(systemd) where PID 1 is not systemd is refused before anything is stopped.
      - O(state=stopped) always stops the job with the backend that started it.
    type: str
    choices: [auto, supervisor, systemd]
    default: auto
  startup_timeout:
    description:
      - Seconds after the launch by which the proof of start must hold. A finite number from 0 to 86400.
    type: float
    default: 120
  min_uptime:
    description:
      - Seconds the job must stay alive after the launch to count as started (supervisord's
        C(startsecs)). At most O(startup_timeout); a finite number from 0 to 86400.
    type: float
    default: 5
  ready_regex:
    description:
      - Regular expression (Python syntax) for a log line that means "training started", such as
        the first step. Without it, the proof is O(min_uptime) and the log's existence.
    type: str
  term_timeout:
    description:
      - Seconds to wait after SIGTERM before SIGKILL when stopping the job. A finite number from 0 to 86400.
      - With O(backend=systemd) this becomes the unit's C(TimeoutStopSec) when the job is started, and
        that value applies when it is stopped.
      - The collection's one name for this grace, as in
        O(gpuops.relaunch.zombie_reap#module:term_timeout).
    type: float
    default: 30
  remove_paths:
    description:
      - Absolute paths removed (files, links or whole directories) before each start, for example the
        compile cache V(/tmp/torchinductor_root). V(/) and relative paths are refused.
      - A link is removed, never followed, inside a directory too; a path whose directory is reached
        through a symlink another user than root can change is refused before anything is stopped.
    type: list
    elements: path
    default: []
  log_tail_lines:
    description:
      - How many of the log's last lines to return as RV(log_tail). Between V(0) and V(10000).
    type: int
    default: 20
  progress_regex:
    description:
      - Regular expression (Python syntax) for a log line that means progress, for example '^step (\d+)'.
        Its first group (or, without one, the whole match) is the step reported in RV(health.last_step).
      - A line ends at a newline or a carriage return, so each redraw of a progress bar counts.
      - Only the last 8 MiB of the log are searched for the last such line.
      - The crash-loop guard compares the step a failed run reached with the step the run before it reached
        (as numbers) - a run that got past it made progress, and the relaunch after it is not counted against
        O(max_relaunches). Without a progress_regex every relaunch after a failure counts.
    type: str
  stall_after:
    description:
      - Seconds without a new O(progress_regex) line after which a live job is V(stalled). Unset, a job
        is never found stalled. Needs O(progress_regex).
      - Before the first progress line of a run, counted from the run's start, so it must be longer
        than the job takes to reach its first step.
      - A finite number, more than 0 and at most 86400.
      - A start stores O(progress_regex) and O(stall_after) with the run (in C(launch.json)), and a later task that
        gives neither (a bare O(state=health), a probe) judges stalls by them, as the node does for O(metrics_dir).
        A change takes effect at the next start; it never restarts the job by itself.
    type: float
  resume_args:
    description:
      - Arguments appended to O(command) when a start replaces a run found V(crashed), V(stalled) or
        V(missing), for example V(['--resume', 'latest']). With O(shell=true) they are appended to the
        command line, quoted.
      - With O(checkpoint_dir), C({checkpoint}) in an argument is replaced by the path of the newest complete
        checkpoint there and C({step}) by its step (a plain replacement, nothing else is evaluated), for example
        V(['--resume-from', '{checkpoint}']). Without O(checkpoint_dir) they are refused.
      - Not part of the job's spec (the next O(state=started) finds the resumed run running with its spec).
    type: list
    elements: str
    default: []
  resume:
    description:
      - When a start appends O(resume_args). V(auto) - after a run found V(crashed), V(stalled) or V(missing).
        V(always) - whenever the job ran before (never on a first launch), for example for the ranks of a
        multi-rank job relaunched because another rank failed, which must resume from the same checkpoint.
        V(never) - never.
    type: str
    choices: [auto, always, never]
    default: auto
  checkpoint_dir:
    description:
      - Where the job saves its checkpoints. A start that resumes (see O(resume)) picks the newest checkpoint there
        that its framework's own mark says is complete (O(checkpoint_format)), falling back past torn ones (a save
        killed midway), and fills in O(resume_args). Torn ones are reported in RV(checkpoint), never deleted.
      - Judged as root but safely - the directory is reached as every path is (no symlink another user can change
        is followed on the way), nothing inside it is followed (a symlink is never a checkpoint), only regular files
        are opened (never a FIFO), every read and every listing is bounded; the job gets the path as text.
      - It is judged before anything is stopped (so the probe reports it and O(checkpoint_missing=refuse) changes
        nothing) and again once the job is stopped, and that second answer is what the job resumes from.
      - See R(the checkpoint guide,ansible_collections.gpuops.relaunch.docsite.guide_checkpoints).
    type: path
  checkpoint_format:
    description:
      - How a complete checkpoint is told from a torn one. V(dcp) - C(torch.distributed.checkpoint), a step
        directory with its C(.metadata) (written last). V(torch_save) - Lightning and C(torch.save) files (C(.pt),
        C(.pth), C(.ckpt), C(.bin), C(.tar)), whole when their zip end record is there. V(deepspeed) - tags up to
        the one C(latest) names, whose C(*.pt) files are whole. V(megatron) - C(iter_N) up to
        C(latest_checkpointed_iteration.txt), with whole files. V(hf_trainer) - C(checkpoint-N) with
        C(trainer_state.json) and whole weights. V(nemo) - no C(NAME-unfinished) marker beside it. V(marker) - a
        numbered directory holding O(checkpoint_marker). V(auto) - the layout recognised by those marks.
      - The step is the number in the name (C(step=N), C(step_N), C(global_stepN), else its last number).
    type: str
    choices: [auto, dcp, torch_save, deepspeed, megatron, hf_trainer, nemo, marker]
    default: auto
  checkpoint_marker:
    description:
      - With O(checkpoint_format=marker), the file whose presence in a numbered directory says it is complete
        (the job writes it last). A plain file name.
    type: str
    default: COMPLETE
  checkpoint_missing:
    description:
      - What a resuming start does when no checkpoint is complete. V(fresh) - it starts without O(resume_args).
        V(refuse) - it fails before anything is stopped.
    type: str
    choices: [fresh, refuse]
    default: fresh
  checkpoint_step:
    description:
      - The step to resume, the ranks' joint choice (the newest step complete on every rank; the relaunch sets it);
        V(-1) - the ranks share none. Unset, this host's newest complete checkpoint.
    type: int
  checkpoint_rename_torn:
    description:
      - Rename the torn checkpoints newer than the one resumed aside (C(NAME.torn)) once the job is stopped, so
        that the job's own C(latest) logic cannot pick them. Nothing is ever deleted.
    type: bool
    default: false
  max_relaunches:
    description:
      - The crash-loop guard - at most this many relaunches after a failure within O(relaunch_window);
        one more is refused before anything is stopped, with an error naming these options.
        V(0) refuses every relaunch after a failure. Unset, there is no limit (the history is kept anyway).
      - Between V(0) and V(1000).
    type: int
  relaunch_window:
    description:
      - The window of O(max_relaunches), in seconds. A finite number, more than 0 and at most 2592000 (30 days).
    type: float
    default: 3600
  relaunch_delay:
    description:
      - The growing delay of a job that keeps failing, modelled on systemd's C(RestartSec), C(RestartSteps) and
        C(RestartMaxDelaySec). The first counted relaunch within O(relaunch_window) is made at once; the
        second is due this many seconds after the last relaunch, each later one twice as long as the one
        before, at most O(relaunch_max_delay). Relaunches that are not counted (RV(relaunch_guard.counts)) are never delayed.
      - Nothing waits for it - no worker is held. Before its due time RV(decision.action) is V(none) with
        RV(decision.due_at), so the relaunch leaves the job for a later run (the event path's repeated alert,
        a schedule); a O(state=started) or O(state=restarted) before it fails with the due time, to be retried.
      - A finite number of seconds between V(0) and V(3600). V(0) (the default) never delays.
    type: float
    default: 0
    version_added: 0.2.0
  relaunch_max_delay:
    description:
      - The longest delay O(relaunch_delay) grows to, in seconds; at least O(relaunch_delay) and at most V(86400).
    type: float
    default: 600
    version_added: 0.2.0
  failure_cause:
    description:
      - What caused the failure a relaunch now follows. V(hardware) - the GPU health gate found the job's GPU
        at fault (and it was reset); the relaunch is made and recorded, but not counted against
        O(max_relaunches) and never delayed. V(unknown) - counted as before, unless the run made progress
        (see O(progress_regex)).
      - The caller's word, as O(force) is - the module does not check the hardware itself
        (M(gpuops.relaunch.gpu_health) does). Give the same value to the probe and to the start.
    type: str
    choices: [unknown, hardware]
    default: unknown
    version_added: 0.2.0
  force:
    description:
      - Decide to relaunch a job that would be left alone - one that V(finished), or runs with this
        spec. Changes RV(decision) only (V(relaunch), its RV(decision.why) starting C(forced)); what the
        task does is unchanged (the C(gpuops.relaunch.relaunch) role stops the job first, then starts it).
      - The crash-loop guard still refuses a relaunch after a failure past O(max_relaunches).
    type: bool
    default: false
  reset_guard:
    description:
      - Reset the crash-loop guard - clear the job's relaunch history (C(relaunches.json) with its
        records) before judging, so that RV(relaunch_guard), the plan and RV(decision) see no earlier
        relaunch. The documented way out of a refusal once the cause is fixed, instead of waiting for
        O(relaunch_window) to pass or raising O(max_relaunches).
      - C(changed) is true when entries were cleared (in check mode, would be; nothing is cleared);
        RV(guard_cleared) says how many.
    type: bool
    default: false
  end_supervisor:
    description:
      - With O(state=stopped) only - also end the job's idle supervisor, as O(state=absent) does, but keep its records
        (the relaunch history, incident records, the exit of its last run). A supervisor stays idle after its run
        where nothing would reap it (PID 1 of a container or namespace that never reaps), and a later start
        reuses it; ended, it may stay a zombie there until the container restarts. C(playbooks/stop.yml) sets it.
    type: bool
    default: false
  wait_for:
    description:
      - With O(state=health) only - ask again (every half second) until RV(health.state) is one of these verdicts,
        or O(wait_timeout) passes; then fail, naming the verdict seen last. The wait is in the module, so a playbook
        waiting for a stall needs no C(until)/C(retries) (whose C(FAILED - RETRYING) lines read as failures).
      - Empty, the verdict is returned at once.
    type: list
    elements: str
    choices: [running, stalled, finished, crashed, missing, stopped]
    default: []
  wait_timeout:
    description:
      - How long O(wait_for) waits, in seconds (0 to 86400).
    type: float
    default: 60
  expect_run_id:
    description:
      - With O(state=stopped) only. The run the caller's look saw, which this stop is for (the run-id fence) -
        RV(health.run_id) of an earlier V(probe) or V(health), or the empty string when that look saw no run.
      - When the job's recorded run is another, newer run than this one and its main process runs (another
        task relaunched the job since the look - a watchdog's relaunch and an alert's at once), nothing is
        stopped and no incident record is written; C(changed) is false, RV(superseded) is true and RV(newer_run)
        names that run. The check is made under the job's lock, which a start holds until its run is proven.
      - The expected run itself, or a newer run that does not run any more, is stopped as without this option.
        The C(gpuops.relaunch.relaunch) role passes the run its probe saw.
      - Unset, the stop ends whatever run the records name (no fence).
    type: str
    version_added: 0.2.0
  metrics_dir:
    description:
      - Keep the job's health live on the node, without Ansible, in C(METRICS_DIR/gpuops_job_JOB.prom) for
        node_exporter's textfile collector (C(--collector.textfile.directory)). The node rewrites it within moments of
        the job's exit (crashed, finished, stopped), within O(stall_after) plus 5 seconds of its last progress line
        (stalled), and every 5 seconds while it runs (C(gpuops_job_seconds_since_progress), C(gpuops_job_last_step)).
        The supervisor does it beside its wait; with O(backend=systemd), a second transient unit
        C(gpuops-live:NAME.service) bound to the job's unit, and the unit's C(ExecStopPost) at its end.
      - The judgement is O(state=health)'s, from a standard-library copy in the job's state directory next to the
        supervisor's; the file is replaced whole (a temporary file renamed over it, a symlink at its name replaced,
        never followed). It holds the job's health series (C(gpuops_job_health), C(gpuops_job_seconds_since_progress),
        C(gpuops_job_last_progress_timestamp_seconds), C(gpuops_job_last_step)) and C(gpuops_job_live_timestamp_seconds),
        each labelled with the run it judges (C(gpuops_run), the run's id, so that the event path's alert of each failed run is
        its own); the relaunch's file (M(gpuops.relaunch.relaunch_summary)'s O(gpuops.relaunch.relaunch_summary#module:metrics_dir))
        then leaves those out. See R(the metrics guide,ansible_collections.gpuops.relaunch.docsite.guide_metrics).
      - An existing directory (it is not created), walked from C(/) without a symlink another user can change; checked
        before anything is stopped. Stored with the run, so a change takes effect at the next start. Unset, no live file.
    type: path
    version_added: 0.2.0
  metrics_host:
    description:
      - The inventory hostname, for the C(gpuops_host) label of the live file (node_exporter's C(instance) is an
        address). Required with O(metrics_dir); the roles pass C(inventory_hostname). At most 253 characters.
    type: str
    version_added: 0.2.0
  metrics_rank0:
    description:
      - For a rank of a multi-rank job, the inventory hostname of the job's rank 0, for the C(gpuops_rank0) label
        of the live file; unset, O(metrics_host) (a job of one host is its own rank 0). Every rank's alert then
        carries one value, by which Alertmanager groups them into one notification and the event-driven relaunch
        runs once for the whole job (extensions/eda). The relaunch role passes it. At most 253 characters.
      - Like O(metrics_dir), part of what a start stores, not of the spec - it never restarts a job by itself.
    type: str
    version_added: 0.2.0
  metrics_gpus:
    description:
      - The job's GPUs (indices or UUIDs, as M(gpuops.relaunch.gpu_mem_wait)'s O(gpuops.relaunch.gpu_mem_wait#module:devices)),
        whose health the live file then reports too, per GPU (labels C(gpu), C(uuid)) - M(gpuops.relaunch.gpu_health)'s
        verdict (C(gpuops_gpu_health)), NVML's recovery action, the last XID of the kernel's own log since the run
        started and whether the GPU is quarantined - and when the node last looked (C(gpuops_gpu_look_timestamp_seconds),
        C(gpuops_gpu_look_ok)).
      - The node looks at most every 15 seconds and at once when the job ends, each time in a short-lived child
        (C(python3 -I), NVML never loaded in the supervisor) killed after 5 seconds if the driver hangs. The child
        imports C(pynvml) from where this module's Python finds it at the start.
      - Needs O(metrics_dir). At most 64. Like O(metrics_dir), part of what a start stores, not of the spec.
      - See R(the GPU health guide,ansible_collections.gpuops.relaunch.docsite.guide_gpu_health).
    type: list
    elements: str
    version_added: 0.2.0
notes:
  - The supervisor exits once the job's whole tree is gone, except where its parent (in a container,
    PID 1) neither catches nor ignores SIGCHLD and so may never reap it. Exiting there would leave the
    supervisor itself as a zombie for ever, so it stays idle instead (one sleeping process per job
    name, with no child) and the next start of that job hands the new run to it.
  - A second task on the same job waits for the first (a lock in the job's state directory), at most
    O(term_timeout) + O(startup_timeout) + 90 seconds.
extends_documentation_fragment:
  - gpuops.relaunch.attributes
attributes:
  check_mode:
    support: full
    details:
      - Says in RV(msg) what it would do (start, restart, stop, rotate the log, remove paths) and
        changes nothing; RV(rotated_log) and RV(removed_paths) name what would be rotated and removed.
      - A start that could not work fails in check mode too, with the same checks and messages as for
        real (see the description).
      - RV(health) is judged as outside check mode; no incident record, progress record or relaunch
        history is written (nor cleared by O(reset_guard)). A relaunch the crash-loop guard would refuse does not fail in check mode -
        RV(relaunch_guard.would_refuse) and RV(msg) say so.
  diff_mode:
    support: partial
    details:
      - A start or restart (in check mode too, and O(state=probe)) returns a diff of the job's spec - the
        recorded run's launch beside this task's, only the fields that differ (C(command), C(env.KEY),
        C(chdir), C(user), C(group), C(log_path), C(backend)), every value with its control characters
        escaped and the value of an O(env) key that looks secret (C(TOKEN), C(PASSWORD), C(PASSWD),
        C(SECRET), C(KEY), C(CREDENTIAL) in its name) masked, saying only whether it changed. So
        C(--check --diff) shows what a restart is for before it happens. A stop reports no diff.
  platform:
    platforms: linux
    details:
      - Linux only (C(/proc), C(PR_SET_CHILD_SUBREAPER)); the target, where the job runs.
"""

EXAMPLES = r"""
- name: Keep the job running and progressing; relaunch after a crash, a stall or a reboot, resuming
  gpuops.relaunch.train_launch:
    name: llm-pretrain
    command: [/usr/bin/python3, /workspace/train.py, --config, /workspace/run.yaml]
    log_path: /workspace/train.log
    ready_regex: '^step \d+ '
    progress_regex: '^step (\d+) '
    stall_after: 900
    resume_args: [--resume, /workspace/ckpt/latest]
    max_relaunches: 3
    relaunch_window: 3600

- name: Ask what the relaunch should do (changes nothing; a finished job is relaunched only with force)
  gpuops.relaunch.train_launch:
    name: llm-pretrain
    state: probe
    command: [/usr/bin/python3, /workspace/train.py, --config, /workspace/run.yaml]
    log_path: /workspace/train.log
    progress_regex: '^step (\d+) '
    stall_after: 900
    resume_args: [--resume, /workspace/ckpt/latest]
    max_relaunches: 3
    force: false
  register: probe

- name: Say what it decided and why
  ansible.builtin.debug:
    msg: "{{ probe.decision.action }} (resume {{ probe.decision.resume }}): {{ probe.decision.why }}"

- name: After fixing the cause of a crash loop, reset the crash-loop guard and relaunch
  gpuops.relaunch.train_launch:
    name: llm-pretrain
    command: [/usr/bin/python3, /workspace/train.py, --config, /workspace/run.yaml]
    log_path: /workspace/train.log
    max_relaunches: 3
    reset_guard: true

- name: Ask how the job is doing (changes nothing)
  gpuops.relaunch.train_launch:
    name: llm-pretrain
    state: health
    progress_regex: '^step (\d+) '
    stall_after: 900
  register: job

- name: Say so
  ansible.builtin.debug:
    msg: "{{ job.health.state }} at step {{ job.health.last_step }}: {{ job.health.reason }}"

- name: Start the training job (unchanged if it already runs with this spec)
  gpuops.relaunch.train_launch:
    name: llm-pretrain
    command: [/usr/bin/python3, /workspace/train.py, --config, /workspace/run.yaml]
    chdir: /workspace
    env:
      CUDA_VISIBLE_DEVICES: "0,1"
    log_path: /workspace/train.log
    ready_regex: '^step 1 '
    min_uptime: 10
    startup_timeout: 300
    remove_paths:
      - /tmp/torchinductor_root

- name: Restart it, keeping the previous log as train.log.1
  gpuops.relaunch.train_launch:
    name: llm-pretrain
    state: restarted
    command: [/usr/bin/python3, /workspace/train.py, --config, /workspace/run.yaml]
    log_path: /workspace/train.log

- name: A shell command line, explicitly
  gpuops.relaunch.train_launch:
    name: legacy-run
    command: /root/run.sh --resume 2>&1 | tee -a /root/extra.log
    shell: true
    log_path: /root/train.log

- name: Stop it, SIGKILL after 60 s, and wait until its whole tree is gone
  gpuops.relaunch.train_launch:
    name: llm-pretrain
    state: stopped
    term_timeout: 60
"""

RETURN = r"""
name:
  description: The job's name.
  returned: always
  type: str
  sample: llm-pretrain
state:
  description: The requested state.
  returned: always
  type: str
  sample: started
backend:
  description: The backend of the job (the one chosen for a start, else the one that started it; null if none ever did).
  returned: always
  type: str
  sample: supervisor
operation:
  description:
    - What the task does (in check mode, would do) to reach O(state) - V(none) (already there),
      V(start), V(restart) or V(stop); with O(state=probe), what O(state=started) would do. Unlike
      C(changed) it is structured for a decision, for example by a probe whose change should not be counted.
  returned: always, except when the options were refused
  type: str
  sample: start
running:
  description: Whether the job runs when the task ends (in check mode, whether it runs now).
  returned: always
  type: bool
  sample: true
msg:
  description: What was done, or what would be done in check mode, or why the task failed.
  returned: always
  type: str
  sample: started with backend supervisor; proof of start holds
state_dir:
  description: The job's own state directory.
  returned: always
  type: str
  sample: /var/lib/gpuops/llm-pretrain
log_path:
  description: The job's log.
  returned: always
  type: str
  sample: /workspace/train.log
log_tail:
  description: The last O(log_tail_lines) lines of the log, control characters escaped (C(\x1b)).
  returned: always, except in check mode when something would change
  type: list
  elements: str
  sample: ["loading data", "step 1 loss=2.31"]
run_id:
  description: Identifier of the run (one per start).
  returned: when the job was ever started
  type: str
  sample: 3f2a9c0e5b8d4e1f9a7c6b5d4e3f2a1b
pid:
  description: PID of the job's main process (in the PID namespace of the target).
  returned: when the job was ever started
  type: int
  sample: 4242
pgid:
  description: The job's process group (its main process leads it).
  returned: when the job was ever started
  type: int
  sample: 4242
starttime:
  description:
    - Start time of the main process in clock ticks since boot (C(/proc/PID/stat) field 22).
    - With RV(pid) it identifies the process even if the pid is reused.
  returned: when the job was ever started
  type: int
  sample: 1234567
started_at:
  description: When the job was started (ISO 8601, UTC).
  returned: when the job was ever started
  type: str
  sample: "2026-12-02T16:00:00.123456+00:00"
spec_hash:
  description: sha256 of the job's spec (command, shell, env, chdir, user, group).
  returned: when the job was ever started, and for started/restarted
  type: str
  sample: 9b1f0c1c7a0e4b1a8f7d1e2c3b4a5968778695a4b3c2d1e0f9e8d7c6b5a49382
supervisor_pid:
  description: PID of the job's supervisor.
  returned: with the supervisor backend, when the job was ever started
  type: int
  sample: 4241
unit:
  description: The transient unit that runs the job.
  returned: with the systemd backend, when the job was ever started
  type: str
  sample: gpuops-llm-pretrain.service
ready_line:
  description: The log line that matched O(ready_regex) (C(null) without one), control characters escaped.
  returned: after a start
  type: str
  sample: step 1 loss=2.31
elapsed:
  description:
    - Seconds the module spent on the task, from its start to its result (stopping an old run,
      rotating, launching and proving the start included). The collection's one name for elapsed
      seconds; M(gpuops.relaunch.zombie_reap) returns it too.
  returned: always
  type: float
  sample: 5.3
option_problems:
  description:
    - Every problem found with the options, or with what a start needs from the machine (the program, O(chdir), the
      log's directory and file, O(state_dir), O(remove_paths), O(backend)), each a dict of C(option), its name, and
      C(reason), what is wrong with its value (never the value of a secret).
  returned: when the options were refused, or a start could not work, before anything was changed
  type: list
  elements: dict
  sample: [{"option": "term_timeout", "reason": "must be a finite number of seconds, got nan"}]
rotated_log:
  description: The name the previous log got (C(LOG.1) by rotation, or C(LOG.failed) for the log of a start that was never proven; C(null) if there was none).
  returned: after a start, and for a planned start in check mode (started/restarted) and with state probe
  type: str
  sample: /workspace/train.log.1
removed_paths:
  description: The O(remove_paths) that existed and were removed (in check mode and with state probe, that would be).
  returned: after a start, and for a planned start in check mode (started/restarted) and with state probe
  type: list
  elements: str
  sample: [/tmp/torchinductor_root]
exit_code:
  description: Exit code of the job's main process (null if a signal ended it).
  returned: when the job has ended (stopped, or failed during startup)
  type: int
  sample: 3
exit_signal:
  description: Name of the signal that ended the job's main process (null if it exited).
  returned: when the job has ended (stopped, or failed during startup)
  type: str
  sample: SIGTERM
ended_at:
  description: When the job's main process ended (ISO 8601, UTC).
  returned: when the job has ended (stopped, or failed during startup)
  type: str
  sample: "2026-12-02T16:10:00.654321+00:00"
start_error:
  description:
    - Why the backend could not start the command at all (for example, the program does not exist, or
      its interpreter; the working directory cannot be entered as the job's user).
  returned: when the job could not be started
  type: str
  sample: "cannot start ['/no/such/program']: [Errno 2] No such file or directory: '/no/such/program'"
stopped_after_failure:
  description: True when the start was not proven and the job, still running, was stopped again.
  returned: when the proof of start failed while the job still ran
  type: bool
  sample: true
previous:
  description: The run that this start replaced (run_id, pid, started_at and, if known, exit_code, exit_signal, ended_at).
  returned: after a start that replaced an earlier run
  type: dict
  sample: {"pid": 4100, "exit_code": null, "exit_signal": "SIGTERM", "ended_at": "2026-12-02T16:09:59.1+00:00"}
superseded:
  description:
    - With O(expect_run_id) - whether the job runs a newer run than the expected one, which this stop left
      alone (then C(changed) is false and nothing was stopped).
  returned: with state stopped and O(expect_run_id)
  type: bool
  sample: true
newer_run:
  description:
    - The newer run that RV(superseded) left alone - its run_id, pid, starttime and started_at; null when not superseded.
  returned: with state stopped and O(expect_run_id)
  type: dict
  sample: {"run_id": "7c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f", "pid": 4388, "starttime": 1003100,
           "started_at": "2026-12-02T16:11:02.5+00:00"}
stop:
  description: What stopping took.
  returned: when the task stopped a running job
  type: dict
  sample: {"signalled": [4242, 4250], "escalated": false, "unreapable_zombies": [], "ignored": []}
  contains:
    signalled:
      description: The PIDs that got a signal (each a proven member of the run).
      type: list
      elements: int
    escalated:
      description: Whether SIGKILL was needed.
      type: bool
    unreapable_zombies:
      description: Zombies of the job that nothing of the job can reap (their parent left).
      type: list
      elements: dict
    ignored:
      description:
        - Recorded pids (C(record) is C(pid) or C(supervisor_pid)) that name a live process which
          failed the membership proof - a reused pid, or a record restored or edited - with the
          reason. They were not signalled.
      type: list
      elements: dict
      sample: [{"record": "pid", "pid": 4100, "comm": "sshd", "reason": "not this run's process: it does not carry this run's mark; ignored"}]
    mark_conflicts:
      description:
        - Processes that descend from the run's proven supervisor but whose C(GPUOPS_RELAUNCH_*) marks name
          another job (C(marked_job_dir), escaped) - a job that does not exist, another job whose marks
          it copied, or this job's directory spelled otherwise. Ancestry outranks what a process says
          about itself, so they were stopped as this job's. Descent stops only at another job that is
          proven (its records believed, its recorded supervisor or run alive and carrying its mark).
      type: list
      elements: dict
      sample:
        - pid: 4250
          comm: python3
          marked_job_dir: /var/lib/gpuops/eval
          reason: "its marks name another job, but it descends from this job's proven supervisor: this job's"
    remaining:
      description:
        - What still ran at the deadline (only on failure), with C(protected) saying why a process
          may never be signalled where that is the reason it remains, and C(waited_for_by_supervisor)
          on a child of the supervisor that belongs to another proven job (the supervisor exits only
          when its last child has). The task's message names every pid.
      type: list
      elements: dict
      returned: on failure
health:
  description:
    - The job's health as the task found it, before it acted (in check mode too).
  returned: always, except when the options were refused
  type: dict
  sample: {"state": "stalled", "reason": "alive, but no progress for 912.4s (stall_after 900s); last: step 4120",
           "run_id": "3f2a9c0e5b8d4e1f9a7c6b5d4e3f2a1b", "last_step": "4120", "last_progress_line": "step 4120 loss=1.92",
           "last_progress_at": "2026-12-02T16:00:00+00:00", "progress_basis": "log_mtime", "since_progress": 912.4,
           "exit_code": null, "exit_signal": null, "ended_at": null, "stopped": false, "log_tail": ["step 4120 loss=1.92"]}
  contains:
    state:
      description: V(running), V(stalled), V(finished), V(crashed), V(missing) or V(stopped) (see the description).
      type: str
    reason:
      description:
        - Why, for people (decide on RV(health.state), never on this text).
        - A live run whose main process is held still says so first, with its state and wait channel
          ("alive, but stopped by a signal (state T, wchan do_signal_stop ...)", "stopped by a debugger",
          "frozen by a cgroup freezer"), instead of a plain running or stall. The incident record names
          such a process in its C(frozen) field.
      type: str
    run_id:
      description: The run judged (null when there is no record of one).
      type: str
    last_step:
      description: The first group of the last O(progress_regex) line (or the whole match); null without one.
      type: str
    last_progress_line:
      description: The last line matching O(progress_regex), control characters escaped.
      type: str
    last_progress_at:
      description: The latest moment the last progress can have happened (ISO 8601, UTC); see the description.
      type: str
    progress_basis:
      description:
        - What RV(health.last_progress_at) rests on - V(log_mtime), V(progress_record) (an earlier task
          saw the line then), V(run_start) (no progress line yet) or V(unknown) (the log cannot be read).
      type: str
    since_progress:
      description: Seconds since RV(health.last_progress_at) (a lower bound of the real time without progress).
      type: float
    exit_code:
      description: The recorded exit code of the run (V(finished), V(crashed), V(stopped)).
      type: int
    exit_signal:
      description: The signal that ended the run's main process, if one did.
      type: str
    ended_at:
      description: When the run's main process ended (ISO 8601, UTC).
      type: str
    stopped:
      description: Whether the run ended because this module stopped it.
      type: bool
    log_tail:
      description: The last O(log_tail_lines) lines of the run's log (V(crashed), V(stalled) and V(missing) only).
      type: list
      elements: str
live_metrics:
  description:
    - The live file the node keeps for the run (O(metrics_dir)) - after a start, the new run's; otherwise the recorded
      run's, if its start set O(metrics_dir). Null when there is none.
  returned: success
  type: str
  sample: /var/lib/prometheus/node-exporter/gpuops_job_llm-pretrain.prom
  version_added: 0.2.0
incident:
  description:
    - The incident record of the run found V(stalled), V(crashed) or V(missing) (with some of its tree left
      to stop) - written by this task before anything
      was signalled, or the one an earlier task wrote for this run. Null when there is none.
  returned: with state started, restarted, stopped or probe, unless the options were refused (null in check mode and with state probe)
  type: str
  sample: /var/lib/gpuops/llm-pretrain/incidents/incident-20261202T161500.123456Z-3f2a9c0e5b8d4e1f9a7c6b5d4e3f2a1b.json
resumed:
  description: Whether O(resume_args) were (in check mode and with state probe, would be) appended to the command of this start.
  returned: with state started, restarted and probe, unless the options were refused
  type: bool
  sample: true
checkpoint:
  description:
    - With O(checkpoint_dir), what the resolver found - judged before anything was stopped, and (after a start)
      again once the job was stopped, which is what the job resumed from. Names are escaped as log lines are.
  returned: with O(checkpoint_dir) and state started, restarted or probe, unless the options were refused
  type: dict
  sample: {"dir": /workspace/ckpt, "format": dcp, "path": /workspace/ckpt/step_1200, "step": 1200, "torn_skipped": 1,
           "torn": [{"path": /workspace/ckpt/step_1300, "step": 1300, "why": "no .metadata (written last)"}],
           "renamed": [], "complete_steps": [1200, 1100], "notes": [], "seconds": 0.0012, "resumed": true}
  contains:
    dir:
      description: O(checkpoint_dir).
      type: str
    format:
      description: The format judged by (with V(auto), the one recognised; V(auto) where none was).
      type: str
    path:
      description: The checkpoint chosen (its path, as the job gets it in C({checkpoint})); null when none is complete.
      type: str
    step:
      description: Its step (C({step})); null when none is complete.
      type: int
    torn_skipped:
      description: How many torn checkpoints newer than the chosen one were skipped.
      type: int
    torn:
      description: Those torn checkpoints, each with its path, step and why it is torn.
      type: list
      elements: dict
    renamed:
      description: Where O(checkpoint_rename_torn) renamed them.
      type: list
      elements: str
    complete_steps:
      description: The newest complete steps (at most 32), newest first - the ranks' joint decision intersects them.
      type: list
      elements: int
    notes:
      description: What else the resolver noted (a tracker file that names no step, a fresh start).
      type: list
      elements: str
    seconds:
      description: How long the resolver took.
      type: float
    resumed:
      description: Whether the start resumes from RV(checkpoint.path).
      type: bool
relaunch_guard:
  description: The crash-loop guard for a start now (after O(reset_guard), if given).
  returned: with state started, restarted, health and probe, unless the options were refused
  type: dict
  sample: {"max_relaunches": 3, "relaunch_window": 3600.0, "recent": 3, "needed": true, "would_refuse": true,
           "history": [{"at": 1764691200.0, "at_iso": "2026-12-02T16:00:00+00:00", "run_id": "3f2a9c0e", "health": "crashed"}]}
  contains:
    max_relaunches:
      description: O(max_relaunches) (null - no limit).
      type: int
    relaunch_window:
      description: O(relaunch_window).
      type: float
    recent:
      description: How many relaunches after a failure within the window count against O(max_relaunches).
      type: int
    recent_all:
      description: How many relaunches after a failure happened within the window, counted or not.
      type: int
      version_added: 0.2.0
    history:
      description:
        - Those relaunches (the last 20) - when (C(at), C(at_iso)), which run they replaced and its health, the
          step it reached (C(step)), the caller's C(cause), whether it counted (C(counted)) and why (C(why)).
      type: list
      elements: dict
    counts:
      description:
        - Whether a relaunch now would count against O(max_relaunches) - false when O(failure_cause=hardware),
          or when the failed run got past the step the run before it reached (numbers read with
          O(progress_regex)); false when no relaunch is needed.
      type: bool
      version_added: 0.2.0
    why:
      description: Why it counts or not, for people (null when no relaunch is needed).
      type: str
      version_added: 0.2.0
    step:
      description: The last progress step the failed run reached (null without a progress line or O(progress_regex)).
      type: str
      version_added: 0.2.0
    cause:
      description: O(failure_cause).
      type: str
      version_added: 0.2.0
    delay:
      description: The growing delay of this relaunch in seconds (O(relaunch_delay)); V(0) when none.
      type: float
      version_added: 0.2.0
    due_at:
      description: When this relaunch is due (seconds since the epoch), or null without a delay.
      type: float
      version_added: 0.2.0
    due_at_iso:
      description: RV(relaunch_guard.due_at) as ISO 8601.
      type: str
      version_added: 0.2.0
    wait:
      description: Seconds until RV(relaunch_guard.due_at) (V(0) when due).
      type: float
      version_added: 0.2.0
    needed:
      description: Whether a start now would be a relaunch after a failure (the health is V(crashed), V(stalled) or V(missing) with a recorded run).
      type: bool
    would_refuse:
      description: Whether the guard refuses (in check mode, would refuse) that relaunch.
      type: bool
decision:
  description:
    - The relaunch's decision on the job, from RV(health), whether it runs with another spec, log path or
      backend, RV(relaunch_guard) and O(force) - what C(gpuops.relaunch.relaunch) acts on. Decide on
      RV(decision.action), never on RV(decision.why).
    - With O(state=health) (no command) a job that runs with another spec is not told apart from one
      that runs with this spec; use O(state=probe) for that.
  returned: with state probe, started, restarted and health, unless the options were refused
  type: dict
  sample: {"action": "relaunch", "relaunch": true, "resume": true, "resume_mode": "always", "resumable": true,
           "why": "the job is crashed: ended with exit code 3 at 2026-12-02T16:10:00+00:00"}
  contains:
    action:
      description:
        - V(relaunch) - the job is V(crashed), V(stalled), V(missing) or V(stopped), runs with another
          spec, log path or backend, or O(force) relaunches a job that V(finished) or runs with this spec.
        - V(none) - left alone (it V(finished), or runs with this spec; O(force) relaunches it; or a relaunch
          that is not due yet, see O(relaunch_delay) and RV(decision.due_at)).
        - V(refused) - a relaunch is wanted but the crash-loop guard refuses it (RV(decision.why) is
          the refusal, naming O(max_relaunches), O(relaunch_window) and O(reset_guard)).
      type: str
      choices: [none, relaunch, refused]
    relaunch:
      description: Whether RV(decision.action) is V(relaunch).
      type: bool
    why:
      description: Why, for people (the wording of the relaunch's summary).
      type: str
    resume:
      description:
        - Whether the relaunch appends O(resume_args) (after a failure with O(resume=auto), after any
          earlier run with O(resume=always)); false when nothing is relaunched.
      type: bool
    resume_mode:
      description:
        - The O(resume) value that makes the start of this relaunch do what RV(decision.resume) says
          (V(always) when it resumes, else V(never)); the start decides with the same rule.
      type: str
      choices: [always, never]
    due_at:
      description:
        - When a relaunch left alone for the growing delay (O(relaunch_delay)) is due, ISO 8601; the next
          relaunch run after it relaunches the job.
      returned: when a relaunch is not due yet
      type: str
      version_added: 0.2.0
    resumable:
      description:
        - Whether a start told O(resume=always) would append O(resume_args) (there are some, and the job ran
          before), whatever this decision is. The relaunch tells the other ranks of a multi-rank job one of whose
          ranks failed to resume, and reports by it whether each does.
      type: bool
      version_added: 0.2.0
guard_cleared:
  description: How many relaunches O(reset_guard) cleared from the job's history (in check mode, would clear).
  returned: when O(reset_guard) is true, unless the options were refused
  type: int
  sample: 3
record_problems:
  description:
    - Records in the job's state directory that were not sound (not JSON, a field of the wrong kind,
      a symlink or FIFO in place of a file), each with what was wrong. They were ignored.
  returned: when a record was not sound
  type: list
  elements: str
  sample: ["/var/lib/gpuops/llm-pretrain/run.json: pid is not a process number or start time ('abc'); ignored"]
removed:
  description: What O(state=absent) removed (in check mode, would remove) - the job's records directory and its live file.
  returned: with state absent
  type: list
  elements: str
  sample: ["/var/lib/gpuops/llm-pretrain"]
idle_supervisor:
  description: The idle supervisor that O(state=absent) ended (its pid, the signal, and whether the gate sent it).
  returned: when state absent found one
  type: dict
  sample: {"pid": 4100, "signal": "SIGTERM", "sent": true}
diff:
  description:
    - With C(--diff), what the start changes in the job's spec - the fields of the recorded run's launch that
      differ from this task's, one line each, values escaped, the values of O(env) keys that look secret masked
      (see the diff_mode attribute). C(before) is empty for a job with no recorded run.
  returned: with --diff, when the task starts or restarts the job (in check mode and with state probe, would)
  type: dict
  sample: {"before": "command: python3 train.py --lr 0.1\nenv.WANDB_API_KEY: ********\n",
           "after": "command: python3 train.py --lr 0.05\nenv.WANDB_API_KEY: ******** (changed)\n",
           "before_header": "recorded run 3f2a9c0e5b8d4e1f9a7c6b5d4e3f2a1b", "after_header": "restart with this task's spec"}
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.checkpoints import FORMATS as CHECKPOINT_FORMATS
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.control import MODULE_STATES, LaunchController, LaunchError
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.decision import PLANNING_STATES
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import HEALTH_WORDS
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import options_from_params

# One GPU query for the incident record may take this long (NVML can hang in the kernel).
GPU_QUERY_TIMEOUT = 10.0


def gpu_evidence(members: list[int]) -> dict:
    """GPU memory per device and per process for the incident record; never fails the task.

    The pids NVML reports are the host's: inside a container they differ from the members' pids,
    so C(job_member) can only say yes where both live in the same PID namespace.
    """
    # Imported here: only an incident record asks for it, and every run of the module compiles what it imports.
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (  # pylint: disable=import-outside-toplevel
        GpuQueryError, open_gpu_source)
    # OSError and ValueError too: the evidence is optional, and must never keep the stop from happening.
    try:
        source = open_gpu_source("auto", "nvidia-smi", GPU_QUERY_TIMEOUT)
    except GpuQueryError as exc:
        return {"available": False, "kind": exc.kind, "reason": str(exc)}
    except (OSError, ValueError) as exc:
        return {"available": False, "kind": "error", "reason": str(exc)}
    try:
        devices = source.query()
    except GpuQueryError as exc:
        return {"available": False, "kind": exc.kind, "reason": str(exc)}
    except (OSError, ValueError) as exc:
        return {"available": False, "kind": "error", "reason": str(exc)}
    finally:
        source.close()
    return {"available": True, "backend": source.backend, "devices": [{
        "index": device.index, "uuid": device.uuid, "name": device.name,
        "used_mib": device.used_mib, "total_mib": device.total_mib,
        "processes": [{"pid": process.pid, "used_mib": process.used_mib, "job_member": process.pid in members}
                      for process in device.processes],
    } for device in devices]}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "state": {"type": "str", "default": "started", "choices": list(MODULE_STATES)},
            "command": {"type": "raw"},
            "shell": {"type": "bool", "default": False},
            "chdir": {"type": "path"},
            "env": {"type": "dict", "default": {}},
            "umask": {"type": "raw", "default": "0022"},
            "user": {"type": "str"},
            "group": {"type": "str"},
            "log_path": {"type": "path"},
            "keep_logs": {"type": "int", "default": 5},
            "state_dir": {"type": "path", "default": "/var/lib/gpuops"},
            "backend": {"type": "str", "default": "auto", "choices": ["auto", "supervisor", "systemd"]},
            "startup_timeout": {"type": "float", "default": 120},
            "min_uptime": {"type": "float", "default": 5},
            "ready_regex": {"type": "str"},
            "term_timeout": {"type": "float", "default": 30},
            "remove_paths": {"type": "list", "elements": "path", "default": []},
            "log_tail_lines": {"type": "int", "default": 20},
            "progress_regex": {"type": "str"},
            "stall_after": {"type": "float"},
            "resume_args": {"type": "list", "elements": "str", "default": []},
            "resume": {"type": "str", "choices": ["auto", "always", "never"], "default": "auto"},
            "max_relaunches": {"type": "int"},
            "relaunch_window": {"type": "float", "default": 3600},
            "relaunch_delay": {"type": "float", "default": 0},
            "relaunch_max_delay": {"type": "float", "default": 600},
            "failure_cause": {"type": "str", "choices": ["unknown", "hardware"], "default": "unknown"},
            "force": {"type": "bool", "default": False},
            "reset_guard": {"type": "bool", "default": False},
            "metrics_dir": {"type": "path"},
            "metrics_host": {"type": "str"},
            "metrics_rank0": {"type": "str"},
            "metrics_gpus": {"type": "list", "elements": "str"},
            "expect_run_id": {"type": "str"},
            "checkpoint_dir": {"type": "path"},
            "checkpoint_format": {"type": "str", "default": "auto", "choices": list(CHECKPOINT_FORMATS)},
            "checkpoint_marker": {"type": "str", "default": "COMPLETE"},
            "checkpoint_missing": {"type": "str", "default": "fresh", "choices": ["fresh", "refuse"]},
            "checkpoint_step": {"type": "int"},
            "checkpoint_rename_torn": {"type": "bool", "default": False},
            "end_supervisor": {"type": "bool", "default": False},
            "wait_for": {"type": "list", "elements": "str", "default": [], "choices": list(HEALTH_WORDS)},
            "wait_timeout": {"type": "float", "default": 60},
        },
        required_if=[("state", word, ("command", "log_path")) for word in PLANNING_STATES],
        supports_check_mode=True,
    )
    with fail_on_invalid_options(module, changed=False):
        options = options_from_params(module.params)
    try:
        result = LaunchController(options, module.check_mode, gpu_evidence=gpu_evidence, diff=module._diff).apply()
    except LaunchError as exc:
        module.fail_json(**dict(exc.result, msg=str(exc)))
    except OSError as exc:
        module.fail_json(msg=f"train_launch {options.name}: {exc}", changed=False)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
