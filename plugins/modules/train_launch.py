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
    C(systemd-run --collect -p KillMode=mixed) with stdout and stderr appended to O(log_path). Its
    exit status is recorded by an C(ExecStopPost=) hook, because a collected unit can no longer be
    asked for it.
  - O(state=started) is idempotent like a service. The job's spec is hashed (command, shell, env,
    chdir, user, group). If the job runs with the same spec, backend and O(log_path) nothing changes;
    if it runs with another spec or log path it is restarted; if it does not run it is started.
  - O(state=restarted) always stops the job (if it runs) and starts it again.
  - O(state=stopped) sends SIGTERM to each proven member of the run, waits up to O(term_timeout)
    seconds, sends SIGKILL, and waits until the whole tree is gone, leaving no zombie of the job behind.
  - Membership is proven, never taken from the records. A process belongs to the run if its
    environment carries the run's mark (C(GPUOPS_RELAUNCH_RUN=STATE_DIR/NAME:RUN_ID), set at spawn
    and inherited by everything the job starts) and it did not start before the run, or if it
    descends from the run's supervisor, itself proven by its own mark and start time. No process
    group is ever signalled as a whole; each member goes through the collection's signal gate, which
    never signals PID 1, the module and its ancestors, members of the module's own process group,
    kernel threads, or processes matching the default protected patterns of M(gpuops.relaunch.zombie_reap).
    A recorded pid that fails the proof (reused, restored, edited) is reported in RV(stop.ignored) and left alone.
  - Before anything is stopped or rotated, a start checks that it can work - the program is resolved
    as the job's user (its C(PATH), or relative to O(chdir)) and must be executable for that user,
    no argument or O(env) value holds a NUL byte, and O(log_path) is not a symlink, FIFO or device.
  - A start first rotates an existing log (C(train.log) becomes C(train.log.1), keeping O(keep_logs)
    earlier logs; a log is never overwritten) - or, if that log is of a start that was never proven,
    sets it aside as C(train.log.failed) (one kept) so failed starts never push out a good run's
    log - then removes O(remove_paths), then launches the job and
    returns only when the proof of start holds - the job is still alive after O(min_uptime) seconds,
    the log exists and, if O(ready_regex) is set, a log line matches it. The task fails with the exit
    code or signal and the log tail when the job ends during startup, and with the log tail when
    O(startup_timeout) passes first. A job whose start was not proven is stopped again, so that a
    second run does not report a job that never proved itself as running.
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
      - V(started) makes sure the job runs with this spec; V(restarted) always restarts it;
        V(stopped) ends it.
    type: str
    choices: [started, restarted, stopped]
    default: started
  command:
    description:
      - The job's argv as a list, for example V(['python3', 'train.py', '--config', 'a.yaml']).
      - A string only together with O(shell=true), which runs it with C(/bin/sh -c).
      - Required with O(state=started) and O(state=restarted).
    type: raw
  shell:
    description:
      - Run O(command), a string, through C(/bin/sh -c). Off unless asked for explicitly.
    type: bool
    default: false
  chdir:
    description:
      - Absolute path of the job's working directory. Defaults to V(/).
    type: path
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
      - Absolute path of the job's log (stdout and stderr). Its directory must exist and be writable
        (in check mode a missing directory is accepted, since an earlier task may create it).
      - It must be a regular file or not exist yet; a symlink, FIFO or device there is refused. It is
        opened without following links and chowned to O(user) only if it has no other hard links.
      - Required with O(state=started) and O(state=restarted).
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
        that is not sound is reported in RV(record_problems) and ignored.
    type: path
    default: /var/lib/gpuops
  backend:
    description:
      - V(auto) picks V(systemd) where PID 1 is systemd (C(/run/systemd/system) exists and
        C(systemd-run) is installed), and V(supervisor) everywhere else. The choice is returned in RV(backend).
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
        O(gpuops.relaunch.zombie_reap#module:term_timeout). Its earlier name O(stop_timeout) is kept
        as an alias.
    type: float
    default: 30
    aliases: [stop_timeout]
  remove_paths:
    description:
      - Absolute paths removed (files, links or whole directories) before each start, for example the
        compile cache V(/tmp/torchinductor_root). V(/) and relative paths are refused.
    type: list
    elements: path
    default: []
  log_tail_lines:
    description:
      - How many of the log's last lines to return as RV(log_tail). Between V(0) and V(10000).
    type: int
    default: 20
notes:
  - The supervisor exits once the job's whole tree is gone, except where its parent (in a container,
    PID 1) neither catches nor ignores SIGCHLD and so may never reap it. Exiting there would leave the
    supervisor itself as a zombie for ever, so it stays idle instead (one sleeping process per job
    name, with no child) and the next start of that job hands the new run to it.
  - A second task on the same job waits for the first (a lock in the job's state directory), at most
    O(term_timeout) + O(startup_timeout) + 90 seconds.
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.platform
attributes:
  check_mode:
    support: full
    details:
      - Says in RV(msg) what it would do (start, restart, stop, rotate the log, remove paths) and
        changes nothing; RV(rotated_log) and RV(removed_paths) name what would be rotated and removed.
  diff_mode:
    support: none
    details:
      - Reports no diff; the result says what was started, stopped, rotated and removed.
  platform:
    platforms: linux
    details:
      - Linux only (C(/proc), C(PR_SET_CHILD_SUBREAPER)); the target, where the job runs.
"""

EXAMPLES = r"""
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
      V(start), V(restart) or V(stop). Unlike C(changed) it is structured for a decision, for
      example by a probe in check mode whose change should not be counted.
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
  description: The last O(log_tail_lines) lines of the log.
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
  description: The log line that matched O(ready_regex) (C(null) without one).
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
ready_after:
  description:
    - Deprecated, kept for playbooks that read it; use RV(elapsed).
    - Seconds from the launch until the proof of start held (or until it failed), the launch-to-proof
      part of RV(elapsed).
  returned: after a start
  type: float
  sample: 5.1
option_problems:
  description: Every problem found with the options (each with its RV(option_problems[].option) and RV(option_problems[].reason)); nothing was changed.
  returned: when the options were refused
  type: list
  elements: dict
  sample: [{"option": "term_timeout", "reason": "must be a finite number of seconds, got nan"}]
  contains:
    option:
      description: The option's name.
      type: str
    reason:
      description: What is wrong with the value given (never the value of a secret).
      type: str
rotated_log:
  description: The name the previous log got (C(LOG.1) by rotation, or C(LOG.failed) for the log of a start that was never proven; C(null) if there was none).
  returned: after a start, and in check mode for started/restarted
  type: str
  sample: /workspace/train.log.1
removed_paths:
  description: The O(remove_paths) that existed and were removed (in check mode, that would be).
  returned: after a start, and in check mode for started/restarted
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
  description: Why the backend could not start the command at all (for example, the program does not exist).
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
    remaining:
      description:
        - What still ran at the deadline (only on failure), with C(protected) saying why a process
          may never be signalled where that is the reason it remains.
      type: list
      elements: dict
      returned: on failure
record_problems:
  description:
    - Records in the job's state directory that were not sound (not JSON, a field of the wrong kind,
      a symlink or FIFO in place of a file), each with what was wrong. They were ignored.
  returned: when a record was not sound
  type: list
  elements: str
  sample: ["/var/lib/gpuops/llm-pretrain/run.json: pid is not a process number or start time ('abc'); ignored"]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.control import LaunchController, LaunchError
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import options_from_params


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "state": {"type": "str", "default": "started", "choices": ["started", "restarted", "stopped"]},
            "command": {"type": "raw"},
            "shell": {"type": "bool", "default": False},
            "chdir": {"type": "path"},
            "env": {"type": "dict", "default": {}},
            "user": {"type": "str"},
            "group": {"type": "str"},
            "log_path": {"type": "path"},
            "keep_logs": {"type": "int", "default": 5},
            "state_dir": {"type": "path", "default": "/var/lib/gpuops"},
            "backend": {"type": "str", "default": "auto", "choices": ["auto", "supervisor", "systemd"]},
            "startup_timeout": {"type": "float", "default": 120},
            "min_uptime": {"type": "float", "default": 5},
            "ready_regex": {"type": "str"},
            "term_timeout": {"type": "float", "default": 30, "aliases": ["stop_timeout"]},
            "remove_paths": {"type": "list", "elements": "path", "default": []},
            "log_tail_lines": {"type": "int", "default": 20},
        },
        required_if=[
            ("state", "started", ("command", "log_path")),
            ("state", "restarted", ("command", "log_path")),
        ],
        supports_check_mode=True,
    )
    try:
        options = options_from_params(module.params, module.check_mode)
    except OptionsInvalid as exc:
        module.fail_json(changed=False, **exc.as_result())
    try:
        result = LaunchController(options, module.check_mode).apply()
    except LaunchError as exc:
        module.fail_json(**dict(exc.result, msg=str(exc)))
    except OSError as exc:
        module.fail_json(msg=f"train_launch {options.name}: {exc}", changed=False)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
