# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The reap plan: which process gets which signal, when, and why — computed, never guessed.

Pure: the plan is a function of one :class:`ProcessTable` snapshot, the job selection, the
protection and the options. It signals nothing and reads nothing itself (the protection looks up
the executable of a process it is asked about, and the test for other jobs' processes their
environment), so the property test can run it on thousands of generated process forests. The executor (reap_executor) only ever signals the
(pid, starttime) identities printed here.

The ladder, least force first (DESIGN.md §3):

1. ``terminate``: the term signal to every live job process, process group by process group. Each
   member is signalled on its own, by identity: a group shared with processes outside the job is
   never signalled as a whole, and neither is a group whose membership could change under us.
2. ``kill_leader``: SIGKILL to a job zombie leader (``Zl``): its main thread has exited, so nobody
   handles a polite signal, and its remaining threads hold the memory.
3. ``kill``: SIGKILL to the job processes still running ``term_timeout`` after step 1.
4. ``notify_parent``: SIGCHLD to the parent, outside the job, of a job process that is left a
   zombie: a parent with a SIGCHLD handler reaps then.
5. ``end_parent`` / ``end_parent_kill`` (only with ``reap_parents``): a parent that still has not
   reaped after ``reap_timeout`` is ended (term signal, grace, SIGKILL) so that the subreaper or
   PID 1 takes its zombies.

A parent that is PID 1, outside this PID namespace, or protected is never signalled: the plan
records who is left to reap instead, and the executor turns what stays into an escalation.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    NAMESPACE_INIT_PID,
    JobSelector,
    Protection,
    SpareTest,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import Identity, format_pids

TERMINATE = "terminate"
KILL_LEADER = "kill_leader"
KILL = "kill"
NOTIFY_PARENT = "notify_parent"
END_PARENT = "end_parent"
END_PARENT_KILL = "end_parent_kill"
STAGES = (TERMINATE, KILL_LEADER, KILL, NOTIFY_PARENT, END_PARENT, END_PARENT_KILL)

# Signals that do not end a process: asking a job to stop with one of them would only make the
# ladder wait for nothing (or freeze the job, SIGSTOP).
_NOT_ENDING = {
    signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGCONT,
    signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG,
}


def parse_term_signal(name: str, option: str = "term_signal") -> signal.Signals:
    """A signal name (``SIGTERM``, ``TERM``, ``sigint``) that ends a process; BadOption otherwise."""
    text = str(name).strip().upper()
    if not text.startswith("SIG"):
        text = "SIG" + text
    try:
        sig = signal.Signals[text]
    except KeyError:
        raise BadOption(option, f"{name!r} is not a signal name (use e.g. SIGTERM, SIGINT, SIGHUP)") from None
    if sig in _NOT_ENDING:
        raise BadOption(option, f"{sig.name} does not end a process (use e.g. SIGTERM, SIGINT, SIGHUP)")
    return sig


@dataclass(frozen=True)
class ReapOptions:
    """How hard and how long: the knobs of the ladder."""

    term_signal: signal.Signals = signal.SIGTERM
    term_timeout: float = 10.0
    kill_timeout: float = 10.0
    reap_timeout: float = 5.0
    d_state_timeout: float = 30.0
    reap_parents: bool = False
    # Not a rung of the ladder: how long the looks before and after it (found, left) watch zombies
    # orphaned to PID 1, as zombie_facts does.
    orphan_grace: float = 2.0


@dataclass(frozen=True)
class Step:
    """One planned signal to one process identity."""

    stage: str
    target: Identity
    signal: signal.Signals
    reason: str
    when: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "pid": self.target.pid,
            "starttime": self.target.starttime,
            "comm": self.target.comm,
            "signal": self.signal.name,
            "reason": self.reason,
            "when": self.when,
        }


@dataclass
class ReapPlan:
    """Everything the executor may do, in order, and what nobody may touch."""

    job: list[Identity] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    protected: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    missing_pids: list[int] = field(default_factory=list)
    # (pid, starttime) of the job processes that had already exited (plain zombies) at the snapshot
    exited: set[tuple[int, int]] = field(default_factory=set)

    def stage(self, name: str) -> list[Step]:
        return [step for step in self.steps if step.stage == name]

    @property
    def targets(self) -> set[tuple[int, int]]:
        """Every identity the plan may signal."""
        return {step.target.key for step in self.steps}

    @property
    def is_empty(self) -> bool:
        return not self.job

    def as_list(self) -> list[dict[str, Any]]:
        return [step.as_dict() for step in self.steps]


def plan_reap(
    table: ProcessTable,
    selector: JobSelector,
    protection: Protection,
    options: ReapOptions,
    spared: SpareTest | None = None,
) -> ReapPlan:
    """The ladder for the job in `table`. Reads only `table` (threads loaded by the caller), and
    through `spared` (another job's processes, see ``other_jobs.py``) what it reads of the job."""
    plan = ReapPlan()
    plan.missing_pids = sorted(pid for pid in selector.pids if pid not in table.processes)
    named = selector.named(table) if not selector.is_empty else set()
    job = selector.select(table, protection, named, spared) if named else set()
    for pid in sorted(named - job):
        why = protection.reason(pid)
        if why is None and spared is not None:
            why = spared(pid)
        plan.protected.append({"pid": pid, "comm": table.processes[pid].comm, "reason": f"selected as the job, but {why}"})
    processes = table.processes
    plan.job = [Identity.of(processes[pid]) for pid in sorted(job)]
    plan.exited = {Identity.of(processes[pid]).key for pid in job if processes[pid].is_zombie and processes[pid].threads <= 1}

    live = sorted(pid for pid in job if not processes[pid].is_zombie)
    leaders = sorted(pid for pid in job if processes[pid].is_zombie and processes[pid].threads > 1)
    _plan_terminate(plan, table, job, live, options)
    for pid in leaders:
        leader = processes[pid]
        tids = [t.tid for t in leader.live_threads]
        threads = f"threads {', '.join(map(str, tids))}" if tids else f"{leader.threads - 1} thread(s)"
        plan.steps.append(Step(
            KILL_LEADER, Identity.of(leader), signal.SIGKILL,
            f"zombie leader of the job: its main thread exited and nobody handles a polite signal; "
            f"SIGKILL ends its live {threads}",
            "at once",
        ))
    for pid in live:
        plan.steps.append(Step(
            KILL, Identity.of(processes[pid]), signal.SIGKILL,
            f"job process that ignored {options.term_signal.name}",
            f"if still running {options.term_timeout:g}s after {options.term_signal.name}",
        ))
    _plan_parents(plan, table, protection, job, options)
    for pid in sorted(job):
        stuck = [t for t in processes[pid].task_list if t.state == "D"]
        for thread in stuck:
            plan.notes.append(
                f"pid {pid} thread {thread.tid} ({thread.comm}) is in uninterruptible sleep "
                f"(wchan {thread.wchan or '?'}): a pending signal fires only when it wakes; "
                f"waited for up to {options.d_state_timeout:g}s, then reported for host action"
            )
    return plan


def _plan_terminate(plan: ReapPlan, table: ProcessTable, job: set[int], live: list[int], options: ReapOptions) -> None:
    members_of: dict[int, list[int]] = {}
    for process in table.processes.values():
        members_of.setdefault(process.pgid, []).append(process.pid)
    by_group: dict[int, list[int]] = {}
    for pid in live:
        by_group.setdefault(table.processes[pid].pgid, []).append(pid)
    for pgid in sorted(by_group):
        outsiders = sorted(pid for pid in members_of.get(pgid, ()) if pid not in job)
        if outsiders:
            reason = (
                f"job process in process group {pgid}, which it shares with {_pids(outsiders)} outside the job: "
                f"signalled alone, never as a group"
            )
        else:
            reason = f"job process (every member of process group {pgid} is the job; each is signalled by identity)"
        for pid in by_group[pgid]:
            plan.steps.append(Step(TERMINATE, Identity.of(table.processes[pid]), options.term_signal, reason, "at once"))


def _plan_parents(plan: ReapPlan, table: ProcessTable, protection: Protection, job: set[int], options: ReapOptions) -> None:
    """Who reaps each job process once it has exited, and what we may do to help them."""
    children_of: dict[int, list[int]] = {}
    for pid in sorted(job):
        ppid = table.processes[pid].ppid
        if ppid not in job:
            children_of.setdefault(ppid, []).append(pid)
    for ppid in sorted(children_of):
        children = _pids(children_of[ppid])
        if ppid == 0:
            plan.notes.append(f"job {children}: the parent is outside this PID namespace and does the reaping")
            continue
        if ppid == NAMESPACE_INIT_PID:
            init = table.processes.get(ppid)
            plan.notes.append(
                f"job {children}: orphaned to PID 1 ({init.comm if init else '?'}), which must do the reaping once "
                f"they exit; watched for {options.reap_timeout:g}s, after that only a restart of the container clears them"
            )
            continue
        parent = table.processes.get(ppid)
        if parent is None or (parent.is_zombie and parent.threads <= 1):
            # Seen only when the parent exited while the scan ran: its children go to their new reaper.
            plan.notes.append(f"job {children}: the parent {ppid} exited during the scan; the new reaper takes over")
            continue
        why = protection.reason(ppid)
        if why is not None:
            plan.protected.append({"pid": ppid, "comm": parent.comm, "reason": f"parent of the job's {children}, but {why}"})
            plan.notes.append(f"job {children}: left to the parent {ppid} ({parent.comm}) to reap; it is never signalled ({why})")
            continue
        parent_id = Identity.of(parent)
        plan.steps.append(Step(
            NOTIFY_PARENT, parent_id, signal.SIGCHLD,
            f"parent (outside the job) of the job's {children}: SIGCHLD asks it to reap",
            "once any of them is a zombie",
        ))
        if options.reap_parents:
            plan.steps.append(Step(
                END_PARENT, parent_id, options.term_signal,
                f"reap_parents: ends the parent of the job's {children} so that the subreaper or PID 1 does the reaping",
                f"if any of them is still a zombie {options.reap_timeout:g}s after SIGCHLD",
            ))
            plan.steps.append(Step(
                END_PARENT_KILL, parent_id, signal.SIGKILL,
                f"reap_parents: the parent of the job's {children} ignored {options.term_signal.name}",
                f"if still running {options.term_timeout:g}s after {options.term_signal.name}",
            ))
        else:
            plan.notes.append(
                f"job {children}: if left as zombies of {ppid} ({parent.comm}), only ending that parent clears them "
                f"(reap_parents is false, so it is only sent SIGCHLD)"
            )


def _pids(pids: list[int]) -> str:
    label = "pid" if len(pids) == 1 else "pids"
    return f"{label} {format_pids(pids)}"
