# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stopping a supervised job: its whole process tree, and nothing else.

The job's processes are those in its process group that started no earlier than the job, the
descendants of its leader, and the descendants of its supervisor (the subreaper adopts whatever the
job orphans, even processes that left the group). SIGTERM first, then, after stop_timeout, SIGKILL;
each step polls the process table until the tree is gone. Protected processes (PID 1, this module
and its ancestors, kernel threads) are never signalled.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils.reap_executor import SENT, ProcessControl
from ansible_collections.gpuops.relaunch.plugins.module_utils.reap_plan import Identity
from ansible_collections.gpuops.relaunch.plugins.module_utils.selection import Protection

KILL_WAIT = 30.0


@dataclass(frozen=True)
class JobIdentity:
    """The recorded identity of a supervised run."""

    pid: int
    starttime: int
    pgid: int
    supervisor_pid: int | None = None
    supervisor_starttime: int | None = None

    @classmethod
    def from_run(cls, run: dict) -> "JobIdentity":
        return cls(
            pid=int(run["pid"]),
            starttime=int(run["starttime"]),
            pgid=int(run.get("pgid") or run["pid"]),
            supervisor_pid=run.get("supervisor_pid"),
            supervisor_starttime=run.get("supervisor_starttime"),
        )


@dataclass
class TreeView:
    """One look at the job's tree in a process table."""

    table: ProcessTable
    identity: JobIdentity
    members: set[int]
    supervisor_alive: bool
    supervisor_idle: bool = False

    @property
    def live(self) -> list[int]:
        return sorted(pid for pid in self.members if not self.table.processes[pid].is_zombie)

    @property
    def zombies(self) -> list[int]:
        return sorted(pid for pid in self.members if self.table.processes[pid].is_zombie)

    def unreapable_zombies(self) -> list[int]:
        """Zombies whose parent is neither a live member nor the live supervisor: nobody of ours reaps them."""
        ours = set(self.live)
        if self.supervisor_alive and self.identity.supervisor_pid:
            ours.add(self.identity.supervisor_pid)
        return [pid for pid in self.zombies if self.table.processes[pid].ppid not in ours]

    def gone(self) -> bool:
        """Nothing of the job runs, every zombie it left has been reaped, the supervisor has exited
        (or, where nothing could reap it, waits idle for the next run)."""
        waiting_zombies = set(self.zombies) - set(self.unreapable_zombies())
        supervisor_done = not self.supervisor_alive or self.supervisor_idle
        return not self.live and not waiting_zombies and supervisor_done

    def describe(self, pids: list[int]) -> list[dict]:
        described = []
        for pid in pids:
            process = self.table.processes[pid]
            described.append({"pid": pid, "ppid": process.ppid, "state": process.state, "comm": process.comm})
        return described


def look(identity: JobIdentity, proc_root: str = "/proc",
         supervisor_idle: Callable[[], bool] = lambda: False) -> TreeView:
    """Scan the process table and pick out the job's tree (`supervisor_idle`: it said so)."""
    table = ProcessTable.scan(proc_root)
    processes = table.processes
    leader = processes.get(identity.pid)
    leader_is_ours = leader is not None and leader.starttime == identity.starttime
    members: set[int] = set()
    # The kernel does not hand out a pid while a group still uses it as its id; so if another
    # process now has the leader's pid, our group emptied long ago and this group is someone else's.
    if leader is None or leader_is_ours:
        members = {
            pid for pid, process in processes.items()
            if process.pgid == identity.pgid and process.starttime >= identity.starttime
        }
    if leader_is_ours:
        members.add(identity.pid)
        members.update(table.descendants(identity.pid))
    supervisor = processes.get(identity.supervisor_pid or 0)
    supervisor_alive = (
        supervisor is not None
        and supervisor.starttime == identity.supervisor_starttime
        and not supervisor.is_zombie
    )
    if supervisor_alive:
        members.update(table.descendants(supervisor.pid))
    idle = supervisor_alive and supervisor_idle()
    return TreeView(table, identity, members, supervisor_alive, idle)


@dataclass
class StopOutcome:
    """What stopping the tree took."""

    signalled: list[int] = field(default_factory=list)
    escalated: bool = False
    gone: bool = True
    remaining: list[dict] = field(default_factory=list)
    unreapable_zombies: list[dict] = field(default_factory=list)


def _send(view: TreeView, signum: signal.Signals, outcome: StopOutcome) -> None:
    protection = Protection(view.table, [])
    own_group = os.getpgrp()
    # Our own process group holds the connection that runs this module: never part of a job.
    targets = [pid for pid in view.live
               if pid not in protection and view.table.processes[pid].pgid != own_group]
    in_group = [pid for pid in targets if view.table.processes[pid].pgid == view.identity.pgid]
    if in_group and view.identity.pgid not in protection:
        # killpg reaches every member at once, even one forked after our scan.
        try:
            os.killpg(view.identity.pgid, signum)
        except OSError:
            in_group = []  # the group emptied since the scan
    # Outside the group, each process is signalled through the same gate as zombie_reap's: only
    # if its pid still has the start time this scan saw (pinned by a pidfd where there is one).
    gate = ProcessControl(view.table.proc_root)
    for pid in targets:
        if pid not in in_group:
            if gate.send(Identity.of(view.table.processes[pid]), signum) != SENT:
                continue  # it ended, or its pid now names another process
        if pid not in outcome.signalled:
            outcome.signalled.append(pid)


def stop_tree(identity: JobIdentity, stop_timeout: float, proc_root: str = "/proc",
              kill_wait: float = KILL_WAIT, supervisor_idle: Callable[[], bool] = lambda: False) -> StopOutcome:
    """SIGTERM, wait up to stop_timeout, SIGKILL, wait up to kill_wait; report what remains."""
    outcome = StopOutcome()
    view = look(identity, proc_root, supervisor_idle)
    if view.gone():
        return _finish(view, outcome)
    _send(view, signal.SIGTERM, outcome)
    for signum, seconds in ((None, stop_timeout), (signal.SIGKILL, kill_wait)):
        if signum is not None:
            outcome.escalated = True
            _send(view, signum, outcome)
        deadline = Deadline(seconds)
        while True:
            view = look(identity, proc_root, supervisor_idle)
            if view.gone():
                return _finish(view, outcome)
            if deadline.expired():
                break
            deadline.pause()
    outcome.gone = False
    outcome.remaining = view.describe(view.live + sorted(set(view.zombies) - set(view.unreapable_zombies())))
    return _finish(view, outcome)


def _finish(view: TreeView, outcome: StopOutcome) -> StopOutcome:
    outcome.unreapable_zombies = view.describe(view.unreapable_zombies())
    return outcome
