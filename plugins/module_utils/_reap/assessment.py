# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the last run left behind, and what it takes to clear it.

Facts first (zombies and their parents, threads in D with their wchan, the job's processes, GPU
device holders), then findings derived only from those facts, each with its escalation (the
collection's one vocabulary, :mod:`.verdict`):

* ``host_action``: a thread sleeps uninterruptibly in a GPU driver path; no signal reaches it and a
  container reboot may not clear it either.
* ``container_reboot``: something only a container restart clears: orphaned zombies that PID 1 of
  this namespace did not reap within ``orphan_grace`` seconds (it was watched, not guessed).
* ``signals``: signals and reaping clear it.
* ``none``: nothing of the job and nothing that blocks a relaunch.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_timeout
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import poll_until
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    DEFAULT_DRIVER_WCHAN,
    DeviceHolder,
    Process,
    ProcessTable,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import cap_line
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, FindingKind, Judged, Verdict
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import (
    Identity,
    ProcessControl,
    format_pids,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    NAMESPACE_INIT_PID,
    FloorReview,
    JobSelector,
    Protection,
    job_selection_from_params,
    own_pid_in,
    review_selection,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.other_jobs import OtherJobs, own_job_dir

ORPHAN_POLL_INTERVAL = 0.1
# A reaping init takes an orphan within about 1.5 s; ten minutes is more than any play should watch.
MAX_ORPHAN_GRACE = 600.0


@dataclass(frozen=True)
class AssessmentOptions:
    selector: JobSelector
    protected: tuple[Pattern[str], ...] = ()
    device_glob: str = "/dev/nvidia*"
    driver_wchan: Pattern[str] = re.compile(DEFAULT_DRIVER_WCHAN)
    orphan_grace: float = 2.0
    require_no_zombies: bool = False


def options_from_params(params: Mapping[str, Any]) -> AssessmentOptions:
    """zombie_facts' options, checked; OptionsInvalid lists every problem."""
    checks = OptionChecks()
    selector, protected = job_selection_from_params(params, checks)
    job_dir = own_job_dir(params, checks)
    orphan_grace = checks.check(check_timeout, "orphan_grace", params["orphan_grace"], maximum=MAX_ORPHAN_GRACE)
    driver_wchan = checks.check(_wchan_pattern, params["driver_wchan"])
    checks.raise_if_any()
    return AssessmentOptions(
        selector=dataclasses.replace(selector, job_dir=job_dir),
        protected=protected,
        device_glob=params["gpu_device_glob"],
        driver_wchan=driver_wchan or re.compile(DEFAULT_DRIVER_WCHAN),
        orphan_grace=float(orphan_grace or 0.0),
        require_no_zombies=params["require_no_zombies"],
    )


def _wchan_pattern(pattern: str) -> Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise BadOption("driver_wchan", f"{pattern!r} is not a valid regular expression: {exc}") from None


@dataclass
class Assessment(Judged):
    zombies: list[dict[str, Any]] = field(default_factory=list)
    uninterruptible: list[dict[str, Any]] = field(default_factory=list)
    job_processes: list[dict[str, Any]] = field(default_factory=list)
    protected: list[dict[str, Any]] = field(default_factory=list)
    other_jobs: list[dict[str, Any]] = field(default_factory=list)
    too_broad: list[str] = field(default_factory=list)
    gpu_holders: list[dict[str, Any]] = field(default_factory=list)
    judgement: Verdict = field(default_factory=Verdict)
    missing_pids: list[int] = field(default_factory=list)
    process_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "zombies": self.zombies,
            "uninterruptible": self.uninterruptible,
            "job_processes": self.job_processes,
            "protected": self.protected,
            "other_jobs": self.other_jobs,
            "too_broad": self.too_broad,
            "gpu_holders": self.gpu_holders,
            **self.judgement.as_dict(),
            "missing_pids": self.missing_pids,
            "process_count": self.process_count,
        }


def assess(
    options: AssessmentOptions,
    proc_root: str = "/proc",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Assessment:
    """Take one snapshot under `proc_root` and classify what it holds.

    A look never refuses: what :mod:`.executor` would refuse as too broad is reported in
    `too_broad`, and the processes of Ansible a selection takes in are left out of the job and
    listed with the protected ones (unless `allow_broad`, with which zombie_reap would end them).
    """
    table = ProcessTable.scan(proc_root)
    own = own_pid_in(proc_root)
    return assess_table(table, options, Protection(table, options.protected, own), OtherJobs(table, options.selector.job_dir),
                        own, clock, sleep)


def assess_table(
    table: ProcessTable,
    options: AssessmentOptions,
    protection: Protection,
    other_jobs: OtherJobs,
    own: int,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Assessment:
    """:func:`assess` of a scan already made: zombie_reap judges the very table its plan is made
    from (and the one it takes after the ladder), so that its ``found`` and ``left`` cost no scan
    of their own. `protection` and `other_jobs` must be of `table`; their answers are reused."""
    selector = options.selector
    named = selector.named(table)
    review = FloorReview()
    if not selector.allow_broad and not selector.is_empty:
        review = review_selection(selector, table, protection, own, other_jobs.reason, named)

    def left_to_others(pid: int) -> str | None:
        why = other_jobs.reason(pid)
        return why if why is not None else review.relation.get(pid)

    job = selector.select(table, protection, named, left_to_others)
    protected_job = {pid for pid in named if pid in protection}

    # Holding a GPU is holding a GPU's own device file (195:N), told by its numbers: /dev/nvidiactl,
    # -modeset and -uvm, which every GPU user holds, and files merely named like one block nothing.
    holders = [h for h in table.device_holders(options.device_glob) if h.device.is_gpu]
    holder_pids = {h.pid for h in holders}

    # The table is walked once for D-state processes and once for zombies, not once per use.
    d_state = {p.pid for p in table.processes.values() if p.state == "D"}
    zombies = sorted((p for p in table.processes.values() if p.is_zombie), key=lambda p: p.pid)
    interesting = set(job) | d_state | {p.pid for p in zombies if p.threads > 1}
    interesting |= {pid for pid in holder_pids if table.processes[pid].threads > 1}
    for pid in interesting:
        table.load_threads(pid)

    result = Assessment(process_count=len(table.processes))
    result.missing_pids = sorted(pid for pid in options.selector.pids if pid not in table.processes)
    result.gpu_holders = [h.as_dict() for h in holders]
    result.job_processes = [_job_entry(table.processes[pid]) for pid in sorted(job)]
    result.protected = [
        {"pid": pid, "comm": table.processes[pid].comm, "reason": protection.reason(pid)}
        for pid in sorted(protected_job)
    ] + [
        {"pid": pid, "comm": table.processes[pid].comm, "reason": f"a process of Ansible: it {why}"}
        for pid, why in sorted(review.relation.items()) if pid not in job
    ]
    result.other_jobs = other_jobs.report()
    result.too_broad = review.reasons
    result.uninterruptible = _uninterruptible(table, interesting)

    blocking: dict[int, str] = {}
    for zombie in zombies:
        why = _blocks_relaunch(zombie, job, holder_pids, options.require_no_zombies)
        entry = _zombie_entry(table, zombie, job)
        entry["blocking"] = why is not None
        result.zombies.append(entry)
        if why is not None:
            blocking[zombie.pid] = why

    unreaped, reaped = _watch_orphans(table, blocking, options.orphan_grace, clock, sleep)
    for entry in result.zombies:
        entry["unreaped_orphan"] = entry["pid"] in unreaped
        # Reaped while it was watched: it no longer stands in the way of anything.
        if entry["pid"] in reaped:
            entry["blocking"] = False
            del blocking[entry["pid"]]
    _decide(result, table, job, blocking, unreaped, holders, options)
    other_jobs.add_findings(result.judgement)
    return result


def _job_entry(process: Process) -> dict[str, Any]:
    return {
        "pid": process.pid,
        "starttime": process.starttime,
        "ppid": process.ppid,
        "pgid": process.pgid,
        "sid": process.sid,
        "state": process.state,
        "comm": process.comm,
        "cmdline": cap_line(process.cmdline),  # a command line can be megabytes: cut as a log line is
        "threads": process.threads,
    }


def _zombie_entry(table: ProcessTable, zombie: Process, job: set[int]) -> dict[str, Any]:
    live = [t.as_dict() for t in zombie.live_threads]
    parent = table.processes.get(zombie.ppid)
    return {
        "pid": zombie.pid,
        "starttime": zombie.starttime,
        "ppid": zombie.ppid,
        "comm": zombie.comm,
        "threads": zombie.threads,
        "live_threads": live,
        "kind": (FindingKind.ZOMBIE_LEADER if live else FindingKind.ZOMBIE).value,
        "job": zombie.pid in job,
        "parent": {
            "pid": zombie.ppid,
            "comm": parent.comm if parent else "",
            "state": parent.state if parent else "",
            "is_namespace_init": zombie.ppid == NAMESPACE_INIT_PID,
            "job": zombie.ppid in job,
        },
        "parent_chain": table.ancestors(zombie.pid),
    }


def _uninterruptible(table: ProcessTable, pids: set[int]) -> list[dict[str, Any]]:
    found = []
    for pid in sorted(pids):
        process = table.processes[pid]
        for thread in process.task_list:
            if thread.state == "D":
                found.append({"pid": pid, "tid": thread.tid, "comm": thread.comm, "wchan": thread.wchan})
    return found


def _blocks_relaunch(zombie: Process, job: set[int], holder_pids: set[int], require_no_zombies: bool) -> str | None:
    """Why this zombie stands in the way of a relaunch, or None if it is someone else's business."""
    if zombie.pid in job or zombie.ppid in job:
        return "belongs to the job"
    # Another program's zombie leader whose threads run on is that program's business, unless it
    # holds a GPU: zombie_reap never touches it, so it must not make a clean-up ask for signals.
    if zombie.pid in holder_pids:
        return "holds a GPU device"
    if zombie.ppid == NAMESPACE_INIT_PID:
        return "orphaned to PID 1"
    if require_no_zombies:
        return "require_no_zombies is set"
    return None


def _watch_orphans(
    table: ProcessTable,
    blocking: dict[int, str],
    grace: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> tuple[set[int], set[int]]:
    """Plain zombies orphaned to PID 1 that are still there after `grace` seconds, and those that
    were reaped meanwhile.

    A reaping init (systemd, tini, a shell) takes them within a second or two; one that does not
    reap never will. One snapshot cannot tell these apart, so watch for up to `grace` seconds.
    """
    watched = {
        pid for pid in blocking
        if table.processes[pid].ppid == NAMESPACE_INIT_PID and not table.processes[pid].live_threads
    }
    waiting = set(watched)

    def all_reaped() -> bool:
        nonlocal waiting
        waiting = {pid for pid in waiting if _still_zombie(table, pid)}
        return not waiting

    poll_until(all_reaped, grace, ORPHAN_POLL_INTERVAL, clock, sleep)
    return waiting, watched - waiting


def _still_zombie(table: ProcessTable, pid: int) -> bool:
    now = ProcessControl(table.proc_root).current(Identity.of(table.processes[pid]))
    return now is not None and now.is_zombie


def _decide(
    result: Assessment,
    table: ProcessTable,
    job: set[int],
    blocking: dict[int, str],
    unreaped: set[int],
    holders: list[DeviceHolder],
    options: AssessmentOptions,
) -> None:
    found = result.judgement
    stuck_in_driver = [u for u in result.uninterruptible if options.driver_wchan.search(u["wchan"] or "")]
    for item in stuck_in_driver:
        found.add(
            FindingKind.UNINTERRUPTIBLE, Escalation.HOST_ACTION,
            f"pid {item['pid']} thread {item['tid']} ({item['comm']}) is in uninterruptible sleep in the "
            f"GPU driver (wchan {item['wchan']}): no signal reaches it, the host must act",
            [item["pid"]],
        )

    if unreaped:
        init = table.processes.get(NAMESPACE_INIT_PID)
        init_name = init.comm if init else "?"
        found.add(
            FindingKind.UNREAPED_ORPHAN, Escalation.CONTAINER_REBOOT,
            f"zombies {format_pids(unreaped)} are orphaned to PID 1 ({init_name}), which did not reap them within "
            f"{options.orphan_grace:g}s: only a restart of this container clears them",
            unreaped,
        )

    live_job = sorted(pid for pid in job if not table.processes[pid].is_zombie)
    if live_job:
        found.add(FindingKind.RUNNING, Escalation.SIGNALS, f"job processes still running: {format_pids(live_job)}", live_job)
    leaders = sorted(pid for pid in blocking if table.processes[pid].live_threads)
    if leaders:
        found.add(FindingKind.ZOMBIE_LEADER, Escalation.SIGNALS,
                  f"zombie leaders with live threads (SIGKILL ends the threads): {format_pids(leaders)}", leaders)
    plain = sorted(pid for pid in blocking if pid not in unreaped and not table.processes[pid].live_threads)
    if plain:
        found.add(FindingKind.ZOMBIE, Escalation.SIGNALS, f"zombies waiting for their parent to reap them: {format_pids(plain)}", plain)
    # Elsewhere a D thread is usually brief I/O; it matters only where it keeps the job alive.
    concerned = job | set(blocking) | {h.pid for h in holders}
    other_d = [u for u in result.uninterruptible if u not in stuck_in_driver and u["pid"] in concerned]
    if other_d:
        threads = ", ".join(f"{u['pid']}/{u['tid']} ({u['wchan'] or '?'})" for u in other_d)
        found.add(FindingKind.UNINTERRUPTIBLE, Escalation.SIGNALS,
                  f"threads in uninterruptible sleep outside the GPU driver (a pending kill fires when they wake): {threads}",
                  {u["pid"] for u in other_d})
    job_holders = sorted({h.pid for h in holders if h.pid in job or h.pid in blocking})
    if job_holders:
        found.add(FindingKind.HOLDS_DEVICE, Escalation.SIGNALS, f"GPU devices still open by {format_pids(job_holders)}", job_holders)
    if not found.findings:
        found.add(FindingKind.NOTHING, Escalation.NONE, "nothing of the job and nothing blocking a relaunch")
