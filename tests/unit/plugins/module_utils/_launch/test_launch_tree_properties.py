"""Property test of the launch stop path: random records and process forests, never a signal outside
the proven members.

Each example writes a fixture /proc tree (stat, cmdline, environ) with: processes carrying this
run's mark, another run's mark or none; start times before and after the run; a supervisor that is
real, an impostor without its mark, or a recycled pid; PID 1, sshd, and processes in this test's own
process group. The record (run.json) then says anything at all: a pid and start time of any of
them, pid 1, numbers that name nothing. Signals go to a recording stand-in for the kernel that may
also recycle the pid at the worst moment (between pinning it and checking its start time).

The oracle restates the membership rule from the module's documentation, written independently of
launch_tree.py. Examples are derandomized, so CI runs the same ones every time.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import (
    RUN_MARK,
    SUPERVISOR_MARK,
    run_mark,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import JobIdentity, leader_alive, stop_tree
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import ProcessControl
from tests.harness.fakeproc import FakeProc

JOB_DIR = "/var/lib/gpuops/job"
RUN_ID = "this-run"
RUN_START = 5000
CI = settings(max_examples=300, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Spec:
    pid: int
    ppid: int
    starttime: int
    mark: str | None       # RUN_MARK value, if any
    supervisor: bool       # carries SUPERVISOR_MARK=JOB_DIR
    comm: str
    pgid: int
    zombie: bool


MARKS = st.sampled_from([run_mark(JOB_DIR, RUN_ID), run_mark(JOB_DIR, "older-run"),
                         run_mark("/elsewhere/job", RUN_ID), None])
COMMS = st.sampled_from(["python3", "python3", "sleep", "sshd", "systemd", "torchrun"])


@st.composite
def forests(draw):
    count = draw(st.integers(min_value=1, max_value=14))
    specs = [Spec(1, 0, 10, None, False, "init", 1, False)]
    own_group = os.getpgrp()
    for pid in range(2, count + 2):
        ppid = draw(st.sampled_from([spec.pid for spec in specs]))
        parent_start = next(spec.starttime for spec in specs if spec.pid == ppid)
        starttime = draw(st.integers(min_value=parent_start, max_value=RUN_START + 500))
        pgid = draw(st.sampled_from([pid, ppid, own_group]))
        specs.append(Spec(pid, ppid, starttime, draw(MARKS), draw(st.booleans()) and draw(st.booleans()),
                          draw(COMMS), pgid, draw(st.integers(0, 9)) == 0))
    pids = [spec.pid for spec in specs] + [4242]  # 4242 names nothing
    by_pid = {spec.pid: spec for spec in specs}

    def recorded(name_pid: str, name_start: str) -> dict:
        pid = draw(st.sampled_from(pids + [None]))
        real = by_pid[pid].starttime if pid in by_pid else RUN_START
        return {name_pid: pid, name_start: draw(st.sampled_from([real, real + 1, RUN_START]))}

    record = {"run_id": RUN_ID, **recorded("pid", "starttime"), **recorded("supervisor_pid", "supervisor_starttime")}
    recycle = draw(st.sets(st.sampled_from(pids), max_size=3))
    survives_term = draw(st.sets(st.sampled_from(pids), max_size=4))
    return specs, record, recycle, survives_term


class RecordingKernel(ProcessControl):
    """Signals land here, never in the real kernel: each is recorded, and ends the fixture process
    (unless it survives SIGTERM). A pid in `recycle` is taken by a stranger when the gate pins it."""

    def __init__(self, fake: FakeProc, specs: dict[int, Spec], recycle: set[int], survives_term: set[int]) -> None:
        super().__init__(str(fake.root), use_pidfd=True)
        self.use_pidfd = True
        self.fake = fake
        self.specs = specs
        self.recycle = set(recycle)
        self.survives_term = survives_term
        self.delivered: list[tuple[int, int, signal.Signals]] = []

    def _open(self, pid: int) -> tuple[int, int]:
        process = self.look(pid)
        if process is None:
            raise ProcessLookupError(pid)
        handle = (pid, process.starttime)
        if pid in self.recycle:
            self.recycle.discard(pid)
            write(self.fake, Spec(pid, 1, process.starttime + 7, None, False, "stranger", pid, False))
        return handle

    def _signal_handle(self, handle: tuple[int, int], sig: signal.Signals) -> None:
        pid, starttime = handle
        process = self.look(pid)
        if process is None or process.starttime != starttime:
            raise ProcessLookupError(pid)
        self.delivered.append((pid, starttime, sig))
        if sig == signal.SIGKILL or pid not in self.survives_term:
            shutil.rmtree(self.fake.root / str(pid))

    def _close(self, handle: tuple[int, int]) -> None:
        pass

    def _kill(self, pid: int, sig: signal.Signals) -> None:
        raise AssertionError("the pidfd path is the one under test")


# What the kernel executed for each comm (/proc/PID/exe): protection judges sshd and systemd by it.
EXECUTABLES = {"sshd": "/usr/sbin/sshd", "systemd": "/usr/lib/systemd/systemd"}


def write(fake: FakeProc, spec: Spec) -> None:
    directory = fake.add(spec.pid, spec.comm, state="Z" if spec.zombie else "S", ppid=spec.ppid, pgid=spec.pgid,
                         starttime=spec.starttime, cmdline=[] if spec.zombie else [spec.comm, "--x"],
                         exe=None if spec.zombie else EXECUTABLES.get(spec.comm, f"/usr/bin/{spec.comm}"))
    env = [] if spec.zombie else ["PATH=/usr/bin"]
    if spec.mark is not None and not spec.zombie:
        env.append(f"{RUN_MARK}={spec.mark}")
    if spec.supervisor and not spec.zombie:
        env.append(f"{SUPERVISOR_MARK}={JOB_DIR}")
    (directory / "environ").write_bytes(b"".join(entry.encode() + b"\0" for entry in env))


def members_by_rule(specs: dict[int, Spec], record: dict) -> set[int]:
    """The rule, restated: this run's mark and no earlier start, or descent from the proven supervisor."""
    floor = record["starttime"] if isinstance(record.get("starttime"), int) else 0
    members = {pid for pid, spec in specs.items()
               if not spec.zombie and spec.mark == run_mark(JOB_DIR, RUN_ID) and spec.starttime >= floor}
    supervisor = specs.get(record.get("supervisor_pid") or 0)
    if (supervisor is not None and supervisor.supervisor and not supervisor.zombie
            and supervisor.starttime == record.get("supervisor_starttime")):
        pending = [supervisor.pid]
        while pending:
            parent = pending.pop()
            for spec in specs.values():
                if spec.ppid == parent and spec.pid != parent:
                    members.add(spec.pid)
                    pending.append(spec.pid)
    return members


def proven_members(specs: dict[int, Spec], record: dict) -> set[tuple[int, int]]:
    """The members by the rule, never PID 1, this process's group, or a protected program (sshd, systemd)."""
    return {
        (pid, specs[pid].starttime) for pid in members_by_rule(specs, record)
        if pid != 1 and specs[pid].pgid != os.getpgrp() and specs[pid].comm not in ("sshd", "systemd")
        and not specs[pid].zombie
    }


@CI
@given(forests())
def test_the_stop_path_signals_only_proven_members(example) -> None:
    specs, record, recycle, survives_term = example
    with tempfile.TemporaryDirectory(prefix="gpuops-fakeproc-") as root:
        fake = FakeProc(Path(root))
        for spec in specs:
            write(fake, spec)
        by_pid = {spec.pid: spec for spec in specs}
        kernel = RecordingKernel(fake, by_pid, recycle, survives_term)
        identity = JobIdentity.from_run(record, JOB_DIR)
        outcome = stop_tree(identity, term_timeout=0, proc_root=root, kill_wait=0, control=kernel)
        allowed = proven_members(by_pid, record)
        delivered = {(pid, starttime) for pid, starttime, _sig in kernel.delivered}
        assert delivered <= allowed, (delivered - allowed, record)
        assert set(outcome.signalled) <= {pid for pid, _start in allowed}
        assert 1 not in outcome.signalled
        for entry in outcome.ignored:
            assert (entry["pid"], by_pid[entry["pid"]].starttime) not in delivered


@CI
@given(forests())
def test_the_leader_is_alive_exactly_when_it_is_a_proven_member(example) -> None:
    """Liveness and the stop path share one proof: a leader that lost the mark (``exec env -i``) is
    alive below its proven supervisor; a recorded pid with another start time, a zombie, or a process
    neither marked nor below the proven supervisor is not the run's leader."""
    specs, record, _recycle, _survives_term = example
    by_pid = {spec.pid: spec for spec in specs}
    leader = by_pid.get(record["pid"] or 0)
    expected = (leader is not None and not leader.zombie and leader.starttime == record["starttime"]
                and leader.pid in members_by_rule(by_pid, record))
    with tempfile.TemporaryDirectory(prefix="gpuops-fakeproc-") as root:
        fake = FakeProc(Path(root))
        for spec in specs:
            write(fake, spec)
        assert leader_alive(JobIdentity.from_run(record, JOB_DIR), root) is expected, record


# Below the proven supervisor (2): a child whose mark names a job nobody can prove (3), one whose mark
# spells this job's directory otherwise (4), and a grandchild of the first (5).
MARKED_OTHERWISE = (
    [Spec(1, 0, 10, None, False, "init", 1, False), Spec(2, 1, RUN_START, None, True, "python3", 2, False),
     Spec(3, 2, RUN_START + 1, run_mark("/elsewhere/job", RUN_ID), False, "python3", 3, False),
     Spec(4, 2, RUN_START + 2, run_mark("/" + JOB_DIR, RUN_ID), False, "python3", 4, False),
     Spec(5, 3, RUN_START + 3, None, False, "sleep", 3, False)],
    {"run_id": RUN_ID, "pid": None, "starttime": RUN_START, "supervisor_pid": 2, "supervisor_starttime": RUN_START},
    set(), set())


@CI
@given(forests())
@example(MARKED_OTHERWISE)
def test_the_stop_path_signals_every_proven_member(example) -> None:
    """And the other half: no proven member escapes. A process below the proven supervisor whose
    mark names another job that nobody can prove (no records: ``/elsewhere/job``) is this job's;
    only a recycled pid (a stranger by the time it is pinned) is not signalled."""
    specs, record, recycle, _survives_term = example
    with tempfile.TemporaryDirectory(prefix="gpuops-fakeproc-") as root:
        fake = FakeProc(Path(root))
        for spec in specs:
            write(fake, spec)
        by_pid = {spec.pid: spec for spec in specs}
        kernel = RecordingKernel(fake, by_pid, recycle, set())
        stop_tree(JobIdentity.from_run(record, JOB_DIR), term_timeout=0, proc_root=root, kill_wait=0, control=kernel)
        delivered = {(pid, starttime) for pid, starttime, _sig in kernel.delivered}
        expected = {(pid, start) for pid, start in proven_members(by_pid, record) if pid not in recycle}
        assert expected <= delivered, (expected - delivered, record)
