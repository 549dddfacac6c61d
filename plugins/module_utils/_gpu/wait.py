# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Wait until GPUs are really free, and say what still holds them when they are not.

The condition is polled with a deadline (:func:`wait_for_release`): per GPU, used memory back
under a ceiling (by default a small baseline: the driver keeps some memory, so "free" is not zero),
optionally no compute process listed; optionally some pids gone and the host's ``MemAvailable``
back above a floor (large pinned host memory takes tens of seconds to come back after a kill).

At the deadline every process still on a GPU is described with the process model
(:class:`~.procfs.ProcessTable`): a zombie, a zombie leader whose threads still run, a thread in
uninterruptible sleep and its wait channel -- or not visible at all, because NVML reports pids of
the host's PID namespace and a container does not see those. From that follows, holder by holder
and from those fields alone, what would help, in the collection's one vocabulary (:mod:`.verdict`):
signals and reaping, only a container restart, or only the host.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import (
    check_poll_interval,
    check_seconds,
    check_timeout,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (
    GPU_LOST,
    MIB,
    RESET_REQUIRED,
    GpuDevice,
    GpuQueryError,
    GpuSource,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    DEFAULT_DRIVER_WCHAN,
    Process,
    ProcessTable,
    read_small,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import NAMESPACE_INIT_PID
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, Finding, FindingKind, Judged, Verdict
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import (
    Identity,
    ProcessControl,
    format_pids,
)

GIB = 1024 * MIB
# What a GPU with no process on it may still show as used (v2 "used" excludes the reservation).
DEFAULT_BASELINE_MIB = 256.0
# The inode of the initial PID namespace is fixed by the kernel (PROC_PID_INIT_INO).
INITIAL_PID_NAMESPACE_INODE = 0xEFFFFFFC
_DRIVER_WCHAN = re.compile(DEFAULT_DRIVER_WCHAN)


@dataclass(frozen=True)
class ReleaseCondition:
    """What "released" means. With neither ceiling given, used memory must be under the baseline."""

    max_used_mib: float | None = None
    max_used_percent: float | None = None
    no_processes: bool = False
    pids_gone: tuple[int, ...] = ()
    min_host_available_gib: float | None = None

    @property
    def ceiling_mib(self) -> float | None:
        if self.max_used_mib is None and self.max_used_percent is None:
            return DEFAULT_BASELINE_MIB
        return self.max_used_mib


@dataclass(frozen=True)
class WaitOptions:
    """gpu_mem_wait's options, checked."""

    condition: ReleaseCondition
    devices: tuple[str, ...] = ()
    timeout: float = 300.0
    poll_interval: float = 0.5
    query_timeout: float = 30.0


def options_from_params(params: Mapping[str, Any]) -> WaitOptions:
    """gpu_mem_wait's options, checked; OptionsInvalid lists every problem."""
    checks = OptionChecks()
    timeout = checks.check(check_timeout, "timeout", params["timeout"])
    poll_interval = checks.check(check_poll_interval, "poll_interval", params["poll_interval"])
    query_timeout = checks.check(check_seconds, "query_timeout", params["query_timeout"], allow_minimum=False)
    checks.check(_finite_within, "max_used_mib", params["max_used_mib"], 0, reason="must be a finite number, 0 or more")
    checks.check(_finite_within, "max_used_percent", params["max_used_percent"], 0, 100, reason="must be between 0 and 100")
    checks.check(_finite_within, "min_host_available_gib", params["min_host_available_gib"], 0,
                 reason="must be a finite number, 0 or more")
    if not all(pid > 0 for pid in params["pids_gone"]):
        checks.add("pids_gone", f"process IDs must be positive integers, got {params['pids_gone']!r}")
    if not all(str(device).strip() for device in params["devices"]):
        checks.add("devices", f"entries must not be empty, got {params['devices']!r}")
    if not params["nvidia_smi"]:
        checks.add("nvidia_smi", f"must not be empty, got {params['nvidia_smi']!r}")
    checks.raise_if_any()
    return WaitOptions(
        condition=ReleaseCondition(
            max_used_mib=params["max_used_mib"],
            max_used_percent=params["max_used_percent"],
            no_processes=params["no_processes"],
            pids_gone=tuple(params["pids_gone"]),
            min_host_available_gib=params["min_host_available_gib"],
        ),
        devices=tuple(str(device) for device in params["devices"]),
        timeout=float(timeout or 0.0),
        poll_interval=float(poll_interval or 0.0),
        query_timeout=float(query_timeout or 0.0),
    )


def _finite_within(option: str, value: float | None, minimum: float, maximum: float = math.inf, *, reason: str) -> float | None:
    """`value` if it is not given or a finite number from `minimum` to `maximum`; BadOption otherwise."""
    if value is None or (math.isfinite(value) and minimum <= value <= maximum):
        return value
    raise BadOption(option, f"{reason}, got {value!r}")


def unmet_on_device(device: GpuDevice, condition: ReleaseCondition) -> list[str]:
    """What still keeps `device` from counting as released (empty: released)."""
    unmet = _memory_unmet(device, condition)
    if condition.no_processes and device.processes:
        pids = format_pids(p.pid for p in device.processes)
        unmet.append(f"GPU {device.index}: compute processes still listed: {pids}")
    return unmet


def _memory_unmet(device: GpuDevice, condition: ReleaseCondition) -> list[str]:
    unmet = []
    ceiling = condition.ceiling_mib
    if ceiling is not None and device.used_bytes > ceiling * MIB:
        unmet.append(f"GPU {device.index}: {device.used_mib:g} MiB used, more than {ceiling:g} MiB")
    if condition.max_used_percent is not None and device.used_percent > condition.max_used_percent:
        unmet.append(f"GPU {device.index}: {device.used_percent:.1f}% used, more than {condition.max_used_percent:g}%")
    return unmet


def resolve_devices(devices: list[GpuDevice], wanted: list[str]) -> list[int]:
    """Indices of the GPUs named by index or UUID (all when `wanted` is empty); BadOption names the option."""
    if not wanted:
        return [d.index for d in devices]
    by_uuid = {d.uuid.lower(): d.index for d in devices}
    indices = {d.index for d in devices}
    chosen: list[int] = []
    unknown: list[str] = []
    for item in wanted:
        text = str(item).strip()
        index = int(text) if text.isdigit() else by_uuid.get(text.lower())
        if index is None or index not in indices:
            unknown.append(text)
        elif index not in chosen:
            chosen.append(index)
    if unknown:
        present = ", ".join(f"{d.index} ({d.uuid})" for d in devices) or "none"
        raise BadOption("devices", f"no GPU {', '.join(unknown)} on this host; present: {present}")
    return chosen


def host_available_bytes(proc_root: str = "/proc") -> int | None:
    """``MemAvailable`` of ``meminfo`` under `proc_root`, or None if it cannot be read."""
    raw = read_small(f"{proc_root}/meminfo")
    if raw is None:
        return None
    for line in raw.decode("ascii", "replace").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def sees_host_pids(proc_root: str = "/proc") -> bool:
    """Whether pids under `proc_root` are host pids (the ones NVML reports).

    False inside a container with a PID namespace of its own: a pid NVML reports may exist there,
    but as another process. When it cannot be told (a fixture tree), the pids are taken as host pids.
    """
    try:
        return os.stat(f"{proc_root}/self/ns/pid").st_ino == INITIAL_PID_NAMESPACE_INODE
    except OSError:
        return True


class PidWatch:
    """Pids that must be gone, each identified by (pid, starttime) when the wait began.

    A pid is gone when it is no longer in the process table or now belongs to another process; a
    zombie is still there (it is gone once reaped).
    """

    def __init__(self, pids: tuple[int, ...], proc_root: str = "/proc") -> None:
        self.control = ProcessControl(proc_root)
        found = (self.control.look(pid) for pid in sorted(set(pids)))
        self.watched = [Identity.of(process) for process in found if process is not None]

    def remaining(self) -> list[Process]:
        still = (self.control.current(identity) for identity in self.watched)
        return [process for process in still if process is not None]


@dataclass
class WaitOutcome(Judged):
    """What a wait saw at its start and at its end, and why it ended."""

    released: bool = False
    waited_s: float = 0.0
    polls: int = 0
    before: list[GpuDevice] = field(default_factory=list)
    after: list[GpuDevice] = field(default_factory=list)
    unmet: list[str] = field(default_factory=list)
    pids_remaining: list[dict[str, Any]] = field(default_factory=list)
    host_available_before: int | None = None
    host_available_after: int | None = None
    holders: list[dict[str, Any]] = field(default_factory=list)
    judgement: Verdict = field(default_factory=Verdict)

    @property
    def released_mib(self) -> float:
        used_before = {d.index: d.used_bytes for d in self.before}
        freed = sum(max(0, used_before.get(d.index, d.used_bytes) - d.used_bytes) for d in self.after)
        return round(freed / MIB, 1)

    def gpus(self) -> list[dict[str, Any]]:
        before = {d.index: d for d in self.before}
        entries = []
        for device in self.after:
            first = before.get(device.index, device)
            entries.append({
                **device.entry(first=first),
                "reserved_mib": None if device.reserved_bytes is None else round(device.reserved_bytes / MIB, 1),
                "processes": device.process_entries(),
            })
        return entries

    def as_dict(self) -> dict[str, Any]:
        return {
            "released": self.released,
            "polls": self.polls,
            "gpus": self.gpus(),
            "released_mib": self.released_mib,
            "unmet": self.unmet,
            "pids_remaining": self.pids_remaining,
            "host_available_gib_before": _gib(self.host_available_before),
            "host_available_gib_after": _gib(self.host_available_after),
            "holders": self.holders,
            **self.judgement.as_dict(),
            "needs_reboot": self.escalation == Escalation.CONTAINER_REBOOT,
        }


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / GIB, 2)


def wait_for_release(
    source: GpuSource | None,
    wanted: list[str],
    condition: ReleaseCondition,
    timeout: float,
    poll_interval: float,
    proc_root: str = "/proc",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    host_pids_visible: bool | None = None,
) -> WaitOutcome:
    """Poll until `condition` holds for the `wanted` GPUs (all when empty) or `timeout` passes.

    `source` None means "no GPU here": only the host and pid conditions are waited for.
    `host_pids_visible` says whether the driver's pids are pids of `proc_root` (default: decided
    by :func:`sees_host_pids`); gpu_reclaim passes what its caller declared.
    Raises BadOption when `wanted` names a GPU that is not there or `timeout` or `poll_interval` is
    out of bounds (NaN, infinite, more than a day, a poll interval under 10 ms), GpuQueryError when a
    query fails.
    """
    timeout = check_timeout("timeout", timeout)
    poll_interval = check_poll_interval("poll_interval", poll_interval)
    deadline = Deadline(timeout, clock, sleep)
    outcome = WaitOutcome()
    watch = PidWatch(condition.pids_gone, proc_root)
    outcome.host_available_before = host_available_bytes(proc_root)
    indices: list[int] | None = None
    while True:
        polled_at = clock()
        if source is None:
            devices: list[GpuDevice] = []
        elif indices is None:
            try:
                inventory = source.query()
            except GpuQueryError as exc:
                # A GPU lost or requiring a reset fails the look at all GPUs. Where the GPUs are named by index
                # (the relaunch's GPU gate left the bad one out), only those are read; else the failure stands.
                if exc.kind not in (GPU_LOST, RESET_REQUIRED) or not wanted or not all(
                        str(item).strip().isdigit() for item in wanted):
                    raise
                inventory = source.query(list(dict.fromkeys(int(str(item).strip()) for item in wanted)))
            indices = resolve_devices(inventory, wanted)
            devices = [d for d in inventory if d.index in indices]
            outcome.before = devices
        else:
            devices = source.query(indices)
        outcome.polls += 1
        outcome.after = devices
        waiting = _waiting_on_host(watch, condition, proc_root)
        unmet = [reason for device in devices for reason in unmet_on_device(device, condition)]
        unmet.extend(finding.why for finding in waiting)
        outcome.unmet = unmet
        # The poll that began at the deadline was the last look; polls keep a fixed cadence.
        if not unmet or polled_at >= deadline.at:
            break
        deadline.pause(poll_interval, since=polled_at)
    outcome.waited_s = deadline.elapsed()
    outcome.released = not outcome.unmet
    outcome.host_available_after = host_available_bytes(proc_root)
    outcome.pids_remaining = [{"pid": p.pid, "comm": p.comm, "state": p.state} for p in watch.remaining()]
    if outcome.released:
        outcome.judgement.add(FindingKind.RELEASED, Escalation.NONE, "released")
        return outcome
    table = ProcessTable.scan(proc_root)
    visible = sees_host_pids(proc_root) if host_pids_visible is None else host_pids_visible
    outcome.holders = describe_holders(outcome.after, table, visible)
    outcome.judgement = judge(outcome.after, outcome.holders, condition, waiting)
    return outcome


def _waiting_on_host(watch: PidWatch, condition: ReleaseCondition, proc_root: str) -> list[Finding]:
    """The conditions that are not about a GPU and still unmet: pids still there, host memory."""
    waiting = []
    remaining = watch.remaining()
    if remaining:
        waiting.append(Finding(
            FindingKind.PIDS_PRESENT, Escalation.SIGNALS,
            "pids still present: " + ", ".join(f"{p.pid} ({p.comm}, state {p.state})" for p in remaining),
            tuple(p.pid for p in remaining),
        ))
    available = host_available_bytes(proc_root) if condition.min_host_available_gib is not None else None
    if available is not None and available < condition.min_host_available_gib * GIB:
        waiting.append(Finding(
            FindingKind.HOST_MEMORY, Escalation.SIGNALS,
            f"host MemAvailable {available / GIB:.1f} GiB, less than {condition.min_host_available_gib:g} GiB",
        ))
    return waiting


def describe_holders(devices: list[GpuDevice], table: ProcessTable, host_pids_visible: bool) -> list[dict[str, Any]]:
    """Every process NVML lists on `devices`, with what the process model says about it."""
    holders = []
    for device in devices:
        for gpu_process in device.processes:
            entry: dict[str, Any] = {
                "pid": gpu_process.pid,
                "gpu": device.index,
                "uuid": device.uuid,
                "used_mib": gpu_process.used_mib,
            }
            process = table.processes.get(gpu_process.pid) if host_pids_visible else None
            if process is None:
                # Listed but not in this table. Seen from the host's own namespace the process is
                # gone and only the host (GPU reset, reboot) clears it; from a container it may be
                # this container's own, stuck in teardown, which a restart of the container clears.
                entry.update(visible=False, kind=FindingKind.INVISIBLE.value, host_pids_visible=host_pids_visible,
                             description=_invisible(gpu_process.pid, host_pids_visible),
                             escalation=(Escalation.HOST_ACTION if host_pids_visible
                                         else Escalation.CONTAINER_REBOOT).value)
            else:
                entry.update(_process_state(table, process))
            holders.append(entry)
    return holders


def _invisible(pid: int, host_pids_visible: bool) -> str:
    if host_pids_visible:
        return (f"pid {pid} is listed by the driver but no longer exists: the driver has not finished "
                f"tearing down its GPU context")
    return (f"pid {pid} is a host pid, not visible in this container's PID namespace: a process of the host "
            f"or of another container holds it, or this container's teardown of it is stuck")


def _process_state(table: ProcessTable, process: Process) -> dict[str, Any]:
    threads = table.load_threads(process.pid)
    live = process.live_threads
    blocked = [t for t in threads if t.state == "D"]
    parent = table.processes.get(process.ppid)
    parent_is_init = process.ppid == NAMESPACE_INIT_PID or _is_namespace_init(table.proc_root, process.ppid)
    entry: dict[str, Any] = {
        "visible": True,
        "starttime": process.starttime,
        "state": process.state,
        "comm": process.comm,
        "threads": process.threads,
        "live_threads": [t.as_dict() for t in live],
        "uninterruptible": [{"tid": t.tid, "wchan": t.wchan, "in_gpu_driver": bool(_DRIVER_WCHAN.search(t.wchan))}
                            for t in blocked],
        "parent": {"pid": process.ppid, "comm": parent.comm if parent else "", "is_namespace_init": parent_is_init},
    }
    name = f"pid {process.pid} ({process.comm})"
    entry["escalation"] = Escalation.SIGNALS.value
    if blocked:
        where = ", ".join(f"thread {t.tid} in {t.wchan or '?'}" for t in blocked)
        entry["kind"] = FindingKind.UNINTERRUPTIBLE.value
        entry["description"] = f"{name} is in uninterruptible sleep ({where}): a kill takes effect only when it wakes"
        if any(t["in_gpu_driver"] for t in entry["uninterruptible"]):
            entry["escalation"] = Escalation.HOST_ACTION.value
    elif process.is_zombie and live:
        entry["kind"] = FindingKind.ZOMBIE_LEADER.value
        tids = ", ".join(str(t.tid) for t in live)
        entry["description"] = (f"{name} is a zombie leader whose threads {tids} still run and hold its GPU "
                                f"context: SIGKILL to {process.pid} ends them")
    elif process.is_zombie:
        entry["kind"] = FindingKind.ZOMBIE.value
        if parent_is_init:
            entry["kind"] = FindingKind.UNREAPED_ORPHAN.value
            entry["escalation"] = Escalation.CONTAINER_REBOOT.value
            entry["description"] = (f"{name} is a zombie orphaned to its namespace's init (pid {process.ppid}, "
                                    f"{entry['parent']['comm'] or '?'}), which has not reaped it: its GPU memory is "
                                    f"not released until it is reaped, and only a restart of that container does that")
        else:
            entry["description"] = (f"{name} is a zombie its parent {process.ppid} ({entry['parent']['comm'] or '?'}) "
                                    f"has not reaped: ending or signalling the parent reaps it")
    else:
        entry["kind"] = FindingKind.RUNNING.value
        entry["description"] = f"{name} is alive (state {process.state})"
    return entry


def _is_namespace_init(proc_root: str, pid: int) -> bool:
    """Whether `pid` is PID 1 of a nested PID namespace (its NSpid chain ends in 1)."""
    raw = read_small(f"{proc_root}/{pid}/status")
    if raw is None:
        return False
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("NSpid:"):
            chain = line.split()[1:]
            return len(chain) > 1 and chain[-1] == "1"
    return False


def judge(
    devices: list[GpuDevice],
    holders: list[dict[str, Any]],
    condition: ReleaseCondition,
    waiting: list[Finding],
) -> Verdict:
    """The least force that would free what is still held, and why: each holder's own escalation,
    memory no process accounts for, and the conditions `waiting` on the host."""
    found = Verdict()
    for holder in holders:
        found.add(holder["kind"], Escalation(holder["escalation"]), holder["description"], [holder["pid"]])
    listed = {d.index for d in devices if d.processes}
    for device in devices:
        if _memory_unmet(device, condition) and device.index not in listed:
            found.add(FindingKind.UNLISTED_MEMORY, Escalation.SIGNALS,
                      f"GPU {device.index}: {device.used_mib:g} MiB used with no process listed: the driver "
                      f"is still tearing down a context, or it is stuck doing so (then only the host can help)")
    found.findings.extend(waiting)
    if not found.findings:
        for device in devices:
            for reason in unmet_on_device(device, condition):
                found.add(FindingKind.GPU_CONDITION, Escalation.SIGNALS, reason)
    return found
