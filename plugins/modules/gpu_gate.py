#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_gate
short_description: Decide whether a job may launch on this host's GPUs, reset or quarantine the bad ones
version_added: 0.1.0
description:
  - The relaunch's hardware gate, after the drain and before the launch, in one module run on the target.
    It looks at the GPUs as M(gpuops.relaunch.gpu_health) does (NVML's reads and the kernel log's XIDs) and
    decides from that look and the host's quarantine record.
  - "V(launch): every GPU healthy and none quarantined; or, where the job can run on fewer (O(min_gpus)),
    on the healthy ones, named by UUID in RV(cuda_visible_devices)."
  - "A GPU that only a reset clears is reset here when O(reset_allowed) is true, O(reset_node) is empty and
    enough GPUs remain usable; then it looks again and decides again. The reset is
    C(nvidia-smi --gpu-reset -i N), only once no process holds the GPU's device file and NVML lists none on it
    (looked at without sending any signal, until O(reset_timeout))."
  - "V(reset): the same GPU in a container whose GPUs its Proxmox node owns (O(reset_node)): the node resets it
    (M(gpuops.relaunch.gpu_reset) there, by RV(reset_uuids)); this module's second run, given the node's answer
    in O(node_reset), looks again and decides as after a reset of its own. Otherwise never an answer."
  - "V(refuse): a GPU that needs a host reboot, is lost or needs service, one a reset did not clear or could not
    reset, or one quarantined earlier, where the job cannot run without it; RV(bad) holds the evidence of
    each (index, UUID, bus id, the XIDs with time and text, the recovery action, the remap counts)."
  - "V(skip): no GPU on the host and O(gpus_required=false)."
  - Every GPU found bad (and not cleared by a reset) is quarantined in a record on this host,
    O(state_dir)C(/gpu-quarantine.json), and stays out of later launches until O(clear_quarantine).
  - A refusal is an answer, not a failure of the task; the task fails for bad options, a GPU query that
    cannot run, or a quarantine record that is not sound.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.gpu_backend
attributes:
  check_mode:
    support: full
    details: A reset is announced (RV(reset)), never done; the record is not written.
  diff_mode:
    support: none
  platform:
    platforms: linux
options:
  state_dir:
    description:
      - The directory of the host's quarantine record (C(gpu-quarantine.json)); the relaunch passes
        O(gpuops.relaunch.train_launch#module:state_dir). Walked from C(/) like the jobs' records.
    type: str
    default: /var/lib/gpuops
  devices:
    description: The job's GPUs, by index or UUID. Empty means all GPUs.
    type: list
    elements: str
    default: []
  since:
    description:
      - The cut-off for XID events, as O(gpuops.relaunch.gpu_health#module:since). The last reset by this
        module and the last O(clear_quarantine) move it later, so that an XID a reset cleared counts once.
    type: float
    default: 0
  xid_overrides:
    description: A site's changes to the XID table, as O(gpuops.relaunch.gpu_health#module:xid_overrides).
    type: dict
    default: {}
  burst_window:
    description: As O(gpuops.relaunch.gpu_health#module:burst_window).
    type: float
    default: 10
  kernel_log:
    description: Whether to read XID events from the kernel log.
    type: bool
    default: true
  kernel_log_timeout:
    description: As O(gpuops.relaunch.gpu_health#module:kernel_log_timeout).
    type: float
    default: 10
  gpus_required:
    description: Whether a host without a usable NVIDIA GPU is a failure; with V(false) the gate says V(skip).
    type: bool
    default: true
  reset_allowed:
    description: Whether a GPU that only a reset clears may be reset. Off by default.
    type: bool
    default: false
  reset_node:
    description:
      - The Proxmox node that owns this container's GPUs (its inventory hostname). Set, no reset is done
        from here (a container cannot reset a GPU of its node); where O(reset_allowed) is true the answer is
        V(reset), naming the node (RV(reset_node)) and the GPUs' UUIDs (RV(reset_uuids)).
    type: str
    default: ""
  node_reset:
    description:
      - The answer of M(gpuops.relaunch.gpu_reset) on the node O(reset_node), after a V(reset) answer - its
        C(reset) (each GPU's C(index), C(uuid), C(done), C(holders), C(why)) and C(at) (when it began).
        Given, this run is the look again after that reset - XIDs from before it do not count, a GPU
        still bad is not reset again, and a GPU the node could not reset (still held) refuses the job, naming why.
    type: dict
  min_gpus:
    description:
      - The fewest GPUs the job can run on. V(0) means every GPU of O(devices); more than 0, the job
        launches without bad GPUs while at least this many healthy ones remain.
    type: int
    default: 0
  clear_quarantine:
    description:
      - A person says the quarantined GPUs are fixed, so clear the record before the look (a GPU still found
        bad is quarantined again). XIDs from before the clearing no longer count.
    type: bool
    default: false
  reset_timeout:
    description: How long to wait for a GPU to be free before its reset, in seconds (more than 0, at most 600).
    type: float
    default: 30
  job_name:
    description:
      - The job this gate is for. Where the gate leaves GPUs out, the record notes the job's
        RV(cuda_visible_devices) (and forgets it when the job gets every GPU again), for O(record_only).
    type: str
    default: ""
  record_only:
    description:
      - Only read the record - RV(cuda_visible_devices) is what the gate last gave O(job_name) and RV(quarantined)
        the quarantined GPUs; no look at the GPUs, nothing written, RV(outcome) is V(record). The relaunch does
        this before its probe for a job with O(min_gpus), so that the probe compares the running job's
        environment with that variable in it.
    type: bool
    default: false
notes:
  - O(query_timeout) is at most 600 seconds for this module.
seealso:
  - module: gpuops.relaunch.gpu_health
  - ref: ansible_collections.gpuops.relaunch.docsite.guide_gpu_health
    description: What each outcome does, quarantine, and how to name a Proxmox node.
"""

EXAMPLES = r"""
- name: May the job launch on this host's GPUs (it can run on 6 of its 8)?
  gpuops.relaunch.gpu_gate:
    state_dir: /var/lib/gpuops
    min_gpus: 6
    reset_allowed: true
  register: gate

- name: In a Proxmox container, the node pve1 resets a GPU that needs it (the relaunch role does this)
  gpuops.relaunch.gpu_gate:
    reset_allowed: true
    reset_node: pve1
  register: gate

- name: Reset it on the node, by UUID
  when: gate.outcome == 'reset'
  gpuops.relaunch.gpu_reset:
    uuids: "{{ gate.reset_uuids }}"
  delegate_to: pve1
  register: node_reset

- name: Look again in the container
  when: gate.outcome == 'reset'
  gpuops.relaunch.gpu_gate:
    reset_allowed: true
    reset_node: pve1
    node_reset: "{{ node_reset }}"

- name: A person replaced GPU 3; let it back in
  gpuops.relaunch.gpu_gate:
    clear_quarantine: true
"""

RETURN = r"""
outcome:
  description:
    - V(launch), V(refuse), V(reset) (on the node O(reset_node)), V(skip) (no GPU, O(gpus_required=false)) or
      V(record) (O(record_only)).
  returned: unless the options were refused
  type: str
  sample: refuse
why:
  description: One sentence saying why, naming each bad GPU.
  returned: unless the options were refused
  type: str
  sample: "GPU 3 (GPU-5c3b..., 00000000:3B:00.0): XID 79 ... (the job needs every one of its GPUs ...)"
escalation:
  description: What clears the worst bad GPU, in the collection's one vocabulary (V(none) when none is bad).
  returned: unless the options were refused
  type: str
  sample: host_reboot
bad:
  description:
    - Each bad GPU's evidence - C(index), C(uuid), C(pci_bus_id), C(escalation), C(reasons), C(xids) (C(xid),
      C(class), C(first), C(last), C(lines), C(text)), C(recovery_action), C(remapped_rows), and C(quarantined)
      (true for one an earlier run quarantined).
  returned: unless the options were refused
  type: list
  elements: dict
  sample: []
visible:
  description: The UUIDs of the GPUs the job launches on where the gate leaves GPUs out; [] otherwise.
  returned: unless the options were refused
  type: list
  elements: str
  sample: []
visible_indices:
  description: The indices of RV(visible), in the same order.
  returned: unless the options were refused
  type: list
  elements: int
  sample: []
cuda_visible_devices:
  description: RV(visible) as the job's C(CUDA_VISIBLE_DEVICES) (empty when the gate leaves none out).
  returned: unless the options were refused
  type: str
  sample: "GPU-0a1b...,GPU-2c3d..."
reset:
  description:
    - Each GPU reset (or, in check mode or for the node, announced) - C(index), C(uuid), C(done), C(holders),
      C(why); after O(node_reset), the node's.
  returned: unless the options were refused
  type: list
  elements: dict
  sample: [{index: 1, uuid: GPU-..., done: true, holders: [], why: ""}]
reset_node:
  description: With RV(outcome=reset), the Proxmox node that resets the GPUs (O(reset_node)); else empty.
  returned: unless the options were refused or the gate was skipped
  type: str
  sample: pve1
reset_uuids:
  description: With RV(outcome=reset), the UUIDs of the GPUs the node is to reset.
  returned: unless the options were refused or the gate was skipped
  type: list
  elements: str
  sample: ["GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001"]
quarantined:
  description: The UUIDs quarantined on this host after this run.
  returned: unless the options were refused
  type: list
  elements: str
  sample: []
quarantine_cleared:
  description: The UUIDs O(clear_quarantine) let back in.
  returned: unless the options were refused
  type: list
  elements: str
  sample: []
quarantine_record:
  description: The path of the host's quarantine record.
  returned: unless the options were refused
  type: str
  sample: /var/lib/gpuops/gpu-quarantine.json
health:
  description: The look the decision was made on (M(gpuops.relaunch.gpu_health)'s result).
  returned: unless the options were refused
  type: dict
  sample: {}
health_after:
  description: The look after a reset (null when none was done).
  returned: unless the options were refused
  type: dict
  sample: null
gpu_present:
  description: Whether a usable NVIDIA GPU was found.
  returned: unless the options were refused
  type: bool
  sample: true
elapsed:
  description: Seconds the gate took.
  returned: unless the options were refused
  type: float
  sample: 0.45
option_problems:
  description: Every problem found with the options, each a dict of C(option) and C(reason).
  returned: when the options were refused
  type: list
  elements: dict
  sample: [{"option": "min_gpus", "reason": "must be a whole number from 0 (every GPU) to 256, got -1"}]
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid, fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.gate_run import gate_options, run_gate
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.quarantine import QuarantineError
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import GpuQueryError, gpu_backend_spec


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state_dir": {"type": "str", "default": "/var/lib/gpuops"},
            "devices": {"type": "list", "elements": "str", "default": []},
            "since": {"type": "float", "default": 0},
            "xid_overrides": {"type": "dict", "default": {}},
            "burst_window": {"type": "float", "default": 10},
            "kernel_log": {"type": "bool", "default": True},
            "kernel_log_timeout": {"type": "float", "default": 10},
            "gpus_required": {"type": "bool", "default": True},
            "reset_allowed": {"type": "bool", "default": False},
            "reset_node": {"type": "str", "default": ""},
            "node_reset": {"type": "dict"},
            "min_gpus": {"type": "int", "default": 0},
            "clear_quarantine": {"type": "bool", "default": False},
            "reset_timeout": {"type": "float", "default": 30},
            "job_name": {"type": "str", "default": ""},
            "record_only": {"type": "bool", "default": False},
            **gpu_backend_spec(),
        },
        supports_check_mode=True,
    )
    with fail_on_invalid_options(module, changed=False):
        options = gate_options(module.params)
    try:
        result = run_gate(options, module.check_mode)
    except GpuQueryError as exc:
        module.fail_json(msg=f"GPU query failed: {exc}", error_kind=exc.kind, changed=False)
    except QuarantineError as exc:
        module.fail_json(msg=f"not relaunching: the GPU quarantine record is not sound: {exc}", changed=False)
    except BadOption as exc:
        # Only a look at the GPUs can tell that one named in devices is not on this host.
        module.fail_json(changed=False, **OptionsInvalid([exc]).as_result())
    result["msg"] = result["why"]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
