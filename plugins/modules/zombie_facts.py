#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: zombie_facts
short_description: Find what a dead training run left behind, and say what it takes to clear it
version_added: 0.1.0
description:
  - Reads the process table once (C(/proc)) and reports zombies, zombie leaders whose other threads
    still run (state C(Zl)), threads in uninterruptible sleep (C(D)) with their wait channel, the
    processes of the job, and the processes or threads holding GPU device files open.
  - Says what it takes to clear what was found, derived only from those facts, in the words
    M(gpuops.relaunch.zombie_reap) and M(gpuops.relaunch.gpu_mem_wait) use too (RV(ansible_facts.zombie_facts.escalation)).
    V(none) means nothing of the job and nothing that blocks a relaunch; V(signals) means signals
    and reaping clear everything found; V(container_reboot) means zombies are orphaned to PID 1 of
    this namespace and PID 1 did not reap them within O(orphan_grace) seconds, so only a restart of
    the container clears them; V(host_action) means a thread sleeps uninterruptibly in the GPU
    driver, which no signal and possibly no container restart clears.
  - Whether PID 1 reaps cannot be seen in one snapshot. When zombies are orphaned to PID 1, the
    module watches them for up to O(orphan_grace) seconds and reports what it saw.
  - Never changes anything, and never refuses a selection (a look is not an act). A selection that
    M(gpuops.relaunch.zombie_reap) would refuse as naming more than a job (see O(match) and
    O(allow_broad)) is reported in RV(ansible_facts.zombie_facts.too_broad), and the processes of
    Ansible it takes in are left out of the job and listed in
    RV(ansible_facts.zombie_facts.protected), so that the verdict on a job is never a verdict on
    Ansible itself. An empty selection looks at the whole table for zombies and D-state threads
    without a job.
  - Processes of another train_launch job are left out of the job and listed in
    RV(ansible_facts.zombie_facts.other_jobs) (see O(job_name)).
  - Reads the process table once per run; the selection is judged on that same snapshot.
  - Every problem with the options is found before the process table is read and reported at once,
    each naming its option (in RV(option_problems) too).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.info_module
  - gpuops.relaunch.job_selection
options:
  orphan_grace:
    description:
      - How long to watch zombies orphaned to PID 1 before concluding that PID 1 does not reap them.
      - A reaping init takes an orphaned zombie within about 1.5 seconds. V(0) takes one look only.
      - Between 0 and 600 seconds; NaN and infinity are refused.
    type: float
    default: 2.0
  driver_wchan:
    description:
      - Regular expression over a thread's wait channel (C(/proc/PID/task/TID/wchan)) that marks an
        uninterruptible sleep inside the GPU driver.
    type: str
    default: ^(uvm_|nv_|nvidia|os_|_nv)
  require_no_zombies:
    description:
      - Count every zombie as blocking, not only those of the job, those with live threads, those
        holding GPU devices and those orphaned to PID 1.
    type: bool
    default: false
attributes:
  facts:
    description: Returns RV(ansible_facts.zombie_facts).
    support: full
  platform:
    platforms: linux
    details:
      - Linux only (C(/proc)); the target, whose process table is read.
notes:
  - Inside a container, GPU memory can be held by a process of another PID namespace (the host or
    another container); such a holder is invisible here. Use M(gpuops.relaunch.gpu_mem_wait) to see
    the memory itself.
seealso:
  - module: gpuops.relaunch.zombie_reap
  - module: gpuops.relaunch.gpu_mem_wait
"""

EXAMPLES = r"""
- name: Look at what the last run left behind
  gpuops.relaunch.zombie_facts:
    match:
      - /workspace/run/train\.py\b
    include_descendants: true

- name: Stop here when only the host can help
  ansible.builtin.assert:
    that: ansible_facts.zombie_facts.escalation != 'host_action'
    fail_msg: "{{ ansible_facts.zombie_facts.reasons | join('; ') }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: dict
  contains:
    zombie_facts:
      description: The snapshot and what it takes to clear what it found.
      returned: always
      type: dict
      contains:
        escalation:
          description:
            - What it takes to clear what was found, in the collection's one vocabulary, least force
              first (see
              R(the verdict table in the relaunch guide,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table)).
          type: str
          choices: [none, signals, container_reboot, host_action]
          sample: signals
        reasons:
          description: Why the escalation is what it is, each naming the pids concerned; the C(why) of each finding.
          type: list
          elements: str
          sample: ["job processes still running: 4121, 4122"]
        findings:
          description:
            - The reasons with structured fields to decide on (never decide on the wording of C(why)).
            - C(kind) is V(running) (job processes still running), V(zombie) (zombies waiting for their parent),
              V(zombie_leader), V(unreaped_orphan) (zombies PID 1 did not reap within O(orphan_grace)),
              V(uninterruptible) (threads in C(D); escalation V(host_action) in the GPU driver), V(holds_device),
              V(nothing), V(other_job) (processes the selection named that belong to another job, left alone;
              escalation V(none)) or V(mark_conflict) (a process whose C(GPUOPS_RELAUNCH_*) marks name another job
              than its ancestry proves - a descendant of a job's proven supervisor or run is that job's whatever its
              environment says, so a worker of O(job_name)'s job that copied another job's marks is selected and
              ended; escalation V(signals)), words of
              R(the collection's one finding vocabulary,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table);
              C(escalation) what clears it; C(pids) the processes concerned.
          type: list
          elements: dict
          sample: [{kind: running, escalation: signals, pids: [4121, 4122], why: "job processes still running: 4121, 4122"}]
        zombies:
          description:
            - Every zombie in the namespace. C(kind) is V(zombie_leader) when threads other than the
              exited main thread still run, else V(zombie).
            - C(blocking) tells whether it stands in the way of a relaunch; C(unreaped_orphan) whether
              it is orphaned to PID 1 and PID 1 did not reap it within O(orphan_grace).
          type: list
          elements: dict
          sample:
            - pid: 4130
              starttime: 991283
              ppid: 4121
              comm: python3
              threads: 3
              kind: zombie_leader
              live_threads: [{tid: 4133, state: S, wchan: futex_wait_queue, comm: pt_main_thread}]
              job: false
              blocking: true
              unreaped_orphan: false
              parent: {pid: 4121, comm: python3, state: S, is_namespace_init: false, job: true}
              parent_chain: [4121, 1]
        uninterruptible:
          description: Threads in state D of the job, of zombies with threads, of GPU holders, and of D-state processes.
          type: list
          elements: dict
          sample: [{pid: 4150, tid: 4152, comm: python3, wchan: uvm_va_space_destroy}]
        job_processes:
          description:
            - The job's processes (after leaving out protected ones).
            - C(cmdline) is escaped and cut to its first 4 KiB, marked as cut (a note at its end gives its whole length).
          type: list
          elements: dict
          sample:
            - {pid: 4121, starttime: 991200, ppid: 1, pgid: 4121, sid: 4121, state: S, comm: python3,
               cmdline: python3 /workspace/run/train.py, threads: 12}
        protected:
          description:
            - Processes that matched the job but are protected, and why; and the processes of Ansible
              the selection took in (left out of the job unless O(allow_broad)).
          type: list
          elements: dict
          sample: [{pid: 612, comm: sshd, reason: "runs /usr/sbin/sshd, a protected program"}]
        other_jobs:
          description:
            - Processes the selection named (or reached as descendants) that are proven to belong to another
              train_launch job, left out of the job. C(proof) is V(run_mark) (the process carries that job's
              run mark, which its run record confirms), V(supervisor) (it is or descends from that job's
              supervisor) or V(run) (it descends from that job's recorded main process). The nearest proven
              supervisor or run among the process and its ancestors decides whose it is; a mark alone never
              outranks it.
          type: list
          elements: dict
          sample: [{pid: 5120, starttime: 88100, comm: python3, job_dir: /var/lib/gpuops/eval, run_id: 3f2a9c, proof: run_mark}]
        too_broad:
          description:
            - Why M(gpuops.relaunch.zombie_reap) would refuse this selection as naming more than a job
              (see O(allow_broad)), each reason naming the option and the pattern; empty when it would not.
          type: list
          elements: str
          sample: ["match: '.*' matches the empty string, so it selects every process"]
        gpu_holders:
          description:
            - "Processes and threads holding a GPU's own device file open at a path matching
              O(gpu_device_glob): the character device with the NVIDIA driver's major number 195 and a
              GPU's minor number (0 to 247, C(/dev/nvidiaN)), told by the kernel's numbers of the opened
              file, never by its name. C(/dev/nvidiactl) (195:255), C(/dev/nvidia-modeset) (195:254) and
              C(/dev/nvidia-uvm), which every GPU user holds, and anything that is not a character device
              hold no GPU. C(device) is the path, C(device_number) the C(major:minor) of what is held."
            - Only such a holder makes another program's zombie leader block (V(holds_device)).
          type: list
          elements: dict
          sample: [{pid: 4121, tid: 4121, comm: python3, state: S, device: /dev/nvidia0, device_number: "195:0"}]
        missing_pids:
          description: Pids given in O(pids) that do not exist.
          type: list
          elements: int
          sample: []
        process_count:
          description: How many processes the snapshot read.
          type: int
          sample: 213
option_problems:
  description: Every problem found with the options, each a dict of C(option), its name, and C(reason), what is wrong with its value.
  returned: when the options were refused, before the process table was read
  type: list
  elements: dict
  sample: [{"option": "orphan_grace", "reason": "must be at least 0 and at most 600 seconds, got 601"}]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import DEFAULT_DRIVER_WCHAN, ProcfsError
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import JOB_SELECTION_SPEC
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.assessment import assess, options_from_params


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            JOB_SELECTION_SPEC,
            orphan_grace={"type": "float", "default": 2.0},
            driver_wchan={"type": "str", "default": DEFAULT_DRIVER_WCHAN},
            require_no_zombies={"type": "bool", "default": False},
        ),
        supports_check_mode=True,
    )
    params = module.params
    with fail_on_invalid_options(module, changed=False):
        options = options_from_params(params)
    try:
        facts = assess(options, proc_root=params["proc_root"]).as_dict()
    except ProcfsError as exc:
        module.fail_json(msg=f"proc_root: {exc}", changed=False)
    module.exit_json(changed=False, ansible_facts={"zombie_facts": facts})


if __name__ == "__main__":
    main()
