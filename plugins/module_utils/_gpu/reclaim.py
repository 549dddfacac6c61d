# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Reclaim GPUs on a shared machine: end every process that holds them and is not spared.

On a CI runner or a shared box the GPUs are held by whatever ran last, not by one known job, so
the selection is "the holders the driver lists on these GPUs", less what must be spared:

* what is never signalled anywhere in this collection (PID 1, the module's own process and its
  ancestors, kernel threads, the protected programs and patterns, the module's own process group);
* what the user allow-lists (patterns over the command line or the executable);
* what signals cannot end or that cannot be identified: a plain zombie (its parent must reap it),
  a pid the driver lists that no longer exists, and every listed pid where the driver's pids are
  not this namespace's (a container sees host pids: the same number names another process here);
* what does not hold the device file of a GPU it is listed on, now: the driver's list is a hint,
  not a proof. It goes stale (DataLoader workers keep the CUDA files after the listed main process
  has died) and its pids get reused, so a listed pid whose process does not hold that file is
  reported ``not_holding`` and never signalled. "That file" is the character device with the NVIDIA
  major (195) and the GPU's minor number (``/dev/nvidiaN``; from NVML, or from one ``nvidia-smi -q -x``
  run with the nvidia-smi backend), told by the kernel's numbers of the file the fd leads to, not by
  a name: ``/dev/nvidiactl`` and ``/dev/nvidia-uvm`` are held by every GPU user and another GPU's
  ``/dev/nvidiaM`` proves nothing about this one. Where a GPU's minor number is not known (the NVML
  call fails or is not supported, nvidia-smi says N/A or fails), nothing proves a holder of that
  GPU: its holders are spared (``device_unknown``), never judged by "any NVIDIA file".
  ``gpu_device_glob`` narrows the paths looked at. A ``Zl`` leader holds through its live threads' files.

Identity. The driver lists bare pids, with no start time. The process table is read *before* the
driver is asked, so a listed pid found in that table with the same start time at signal time has
been that very process all along (a pid is not reused while its process exists): the table's
(pid, starttime) is the identity, and the one signal gate (``_base/signal_gate.py``) pins it with
a pidfd and checks the start time again, so a pid recycled at any moment is never signalled.
The gate also runs the device-file check (:func:`holds_gpu_device`, its proof, with the minor
numbers of the GPUs that target is listed on) on the pinned process, before every signal: the look
of the plan only says what a check-mode run would end.

Then SIGTERM, ``term_timeout``, SIGKILL (if allowed), and a wait for the release through
gpu_mem_wait's own :func:`~.wait.wait_for_release`, on a view of the GPUs without the spared
holders (they keep their memory by design). What still holds memory at the deadline is judged
by gpu_mem_wait's rules (a zombie orphaned to a non-reaping init: ``container_reboot``; a thread
asleep in the driver or a listed pid that no longer exists: ``host_action``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import (
    check_poll_interval,
    check_seconds,
    check_timeout,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    NVIDIA_MAJOR,
    OpenDevice,
    Process,
    ProcessTable,
    compile_patterns,
    read_process,
    read_small,
    shown_cmdline,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    DEFAULT_PROTECTED,
    NAMESPACE_INIT_PID,
    Protection,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import (
    DENIED,
    GONE,
    RECYCLED,
    REFUSED,
    SENT,
    UNPROVEN,
    Identity,
    ProcessControl,
    Proof,
    SignalGate,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import cap_line
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, FindingKind, Verdict
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (
    MIB,
    GpuDevice,
    GpuQueryError,
    GpuSource,
    add_minor_numbers,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.wait import (
    ReleaseCondition,
    WaitOutcome,
    _finite_within,
    resolve_devices,
    sees_host_pids,
    wait_for_release,
)

ALL_DEVICES = "all"
# Whose pids the driver lists: the host's (NVIDIA's driver, seen from a container too) or this
# namespace's own (a runtime that shares or translates them; the simulated driver of the tests).
DRIVER_PIDS = ("host", "own_namespace")
# How often the ending holders are looked at: they are normally gone within milliseconds.
EXIT_POLL_INTERVAL = 0.05
# Rounds of "read the table, then ask the driver" while the driver lists pids newer than the table.
MAX_LOOKS = 3

# Why a listed holder is not signalled. The first group is policy: such a holder keeps its memory
# by design and is left out of the release condition; the others must still let go of the GPU.
ALLOW_LISTED = "allow_listed"
PROTECTED = "protected"
ANCESTOR = "ancestor"
PID1 = "pid1"
ANSIBLE = "ansible"
POLICY_REASONS = frozenset({ALLOW_LISTED, PROTECTED, ANCESTOR, PID1, ANSIBLE})
GONE_REASON = "gone"
RECYCLED_REASON = "recycled"
APPEARED = "appeared"
INVISIBLE = "invisible"
ZOMBIE = "zombie"
DENIED_REASON = "denied"
NOT_HOLDING = "not_holding"
DEVICE_UNKNOWN = "device_unknown"

DEFAULT_GPU_DEVICE_GLOB = "/dev/nvidia*"
GLOB_WILDCARDS = "*?["
# Files nearly every process holds open: a glob that matches one of them proves nothing about a GPU.
COMMON_OPEN_FILES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/tty", "/dev/pts/0", "/dev/console")


@dataclass(frozen=True)
class ReclaimOptions:
    """gpu_reclaim's options, checked. `devices` empty means every GPU (only from an explicit V(all))."""

    devices: tuple[str, ...]
    allow: tuple[Pattern[str], ...] = ()
    protected: tuple[Pattern[str], ...] = ()
    term_timeout: float = 10.0
    kill: bool = True
    release_timeout: float = 60.0
    poll_interval: float = 0.5
    max_used_mib: float | None = None
    query_timeout: float = 30.0
    driver_pids: str = "host"
    gpu_device_glob: str = DEFAULT_GPU_DEVICE_GLOB

    @property
    def all_devices(self) -> bool:
        return not self.devices


def options_from_params(params: Mapping[str, Any]) -> ReclaimOptions:
    """gpu_reclaim's options; OptionsInvalid lists every problem, each naming its option."""
    checks = OptionChecks()
    devices = checks.check(_devices, "devices", params["devices"])
    allow = checks.check(compile_patterns, params["allow"], "allow")
    protected = checks.check(compile_patterns, params["protected"], "protected")
    timeouts = {option: checks.check(check_timeout, option, params[option]) for option in ("term_timeout", "release_timeout")}
    poll_interval = checks.check(check_poll_interval, "poll_interval", params["poll_interval"])
    query_timeout = checks.check(check_seconds, "query_timeout", params["query_timeout"], allow_minimum=False)
    checks.check(_finite_within, "max_used_mib", params["max_used_mib"], 0, reason="must be a finite number, 0 or more")
    device_glob = checks.check(_device_glob, "gpu_device_glob", params["gpu_device_glob"])
    if params["driver_pids"] not in DRIVER_PIDS:
        checks.add("driver_pids", f"must be one of {', '.join(DRIVER_PIDS)}, got {params['driver_pids']!r}")
    if not params["nvidia_smi"]:
        checks.add("nvidia_smi", f"must not be empty, got {params['nvidia_smi']!r}")
    checks.raise_if_any()
    return ReclaimOptions(
        devices=tuple(devices or ()),
        allow=tuple(allow or ()),
        protected=tuple(compile_patterns(DEFAULT_PROTECTED, "protected")) + tuple(protected or ()),
        term_timeout=float(timeouts["term_timeout"] or 0.0),
        kill=bool(params["kill"]),
        release_timeout=float(timeouts["release_timeout"] or 0.0),
        poll_interval=float(poll_interval or 0.0),
        max_used_mib=params["max_used_mib"],
        query_timeout=float(query_timeout or 0.0),
        driver_pids=params["driver_pids"],
        gpu_device_glob=device_glob or DEFAULT_GPU_DEVICE_GLOB,
    )


def _devices(option: str, devices: list[Any]) -> tuple[str, ...]:
    """The GPUs by index or UUID; () for every GPU, which takes the explicit word V(all) alone.

    An empty list is refused rather than read as "all": on a shared machine a variable that came
    out empty must not end every GPU user.
    """
    names = [str(device).strip() for device in devices or ()]
    if not names:
        raise BadOption(option, "is empty: name the GPUs to reclaim by index or UUID, or give [all] for every GPU "
                                "of the host (an empty list never means all)")
    if any(not name for name in names):
        raise BadOption(option, f"entries must not be empty, got {list(devices)!r}")
    if any(name.lower() == ALL_DEVICES for name in names):
        if len(names) > 1:
            raise BadOption(option, f"'all' stands alone (every GPU of the host), got {list(devices)!r}")
        return ()
    return tuple(names)


def _device_glob(option: str, device_glob: str | None) -> str:
    """The glob over open files' targets that proves a holder holds a GPU device.

    It must name device files, not everything: a glob that also matches what every process holds
    (``/dev/null``, a terminal) or whose file name begins with a wildcard would make any process a
    "holder" and let a stale or reused pid be signalled again.
    """
    if not device_glob:
        raise BadOption(option, f"must not be empty, got {device_glob!r}")
    if not device_glob.startswith("/"):
        raise BadOption(option, f"must be an absolute path glob like /dev/nvidia* (open files' targets are absolute "
                                f"paths), got {device_glob!r}")
    first_wildcard = min((device_glob.find(c) for c in GLOB_WILDCARDS if c in device_glob), default=len(device_glob))
    name_prefix = device_glob[:first_wildcard].rsplit("/", 1)[1]
    common = next((path for path in COMMON_OPEN_FILES if fnmatch.fnmatchcase(path, device_glob)), None)
    if not name_prefix or common is not None:
        why = "its file name begins with a wildcard" if not name_prefix else f"also matches {common}, which nearly every process holds"
        raise BadOption(option, f"must name the GPU device files (like /dev/nvidia*), not any file: {device_glob!r} {why}")
    return device_glob


def open_devices(proc_root: str, device_glob: str, process: Process) -> list[OpenDevice]:
    """The character devices `process` (as read now) holds open at a path matching `device_glob`,
    with the kernel's numbers: the collection's one walk (:meth:`ProcessTable.device_holders`, which
    zombie_facts' gpu_holders use too), a ``Zl`` leader by its live threads' files."""
    holders = ProcessTable({process.pid: process}, proc_root).device_holders(device_glob, [process.pid])
    return sorted({holder.device for holder in holders}, key=lambda d: (d.path, d.major, d.minor))


def holds_gpu_device(proc_root: str, device_glob: str, minors: frozenset[int], process: Process) -> bool:
    """Whether `process` (as read now) holds open the device file of a GPU whose minor number is in `minors`."""
    return any(device.is_gpu and device.minor in minors for device in open_devices(proc_root, device_glob, process))


def device_proof(proc_root: str, device_glob: str, minors_by_pid: Mapping[int, frozenset[int]]) -> Proof:
    """The signal gate's proof for gpu_reclaim: the pinned process holds the device file of a GPU the
    driver listed it on. By pid: the gate has pinned the planned identity before it asks."""
    def proof(process: Process) -> bool:
        return holds_gpu_device(proc_root, device_glob, minors_by_pid.get(process.pid, frozenset()), process)
    return proof


def _wanted(device_minors: Mapping[int, int]) -> str:
    return " or ".join(f"GPU {index} (char {NVIDIA_MAJOR}:{minor})" for index, minor in sorted(device_minors.items()))


def _not_holding_detail(device_minors: Mapping[int, int], held: list[OpenDevice] | None, device_glob: str,
                        when: str) -> str:
    """Why a listed holder is not signalled; `held` (None: not read again) says what it holds instead."""
    wanted = _wanted(device_minors)
    others = [device for device in held or () if device.is_gpu]
    if held is None:
        what = f"holds no device file of {wanted} {when}"
    elif others:
        what = f"holds {', '.join(map(str, others))}, another GPU's device file, and no device file of {wanted} {when}"
    elif held:
        what = (f"holds only device files GPU users share ({', '.join(map(str, held))}), no device file of "
                f"{wanted} {when}")
    else:
        what = (f"holds none of the NVIDIA device files (gpu_device_glob {device_glob!r}), so no device file of "
                f"{wanted}, {when}")
    return f"{what}: the driver's listing is stale or its pid names another process, so it is not signalled"


def _device_unknown_detail(gpus: list[int], minor_unknown: Mapping[int, str]) -> str:
    whys = "; ".join(f"GPU {index}'s device file is not known: {minor_unknown.get(index) or 'the driver gave no minor number'}"
                     for index in sorted(gpus))
    return (f"{whys}. Holding it cannot be proven (another NVIDIA file proves nothing about this GPU), so it is "
            f"not signalled")


@dataclass
class Holder:
    """A process the driver lists on the chosen GPUs, as the process table saw it before the query."""

    pid: int
    gpus: list[int] = field(default_factory=list)
    used_bytes: int | None = 0
    process: Process | None = None
    exe: str = ""
    # GPU index -> minor number of its device file, for the GPUs it is listed on whose number is known.
    device_minors: dict[int, int] = field(default_factory=dict)

    def add(self, device: GpuDevice, used_bytes: int | None) -> None:
        if device.index not in self.gpus:
            self.gpus.append(device.index)
        self.used_bytes = None if used_bytes is None or self.used_bytes is None else self.used_bytes + used_bytes

    @property
    def used_mib(self) -> float | None:
        return None if self.used_bytes is None else round(self.used_bytes / MIB, 1)

    def entry(self, **extra: Any) -> dict[str, Any]:
        process = self.process
        return {
            "pid": self.pid,
            "starttime": process.starttime if process else None,
            "comm": process.comm if process else "",
            "cmdline": cap_line(process.cmdline) if process else "",  # cut as a log line is (megabytes)
            "gpus": sorted(self.gpus),
            "used_mib": self.used_mib,
            **extra,
        }


@dataclass
class ReclaimPlan:
    """What one look found: the holders to end (`targets`) and those spared, with why."""

    indices: list[int]
    before: list[GpuDevice]
    host_pids_visible: bool
    targets: list[Holder] = field(default_factory=list)
    spared: list[dict[str, Any]] = field(default_factory=list)

    @property
    def policy_spared_pids(self) -> set[int]:
        """Holders that keep their memory by design: left out of the release condition."""
        return {entry["pid"] for entry in self.spared if entry["reason"] in POLICY_REASONS}


def plan_reclaim(
    source: GpuSource,
    options: ReclaimOptions,
    proc_root: str = "/proc",
    own_pid: int | None = None,
    spare_group: int | None = None,
) -> ReclaimPlan:
    """Look once (the table first, then the driver) and sort every holder into targets and spared.

    Raises BadOption (devices) for a GPU that is not there, GpuQueryError when the driver fails.
    """
    inventory = source.query()
    indices = resolve_devices(inventory, list(options.devices))
    before = [device for device in inventory if device.index in indices]
    visible = options.driver_pids == "own_namespace" or sees_host_pids(proc_root)
    table, devices = _look(source, indices, proc_root, visible)
    devices = add_minor_numbers(source, devices)
    plan = ReclaimPlan(indices, before, visible)
    holders: dict[int, Holder] = {}
    for device in devices:
        for listed in device.processes:
            holders.setdefault(listed.pid, Holder(listed.pid, process=table.processes.get(listed.pid))).add(device, listed.used_bytes)
    minor_unknown = {device.index: device.minor_unknown for device in devices if device.minor_number is None}
    minors = {device.index: device.minor_number for device in devices if device.minor_number is not None}
    for holder in holders.values():
        holder.device_minors = {index: minors[index] for index in holder.gpus if index in minors}
        if holder.process is not None:
            holder.exe = table.executable(holder.pid)
            _zombie_leader_cmdline(table, holder.process)
    # Before any pattern is matched: Protection reads the command lines from the same table.
    protection = Protection(table, options.protected, own_pid)
    for pid in sorted(holders):
        holder = holders[pid]
        reason, detail = _why_spared(holder, visible, protection, options, spare_group, proc_root, minor_unknown)
        if reason is None:
            plan.targets.append(holder)
        else:
            plan.spared.append(holder.entry(reason=reason, detail=detail))
    return plan


def _look(source: GpuSource, indices: list[int], proc_root: str, visible: bool) -> tuple[ProcessTable, list[GpuDevice]]:
    """The process table, then the driver's view of the GPUs.

    In that order: a listed pid the table holds was that process at the query (see the module
    docstring). A listed pid newer than the table is looked at again, a few times at most.
    """
    for _round in range(MAX_LOOKS):
        table = ProcessTable.scan(proc_root)
        devices = source.query(indices)
        if not visible:
            break
        newer = [p.pid for d in devices for p in d.processes
                 if p.pid not in table.processes and read_process(proc_root, p.pid) is not None]
        if not newer:
            break
    return table, devices


def _zombie_leader_cmdline(table: ProcessTable, process: Process) -> None:
    """Fill in the command line of a zombie leader whose threads run on (``Zl``) from a live thread.

    A ``Zl`` leader's own ``cmdline`` is empty, but its live threads still run the program:
    without this, an allow-listed program whose main thread exited would match nothing and be ended.
    """
    if not (process.is_zombie and process.threads > 1):
        return
    live = [t for t in table.load_threads(process.pid) if t.state not in ("Z", "X")]
    if live:
        raw = read_small(f"{table.proc_root}/{process.pid}/task/{live[0].tid}/cmdline")
        if raw:
            process.cmdline = shown_cmdline(raw)


def _why_spared(
    holder: Holder, visible: bool, protection: Protection, options: ReclaimOptions, spare_group: int | None,
    proc_root: str, minor_unknown: Mapping[int, str],
) -> tuple[str | None, str]:
    """(reason, detail) for a holder that is not signalled, (None, "") for a target. Safety first."""
    pid, process = holder.pid, holder.process
    if not visible:
        return INVISIBLE, ("the driver lists pids of the host's PID namespace and this is another one (a "
                           "container): the same number names another process here, so it is never signalled")
    if process is None:
        if read_process(proc_root, pid) is not None:
            return APPEARED, "started after the process table was read: not identified, so not signalled (a re-run ends it)"
        return GONE_REASON, "listed by the driver but no longer in the process table"
    if pid == NAMESPACE_INIT_PID:
        return PID1, "PID 1 of this namespace"
    if pid in protection.own_chain:
        return ANCESTOR, "runs this module or is one of its ancestors"
    why = protection.reason(pid)
    if why is not None:
        return PROTECTED, why
    # Ansible is spared by its relation to this module only (the connection's ancestors above, its
    # process group here): what a process runs can be named after Ansible by any GPU user.
    if spare_group is not None and process.pgid == spare_group:
        return ANSIBLE, "is in the process group of the Ansible process running this module"
    for rx in options.allow:
        if rx.search(process.cmdline) or (holder.exe and rx.search(holder.exe)):
            return ALLOW_LISTED, f"matches allow pattern {rx.pattern!r}"
    if process.is_zombie and process.threads <= 1:
        return ZOMBIE, "a zombie: no signal ends it, its parent must reap it"
    # Without the minor number of a GPU it is listed on, nothing proves it holds that GPU.
    if not holder.device_minors:
        return DEVICE_UNKNOWN, _device_unknown_detail(holder.gpus, minor_unknown)
    # What a check-mode run would not end; in a real run the signal gate asks again, pinned.
    held = open_devices(proc_root, options.gpu_device_glob, process)
    if not any(device.is_gpu and device.minor in holder.device_minors.values() for device in held):
        return NOT_HOLDING, _not_holding_detail(holder.device_minors, held, options.gpu_device_glob, "in the look")
    return None, ""


class _SparedView:
    """The GPUs as the release condition sees them: without the holders spared by policy.

    Their memory is subtracted where the driver reports it per process; where it does not, only
    the listing counts on that GPU (its memory cannot be told apart). `last` is the raw view.
    """

    backend = "view"

    def __init__(self, source: GpuSource, spared: set[int]) -> None:
        self.source = source
        self.spared = spared
        self.last: list[GpuDevice] = []

    def query(self, indices: list[int] | None = None) -> list[GpuDevice]:
        self.last = self.source.query(indices)
        return [self._without_spared(device) for device in self.last]

    def _without_spared(self, device: GpuDevice) -> GpuDevice:
        kept = tuple(p for p in device.processes if p.pid not in self.spared)
        left_out = [p for p in device.processes if p.pid in self.spared]
        if not left_out:
            return device
        if any(p.used_bytes is None for p in left_out):
            used = 0
        else:
            used = max(0, device.used_bytes - sum(p.used_bytes or 0 for p in left_out))
        return dataclasses.replace(device, used_bytes=used, processes=kept)

    def close(self) -> None:
        pass


class QueryFailedAfterSignals(Exception):
    """A GPU query failed while waiting for the release; `result` says what had been signalled."""

    def __init__(self, error: GpuQueryError, result: "ReclaimResult") -> None:
        super().__init__(str(error))
        self.error = error
        self.result = result


@dataclass
class ReclaimResult:
    """The plan, what the signals did, and the release."""

    plan: ReclaimPlan
    check_mode: bool
    ended: list[dict[str, Any]] = field(default_factory=list)
    remaining: list[dict[str, Any]] = field(default_factory=list)
    signals: list[dict[str, Any]] = field(default_factory=list)
    release: WaitOutcome = field(default_factory=WaitOutcome)
    after: list[GpuDevice] = field(default_factory=list)
    judgement: Verdict = field(default_factory=Verdict)

    @property
    def changed(self) -> bool:
        if self.check_mode:
            return bool(self.plan.targets)
        return any(s["result"] == SENT for s in self.signals)

    @property
    def released(self) -> bool:
        return self.release.released

    @property
    def not_holding(self) -> list[dict[str, Any]]:
        """The listed holders that held no device file of their GPU (in `spared` too), so were not signalled."""
        return [entry for entry in self.plan.spared if entry["reason"] == NOT_HOLDING]

    def gpus(self) -> list[dict[str, Any]]:
        after = {d.index: d for d in self.after}
        entries = []
        for device in self.plan.before:
            last = after.get(device.index, device)
            entries.append({**last.entry(first=device), "processes_before": device.process_entries(),
                            "processes_after": last.process_entries()})
        return entries

    def as_dict(self) -> dict[str, Any]:
        return {
            "changed": self.changed,
            "released": self.released,
            "targets": [holder.entry() for holder in self.plan.targets],
            "ended": self.ended,
            "spared": self.plan.spared,
            "not_holding": self.not_holding,
            "remaining": self.remaining,
            "signals": self.signals,
            "gpus": self.gpus(),
            "holders": self.release.holders,
            **self.judgement.as_dict(),
        }


def reclaim(
    source: GpuSource,
    options: ReclaimOptions,
    check_mode: bool = False,
    proc_root: str = "/proc",
    control: ProcessControl | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    plan: ReclaimPlan | None = None,
) -> ReclaimResult:
    """Plan (unless given), and unless `check_mode` end the targets and wait for the release.

    Outside check mode `proc_root` must be the table of the namespace this runs in: it is signalled.
    """
    if plan is None:
        plan = plan_reclaim(source, options, proc_root, spare_group=own_group())
    result = ReclaimResult(plan, check_mode)
    control = control or ProcessControl(proc_root)
    if not check_mode and plan.targets:
        _end_targets(result, options, control, proc_root, clock, sleep)
    view = _SparedView(source, plan.policy_spared_pids)
    condition = ReleaseCondition(max_used_mib=options.max_used_mib, no_processes=True)
    # Check mode ends nothing, so waiting would only burn the timeout: one look says where it stands.
    timeout = 0.0 if check_mode else options.release_timeout
    try:
        result.release = wait_for_release(view, [str(i) for i in plan.indices], condition, timeout, options.poll_interval,
                                          proc_root, clock, sleep, host_pids_visible=plan.host_pids_visible)
    except GpuQueryError as exc:
        # Signals may already have gone out: the caller must be able to say so.
        _settle(result, control)
        raise QueryFailedAfterSignals(exc, result) from exc
    result.after = view.last
    _settle(result, control)
    result.judgement.extend(result.release.judgement)
    for entry in result.plan.spared:
        if entry["reason"] == DENIED_REASON:
            result.judgement.add(FindingKind.PERMISSION_DENIED, Escalation.HOST_ACTION,
                                 f"pid {entry['pid']} ({entry['comm']}) holds GPU {entry['gpus']} and could not be signalled: "
                                 f"permission denied", [entry["pid"]])
    still_listed = {holder["pid"] for holder in result.release.holders}
    for entry in result.not_holding:
        if entry["pid"] in still_listed:
            # Signals still free it, but of whatever holds the device files, which the driver does not list.
            result.judgement.add(FindingKind.NOT_HOLDING, Escalation.SIGNALS,
                                 f"pid {entry['pid']} ({entry['comm'] or '?'}) holds no device file of GPU {entry['gpus']}, "
                                 f"where the driver lists it, so it was not signalled: the memory is held by processes "
                                 f"the driver does not list (zombie_facts' gpu_holders names who holds the device files)",
                                 [entry["pid"]])
    for entry in result.plan.spared:
        if entry["reason"] == DEVICE_UNKNOWN and entry["pid"] in still_listed:
            result.judgement.add(FindingKind.NOT_SIGNALLED, Escalation.SIGNALS,
                                 f"pid {entry['pid']} ({entry['comm'] or '?'}) was not signalled: {entry['detail']}",
                                 [entry["pid"]])
    return result


def own_group() -> int | None:
    """The process group of the Ansible process running this module: its members are spared.

    None where the group's leader is outside this PID namespace (getpgrp() is 0 there, the number
    every process whose group lies outside shares; sparing "group 0" would spare all of them).
    """
    group = os.getpgrp()
    return group if group > 0 else None


def _end_targets(result: ReclaimResult, options: ReclaimOptions, control: ProcessControl, proc_root: str,
                 clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
    """SIGTERM, `term_timeout`, SIGKILL: every signal through the gate, to the planned identity."""
    table = ProcessTable.scan(proc_root)
    minors_by_pid = {holder.pid: frozenset(holder.device_minors.values()) for holder in result.plan.targets}
    gate = SignalGate(Protection(table, options.protected), control, spare_group=own_group(),
                      proof=device_proof(proc_root, options.gpu_device_glob, minors_by_pid))
    began = clock()
    live: list[Holder] = []
    for holder in result.plan.targets:
        if _send(result, gate, holder, signal.SIGTERM, began, clock, options.gpu_device_glob):
            live.append(holder)
    if not live:
        return
    Deadline(options.term_timeout, clock, sleep).poll(lambda: not _still_running(control, live), EXIT_POLL_INTERVAL)
    survivors = _still_running(control, live)
    if options.kill:
        for holder in survivors:
            _send(result, gate, holder, signal.SIGKILL, began, clock, options.gpu_device_glob)


def _send(result: ReclaimResult, gate: SignalGate, holder: Holder, sig: signal.Signals, began: float,
          clock: Callable[[], float], device_glob: str) -> bool:
    """Signal one holder through the gate; True if delivered. A holder not reached joins `spared`."""
    if holder.process is None:  # only holders found in the table are targets
        raise ValueError(f"pid {holder.pid} is not a planned target")
    identity = Identity.of(holder.process)
    outcome = gate.send(identity, sig)
    result.signals.append({"pid": holder.pid, "starttime": identity.starttime, "signal": sig.name,
                           "result": NOT_HOLDING if outcome == UNPROVEN else outcome, "elapsed": round(clock() - began, 3)})
    if outcome == SENT:
        return True
    if sig == signal.SIGTERM:
        reason = {GONE: GONE_REASON, RECYCLED: RECYCLED_REASON, DENIED: DENIED_REASON, REFUSED: PROTECTED,
                  UNPROVEN: NOT_HOLDING}[outcome]
        detail = {
            GONE: "exited before it was signalled",
            RECYCLED: "its pid now belongs to another process, which is not signalled",
            DENIED: "permission denied",
            REFUSED: f"refused by the signal gate ({gate.refusal(holder.pid) or 'PID 1'})",
            UNPROVEN: _not_holding_detail(holder.device_minors, None, device_glob, "when it was to be signalled"),
        }[outcome]
        result.plan.spared.append(holder.entry(reason=reason, detail=detail))
    return False


def _runs(control: ProcessControl, now: Process | None) -> bool:
    """Whether the process still has a live thread: a plain zombie has ended (its parent reaps it),
    a zombie leader whose threads run on has not."""
    return now is not None and (not now.is_zombie or any(t.state not in ("Z", "X") for t in control.threads(now.pid)))


def _still_running(control: ProcessControl, holders: list[Holder]) -> list[Holder]:
    """The holders whose process still runs."""
    return [holder for holder in holders
            if holder.process is not None and _runs(control, control.current(Identity.of(holder.process)))]


def _settle(result: ReclaimResult, control: ProcessControl) -> None:
    """`ended` and `remaining` from the last signal each holder got and what it is now."""
    last: dict[int, dict[str, Any]] = {}
    for sent in result.signals:
        if sent["result"] == SENT:
            last[sent["pid"]] = sent
    for holder in result.plan.targets:
        sent = last.get(holder.pid)
        if sent is None or holder.process is None:
            continue
        now = control.current(Identity.of(holder.process))
        if not _runs(control, now):
            result.ended.append(holder.entry(signal=sent["signal"], now="gone" if now is None else "zombie"))
        else:
            result.remaining.append(holder.entry(signal=sent["signal"], state=now.state))


def summary(result: ReclaimResult) -> str:
    """One line for the task output."""
    plan = result.plan
    spared = f"; spared {len(plan.spared)}" if plan.spared else ""
    gpus = ", ".join(str(i) for i in plan.indices)
    if result.check_mode:
        return (f"check mode: would end {len(plan.targets)} holder(s) of GPU(s) {gpus}{spared}; nothing was signalled")
    if not plan.targets and not result.signals:
        head = f"nothing to end on GPU(s) {gpus}{spared}"
    else:
        head = f"ended {len(result.ended)} of {len(plan.targets)} holder(s) of GPU(s) {gpus}{spared}"
    if result.released:
        return f"{head}; released"
    why = "; ".join(result.judgement.reasons)
    return f"{head}; not released after {result.release.waited_s:g}s (escalation {result.judgement.escalation.value}): {why}"
