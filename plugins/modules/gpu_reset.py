#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_reset
short_description: Reset GPUs named by UUID on the machine that owns them, once nothing there holds them
version_added: 0.1.0
description:
  - Resets each GPU named in O(uuids) with C(nvidia-smi --gpu-reset -i UUID) on the target, the machine that owns
    the GPUs - for a Proxmox LXC container, its node (the relaunch role runs it there, delegated, when
    M(gpuops.relaunch.gpu_gate) in the container answers V(reset)). GPUs are named by UUID because the indices a
    container sees need not be the node's.
  - A GPU is reset only once no process on this machine holds its device file and NVML lists none on it
    (looked at without sending any signal, until O(reset_timeout)); still held, it is not reset and its answer
    names the holders. A GPU that is not on this machine, or cannot be read, is not reset.
  - Not resetting a GPU is an answer (RV(reset)), not a failure of the task; the task fails for bad options.
  - Each UUID's format is checked before anything runs; the command is run without a shell.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.gpu_backend
attributes:
  check_mode:
    support: full
    details: Each reset is announced (RV(reset), C(done) false), never done.
  diff_mode:
    support: none
  platform:
    platforms: linux
options:
  uuids:
    description: The GPUs to reset, by UUID (C(GPU-) and 32 hexadecimal digits, as NVML prints them).
    type: list
    elements: str
    required: true
  reset_timeout:
    description: How long to wait for each GPU to be free before its reset, in seconds (more than 0, at most 600).
    type: float
    default: 30
notes:
  - O(query_timeout) is at most 600 seconds for this module.
seealso:
  - module: gpuops.relaunch.gpu_gate
  - ref: ansible_collections.gpuops.relaunch.docsite.guide_gpu_health
    description: How to name a Proxmox node, and what a container can and cannot see.
"""

EXAMPLES = r"""
- name: Reset a container's GPU on its Proxmox node
  gpuops.relaunch.gpu_reset:
    uuids: [GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001]
    reset_timeout: 60
  delegate_to: pve1
"""

RETURN = r"""
reset:
  description: Each GPU's answer, in the order of O(uuids) - C(index) (on this machine; -1 where not found),
    C(uuid), C(done), C(holders) (each C(pid), C(comm), C(seen_by) - C(device_file) or C(nvml)), C(why) (why not).
  returned: unless the options were refused
  type: list
  elements: dict
  sample: [{index: 3, uuid: GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001, done: true, holders: [], why: ""}]
at:
  description: When the first reset began (seconds since the epoch); XIDs before it are the reset's to clear.
  returned: unless the options were refused
  type: float
  sample: 1767000000.5
option_problems:
  description: Every problem found with the options, each a dict of C(option) and C(reason).
  returned: when the options were refused
  type: list
  elements: dict
  sample: [{"option": "uuids", "reason": "'GPU-x; reboot' is not a GPU's UUID"}]
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_seconds
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks, fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import gpu_backend_spec
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.reset import ResetAnswer, is_gpu_uuid, read_device, reset_by_uuid

MAX_TIMEOUT = 600.0


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "uuids": {"type": "list", "elements": "str", "required": True},
            "reset_timeout": {"type": "float", "default": 30},
            **gpu_backend_spec(),
        },
        supports_check_mode=True,
    )
    params = module.params
    with fail_on_invalid_options(module, changed=False):
        checks = OptionChecks()
        for uuid in params["uuids"]:
            if not is_gpu_uuid(uuid):
                checks.add("uuids", f"{escape_controls(repr(uuid))[:100]} is not a GPU's UUID (GPU- and 32 hexadecimal digits)")
        timeout = checks.check(check_seconds, "reset_timeout", params["reset_timeout"], 0.0, MAX_TIMEOUT, allow_minimum=False)
        checks.check(check_seconds, "query_timeout", params["query_timeout"], 0.0, MAX_TIMEOUT, allow_minimum=False)
        checks.raise_if_any()
    began = time.time()
    answers = []
    for uuid in params["uuids"]:
        def look(uuid: str = uuid):  # type: ignore[no-untyped-def]
            return read_device(params["backend"], params["nvidia_smi"], params["query_timeout"], uuid=uuid)
        if module.check_mode:
            device = look()
            answers.append(ResetAnswer(device.index if device else -1, uuid, why="check mode: would reset").as_dict())
            continue
        answers.append(reset_by_uuid(uuid, look, params["nvidia_smi"], float(timeout)).as_dict())  # type: ignore[arg-type]
    done = [answer["uuid"] for answer in answers if answer["done"]]
    left = [answer["why"] for answer in answers if not answer["done"]]
    msg = "; ".join([f"reset {', '.join(done)}"] * bool(done) + left) or "nothing to reset"
    module.exit_json(changed=bool(done), reset=answers, at=round(began, 3), msg=msg)


if __name__ == "__main__":
    main()
