#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: zombie_reap
short_description: End a training job's processes and clear its zombies with the least force that works
version_added: 0.1.0
description:
  - Selects the job exactly as M(gpuops.relaunch.zombie_facts) does (O(match), O(pids),
    O(include_descendants), O(protected)), computes a plan from one snapshot of the process table,
    and walks an escalation ladder, least force first. Every signal goes to a (pid, start time)
    identity the plan selected and returns in RV(plan).
  - "Step 1: O(term_signal) to every live job process, process group by process group; each member
    is signalled on its own, so a process group shared with processes outside the job is never
    signalled as a whole. Then a wait of up to O(term_timeout) for them to exit."
  - "Step 2: SIGKILL to a zombie leader of the job (state C(Zl): the main thread exited, other
    threads run on and hold the memory) at once, and to every job process still running after
    O(term_timeout). Then a wait of up to O(kill_timeout) for them to exit or to show that they are
    stuck in uninterruptible sleep (C(D))."
  - "Step 3: threads in C(D) hold a pending SIGKILL until they wake: a wait of up to
    O(d_state_timeout) for them to end."
  - "Step 4: a job process left as a zombie is reaped by its parent. A parent outside the job gets
    SIGCHLD (a parent with a SIGCHLD handler reaps then); then a wait of up to O(reap_timeout).
    Zombies orphaned to PID 1 are left to PID 1 for that time (a reaping init takes them within
    about 1.5 seconds)."
  - "Step 5: only with O(reap_parents=true), a parent that still has not reaped is ended
    (O(term_signal), O(term_timeout), SIGKILL) so that its zombies go to the subreaper or PID 1; then
    another wait of up to O(reap_timeout)."
  - "Step 6: what is left is reported in RV(remaining) with RV(reasons) and RV(findings) naming the
    pids, and RV(escalation) says what would clear it, in the words M(gpuops.relaunch.zombie_facts)
    and M(gpuops.relaunch.gpu_mem_wait) use too: V(container_reboot) for zombies orphaned to a PID 1
    that does not reap (only a restart of the container clears them), V(host_action) for threads
    still in C(D) after O(d_state_timeout) (with their wait channel) or a process that survives
    SIGKILL. A zombie whose live parent may not be ended holds only its pid and is reported with
    escalation V(none)."
  - "Before and after: RV(found) is what M(gpuops.relaunch.zombie_facts) would say of the snapshot
    the plan is made from (no scan of its own), RV(left) what it says of one fresh snapshot taken
    after the ladder (the same as RV(found) when nothing was executed: check mode, or a plan with no
    step). So one task both clears and judges: no look before or after it is needed. RV(escalation)
    is the worst of what the ladder could not clear and of RV(left); for a process the ladder tried
    and reports in RV(remaining), the ladder's judgement stands (it knows what was tried)."
  - "A selection that names more than a job is refused before anything is signalled, unless
    O(allow_broad=true): a O(match) pattern that matches the empty string or the command line of
    this module's process or of its ancestors (and so every python process, every other connection,
    every other worker of the Ansible controller), and a selection that takes in a process of
    Ansible itself (see O(allow_broad)). An Ansible program's command line is judged without the
    module arguments and extra variables typed on it, so C(ansible localhost -m
    gpuops.relaunch.zombie_reap -a 'match=train') is not refused for its own words. The refusal
    names the option and the pattern, in check mode too, and returns in RV(job) what the selection
    would have taken. It is judged on the one snapshot of the process table the plan is made from."
  - "Processes of another train_launch job are never part of the job (see O(job_name)): they are
    listed in RV(other_jobs) and left alone. With O(expect_run_id), neither is a newer run of the job itself."
  - "Never signalled: PID 1 of the namespace, the process running this module and all its
    ancestors (the Ansible connection), kernel threads, the protected programs (sshd, systemd, init,
    the container runtime; judged by their executable, not by their command line, see O(protected)),
    anything matching O(protected), and any process that is neither the job nor the parent of a job
    process under the rules above. A broad pattern kill is impossible by construction: there is no
    signal to a process group and none to a pid the plan did not print."
  - Each signal first pins the process with a pidfd (C(pidfd_open), Linux 5.3+) and only then checks
    its start time, so a pid that was reused by another process after the snapshot is never
    signalled (RV(actions) shows V(recycled)). Where pidfds are unavailable, the start time is
    re-read immediately before C(kill()).
  - Every problem with the options is found before anything is read or signalled and reported at
    once, each naming its option (in RV(option_problems) too).
  - Processes the job forks while it is being ended are found by a fresh look afterwards and get the
    same ladder (at most three rounds).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.job_selection
options:
  term_signal:
    description:
      - The polite signal of steps 1 and 5, for example V(SIGTERM), V(SIGINT) (many trainers save a
        checkpoint on it) or V(SIGHUP). The C(SIG) prefix is optional; case does not matter.
      - Signals that do not end a process (V(SIGSTOP), V(SIGCONT), V(SIGCHLD) and the like) are
        refused.
    type: str
    default: SIGTERM
  term_timeout:
    description:
      - Seconds to wait after O(term_signal) before SIGKILL. Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 10.0
  kill_timeout:
    description:
      - Seconds to wait after SIGKILL for processes to exit, or to show that they are stuck in
        uninterruptible sleep. Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 10.0
  reap_timeout:
    description:
      - Seconds to wait for zombies of the job to be reaped by their parent, their subreaper or
        PID 1 (after SIGCHLD, and again after ending parents). A reaping init takes orphans
        within about 1.5 seconds. Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 5.0
  d_state_timeout:
    description:
      - Seconds to wait for threads in uninterruptible sleep to wake (their pending SIGKILL ends them
        then) before reporting RV(escalation=host_action). Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 30.0
  reap_parents:
    description:
      - Whether a parent outside the job that does not reap a zombie of the job within
        O(reap_timeout) may be ended (O(term_signal), O(term_timeout), SIGKILL) so that the subreaper or
        PID 1 reaps the zombie. Protected processes, PID 1 and this module's ancestors are never
        ended, whatever this says.
      - Ending a parent also orphans its other children; they keep running.
    type: bool
    default: false
  orphan_grace:
    description:
      - Seconds the looks of RV(found) and RV(left) watch zombies orphaned to PID 1 before concluding
        that PID 1 does not reap them (V(container_reboot)), as O(gpuops.relaunch.zombie_facts#module:orphan_grace)
        does. A zombie reaped meanwhile is not reported. Between 0 and 600; NaN and infinity are refused.
    type: float
    default: 2.0
  expect_run_id:
    description:
      - The run of O(job_name)'s job this clean-up is for (the run-id fence) - RV(gpuops.relaunch.train_launch#module:health.run_id)
        of the look that decided on it, or the empty string when that look saw no run. Needs O(job_name).
      - When the job's records (in O(job_state_dir), believed only where nobody but root or this user can have
        written them) name another, newer run whose main process runs - another task relaunched the job since that
        look, a watchdog's relaunch and an alert's at once - that run is left alone like another job's - its
        proven supervisor, its proven main process and everything below them, proven by ancestry and the records,
        never by a mark or a command line. They are listed in RV(other_jobs) (with C(newer_run=true)) and a
        finding of kind V(other_job); RV(superseded) is true and RV(newer_run) names the run. What else the
        selection takes is cleaned up as without this option.
      - Before it looks, a clean-up with this option waits (up to 10 minutes) for the job's lock, which
        M(gpuops.relaunch.train_launch) holds while it stops the job or starts and proves a run (a start in
        progress has launched its run before it records it, and the look must see the recorded run). It fails,
        naming this option, when the lock stays held or cannot be opened.
      - Unset, the selection takes the job's processes whatever run they belong to.
        The C(gpuops.relaunch.relaunch) role passes the run its probe saw.
    type: str
    version_added: 0.2.0
  fail_on_escalation:
    description:
      - Whether to fail when RV(escalation) is not V(none). The default lets the playbook decide
        (for example to reboot the container with M(gpuops.relaunch.proxmox_ct_reboot)). Never fails
        in check mode, where RV(escalation) is what was found.
    type: bool
    default: false
attributes:
  check_mode:
    support: full
    details:
      - Makes the same option checks and the same refusal of a too broad selection as a real run (except
        that O(proc_root) may be another namespace's), computes and returns the full RV(plan), and sends
        no signal. C(changed) says whether the plan would signal anything. RV(left) is RV(found) and
        RV(escalation) what it would take to clear that.
  diff_mode:
    support: none
    details:
      - Reports no diff; RV(plan), RV(actions) and RV(ended) say what would be or was signalled.
  platform:
    platforms: linux
    details:
      - Linux only (C(/proc), C(pidfd_open)); the target, in the PID namespace whose processes are ended.
notes:
  - C(changed) is true only when a signal was sent and a process of the job (or a parent ended
    under O(reap_parents)) went away (exited, or was reaped).
  - A job whose selection matches nothing returns C(changed=false) with a message, so a second run
    is a no-op. O(match) and O(pids) must not both be empty.
  - The check for a too broad selection, the first plan and RV(found) share one look at the process
    table; each round of the ladder ends with one more, and the last of them is what RV(left) judges.
    A job with nothing to signal costs one look and sends nothing.
  - O(proc_root) must be the process table of the PID namespace the module runs in, except in check
    mode; run the module inside the container (for example over C(pct exec)) to act there.
seealso:
  - module: gpuops.relaunch.zombie_facts
  - module: gpuops.relaunch.gpu_mem_wait
  - module: gpuops.relaunch.proxmox_ct_reboot
"""

EXAMPLES = r"""
- name: End the old training run and clear its zombies
  gpuops.relaunch.zombie_reap:
    match:
      - /workspace/run/train\.py\b
    term_signal: SIGINT
    term_timeout: 30
  register: reap

- name: Reboot the container only when nothing less helps
  ansible.builtin.debug:
    msg: "{{ reap.reasons }}"
  when: reap.escalation == 'container_reboot'

- name: A defunct python3 whose parent never waits
  gpuops.relaunch.zombie_reap:
    pids: [4130]
    reap_parents: true
    fail_on_escalation: true
"""

RETURN = r"""
msg:
  description: One line saying what was done or would be done.
  returned: always
  type: str
  sample: "ended 6 process(es) with 7 signal(s); nothing left that blocks a relaunch"
job:
  description:
    - The job's processes at the snapshot (after leaving out protected ones).
    - When the selection is refused as too broad (see RV(refused)), what it would have selected.
  returned: always
  type: list
  elements: dict
  sample: [{pid: 4121, starttime: 991200, comm: python3}]
refused:
  description:
    - Why the selection was refused as too broad, each reason naming the option and the pattern.
      Nothing was signalled. Set O(allow_broad=true) only if every process in RV(job) may be ended.
  returned: when the selection is refused
  type: list
  elements: str
  sample: ["match: '.*' matches the empty string, so it selects every process"]
plan:
  description:
    - Every signal the ladder may send, in order, with its target identity, the condition under
      which it is sent (C(when)) and why. Conditional steps are skipped when their condition does
      not hold. C(round) is 2 or 3 for processes the job forked while being ended.
    - C(stage) is one of V(terminate), V(kill_leader), V(kill), V(notify_parent), V(end_parent),
      V(end_parent_kill).
  returned: always
  type: list
  elements: dict
  sample:
    - {stage: terminate, pid: 4121, starttime: 991200, comm: python3, signal: SIGTERM, when: at once, round: 1,
       reason: "job process (every member of process group 4121 is the job; each is signalled by identity)"}
notes:
  description: What the plan leaves to others (PID 1, a protected parent) and threads found in uninterruptible sleep.
  returned: always
  type: list
  elements: str
  sample: ["job pid 4130: orphaned to PID 1 (sleep), which must do the reaping once they exit; watched for 5s, ..."]
protected:
  description: Processes the selection or the ladder would have touched but that are protected, and why.
  returned: always
  type: list
  elements: dict
  sample: [{pid: 612, comm: sshd, reason: "parent of the job's pid 4121, but runs /usr/sbin/sshd, a protected program"}]
other_jobs:
  description:
    - Processes the selection named (or reached as descendants) that are proven to belong to another
      train_launch job; never signalled. C(proof) is V(run_mark) (the process carries that job's run
      mark, which its run record confirms), V(supervisor) (it is or descends from that job's supervisor) or
      V(run) (it descends from that job's recorded main process). Ancestry outranks marks; a descendant of
      the proven supervisor of O(job_name)'s job is that job's, whatever marks it carries.
    - With O(expect_run_id), also the processes of the job's newer run (see O(expect_run_id)), each with
      C(newer_run=true) and the job's own C(job_dir); C(newer_run) is there only with O(expect_run_id).
  returned: always
  type: list
  elements: dict
  sample: [{pid: 5120, starttime: 88100, comm: python3, job_dir: /var/lib/gpuops/eval, run_id: 3f2a9c, proof: run_mark,
            newer_run: false}]
superseded:
  description:
    - With O(expect_run_id) - whether the job runs a newer run than the expected one (RV(newer_run)), which the
      clean-up left alone. The C(gpuops.relaunch.relaunch) role then drains nothing and starts no other run.
  returned: with O(expect_run_id), unless the options or the selection are refused
  type: bool
  sample: true
newer_run:
  description:
    - The newer run that RV(superseded) left alone - its run_id, pid and starttime (of its main process); null when
      there is none.
  returned: with O(expect_run_id), unless the options or the selection are refused
  type: dict
  sample: {run_id: 7c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f, pid: 4388, starttime: 1003100}
missing_pids:
  description: Pids given in O(pids) that do not exist.
  returned: always
  type: list
  elements: int
  sample: []
actions:
  description:
    - The signals actually tried (none in check mode), with C(result) V(sent), V(gone) (it had
      exited), V(recycled) (its pid now belongs to another process, which is not signalled), V(denied) or
      V(refused), and C(elapsed) seconds since the ladder started.
  returned: always
  type: list
  elements: dict
  sample: [{stage: terminate, pid: 4121, starttime: 991200, comm: python3, signal: SIGTERM, result: sent, elapsed: 0.002, round: 1}]
signals_sent:
  description: How many signals were delivered.
  returned: always
  type: int
  sample: 7
ended:
  description: Processes of the job (and parents ended under O(reap_parents)) whose state changed; C(was) and C(now) are V(running), V(zombie) or V(gone).
  returned: always
  type: list
  elements: dict
  sample: [{pid: 4121, starttime: 991200, comm: python3, was: running, now: gone}]
remaining:
  description:
    - What the ladder could not clear, with C(state) (C(D), V(running) or C(Z)), C(kind)
      (V(uninterruptible), V(permission_denied), V(survived_kill), V(not_signalled), V(unreaped_orphan)
      or V(zombie), words of RV(findings)), the C(escalation) that would clear it and a C(reason). Entries for
      processes still running name the GPU device files they hold in C(devices) (a GPU's own,
      195:0 to 195:247, as in M(gpuops.relaunch.zombie_facts)' C(gpu_holders)).
  returned: always
  type: list
  elements: dict
  sample: [{pid: 4150, starttime: 991290, comm: python3, state: D, kind: uninterruptible, escalation: host_action,
            devices: [/dev/nvidia0],
            reason: "pid 4150 thread 4152 (python3) is still in uninterruptible sleep (wchan uvm_va_space_destroy) ..."}]
escalation:
  description:
    - What it takes to clear what is left, in the collection's one vocabulary, least force first
      (see R(the verdict table in the relaunch guide,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table));
      the worst of what the ladder could not clear and of
      RV(left) (where the ladder's judgement of a process in RV(remaining) stands for it).
    - V(none) (nothing left that needs more), V(signals) (signals would clear what is left, for
      example a process the job forked after the last round, or in check mode what was found),
      V(container_reboot) (only a restart of the container clears what is left) or V(host_action)
      (not even that may help).
  returned: always
  type: str
  choices: [none, signals, container_reboot, host_action]
  sample: container_reboot
found:
  description:
    - What was found before anything was signalled, as M(gpuops.relaunch.zombie_facts) judges it,
      from the snapshot the plan is made from.
  returned: unless the options or the selection are refused
  type: dict
  sample: {escalation: signals, reasons: ["job processes still running: 4121, 4122"],
           findings: [{kind: running, escalation: signals, pids: [4121, 4122], why: "job processes still running: 4121, 4122"}]}
  contains:
    escalation:
      description: What it takes to clear what was found.
      type: str
      choices: [none, signals, container_reboot, host_action]
    reasons:
      description: The C(why) of each finding.
      type: list
      elements: str
    findings:
      description:
        - The findings, with the fields of RV(findings); their C(kind) as in
          RV(gpuops.relaunch.zombie_facts#module:ansible_facts.zombie_facts.findings).
      type: list
      elements: dict
left:
  description:
    - What is left after the ladder, as M(gpuops.relaunch.zombie_facts) judges one fresh snapshot
      taken after it; the same as RV(found) when nothing was executed (check mode, nothing to signal).
    - The fields of RV(found) (C(escalation), C(reasons), C(findings)), for what is left.
  returned: unless the options or the selection are refused
  type: dict
  sample: {escalation: none, reasons: ["nothing of the job and nothing blocking a relaunch"],
           findings: [{kind: nothing, escalation: none, pids: [], why: "nothing of the job and nothing blocking a relaunch"}]}
reasons:
  description:
    - Why RV(escalation) is what it is, and what is left, each naming pids; the C(why) of each of RV(findings).
    - When RV(left) asks for more than the ladder does, its reasons follow the ladder's.
  returned: always
  type: list
  elements: str
  sample: ["zombies 7, 9 are orphaned to PID 1 (sleep) ..., and were not reaped within 5s: only a restart of the container clears them"]
findings:
  description:
    - RV(reasons) with structured fields to decide on (never decide on the wording of C(why)).
    - C(kind) is V(uninterruptible), V(permission_denied), V(survived_kill), V(not_signalled), V(unreaped_orphan),
      V(zombie), V(holds_device), V(other_job) (processes of another job the selection named, or of the job's newer run
      with O(expect_run_id), left alone; escalation V(none)) or V(mark_conflict) (a process whose marks name another job
      than its proven ancestry; it is the ancestry's job's; escalation V(signals)), words of
      R(the collection's one finding vocabulary,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table);
      C(escalation) what clears it; C(pids) the processes concerned.
    - When RV(left) asks for more than the ladder does, its findings follow (with the words of
      RV(gpuops.relaunch.zombie_facts#module:ansible_facts.zombie_facts.findings), so V(running), V(zombie_leader) and V(nothing) too).
  returned: always
  type: list
  elements: dict
  sample: [{kind: unreaped_orphan, escalation: container_reboot, pids: [7, 9], why: "zombies 7, 9 are orphaned to PID 1 ..."}]
option_problems:
  description: Every problem found with the options, each a dict of C(option), its name, and C(reason), what is wrong with its value.
  returned: when the options were refused, before anything was signalled
  type: list
  elements: dict
  sample: [{"option": "term_signal", "reason": "SIGSTOP does not end a process (use e.g. SIGTERM, SIGINT, SIGHUP)"}]
elapsed:
  description: Seconds the module spent planning and walking the ladder.
  returned: always
  type: float
  sample: 1.734
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcfsError
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import JOB_SELECTION_SPEC, BroadSelectionError
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.executor import (
    JobLockError,
    options_from_params,
    reap_job,
    summary,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            JOB_SELECTION_SPEC,
            term_signal={"type": "str", "default": "SIGTERM"},
            term_timeout={"type": "float", "default": 10.0},
            kill_timeout={"type": "float", "default": 10.0},
            reap_timeout={"type": "float", "default": 5.0},
            d_state_timeout={"type": "float", "default": 30.0},
            reap_parents={"type": "bool", "default": False},
            orphan_grace={"type": "float", "default": 2.0},
            fail_on_escalation={"type": "bool", "default": False},
            expect_run_id={"type": "str"},
        ),
        supports_check_mode=True,
    )
    params = module.params
    with fail_on_invalid_options(module, changed=False):
        selector, protected, options = options_from_params(params, module.check_mode)
    try:
        result = reap_job(
            selector, protected, options,
            proc_root=params["proc_root"], device_glob=params["gpu_device_glob"], check_mode=module.check_mode,
        )
    except BroadSelectionError as exc:
        module.fail_json(msg=str(exc), refused=exc.reasons, job=exc.job, plan=[], actions=[], signals_sent=0, changed=False)
    except ProcfsError as exc:
        module.fail_json(msg=f"proc_root: {exc}", changed=False)
    except JobLockError as exc:
        module.fail_json(msg=f"expect_run_id: the job's lock: {exc}", changed=False)
    except OSError as exc:
        module.fail_json(msg=f"signalling failed: {exc}")
    report = result.as_dict()
    report["msg"] = summary(result, module.check_mode)
    if module.check_mode:
        report["changed"] = bool(result.first.steps)
    if params["fail_on_escalation"] and not module.check_mode and result.escalation != Escalation.NONE:
        module.fail_json(**report)
    module.exit_json(**report)


if __name__ == "__main__":
    main()
