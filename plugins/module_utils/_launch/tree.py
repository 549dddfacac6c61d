# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stopping a supervised job: its whole process tree, and nothing else.

Membership is proven, not remembered. The records (run.json, idle.json) say where to look, never
what to signal: a process belongs to the run only if

* it carries the run's mark (``GPUOPS_RELAUNCH_RUN=JOB_DIR:RUN_ID``, set by the supervisor when it
  started the job and inherited by everything the job starts) in the environment it was started
  with, and did not start before the run; or
* it descends from the run's supervisor, itself proven by its own mark
  (``GPUOPS_RELAUNCH_SUPERVISOR=JOB_DIR``) and its start time: as the child subreaper it adopts
  whatever the job orphans, so a process of the job that cleared its environment is still found;
  descent stops only at another job that is proven (its records believed, its recorded supervisor or
  run alive and carrying its mark: ``_reap/other_jobs.py``); a mark naming another job shields
  nothing by itself (an environment is anyone's to rewrite) and is reported as a conflict;
* with the systemd backend, it runs in the job's unit's control group (``system.slice/gpuops-NAME.service``
  below systemd's own root, the unit named after the job, never after the record) and did not start
  before the run: systemd puts there what the unit starts, whatever its environment.

The same proof says whether the run's main process runs (:func:`leader_alive`): health, the probe
and ``state=started`` judge liveness exactly as the stop path judges membership.

A recorded pid that fails the proof (a recycled pid, a record restored or edited) is reported and
ignored. The record's process group id is never used: a group is signalled member by member,
each through the collection's one signal gate (protection, then the pinned identity). SIGTERM
first (the gate follows it with SIGCONT, so a frozen member runs its handler), then, after
term_timeout, SIGKILL; each step polls the process table until the tree is gone.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import (
    RUN_MARK,
    SUPERVISOR_MARK,
    run_mark,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    Process,
    ProcessTable,
    compile_patterns,
    read_environ_value,
    read_process,
    read_small,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import DEFAULT_PROTECTED, Protection
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import (
    REFUSED,
    SENT,
    Identity,
    ProcessControl,
    SignalGate,
)

KILL_WAIT = 30.0
POLL_INTERVAL = 0.1
# The stop path has no `protected` option of its own: the modules' default patterns (none) apply, on
# top of what the gate always protects (sshd, systemd, init, the container runtime by their executable).
STOP_PROTECTED = tuple(compile_patterns(DEFAULT_PROTECTED, "protected"))


class RecordError(ValueError):
    """A record whose fields cannot describe a run; the message names the file and the field."""


def _record_int(record: dict, key: str, source: str, required: bool = True) -> int | None:
    value = record.get(key)
    if value is None and not required:
        return None
    # bool is an int in Python; a record saying `true` for a pid is broken, not pid 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RecordError(f"{source}: {key} is not a process number or start time ({value!r})")
    return value


# What new_run_id writes (uuid4 hex), with room for ids of other versions; no "/" and no "..".
RUN_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


@dataclass(frozen=True)
class JobIdentity:
    """What the record says about one supervised run: where to look, not what to signal."""

    job_dir: str
    run_id: str
    pid: int | None = None
    starttime: int | None = None
    supervisor_pid: int | None = None
    supervisor_starttime: int | None = None
    # The systemd backend's unit, derived from the job's name (never taken from the record).
    unit: str | None = None

    @classmethod
    def from_run(cls, run: dict, job_dir: str, source: str = "run.json") -> "JobIdentity":
        """The identity in a run record; RecordError when a field is of the wrong kind."""
        run_id = run.get("run_id")
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            # The run id names files (incidents/incident-TIME-RUN_ID.json): never a path.
            raise RecordError(f"{source}: run_id is missing or not a run id ({run_id!r})")
        return cls(
            job_dir=job_dir,
            run_id=run_id,
            pid=_record_int(run, "pid", source, required=False),
            starttime=_record_int(run, "starttime", source, required=False),
            supervisor_pid=_record_int(run, "supervisor_pid", source, required=False),
            supervisor_starttime=_record_int(run, "supervisor_starttime", source, required=False),
            unit=_unit_name(os.path.basename(job_dir)) if run.get("backend") == "systemd" else None,
        )

    @property
    def mark(self) -> str:
        return run_mark(self.job_dir, self.run_id)

    @property
    def leader(self) -> Identity | None:
        """The run's main process as recorded (pid 0 or no start time: none recorded)."""
        return Identity(self.pid, self.starttime) if self.pid and self.starttime is not None else None

    def marks(self, process: Process, carried: str | None) -> bool:
        """Whether `process`, whose environment carries `carried` as its run mark, is this run's by
        that mark: the run's own mark, on a live process that did not start before the run."""
        return carried == self.mark and not process.is_zombie and process.starttime >= (self.starttime or 0)

    @property
    def supervisor(self) -> Identity | None:
        return recorded_identity(self.supervisor_pid, self.supervisor_starttime)


def same_directory(first: str, second: str) -> bool:
    """Whether two spellings name one directory: by (device, inode) where both exist, else by spelling."""
    if first == second:
        return True
    try:
        one, other = os.stat(first), os.stat(second)
    except (OSError, ValueError):
        return False
    return (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino)


def recorded_identity(pid: object, starttime: object) -> Identity | None:
    """The identity a record names, or None when its fields are not a pid and a start time."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    if not isinstance(starttime, int) or isinstance(starttime, bool):
        return None
    return Identity(pid, starttime)


def _carries(table: ProcessTable, process: Process, name: str) -> str | None:
    """`name` in the environment of exactly the process the scan saw."""
    value = read_environ_value(table.proc_root, process.pid, name)
    return value if value is not None and _still_seen(table, process) else None


def _still_seen(table: ProcessTable, process: Process) -> bool:
    """Whether `process`'s pid still has the start time the scan saw, so that what was read of it
    since was its own and not a later process's with its pid. Its stat alone is read again: the
    identity is (pid, start time), nothing else (:class:`.signal_gate.Identity`)."""
    return Identity(process.pid, process.starttime).matches(read_process(table.proc_root, process.pid, with_cmdline=False))


def _marked(table: ProcessTable, process: Process, identity: JobIdentity) -> bool:
    """Whether exactly the process the scan saw carries `identity`'s run mark (:meth:`JobIdentity.marks`).

    Proven only where the environment names this run: a process whose environment does not is no
    member whoever's environment was read (the process the scan saw, or a later one with its pid
    after the one seen has ended), and on a host of ten thousand processes few carry a run's mark.
    """
    carried = read_environ_value(table.proc_root, process.pid, RUN_MARK)
    return identity.marks(process, carried) and _still_seen(table, process)


def unit_control_groups(proc_root: str, unit: str) -> frozenset[bytes]:
    """The /proc/PID/cgroup lines of a process in system unit `unit`, one per hierarchy.

    systemd-run puts a transient system unit in system.slice below systemd's root, which is PID 1's
    own control group without its init.scope: ``/`` where the container has a cgroup namespace,
    ``/lxc.payload.NAME`` where it has none. Only that exact path counts: a unit of the same name
    elsewhere (a user's systemd, another container's tree seen from the host) is not this job's.
    """
    expected = set()
    for line in (read_small(f"{proc_root}/1/cgroup") or b"").splitlines():
        hierarchy, sep, root = line.rpartition(b":")
        if not sep:
            continue
        if root.endswith(b"/init.scope"):
            root = root[: -len(b"/init.scope")]
        expected.add(hierarchy + b":" + root.rstrip(b"/") + b"/system.slice/" + unit.encode())
    return frozenset(expected)


def _in_control_group(table: ProcessTable, process: Process, groups: frozenset[bytes]) -> bool:
    """Whether exactly the process the scan saw runs in one of `groups` (lines of /proc/PID/cgroup).

    The start time is checked after the read, so what was read belongs to this process, not to a
    later one with its pid.
    """
    raw = read_small(f"{table.proc_root}/{process.pid}/cgroup")
    found = raw is not None and any(line in groups for line in raw.splitlines())
    return found and _still_seen(table, process)


def _unit_name(job_name: str) -> str:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.systemd import unit_name  # pylint: disable=import-outside-toplevel
    return unit_name(job_name)


def stop_gate(table: ProcessTable, control: ProcessControl | None = None) -> SignalGate:
    """The signal gate of the launch path for one scan; the module's own process group is spared too."""
    return SignalGate(Protection(table, STOP_PROTECTED), control or ProcessControl(table.proc_root),
                      spare_group=os.getpgrp())


def proven_supervisor(table: ProcessTable, supervisor: Identity | None, job_dir: str) -> bool:
    """Whether `supervisor` is, right now, the live supervisor of `job_dir`."""
    process = table.processes.get(supervisor.pid) if supervisor is not None else None
    return (
        supervisor is not None
        and supervisor.matches(process)
        and not process.is_zombie
        and _carries(table, process, SUPERVISOR_MARK) == job_dir
    )


# --- the run-id fence --------------------------------------------------------------------------
#
# A relaunch looks at the job (train_launch's probe), then stops and cleans up what it saw. Another
# relaunch of the same job (a watchdog's run and an alert's at once) may relaunch it in between: the
# stop and the clean-up are given the run the look saw (expect_run_id) and leave a newer live run alone.


def check_expect_run_id(value: Any) -> str | None:
    """`expect_run_id` as given: None (no fence: today's behaviour), "" (the look saw no run of the job)
    or a run id; BadOption, naming the option, for anything else."""
    if value is None or value == "":
        return value
    if not isinstance(value, str) or not RUN_ID.fullmatch(value):
        raise BadOption("expect_run_id", f"{escape_controls(repr(value))} is not a run id (the run_id or health.run_id "
                                         f"train_launch returns: letters, digits, '_' and '-', at most 64), nor empty "
                                         f"(no run was seen)")
    return value


def supersedes(expected: str | None, current: str | None, alive: Callable[[], bool]) -> bool:
    """Whether the job's recorded run `current` is a newer run than the one a step was sent for (`expected`,
    "" for none) and alive, so that the step must leave it alone. No fence (`expected` None), no recorded
    run, the expected run itself, or a newer run that is not alive: False (the step does what it always did).
    `alive` is asked only when the runs differ."""
    return expected is not None and current is not None and current != expected and alive()


def leader_alive(identity: JobIdentity, proc_root: str = "/proc") -> bool:
    """Whether the run's main process runs: its recorded pid and start time, proven a member of the run.

    The same proof as the stop path's (:func:`prove`): the run's mark, descent from the run's proven
    supervisor, or its systemd unit's control group - a job whose command ends in ``exec env -i ...``
    (``su -``, ``sudo -i``, a container runtime) has lost the mark but is still the job. Only the
    leader's line of ancestors is read, not the whole process table: this runs on every poll of the
    readiness wait.
    """
    leader = identity.leader
    return leader is not None and prove(_lineage(leader.pid, proc_root), identity).leader_running


def _lineage(pid: int, proc_root: str) -> ProcessTable:
    """`pid` and its ancestors, nearest first, as a table (empty if there is no such process).

    A parent that started after its child is not its parent: the child was reparented and the
    parent's pid reused between the two reads; the line ends there, proving nothing more.
    """
    control = ProcessControl(proc_root)
    processes: dict[int, Process] = {}
    process = control.look(pid)
    while process is not None and process.pid not in processes:
        processes[process.pid] = process
        parent = control.look(process.ppid) if process.ppid > 0 else None
        if parent is None or parent.starttime > process.starttime:
            break
        process = parent
    return ProcessTable(processes, proc_root)


def _one_process(pid: int, proc_root: str) -> ProcessTable:
    """A table that holds just `pid` (empty if there is no such process)."""
    process = ProcessControl(proc_root).look(pid)
    return ProcessTable({pid: process} if process is not None else {}, proc_root)


def wake_idle_supervisor(idle: dict, job_dir: str, proc_root: str = "/proc") -> str:
    """SIGUSR1 to the idle supervisor that idle.json names, if it is proven to be this job's.

    Returns the gate's word (SENT, or why not); the caller starts a new supervisor unless SENT.
    """
    supervisor = recorded_identity(idle.get("supervisor_pid"), idle.get("supervisor_starttime"))
    table = ProcessTable.scan(proc_root, cmdlines=False)
    if supervisor is None or not proven_supervisor(table, supervisor, job_dir):
        return REFUSED
    return stop_gate(table).send(Identity.of(table.processes[supervisor.pid]), signal.SIGUSR1)


def end_idle_supervisor(idle: dict, job_dir: str, proc_root: str = "/proc") -> str:
    """SIGTERM to the idle supervisor that idle.json names, if it is proven to be this job's (state=absent).

    An idle supervisor has no child: it waits for the next run and ends on SIGTERM. Returns the gate's
    word (SENT, or why not).
    """
    supervisor = recorded_identity(idle.get("supervisor_pid"), idle.get("supervisor_starttime"))
    table = ProcessTable.scan(proc_root)
    if supervisor is None or not proven_supervisor(table, supervisor, job_dir):
        return REFUSED
    return stop_gate(table).send(Identity.of(table.processes[supervisor.pid]), signal.SIGTERM)


def supervisor_alive(pid: int | None, starttime: int | None, job_dir: str, proc_root: str = "/proc") -> bool:
    """Whether (pid, starttime) is this job's supervisor, alive, right now."""
    supervisor = recorded_identity(pid, starttime)
    return supervisor is not None and proven_supervisor(_one_process(supervisor.pid, proc_root), supervisor, job_dir)


@dataclass
class TreeView:
    """One look at the run's proven members in a process table."""

    table: ProcessTable
    identity: JobIdentity
    members: set[int]
    supervisor_alive: bool
    supervisor_idle: bool = False
    ignored: list[dict[str, Any]] = field(default_factory=list)
    # Members by descent whose marks name another job (never proven): what they say is reported, not believed.
    mark_conflicts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def live(self) -> list[int]:
        return sorted(pid for pid in self.members if not self.table.processes[pid].is_zombie)

    @property
    def zombies(self) -> list[int]:
        return sorted(pid for pid in self.members if self.table.processes[pid].is_zombie)

    @property
    def leader_running(self) -> bool:
        """The run's main process is alive and proven to be it."""
        recorded = self.identity.leader
        leader = self.table.processes.get(recorded.pid) if recorded is not None else None
        return recorded is not None and recorded.matches(leader) and leader.pid in self.members and not leader.is_zombie

    def unreapable_zombies(self) -> list[int]:
        """Zombies whose parent is neither a live member nor the live supervisor: nobody of ours reaps them."""
        ours = set(self.live)
        if self.supervisor_alive and self.identity.supervisor_pid:
            ours.add(self.identity.supervisor_pid)
        return [pid for pid in self.zombies if self.table.processes[pid].ppid not in ours]

    def gone(self) -> bool:
        """Nothing of the job runs, every zombie it left has been reaped, the supervisor has exited
        or has no child left (it exits, or, where nothing could reap it, waits idle for the next run)."""
        waiting_zombies = set(self.zombies) - set(self.unreapable_zombies())
        supervisor_done = (not self.supervisor_alive or self.supervisor_idle
                           or not self.table.children.get(self.identity.supervisor_pid or 0))
        return not self.live and not waiting_zombies and supervisor_done

    def waited_for(self) -> list[int]:
        """Children of the live supervisor that are not members (another proven job's): it waits for them."""
        if not self.supervisor_alive or self.supervisor_idle:
            return []
        return sorted(set(self.table.children.get(self.identity.supervisor_pid or 0, ())) - self.members)

    def describe(self, pids: list[int], gate: SignalGate | None = None) -> list[dict]:
        described = []
        for pid in pids:
            process = self.table.processes[pid]
            entry = {"pid": pid, "ppid": process.ppid, "state": process.state, "comm": process.comm}
            refusal = gate.refusal(pid) if gate is not None else None
            if refusal is not None:
                entry["protected"] = refusal
            described.append(entry)
        return described

    def gate(self, control: ProcessControl | None = None) -> SignalGate:
        return stop_gate(self.table, control)


def _other_jobs(table: ProcessTable, job_dir: str) -> Any:
    """The proof of other jobs (``_reap/other_jobs.py``, which builds on this module: imported here)."""
    from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.other_jobs import OtherJobs  # pylint: disable=import-outside-toplevel
    return OtherJobs(table, job_dir)


def _descent(table: ProcessTable, identity: JobIdentity) -> tuple[set[int], list[dict[str, Any]]]:
    """The proven supervisor's descendants, less every subtree of another proven job; and the
    members whose marks name another job all the same (conflicts).

    A second train_launch job started from inside this one has its own supervisor (or run) below
    this supervisor: where that job is proven - its records believed, the recorded supervisor or
    run alive and carrying its mark - it and what it started are that job's. A mark alone proves
    nothing: a process that rewrites its environment to name another job (or this job's directory
    spelled otherwise) is still this job's, and the conflict is reported.
    """
    others = _other_jobs(table, identity.job_dir)
    found: set[int] = set()
    conflicts: list[dict[str, Any]] = []
    pending = list(table.children.get(identity.supervisor_pid or 0, ()))
    while pending:
        pid = pending.pop()
        if pid in found:
            continue
        head = others.head(pid)
        if head is not None and not same_directory(head.job_dir, identity.job_dir):
            continue
        found.add(pid)
        marked = others.marked_otherwise(pid, identity.job_dir)
        if marked is not None:
            process = table.processes[pid]
            conflicts.append({"pid": pid, "comm": escape_controls(process.comm),
                              "marked_job_dir": escape_controls(marked),
                              "reason": "its marks name another job, but it descends from this job's proven supervisor: "
                                        "this job's"})
        pending.extend(table.children.get(pid, ()))
    return found, sorted(conflicts, key=lambda entry: entry["pid"])


def _marked_members(table: ProcessTable, identity: JobIdentity) -> set[int]:
    """Processes that did not start before the run and carry its mark or run in its unit's control group."""
    floor = identity.starttime or 0
    groups = unit_control_groups(table.proc_root, identity.unit) if identity.unit else frozenset()
    return {
        pid for pid, process in table.processes.items()
        # Cheap tests first: the environment is read only of live processes not older than the run.
        if process.starttime >= floor and not process.is_zombie and (
            _marked(table, process, identity)
            or (groups and _in_control_group(table, process, groups)))
    }


def _ignored(table: ProcessTable, identity: JobIdentity, members: set[int], supervisor_alive: bool) -> list[dict]:
    """Recorded pids that name a live process which failed the proof: reported, never signalled.

    A process proven a member some other way is not reported, whatever role the record gave it.
    """
    ignored = []
    for role, pid, starttime, proven in (
        ("pid", identity.pid, identity.starttime, False),
        ("supervisor_pid", identity.supervisor_pid, identity.supervisor_starttime, supervisor_alive),
    ):
        process = table.processes.get(pid or 0)
        if process is None or proven or process.pid in members or process.is_zombie:
            continue
        mark = "this run's mark" if role == "pid" else "the mark of this job's supervisor"
        why = ("its start time differs from the record's: the pid was reused"
               if not Identity(process.pid, starttime).matches(process) else f"it does not carry {mark}")
        ignored.append({"record": role, "pid": process.pid, "comm": process.comm,
                        "reason": f"not this run's process: {why}; ignored"})
    return ignored


def look(identity: JobIdentity, proc_root: str = "/proc",
         supervisor_idle: Callable[[], bool] = lambda: False) -> TreeView:
    """Scan the process table and prove the run's members (`supervisor_idle`: it said so).

    Membership is proven by start times, marks, control groups and descent, never by arguments: a
    process's command line is read only when something asks for it (the gate's protected patterns,
    of a member about to be signalled; the incident record), proven by its start time then.
    """
    return prove(ProcessTable.scan(proc_root, cmdlines=False), identity, supervisor_idle)


def prove(table: ProcessTable, identity: JobIdentity,
          supervisor_idle: Callable[[], bool] = lambda: False) -> TreeView:
    """The run's members in `table`: the one proof of membership, for the stop path and for liveness.

    A member did not start before the run and carries the run's mark or runs in its systemd unit's
    control group, or it descends from the run's supervisor, proven by its own mark and its start
    time, whatever its environment.
    """
    members = _marked_members(table, identity)
    supervisor_alive = proven_supervisor(table, identity.supervisor, identity.job_dir)
    conflicts: list[dict[str, Any]] = []
    if supervisor_alive:
        descendants, conflicts = _descent(table, identity)
        members.update(descendants)
    idle = supervisor_alive and supervisor_idle()
    return TreeView(table, identity, members, supervisor_alive, idle,
                    _ignored(table, identity, members, supervisor_alive), conflicts)


@dataclass
class StopOutcome:
    """What stopping the tree took."""

    signalled: list[int] = field(default_factory=list)
    escalated: bool = False
    gone: bool = True
    remaining: list[dict] = field(default_factory=list)
    unreapable_zombies: list[dict] = field(default_factory=list)
    ignored: list[dict] = field(default_factory=list)
    mark_conflicts: list[dict] = field(default_factory=list)

    def note_conflicts(self, view: TreeView) -> None:
        known = {entry["pid"] for entry in self.mark_conflicts}
        self.mark_conflicts.extend(entry for entry in view.mark_conflicts if entry["pid"] not in known)


def _send(view: TreeView, gate: SignalGate, signum: signal.Signals, sent: set[tuple[int, int]],
          outcome: StopOutcome) -> None:
    """`signum` to every live member not yet sent it, each by identity through the gate."""
    for pid in view.live:
        identity = Identity.of(view.table.processes[pid])
        if identity.key in sent:
            continue
        result = gate.send(identity, signum)
        if result == REFUSED:
            continue  # reported with the remaining processes if it outlives the deadline
        sent.add(identity.key)
        if result == SENT:
            outcome.escalated = outcome.escalated or signum == signal.SIGKILL
            if pid not in outcome.signalled:
                outcome.signalled.append(pid)


def stop_tree(identity: JobIdentity, term_timeout: float, proc_root: str = "/proc",
              kill_wait: float = KILL_WAIT, supervisor_idle: Callable[[], bool] = lambda: False,
              control: ProcessControl | None = None) -> StopOutcome:
    """SIGTERM, wait up to term_timeout, SIGKILL, wait up to kill_wait; report what remains.

    Members that appear while we wait (forked after a scan) get the current signal at the next poll.
    `control` stands in for the kernel's signalling primitives in tests.
    """
    outcome = StopOutcome()
    view = look(identity, proc_root, supervisor_idle)
    outcome.ignored = view.ignored
    outcome.note_conflicts(view)
    for signum, seconds in ((signal.SIGTERM, term_timeout), (signal.SIGKILL, kill_wait)):
        if view.gone():
            return _finish(view, outcome)
        sent: set[tuple[int, int]] = set()
        deadline = Deadline(seconds)
        while True:
            gate = view.gate(control)
            _send(view, gate, signum, sent, outcome)
            if view.live and all(gate.refusal(pid) for pid in view.live):
                break  # only protected processes are left: waiting cannot change that
            if deadline.expired():
                break
            deadline.pause(POLL_INTERVAL)
            view = look(identity, proc_root, supervisor_idle)
            outcome.note_conflicts(view)
            if view.gone():
                return _finish(view, outcome)
    outcome.gone = view.gone()
    if not outcome.gone:
        left = view.live + sorted(set(view.zombies) - set(view.unreapable_zombies()))
        outcome.remaining = view.describe(left, view.gate())
        # The supervisor exits only when its last child has: one of another proven job keeps it.
        for entry in view.describe(view.waited_for()):
            head = _other_jobs(view.table, identity.job_dir).head(entry["pid"])
            entry["waited_for_by_supervisor"] = (f"not this job's: {head.why()}" if head is not None
                                                 else "a child of the supervisor that is not this job's")
            outcome.remaining.append(entry)
    return _finish(view, outcome)


def _finish(view: TreeView, outcome: StopOutcome) -> StopOutcome:
    outcome.unreapable_zombies = view.describe(view.unreapable_zombies())
    return outcome
