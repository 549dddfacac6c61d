#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_health
short_description: Judge the GPUs' hardware health from NVML and the kernel log's XID events
version_added: 0.1.0
description:
  - Reads, per GPU, what the driver knows about the hardware and judges it in the collection's one
    escalation vocabulary, so that a relaunch (or a play of your own) can tell a job's crash from a
    GPU that needs a reset or a host that needs a reboot.
  - "From NVML (in a child process, each query under O(query_timeout)): the recovery action
    (C(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), driver 570 and later: none, GPU reset, node reboot, drain P2P,
    drain and reset), row remapping (corrected, uncorrected, pending, failure), retired pages pending
    (before Ampere), uncorrectable ECC errors since the last reset (volatile), NVLink links down, and
    throttle reasons (a hardware slowdown or power brake is a warning, never a verdict). A GPU that NVML
    reports lost (error 15) or requiring a reset (error 16) is judged so."
  - Each read that this GPU, driver or binding does not support says so in C(reads) of RV(gpus) and is not
    an error.
  - "From the kernel's own log (C(/dev/kmsg), read without blocking, bounded): the driver's
    C(NVRM: Xid (PCI:0000:3b:00): 79, ...) lines at or after O(since), matched to a GPU by its bus id.
    Only records the kernel wrote count: text that user space wrote to C(/dev/kmsg) carries the user
    facility and is counted in C(user_lines_ignored) of RV(kernel_log) only. Inside an LXC container the
    kernel log is denied: C(status) of RV(kernel_log) says so, and that is not an error."
  - Each XID is classified by one table kept as data with its source (NVIDIA's XID catalog), see
    R(the GPU health guide,ansible_collections.gpuops.relaunch.docsite.guide_gpu_health); lines of one
    XID on one GPU close together in time are one burst, and a rule counts bursts, not lines.
  - With the C(nvidia-smi) backend (no Python bindings on the target) the reads come from one C(nvidia-smi -q -x)
    report - remapped rows, retired pages pending, volatile uncorrectable ECC counts, throttle reasons and the
    bus id that XIDs are matched by; the recovery action and NVLink say the report does not give them.
  - Never changes anything. A look never fails because of what it found; it fails only for bad options
    or a GPU query that cannot run.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.info_module
  - gpuops.relaunch.gpu_backend
options:
  devices:
    description:
      - The GPUs to judge, by index (V(0)) or UUID (C(GPU-...)). Empty means all GPUs.
      - With all GPUs, an XID of a bus id NVML does not list (a GPU that fell off the bus) counts for the
        host; with a selection it is only reported in RV(unmatched_xids).
    type: list
    elements: str
    default: []
  since:
    description:
      - The cut-off for XID events, in seconds since the epoch (for example the failed run's start time).
        A negative number counts back from now (V(-3600) is the last hour). V(0) takes everything the
        kernel's ring buffer still holds.
      - A finite number, at most a day in the future.
    type: float
    default: 0
  xid_overrides:
    description:
      - A site's changes to the XID table, by XID number. A value is a class, or a mapping with C(class)
        and C(bursts) (how many bursts of that XID on one GPU since O(since) it takes to count, 1 to 1000).
      - "Classes: V(application) (the job's fault: a relaunch helps), V(reset_gpu), V(reboot_host),
        V(workflow) (read the recovery action), V(informational)."
    type: dict
    default: {}
  burst_window:
    description:
      - Lines of one XID on one GPU with gaps of at most this many seconds are one burst.
      - From 0 to 3600; NaN and infinity are refused.
    type: float
    default: 10
  kernel_log:
    description:
      - Whether to read XID events from the kernel log at all.
    type: bool
    default: true
  kernel_log_timeout:
    description:
      - How long the scan of the kernel log may take, in seconds; past it the scan stops and says it was
        truncated (C(truncated) of RV(kernel_log)).
      - More than 0 and at most 600.
    type: float
    default: 10
  gpus_required:
    description:
      - Whether a host without a usable NVIDIA GPU (no bindings nor C(nvidia-smi), no NVML library, driver
        not loaded, no device) is a failure. With V(false) the task then succeeds with RV(gpu_present=false).
    type: bool
    default: true
attributes:
  platform:
    platforms: linux
    details:
      - Linux only (NVML or C(nvidia-smi), and C(/dev/kmsg)). Run it where the kernel log is visible (the
        host, or a Proxmox node) to see XIDs; inside a container only the NVML reads are possible.
notes:
  - Reading C(/dev/kmsg) needs C(CAP_SYSLOG) where C(kernel.dmesg_restrict) is 1 (run as root).
  - The kernel stamps its records with a clock that does not count suspended time; on a machine that
    was suspended, O(since) is approximate.
  - O(query_timeout) is at most 600 seconds for this module.
seealso:
  - module: gpuops.relaunch.gpu_mem_wait
  - ref: ansible_collections.gpuops.relaunch.docsite.guide_gpu_health
    description: What is checked, the XID table and its sources, and what a container can see.
"""

EXAMPLES = r"""
- name: Judge every GPU, with the XIDs since the failed run started
  gpuops.relaunch.gpu_health:
    since: "{{ failed_run_started }}"
  register: health

- name: Stop here when the hardware must act first
  ansible.builtin.assert:
    that: health.healthy
    fail_msg: "{{ health.reasons | join('; ') }}"

- name: A site that treats a burst of XID 92 as needing a reset, and a third burst of XID 13 too
  gpuops.relaunch.gpu_health:
    devices: [0, 1]
    since: -3600
    xid_overrides:
      92: reset_gpu
      13: {class: reset_gpu, bursts: 3}
"""

RETURN = r"""
healthy:
  description: Whether nothing found needs more than a relaunch (RV(escalation) is V(none)); throttle warnings do not count.
  returned: always
  type: bool
  sample: false
escalation:
  description:
    - What it takes to clear what was found on the host, the worst of its GPUs', in the collection's one
      vocabulary, least force first.
    - "V(none) (healthy, or only warnings); V(gpu_reset) (a reset of the GPU on the machine that owns it);
      V(host_reboot) (a reboot of the machine that owns the GPU; for a container, its Proxmox node);
      V(host_action) (no known step clears it, for example a failed row remap; the GPU needs service).
      V(signals) and V(container_reboot) are never the hardware's."
  returned: always
  type: str
  choices: [none, signals, container_reboot, gpu_reset, host_reboot, host_action]
  sample: gpu_reset
reasons:
  description: Why RV(escalation) is what it is, one sentence per finding; the C(why) of each of RV(findings).
  returned: always
  type: list
  elements: str
  sample: ["GPU 3 (GPU-5c3b..., 00000000:3B:00.0): a row remap is pending: a GPU reset activates it"]
findings:
  description:
    - RV(reasons) with structured fields to decide on (never decide on the wording of C(why)).
    - C(kind) is V(healthy), V(gpu_lost), V(reset_required), V(recovery_action), V(row_remap),
      V(retired_pages), V(ecc_errors), V(nvlink_down), V(throttle) or V(xid), words of
      R(the collection's one finding vocabulary,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table);
      C(escalation) what clears it.
  returned: always
  type: list
  elements: dict
  sample: [{kind: row_remap, escalation: gpu_reset, pids: [], why: "GPU 3 (...): a row remap is pending: a GPU reset activates it"}]
gpus:
  description:
    - Per selected GPU, its identity, its verdict and what each read said.
    - C(reads) has C(recovery_action), C(remapped_rows), C(retired_pages_pending), C(ecc_uncorrected_volatile),
      C(nvlink) and C(throttle_reasons), each with C(status) V(ok) and C(value), or V(unsupported) or V(error)
      and C(why). C(recovery_action) adds C(action) (V(none), V(gpu_reset), V(node_reboot), V(drain_p2p),
      V(drain_and_reset), ...); C(throttle_reasons) adds C(active), the hardware slowdowns in force.
    - C(xids) are the GPU's XID bursts since O(since) (see RV(unmatched_xids) for their fields), each with its C(class).
    - C(warnings) are the throttle findings' sentences.
  returned: always
  type: list
  elements: dict
  sample:
    - index: 3
      uuid: GPU-5c3b1b8e-1d2f-4a7b-9e0c-2b1d1f3a4c5d
      pci_bus_id: "00000000:3B:00.0"
      escalation: host_reboot
      healthy: false
      reads:
        recovery_action: {status: ok, value: 2, action: node_reboot}
        remapped_rows: {status: ok, value: {corrected: 0, uncorrected: 1, pending: true, failure: false}}
        nvlink: {status: unsupported, why: "the driver does not support it (Not Supported)"}
      xids:
        - {xid: 79, class: reboot_host, pci_bus_id: "00000000:3B:00.0", first: 1767225600.1, last: 1767225600.2,
           lines: 2, pids: [4242], names: [python3], text: "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, ..."}
      findings: []
      warnings: []
unmatched_xids:
  description:
    - XID bursts on a bus id that no selected GPU has. C(xid), C(class), C(pci_bus_id) (NVML's spelling),
      C(first) and C(last) (seconds since the epoch), C(lines), C(pids) and C(names) (what the driver said
      of the process, bounded and escaped), C(text) (the first line, bounded and escaped).
  returned: always
  type: list
  elements: dict
  sample: []
kernel_log:
  description:
    - How the kernel log was read. C(status) is V(read), V(denied) (inside an LXC container, or without
      C(CAP_SYSLOG)), V(absent), V(failed) or V(not_read) (O(kernel_log=false)); C(why) says why it was not read.
    - C(records) and C(bytes) scanned, C(xid_lines) counted, C(user_lines_ignored) (XID text written from
      user space), C(before_cutoff), C(lost_records) (overwritten while read) and C(truncated).
  returned: always
  type: dict
  sample: {status: read, why: "", records: 1812, bytes: 190211, xid_lines: 2, user_lines_ignored: 1,
           before_cutoff: 0, lost_records: 0, truncated: false}
backend:
  description: What the GPUs were read with, V(pynvml) or V(nvidia-smi); V(none) when no GPU was read.
  returned: always
  type: str
  sample: pynvml
gpu_present:
  description: Whether a usable NVIDIA GPU was found (a lost GPU counts as present).
  returned: always
  type: bool
  sample: true
elapsed:
  description: Seconds the look took.
  returned: unless the options were refused
  type: float
  sample: 0.41
option_problems:
  description: Every problem found with the options, each a dict of C(option), its name, and C(reason).
  returned: when the options were refused
  type: list
  elements: dict
  sample: [{"option": "xid_overrides", "reason": "XID 79: class must be one of application, ..."}]
error_kind:
  description: Why the GPU query failed, when it did (the words of M(gpuops.relaunch.gpu_mem_wait)'s RV(error_kind)).
  returned: when a GPU query failed
  type: str
  sample: hung
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid, fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.health import no_gpu_health, options_from_params, read_host
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import GpuQueryError, gpu_backend_spec


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "devices": {"type": "list", "elements": "str", "default": []},
            "since": {"type": "float", "default": 0},
            "xid_overrides": {"type": "dict", "default": {}},
            "burst_window": {"type": "float", "default": 10},
            "kernel_log": {"type": "bool", "default": True},
            "kernel_log_timeout": {"type": "float", "default": 10},
            "gpus_required": {"type": "bool", "default": True},
            **gpu_backend_spec(),
        },
        supports_check_mode=True,
    )
    params = module.params
    with fail_on_invalid_options(module, changed=False, healthy=False):
        options = options_from_params(params)
    began = time.monotonic()
    try:
        backend, health = read_host(options, params["backend"], params["nvidia_smi"], params["query_timeout"])
        gpu_present = True
    except GpuQueryError as exc:
        if params["gpus_required"] or not exc.means_no_gpu:
            module.fail_json(msg=f"GPU query failed: {exc}", error_kind=exc.kind, changed=False, healthy=False,
                             elapsed=round(time.monotonic() - began, 3))
        backend, health, gpu_present = "none", no_gpu_health(options, str(exc)), False
    except BadOption as exc:
        # Only a look at the GPUs can tell that one named in devices is not on this host.
        module.fail_json(changed=False, healthy=False, **OptionsInvalid([exc]).as_result())
    result = health.as_dict()
    result.update(changed=False, backend=backend, gpu_present=gpu_present, elapsed=round(time.monotonic() - began, 3))
    result["msg"] = (f"{len(result['gpus'])} GPU(s) healthy" if result["healthy"]
                     else f"{result['escalation']}: {'; '.join(result['reasons'])}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
