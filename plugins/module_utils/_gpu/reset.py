# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A GPU reset on the machine that owns the GPU: ``nvidia-smi --gpu-reset -i N``, only once nothing holds it.

A reset needs the GPU free on the whole machine (NVIDIA: no process may use it). Before the reset the GPU is
looked at without sending anything to anyone, until a deadline: no process may hold its device file
(``/dev/nvidiaN``, N its minor number: ProcessTable.device_holders, the collection's one "holds a GPU" walk)
and NVML may list no process on it. Still held at the deadline, it is not reset and the answer names the
holders. The command runs under the same deadline, its output bounded (NvidiaSmiSession).

On a Proxmox node (module gpu_reset, for a container's GPUs) the GPU is named by its UUID, not its index:
the indices the container sees need not be the node's. A UUID reaches the command line only after its format
is checked (GPU_UUID), as one argument of the command's list, never a shell string.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import GpuDevice, GpuQueryError, NvidiaSmiSession, open_gpu_source

DEFAULT_DEVICE_GLOB = "/dev/nvidia*"
POLL_INTERVAL = 0.2
# A whole GPU's UUID as NVML and nvidia-smi print it (a MIG instance's, MIG-..., is not reset on its own).
GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)


def is_gpu_uuid(text: object) -> bool:
    """Whether `text` is a whole GPU's UUID, and nothing else."""
    return isinstance(text, str) and GPU_UUID.fullmatch(text) is not None


def read_device(backend: str, nvidia_smi: str, query_timeout: float, index: int | None = None,
                uuid: str = "") -> GpuDevice | None:
    """One GPU as the driver lists it now, with the minor number of its device file: GPU `index`, or the one
    whose UUID is `uuid`. None where it cannot be read or is not there."""
    try:
        source = open_gpu_source(backend, nvidia_smi, query_timeout)
    except GpuQueryError:
        return None
    try:
        devices = source.query(None if index is None else [index])
        if uuid:
            devices = [device for device in devices if device.uuid.lower() == uuid.lower()]
        if isinstance(source, NvidiaSmiSession):
            devices = source.with_minor_numbers(devices[:1])
        return devices[0] if devices else None
    except GpuQueryError:
        return None
    finally:
        source.close()


@dataclass
class ResetAnswer:
    """One GPU's reset: done or not, and why not (the holders seen at the deadline, or the command's error)."""

    index: int
    uuid: str
    done: bool = False
    holders: list[dict[str, Any]] = field(default_factory=list)
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "done": self.done, "holders": self.holders, "why": self.why}


def holders_of(device: GpuDevice, proc_root: str = "/proc", device_glob: str = DEFAULT_DEVICE_GLOB) -> list[dict[str, Any]]:
    """Who holds `device` now: each process holding its device file open (by the file's numbers, never a name),
    and each process NVML lists on it (host pids). Sends no signal."""
    found: list[dict[str, Any]] = []
    if device.minor_number is not None:
        table = ProcessTable.scan(proc_root, cmdlines=False)
        for holder in table.device_holders(device_glob):
            if holder.device.is_gpu and holder.device.minor == device.minor_number:
                found.append({"pid": holder.pid, "comm": escape_controls(holder.comm)[:64], "seen_by": "device_file"})
    for process in device.processes:
        found.append({"pid": process.pid, "comm": "", "seen_by": "nvml"})
    return found


def reset_gpu(index: int, look: Callable[[], GpuDevice | None], nvidia_smi: str, timeout: float,
              proc_root: str = "/proc", device_glob: str = DEFAULT_DEVICE_GLOB, by_uuid: str = "") -> ResetAnswer:
    """Reset GPU `index` once nothing holds it, within `timeout` seconds. `look` reads the GPU afresh (None:
    NVML cannot read it now, and then only the device files are looked at). With `by_uuid` (checked by
    is_gpu_uuid) the command names the GPU by that UUID instead of the index. Never raises for the GPU's state."""
    deadline = Deadline(timeout)
    unknown = GpuDevice(index=index, uuid="", name="", total_bytes=0, used_bytes=0)
    device = look() or unknown
    answer = ResetAnswer(index, device.uuid)
    if device.minor_number is None:
        answer.why = (f"GPU {index}: its device file is not known ({device.minor_unknown or 'no minor number'}), so "
                      f"no look can prove that nothing holds it: not reset")
        return answer

    def free() -> bool:
        answer.holders = holders_of(look() or device, proc_root, device_glob)
        return not answer.holders

    if not deadline.poll(free, POLL_INTERVAL):
        pids = ", ".join(f"{h['pid']} ({h['seen_by']})" for h in answer.holders)
        answer.why = f"GPU {index}: still held after {timeout:g}s by pid(s) {pids}: not reset"
        return answer
    executable = shutil.which(nvidia_smi)
    if executable is None:
        answer.why = f"GPU {index}: {escape_controls(nvidia_smi)} not found: not reset"
        return answer
    try:
        NvidiaSmiSession(executable, max(deadline.remaining(), 1.0)).command(["--gpu-reset", "-i", by_uuid or str(index)])
    except GpuQueryError as exc:
        answer.why = f"GPU {index}: nvidia-smi --gpu-reset failed: {escape_controls(str(exc))[:400]}"
        return answer
    answer.done = True
    return answer


def reset_by_uuid(uuid: str, look: Callable[[], GpuDevice | None], nvidia_smi: str, timeout: float,
                  proc_root: str = "/proc", device_glob: str = DEFAULT_DEVICE_GLOB) -> ResetAnswer:
    """Reset the GPU whose UUID is `uuid` on this machine (a Proxmox node, for its container), as reset_gpu does;
    `look` finds it by that UUID. Not reset: a UUID that is not one (nothing is run), or no such GPU here."""
    if not is_gpu_uuid(uuid):
        return ResetAnswer(-1, escape_controls(str(uuid))[:80], why=f"{escape_controls(str(uuid))[:80]!r} is not a GPU's UUID: not reset")
    device = look()
    if device is None:
        return ResetAnswer(-1, uuid, why=f"{uuid}: no such GPU can be read on this machine: not reset")
    return reset_gpu(device.index, look, nvidia_smi, timeout, proc_root, device_glob, by_uuid=uuid)
