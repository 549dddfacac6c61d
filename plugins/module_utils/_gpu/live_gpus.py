# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The GPUs of a job, seen live on the node: gpu_health's judgement without Ansible.

With train_launch's ``metrics_dir`` and the job's GPUs (``metrics_gpus``), the node's live health
(``_launch/live.py``: the supervisor, or the systemd backend's live unit) also writes, per GPU of
the job, gpu_health's verdict (health_judge.py, the very code the module judges with), NVML's
recovery action, the last XID of the kernel's own log since the run started, and whether the GPU is
quarantined. So an XID reaches Prometheus within one GPU period without Ansible.

How it looks, and why so:

* NVML is never loaded in the supervisor (nor the live unit): a driver call can hang in the kernel
  (D state), and the supervisor must go on reaping. Each look runs the private copy of
  health_reads.py as a short-lived child (``python3 -I``, a minimal environment), reads its one JSON
  line under GPU_TIMEOUT, and kills it when the deadline passes (a child stuck in the kernel is left
  to the supervisor's own reaping; the live unit leaves it to its end). A child, not a long-lived
  NVML session: a process that keeps NVML open holds the GPUs' device files, which the drain counts
  as holders.
* At most one look every GPU_PERIOD seconds, whatever the live file's own period: a look costs a
  Python start and NVML's initialisation (bench/live_health_cpu.py measures it).
* The kernel log (/dev/kmsg) is scanned from the run's start; inside an LXC container it is denied
  and the verdict stands on NVML alone (the node's own watcher sees the XIDs there).

Standard library only, and only files that are too (imported by bare name in the private copy).
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import sys
import time
from typing import Any, Callable

if not __package__:
    # The private copy next to the supervisor's (see _launch/supervisor.py): its neighbours are copies too.
    import health_judge  # pylint: disable=import-error
    import health_reads  # pylint: disable=import-error
    import safepath  # pylint: disable=import-error
    import xid  # pylint: disable=import-error
    from polling import Deadline  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import health_judge, health_reads, xid

# launch.json's live settings keep the job's GPUs under this key: {"devices": [...], "nvml_path": DIR or None}.
GPUS_KEY = "gpus"
READS_FILE = "health_reads.py"
# At most one look every this many seconds; a look that hangs is killed after GPU_TIMEOUT.
GPU_PERIOD = 15.0
GPU_TIMEOUT = 5.0
KERNEL_LOG_TIMEOUT = 2.0
MAX_ANSWER = 1 << 20
CHILD_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# The words a GPU's verdict can take (health_judge gives no others to a GPU).
GPU_WORDS = ("none", "gpu_reset", "host_reboot", "host_action")

# The host's GPU quarantine, which the relaunch's gate keeps (_gpu/quarantine.py: {"gpus": {uuid: evidence}, ...}),
# read here only where it exists. Its name is quarantine.RECORD, spelt out: the supervisor's private copies
# do not carry quarantine.py (tests/unit/plugins/module_utils/_gpu keeps the two names one).
QUARANTINE_FILE = "gpu-quarantine.json"


def quarantined_uuids(state_dir: str) -> set[str] | None:
    """The UUIDs the quarantine record in `state_dir` names; None where there is no record, or one that is not
    root's (owned by root, writable by nobody else, a regular file reached without a link another user can change)."""
    try:
        fd = safepath.open_regular(os.path.join(state_dir, QUARANTINE_FILE), os.O_RDONLY)
    except (OSError, safepath.UnsafePath, safepath.NotRegularFile):
        return None
    try:
        info = os.fstat(fd)
        if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        data = os.read(fd, MAX_ANSWER)
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if isinstance(record, dict) and "gpus" in record:
        record = record["gpus"]
    if isinstance(record, (dict, list)):
        return {str(uuid) for uuid in record}
    return None


def gpu_settings(devices: list[str] | None, nvml_path: str | None) -> dict[str, Any] | None:
    """What a start stores for the job's GPUs (under GPUS_KEY), or None for a job without any named."""
    if not devices:
        return None
    return {"devices": [str(device) for device in devices], "nvml_path": nvml_path}


def nvml_path_here() -> str | None:
    """Where this (the module's) interpreter finds pynvml, for the node's child, which runs with -I and a
    minimal environment (no PYTHONPATH); None where it finds none."""
    import importlib.util  # pylint: disable=import-outside-toplevel

    try:
        spec = importlib.util.find_spec("pynvml")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    where = os.path.dirname(spec.origin)
    return os.path.dirname(where) if spec.submodule_search_locations else where


class GpuWatch:
    """The live look at one job's GPUs: `look` runs one child when due and keeps its answer."""

    def __init__(self, job_dir: str, settings: dict[str, Any], since: float | None,
                 python: str = sys.executable, kernel_log: str = xid.KMSG, clock: Callable[[], float] = time.monotonic,
                 timeout: float = GPU_TIMEOUT, period: float = GPU_PERIOD) -> None:
        self.job_dir = job_dir
        self.devices = [str(device) for device in settings.get("devices") or []]
        nvml_path = settings.get("nvml_path")
        self.nvml_path = nvml_path if isinstance(nvml_path, str) and os.path.isabs(nvml_path) else "-"
        self.since = since
        self.python = python
        self.kernel_log = kernel_log
        self.clock = clock
        self.timeout = timeout
        self.period = period
        self.next_at = 0.0
        self.last: dict[str, Any] | None = None
        self.looked_since_end = False
        self.table = xid.xid_table(None)

    def look(self, now: bool = False) -> dict[str, Any] | None:
        """The GPUs as last seen (a new look if one is due, or `now`, once per state of the job: the caller asks
        when the job ended): {"at": epoch, "ok": bool, "why": text, "gpus": [...]}, each GPU {"index", "uuid",
        "escalation", "recovery_action", "last_xid", "last_xid_at", "quarantined"}."""
        if now and not self.looked_since_end:
            self.looked_since_end = True
            self.next_at = 0.0
        if self.clock() >= self.next_at:
            self.next_at = self.clock() + self.period
            self.last = self._look_now()
        return self.last

    def _look_now(self) -> dict[str, Any]:
        answer = run_reads(self.python, os.path.join(self.job_dir, READS_FILE), self.nvml_path, self.timeout)
        moment = time.time()
        scan = xid.read_kernel_log(self.since, KERNEL_LOG_TIMEOUT, self.kernel_log) if self.since is not None else None
        why = str(answer.get("detail") or answer.get("error"))[:300]
        if answer.get("error") in (health_reads.GPU_LOST, health_reads.RESET_REQUIRED):
            # NVML itself says a GPU is lost or needs a reset before any could be read: gpu_health's verdict
            # for the host (health_judge.host_lost) stands for each of the job's GPUs, which cannot be told apart.
            verdict = health_judge.host_lost(answer["error"], why, scan, self.table, xid.DEFAULT_BURST_WINDOW).escalation
            gpus = [{"index": int(device) if device.isdigit() else None, "uuid": "" if device.isdigit() else device,
                     "escalation": verdict.value} for device in self.devices]
            return {"at": moment, "ok": False, "why": why, "gpus": gpus}
        if "health" not in answer:
            return {"at": moment, "ok": False, "why": why, "gpus": []}
        entries = [entry for entry in answer["health"] if _selected(entry, self.devices)]
        judged = health_judge.judge_host(entries, scan, self.table, all_gpus=False)
        quarantine = quarantined_uuids(os.path.dirname(self.job_dir.rstrip("/")))
        gpus = [_gpu_row(gpu, quarantine) for gpu in judged.gpus]
        return {"at": moment, "ok": True, "why": "", "gpus": gpus,
                "kernel_log": scan.status if scan is not None else "not_read"}


def _selected(entry: dict[str, Any], devices: list[str]) -> bool:
    return str(entry.get("index")) in devices or str(entry.get("uuid", "")) in devices


def _gpu_row(gpu: Any, quarantine: set[str] | None) -> dict[str, Any]:
    recovery = gpu.reads.get("recovery_action", {})
    last = max(gpu.xids, key=lambda burst: burst["last"], default=None)
    return {"index": gpu.index, "uuid": gpu.uuid, "escalation": gpu.escalation.value,
            "recovery_action": recovery.get("value") if recovery.get("status") == "ok" else None,
            "last_xid": last["xid"] if last else None, "last_xid_at": last["last"] if last else None,
            "quarantined": None if quarantine is None else gpu.uuid in quarantine}


def run_reads(python: str, script: str, nvml_path: str, timeout: float) -> dict[str, Any]:
    """One run of the health reads' child: its JSON answer, or {"error": ..., "detail": ...} when it hung,
    failed or said nothing. The child is ours, unreaped while we look at it: its pid names no one else."""
    read_end, write_end = os.pipe()
    try:
        pid = os.posix_spawn(python, [python, "-I", script, nvml_path], {"PATH": CHILD_PATH, "LANG": "C.UTF-8"},
                             file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                           (os.POSIX_SPAWN_DUP2, write_end, 1),
                                           (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)])
    except OSError as exc:
        os.close(read_end)
        return {"error": health_reads.NVML_ERROR, "detail": f"cannot start {script}: {exc}"}
    finally:
        os.close(write_end)
    deadline = Deadline(timeout)
    data = b""
    try:
        while not deadline.expired() and len(data) <= MAX_ANSWER:
            if not select.select([read_end], [], [], deadline.remaining())[0]:
                continue
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            data += chunk
        else:
            os.kill(pid, signal.SIGKILL)
            _reap(pid, 0.5)
            return {"error": health_reads.HUNG, "detail": f"the GPU health reads took longer than {timeout:g}s"}
    finally:
        os.close(read_end)
    _reap(pid, max(deadline.remaining(), 0.5))
    try:
        answer = json.loads(data.decode("utf-8", "replace").splitlines()[0])
    except (ValueError, IndexError):
        return {"error": health_reads.NVML_ERROR, "detail": "the GPU health reads said nothing readable"}
    return answer if isinstance(answer, dict) else {"error": health_reads.NVML_ERROR, "detail": "not an answer"}


def _reap(pid: int, within: float) -> None:
    """Reap our child within `within` seconds (SIGKILL at the end); one stuck in the kernel is left behind,
    for the supervisor's own reaping of its children (or the live unit's end)."""
    deadline = Deadline(within)
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] != 0:
                return
        except ChildProcessError:
            return
        if deadline.expired():
            os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            return
        deadline.pause(0.01)
