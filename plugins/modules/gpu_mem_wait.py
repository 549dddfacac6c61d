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
    process. Each query has its own deadline I(query_timeout), because NVML calls can hang in the
    kernel; a hung query fails the task with a message saying so instead of hanging the play. Where
    the bindings are not installed on the target, C(nvidia-smi) CSV output is parsed instead.
  - On timeout the task fails and lists the C(holders). NVML reports pids of the host's PID namespace;
    where such a pid is visible here, its state comes from the process table (a zombie, a zombie
    leader whose threads still run, a thread in uninterruptible sleep with its wait channel).
    Inside a container the pids are not visible (C(visible=false)). RV(escalation) says what would
    free the memory, in the words M(gpuops.relaunch.zombie_facts) and M(gpuops.relaunch.zombie_reap)
    use too, in particular whether only a container restart helps (C(container_reboot)).
  - A missing driver, a missing library, a library/driver version mismatch, a lost GPU and a GPU
    that requires a reset each fail with a message saying so. With I(gpus_required=false), a host
    without any NVIDIA GPU is not an error.
  - Never changes anything.
author:
  - gpuops.relaunch maintainers (@gpuops)
options:
  devices:
    description:
      - The GPUs to wait for, by index (C(0)) or UUID (C(GPU-...)). Empty means all GPUs.
    type: list
    elements: str
    default: []
  max_used_mib:
    description:
      - Used memory per GPU, in MiB, at or under which the GPU counts as free. Where the driver
        reports its reservation apart (NVML memory info v2), that reservation is not counted.
      - A finite number, 0 or more.
      - When neither I(max_used_mib) nor I(max_used_percent) is given, the ceiling is 256 MiB.
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
      - Also require that the host's C(MemAvailable) (from C(meminfo) under I(proc_root)) is at least
        this many GiB. Large pinned host memory of a killed job takes tens of seconds to come back.
      - A finite number, 0 or more.
    type: float
  timeout:
    description:
      - How long to wait, in seconds, before failing. C(0) takes one look.
      - Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 300
  poll_interval:
    description:
      - Seconds between two looks.
      - At least 0.01 (a shorter pause only burns a core) and at most 3600.
    type: float
    default: 0.5
  query_timeout:
    description:
      - How long one GPU query (the first one includes initialising NVML) may take, in seconds,
        before it counts as hung and the task fails.
      - More than 0 and at most 86400 (a day); NaN and infinity are refused.
    type: float
    default: 30
  gpus_required:
    description:
      - Whether a host without a usable NVIDIA GPU (no bindings nor C(nvidia-smi), no NVML library,
        driver not loaded, no device) is a failure. With C(false) the task then succeeds with
        C(gpu_present=false) after waiting for the other conditions.
    type: bool
    default: true
  backend:
    description:
      - How to read the GPUs. C(auto) uses the Python bindings and falls back to C(nvidia-smi) when
        they are not installed.
    type: str
    choices: [auto, pynvml, nvidia-smi]
    default: auto
  nvidia_smi:
    description:
      - The C(nvidia-smi) executable, a name looked up on C(PATH) or a path.
    type: str
    default: nvidia-smi
  proc_root:
    description:
      - Where the process table is mounted, for the holders' states, I(pids_gone) and C(meminfo).
    type: path
    default: /proc
attributes:
  check_mode:
    description: The module only reads; in check mode it waits and reports exactly as otherwise.
    support: full
  diff_mode:
    description: Has no diff to show.
    support: none
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
waited_s:
  description: Seconds from the first look to the last.
  returned: always
  type: float
  sample: 2.53
polls:
  description: How many looks it took.
  returned: always
  type: int
  sample: 6
backend:
  description: What the GPUs were read with, C(pynvml) or C(nvidia-smi); C(none) when no GPU was found.
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
  description: Pids of I(pids_gone) still present at the end, with comm and state.
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
    - C(kind) is C(running), C(zombie), C(zombie_leader), C(uninterruptible) or C(invisible);
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
      first (see the README's verdict table).
    - C(none) (released); C(signals) (signals, reaping or more time can free it); C(container_reboot)
      (only a restart of the container clears it, e.g. a zombie holder its init never reaps);
      C(host_action) (a holder thread sleeps in the GPU driver, or the driver lists a pid that no
      longer exists).
  returned: always
  type: str
  choices: [none, signals, container_reboot, host_action]
  sample: container_reboot
verdict:
  description:
    - Deprecated, use RV(escalation); kept with the words of earlier releases.
    - C(released) (escalation C(none)), C(held) (C(signals)), C(needs_reboot) (C(container_reboot)) or
      C(needs_host_action) (C(host_action)).
  returned: always
  type: str
  choices: [released, held, needs_reboot, needs_host_action]
  sample: needs_reboot
needs_reboot:
  description: Whether RV(escalation) is C(container_reboot).
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
    - C(kind) is a holder's kind (see RV(holders)), C(unlisted_memory) (memory used with no process
      listed), C(pids_present), C(host_memory), C(gpu_condition) or C(released); C(escalation) what
      clears it; C(pids) the processes concerned.
  returned: always
  type: list
  elements: dict
  sample: [{kind: zombie, escalation: container_reboot, pids: [51234], why: "pid 51234 (python3) is a zombie orphaned ..."}]
error_kind:
  description:
    - Why a GPU query failed, when it did; C(not_installed), C(library_not_found), C(driver_not_loaded),
      C(no_devices), C(version_mismatch), C(gpu_lost), C(reset_required), C(no_permission), C(hung) or
      C(nvml_error).
  returned: when a GPU query failed
  type: str
  sample: driver_not_loaded
"""

import math

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import (
    BoundsError,
    check_poll_interval,
    check_seconds,
    check_timeout,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.wait import (
    ReleaseCondition,
    wait_for_release,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (
    GpuQueryError,
    open_gpu_source,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcfsError


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
            "query_timeout": {"type": "float", "default": 30},
            "gpus_required": {"type": "bool", "default": True},
            "backend": {"type": "str", "default": "auto", "choices": ["auto", "pynvml", "nvidia-smi"]},
            "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
            "proc_root": {"type": "path", "default": "/proc"},
        },
        supports_check_mode=True,
    )
    params = module.params
    problem = _bad_option(params)
    if problem:
        module.fail_json(msg=problem)
    condition = ReleaseCondition(
        max_used_mib=params["max_used_mib"],
        max_used_percent=params["max_used_percent"],
        no_processes=params["no_processes"],
        pids_gone=tuple(params["pids_gone"]),
        min_host_available_gib=params["min_host_available_gib"],
    )
    source = None
    no_gpu = ""
    try:
        try:
            source = open_gpu_source(params["backend"], params["nvidia_smi"], params["query_timeout"])
            outcome = wait_for_release(source, params["devices"], condition, params["timeout"],
                                       params["poll_interval"], params["proc_root"])
        except GpuQueryError as exc:
            if params["gpus_required"] or not exc.means_no_gpu:
                raise
            if source is not None:
                source.close()
            source, no_gpu = None, str(exc)
            outcome = wait_for_release(None, [], condition, params["timeout"], params["poll_interval"],
                                       params["proc_root"])
    except GpuQueryError as exc:
        module.fail_json(msg=f"GPU query failed: {exc}", error_kind=exc.kind, released=False,
                         backend=source.backend if source is not None else "none")
    except ValueError as exc:
        module.fail_json(msg=str(exc), released=False)
    except ProcfsError as exc:
        module.fail_json(msg=f"proc_root: {exc}", released=False)
    finally:
        if source is not None:
            source.close()

    result = outcome.as_dict()
    result.update(changed=False, backend=source.backend if source is not None else "none", gpu_present=not no_gpu)
    if not outcome.released:
        module.fail_json(msg=_timeout_message(result, params["timeout"]), **result)
    if no_gpu:
        result["msg"] = f"no NVIDIA GPU on this host (gpus_required=false): {no_gpu}"
    else:
        result["msg"] = f"released {result['released_mib']:g} MiB on {len(result['gpus'])} GPU(s) after {result['waited_s']:g}s"
    module.exit_json(**result)


def _bad_option(params: dict) -> str | None:
    """A message naming the first option with a wrong value, or None."""
    try:
        check_timeout("timeout", params["timeout"])
        check_poll_interval("poll_interval", params["poll_interval"])
        check_seconds("query_timeout", params["query_timeout"], allow_minimum=False)
    except BoundsError as exc:
        return str(exc)
    checks = [
        ("max_used_mib", _finite_within(params["max_used_mib"], 0), "must be a finite number, 0 or more"),
        ("max_used_percent", _finite_within(params["max_used_percent"], 0, 100), "must be between 0 and 100"),
        ("min_host_available_gib", _finite_within(params["min_host_available_gib"], 0),
         "must be a finite number, 0 or more"),
        ("pids_gone", all(pid > 0 for pid in params["pids_gone"]), "process IDs must be positive integers"),
        ("devices", all(str(d).strip() for d in params["devices"]), "entries must not be empty"),
        ("nvidia_smi", bool(params["nvidia_smi"]), "must not be empty"),
    ]
    for option, ok, what in checks:
        if not ok:
            return f"{option}: {what}, got {params[option]!r}"
    return None


def _finite_within(value: float | None, minimum: float, maximum: float = math.inf) -> bool:
    """True for an option not given, or a finite number from `minimum` to `maximum`."""
    return value is None or (math.isfinite(value) and minimum <= value <= maximum)


def _timeout_message(result: dict, timeout: float) -> str:
    """What is still unmet, then why (the reasons that do not merely repeat it)."""
    why = [reason for reason in result["reasons"] if reason not in result["unmet"]]
    text = f"not released after {timeout:g}s (escalation {result['escalation']}): {'; '.join(result['unmet'])}"
    return f"{text}. {'; '.join(why)}" if why else text


if __name__ == "__main__":
    main()
