#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_mem_wait
short_description: Wait until GPUs are really free, or fail naming what still holds them
version_added: 0.1.0
description:
  - Polls NVML until, for every selected GPU, used memory is back under a ceiling (by default a small
    baseline, because the driver keeps some memory, so free is not zero), and optionally no compute
    process is listed, some pids are gone and the host's C(MemAvailable) is back above a floor.
  - NVML is read through the Python bindings (C(pynvml) from the C(nvidia-ml-py) package) in a child
    process. Each query has its own deadline O(query_timeout), because NVML calls can hang in the
    kernel; a hung query fails the task with a message saying so instead of hanging the play. Where
    the bindings are not installed on the target, C(nvidia-smi) CSV output is parsed instead.
  - On timeout the task fails and lists the RV(holders). NVML reports pids of the host's PID namespace;
    where such a pid is visible here, its state comes from the process table (a zombie, a zombie
    leader whose threads still run, a thread in uninterruptible sleep with its wait channel).
    Inside a container the pids are not visible (C(visible=false)). RV(escalation) says what would
    free the memory, in the words M(gpuops.relaunch.zombie_facts) and M(gpuops.relaunch.zombie_reap)
    use too, in particular whether only a container restart helps (V(container_reboot)).
  - A missing driver, a missing library, a library/driver version mismatch, a lost GPU and a GPU
    that requires a reset each fail with a message saying so. With O(gpus_required=false), a host
    without any NVIDIA GPU is not an error.
  - Never changes anything.
  - Every problem with the options is found before the first query and reported at once, each naming
    its option (in RV(option_problems) too).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.info_module
  - gpuops.relaunch.gpu_backend
options:
  devices:
    description:
      - The GPUs to wait for, by index (V(0)) or UUID (C(GPU-...)). Empty means all GPUs.
    type: list
    elements: str
    default: []
  max_used_mib:
    description:
      - Used memory per GPU, in MiB, at or under which the GPU counts as free. Where the driver
        reports its reservation apart (NVML memory info v2), that reservation is not counted.
      - A finite number, 0 or more.
      - When neither O(max_used_mib) nor O(max_used_percent) is given, the ceiling is 256 MiB.
    type: float
  max_used_percent:
    description:
      - Used memory per GPU, in percent of its total, at or under which the GPU counts as free.
        Both ceilings must hold when both are given. Between 0 and 100.
    type: float
  no_processes:
    description:
      - Also require that no compute process is listed on the GPU.
    type: bool
    default: false
  pids_gone:
    description:
      - Also require that these pids no longer exist here. A zombie still exists (it is gone once
        reaped); a pid taken over by a new process counts as gone.
    type: list
    elements: int
    default: []
  min_host_available_gib:
    description:
      - Also require that the host's C(MemAvailable) (from C(meminfo) under O(proc_root)) is at least
        this many GiB. Large pinned host memory of a killed job takes tens of seconds to come back.
      - A finite number, 0 or more.
    type: float
  timeout:
    description:
      - How long to wait, in seconds, before failing. V(0) takes one look.
      - Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 300
  poll_interval:
    description:
      - Seconds between two looks.
      - At least 0.01 (a shorter pause only burns a core) and at most 3600.
    type: float
    default: 0.5
  gpus_required:
    description:
      - Whether a host without a usable NVIDIA GPU (no bindings nor C(nvidia-smi), no NVML library,
        driver not loaded, no device) is a failure. With V(false) the task then succeeds with
        RV(gpu_present=false) after waiting for the other conditions.
    type: bool
    default: true
  proc_root:
    description:
      - Where the process table is mounted, for the holders' states, O(pids_gone) and C(meminfo).
    type: path
    default: /proc
attributes:
  platform:
    platforms: linux
    details:
      - Linux only (NVML or C(nvidia-smi), and C(/proc) for the holders); the target, where the GPUs are.
notes:
  - Inside a container NVML lists the pids of the host's PID namespace. They do not exist in the
    container, so holders show C(visible=false); run the module on the host to see their states.
  - A query process stuck in the kernel cannot be killed; it is left behind and named in the message.
seealso:
  - module: gpuops.relaunch.zombie_facts
  - module: gpuops.relaunch.zombie_reap
"""

EXAMPLES = r"""
- name: Wait until every GPU is back under the baseline and the old job's pids are gone
  gpuops.relaunch.gpu_mem_wait:
    pids_gone: "{{ old_job_pids }}"
    timeout: 180

- name: Wait for GPUs 0 and 1 to have no process and under 1 GiB used, and 200 GiB of host memory back
  gpuops.relaunch.gpu_mem_wait:
    devices: [0, 1]
    max_used_mib: 1024
    no_processes: true
    min_host_available_gib: 200
  register: drain

- name: In a mixed inventory, CPU-only hosts pass
  gpuops.relaunch.gpu_mem_wait:
    gpus_required: false
"""

RETURN = r"""
released:
  description: Whether every condition held before the timeout.
  returned: always
  type: bool
  sample: true
elapsed:
  description: Seconds the task took, from the first GPU query (which includes initialising NVML) to the verdict.
  returned: unless the options were refused
  type: float
  sample: 2.61
polls:
  description: How many looks it took.
  returned: always
  type: int
  sample: 6
backend:
  description: What the GPUs were read with, V(pynvml) or V(nvidia-smi); V(none) when no GPU was found.
  returned: always
  type: str
  sample: pynvml
gpu_present:
  description: Whether a usable NVIDIA GPU was found.
  returned: always
  type: bool
  sample: true
gpus:
  description: The selected GPUs, used memory at the first and at the last look, and the processes listed at the last.
  returned: always
  type: list
  elements: dict
  sample:
    - index: 0
      uuid: GPU-5c3b1b8e-1d2f-4a7b-9e0c-2b1d1f3a4c5d
      name: NVIDIA H100 80GB HBM3
      total_mib: 81559.0
      reserved_mib: 527.0
      used_mib_before: 40960.0
      used_mib_after: 0.0
      processes: []
released_mib:
  description: Memory freed on the selected GPUs between the first and the last look, in MiB.
  returned: always
  type: float
  sample: 40960.0
unmet:
  description: The conditions that still did not hold at the last look (empty when released).
  returned: always
  type: list
  elements: str
  sample: ["GPU 0: 40960 MiB used, more than 256 MiB"]
pids_remaining:
  description: Pids of O(pids_gone) still present at the end, with comm and state.
  returned: always
  type: list
  elements: dict
  sample: [{pid: 4130, comm: python3, state: Z}]
host_available_gib_before:
  description: Host C(MemAvailable) in GiB at the start (null if unreadable).
  returned: always
  type: float
  sample: 112.4
host_available_gib_after:
  description: Host C(MemAvailable) in GiB at the end (null if unreadable).
  returned: always
  type: float
  sample: 351.9
holders:
  description:
    - On timeout, every process still listed on a selected GPU. C(visible) false means its pid does
      not exist here (a host pid seen from a container, or a process whose teardown is stuck).
    - C(kind) is V(running), V(zombie), V(unreaped_orphan) (a zombie of its namespace's init),
      V(zombie_leader), V(uninterruptible) or V(invisible), words of RV(findings);
      C(escalation) what would free it; C(description) says it in words. C(starttime) is given for
      a visible holder; C(host_pids_visible) for an invisible one (true when this is the host's PID
      namespace, so the listed process is gone and only the host helps; false in a container, where
      a restart of the container may help).
  returned: always
  type: list
  elements: dict
  sample:
    - pid: 51234
      gpu: 0
      uuid: GPU-5c3b1b8e-1d2f-4a7b-9e0c-2b1d1f3a4c5d
      used_mib: 40960.0
      visible: true
      starttime: 991283
      kind: zombie
      escalation: container_reboot
      state: Z
      comm: python3
      threads: 1
      live_threads: []
      uninterruptible: []
      parent: {pid: 51200, comm: sleep, is_namespace_init: true}
      description: pid 51234 (python3) is a zombie orphaned to its namespace's init ...
escalation:
  description:
    - What it takes to free what is still held, in the collection's one vocabulary, least force
      first (see
      R(the verdict table in the relaunch guide,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table)).
    - V(none) (released); V(signals) (signals, reaping or more time can free it); V(container_reboot)
      (only a restart of the container clears it, e.g. a zombie holder its init never reaps);
      V(host_action) (a holder thread sleeps in the GPU driver, or the driver lists a pid that no
      longer exists).
  returned: always
  type: str
  choices: [none, signals, container_reboot, host_action]
  sample: container_reboot
needs_reboot:
  description: Whether RV(escalation) is V(container_reboot).
  returned: always
  type: bool
  sample: false
reasons:
  description: Why RV(escalation) is what it is, one sentence per holder or unmet condition; the C(why) of each of RV(findings).
  returned: always
  type: list
  elements: str
  sample: ["released"]
findings:
  description:
    - RV(reasons) with structured fields to decide on (never decide on the wording of C(why)).
    - C(kind) is a holder's kind (see RV(holders)), V(unlisted_memory) (memory used with no process listed),
      V(pids_present), V(host_memory), V(gpu_condition) or V(released), words of
      R(the collection's one finding vocabulary,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table);
      C(escalation) what clears it; C(pids) the processes concerned.
  returned: always
  type: list
  elements: dict
  sample: [{kind: unreaped_orphan, escalation: container_reboot, pids: [51234], why: "pid 51234 (python3) is a zombie orphaned ..."}]
option_problems:
  description: Every problem found with the options, each a dict of C(option), its name, and C(reason), what is wrong with its value.
  returned: when the options were refused, before any waiting (the first GPU query finds a GPU of O(devices) that is not on the host)
  type: list
  elements: dict
  sample: [{"option": "poll_interval", "reason": "must be at least 0.01 and at most 3600 seconds, got 0"}]
error_kind:
  description:
    - Why a GPU query failed, when it did; V(not_installed), V(library_not_found), V(driver_not_loaded),
      V(no_devices), V(version_mismatch), V(gpu_lost), V(reset_required), V(no_permission), V(hung) or
      V(nvml_error).
  returned: when a GPU query failed
  type: str
  sample: driver_not_loaded
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid, fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcfsError
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (
    GpuQueryError,
    gpu_backend_spec,
    open_gpu_source,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.wait import (
    options_from_params,
    wait_for_release,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "devices": {"type": "list", "elements": "str", "default": []},
            "max_used_mib": {"type": "float"},
            "max_used_percent": {"type": "float"},
            "no_processes": {"type": "bool", "default": False},
            "pids_gone": {"type": "list", "elements": "int", "default": []},
            "min_host_available_gib": {"type": "float"},
            "timeout": {"type": "float", "default": 300},
            "poll_interval": {"type": "float", "default": 0.5},
            "gpus_required": {"type": "bool", "default": True},
            "proc_root": {"type": "path", "default": "/proc"},
            **gpu_backend_spec(),
        },
        supports_check_mode=True,
    )
    params = module.params
    with fail_on_invalid_options(module, changed=False, released=False):
        options = options_from_params(params)
    began = time.monotonic()
    source = None
    no_gpu = ""

    try:
        try:
            source = open_gpu_source(params["backend"], params["nvidia_smi"], options.query_timeout)
            outcome = wait_for_release(source, list(options.devices), options.condition, options.timeout,
                                       options.poll_interval, params["proc_root"])
        except GpuQueryError as exc:
            if params["gpus_required"] or not exc.means_no_gpu:
                raise
            if source is not None:
                source.close()
            source, no_gpu = None, str(exc)
            outcome = wait_for_release(None, [], options.condition, options.timeout, options.poll_interval,
                                       params["proc_root"])
    except GpuQueryError as exc:
        module.fail_json(msg=f"GPU query failed: {exc}", error_kind=exc.kind, released=False, changed=False,
                         backend=source.backend if source is not None else "none",
                         elapsed=round(time.monotonic() - began, 3))
    except BadOption as exc:
        # Only a wait can tell that a GPU named in devices is not on this host.
        module.fail_json(changed=False, released=False, **OptionsInvalid([exc]).as_result())
    except ProcfsError as exc:
        module.fail_json(msg=f"proc_root: {exc}", released=False, changed=False)
    finally:
        if source is not None:
            source.close()

    result = outcome.as_dict()
    result.update(changed=False, backend=source.backend if source is not None else "none", gpu_present=not no_gpu,
                  elapsed=round(time.monotonic() - began, 3))
    if not outcome.released:
        module.fail_json(msg=_timeout_message(result, options.timeout), **result)
    if no_gpu:
        result["msg"] = f"no NVIDIA GPU on this host (gpus_required=false): {no_gpu}"
    else:
        result["msg"] = f"released {result['released_mib']:g} MiB on {len(result['gpus'])} GPU(s) after {result['elapsed']:g}s"
    module.exit_json(**result)


def _timeout_message(result: dict, timeout: float) -> str:
    """What is still unmet, then why (the reasons that do not merely repeat it)."""
    why = [reason for reason in result["reasons"] if reason not in result["unmet"]]
    text = f"not released after {timeout:g}s (escalation {result['escalation']}): {'; '.join(result['unmet'])}"
    return f"{text}. {'; '.join(why)}" if why else text


if __name__ == "__main__":
    main()
