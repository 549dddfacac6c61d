"""Another job's processes are left out of a selection, proven by their mark or their supervisor,
and only where the job's records can be believed (issue 17, item 2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import signal_gate
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import JobSelector, Protection
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Verdict
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import RUN_MARK, SUPERVISOR_MARK, run_mark
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.other_jobs import (
    RUN_MARK_PROOF,
    RUN_PROOF,
    SUPERVISOR_PROOF,
    OtherJobs,
    own_job_dir,
    trustworthy_job_dir,
)
from tests.harness.fakeproc import FakeProc

SCRIPT = ["python3", "/w/run/train.py"]
RUN_A = "a1b2"


def job_dir(state: Path, name: str, run: dict | None = None, idle: dict | None = None, mode: int = 0o700) -> str:
    directory = state / name
    directory.mkdir(parents=True)
    directory.chmod(mode)
    if run is not None:
        (directory / "run.json").write_text(json.dumps(run), encoding="utf-8")
    if idle is not None:
        (directory / "idle.json").write_text(json.dumps(idle), encoding="utf-8")
    return str(directory)


@pytest.fixture
def host(tmp_path):
    """Job A (supervisor 20, leader 21 with a worker 22, and 23 that cleared its environment) and
    job B's old run (30, 31), both running the same script; the module is 900."""
    proc, state = FakeProc(tmp_path / "proc"), tmp_path / "state"
    a = job_dir(state, "a", run={"run_id": RUN_A, "pid": 21, "starttime": 2100, "supervisor_pid": 20,
                                 "supervisor_starttime": 2000})
    b = job_dir(state, "b", run={"run_id": "b0", "pid": 31, "starttime": 3100, "supervisor_pid": 30,
                                 "supervisor_starttime": 3000})
    proc.add(1, "init", ppid=0, cmdline=["/sbin/init"])
    proc.add(20, "python3", cmdline=["python3", "-I", f"{a}/supervisor.py", "run", a], starttime=2000,
             environ={SUPERVISOR_MARK: a})
    proc.add(21, "python3", ppid=20, cmdline=SCRIPT, starttime=2100, environ={RUN_MARK: run_mark(a, RUN_A)})
    proc.add(22, "python3", ppid=21, pgid=21, cmdline=SCRIPT + ["--worker"], starttime=2200,
             environ={RUN_MARK: run_mark(a, RUN_A)})
    proc.add(23, "python3", ppid=21, pgid=21, cmdline=SCRIPT + ["--env-i"], starttime=2300, environ={})
    proc.add(30, "python3", cmdline=["python3", "-I", f"{b}/supervisor.py", "run", b], starttime=3000,
             environ={SUPERVISOR_MARK: b})
    proc.add(31, "python3", ppid=30, cmdline=SCRIPT, starttime=3100, environ={RUN_MARK: run_mark(b, "b0")})
    proc.add(900, "python3", cmdline=["python3", "AnsiballZ_zombie_reap.py"], starttime=9000)
    return str(proc.root), a, b, tmp_path


def select(root: str, own: str | None, match=(r"/w/run/train\.py",), pids=(), expect: str | None = None
           ) -> tuple[set[int], OtherJobs]:
    table = ProcessTable.scan(root)
    others = OtherJobs(table, own, expect_run_id=expect)
    selector = JobSelector.from_options(list(match), list(pids), True)
    return selector.select(table, Protection(table, (), own_pid=900), spared=others.reason), others


def test_the_selection_for_b_leaves_a_alone_and_says_whose_they_are(host):
    root, a, b, _tmp = host
    job, others = select(root, b)
    assert job == {31}
    claimed = others.claimed
    assert set(claimed) == {21, 22, 23}
    assert claimed[21].job_dir == a and claimed[21].run_id == RUN_A and claimed[21].proof == RUN_MARK_PROOF
    # 23 cleared its environment: its descent from A's proven supervisor gives it away.
    assert claimed[23].proof == SUPERVISOR_PROOF and claimed[23].supervisor_pid == 20
    assert others.reason(21) == f"belongs to the job {a} (run {RUN_A}): it carries that run's mark"
    assert [(e["pid"], e["job_dir"], e["proof"]) for e in others.report()] == [
        (21, a, RUN_MARK_PROOF), (22, a, RUN_MARK_PROOF), (23, a, SUPERVISOR_PROOF)]
    verdict = Verdict()
    others.add_findings(verdict)
    (finding,) = verdict.findings
    assert finding.kind == "other_job" and finding.pids == (21, 22, 23) and a in finding.why


def test_without_a_job_name_every_proven_job_is_left_alone(host):
    root, _a, _b, _tmp = host
    job, others = select(root, None)
    assert job == set() and set(others.claimed) == {21, 22, 23, 31}


def test_a_supervisor_named_by_the_pattern_is_its_job_s_and_shields_its_tree(host):
    root, a, b, _tmp = host
    job, others = select(root, b, match=[r"supervisor\.py run"])
    assert job == {30, 31}  # B's own supervisor and job
    assert others.claimed[20].proof == SUPERVISOR_PROOF and others.claimed[20].job_dir == a


@pytest.mark.parametrize("lie,left_to_a,selected", [
    ("wrong run", {21: SUPERVISOR_PROOF, 22: SUPERVISOR_PROOF, 23: SUPERVISOR_PROOF}, {24, 31}),
    ("started before the run", {21: SUPERVISOR_PROOF, 22: SUPERVISOR_PROOF, 23: SUPERVISOR_PROOF}, {24, 31}),
    ("no record", {}, {21, 22, 23, 24, 31}),
    # 23 cleared its environment, but descends from A's run, proven by its record and its mark.
    ("recycled supervisor", {21: RUN_MARK_PROOF, 22: RUN_MARK_PROOF, 23: RUN_PROOF, 24: RUN_MARK_PROOF}, {31}),
])
def test_a_mark_or_a_supervisor_the_records_do_not_confirm_proves_nothing(host, lie, left_to_a, selected):
    root, a, b, _tmp = host
    # 24 carries A's mark but is no descendant of A's supervisor (its own parent has gone).
    FakeProc(Path(root)).add(24, "python3", cmdline=SCRIPT + ["--orphan"], starttime=2400,
                             environ={RUN_MARK: run_mark(a, RUN_A)})
    record = Path(a) / "run.json"
    run = json.loads(record.read_text(encoding="utf-8"))
    if lie == "wrong run":
        run["run_id"] = "later"
    elif lie == "started before the run":
        run["starttime"] = 2450  # 24 started before it: it cannot carry its mark
    elif lie == "recycled supervisor":
        run["supervisor_starttime"] = 1999
    record.write_text(json.dumps(run), encoding="utf-8")
    if lie == "no record":
        record.unlink()
    job, others = select(root, b)
    assert job == selected
    assert {pid: claim.proof for pid, claim in others.claimed.items()} == left_to_a


def test_records_are_believed_only_where_nobody_else_could_have_written_them(host):
    root, a, b, tmp = host
    # A directory anyone may write, and a path through a symlink to A's real directory.
    loose = job_dir(tmp / "state", "loose", run={"run_id": "x", "pid": 21, "starttime": 0}, mode=0o777)
    (tmp / "link").symlink_to(tmp / "state")
    through_link = str(tmp / "link" / "a")
    assert trustworthy_job_dir(a)
    assert not trustworthy_job_dir(loose)
    assert not trustworthy_job_dir(through_link)
    assert not trustworthy_job_dir("relative/a") and not trustworthy_job_dir(a + "/../a")
    # A tight directory below one that others may rename in: they could swap it for their own.
    open_parent = tmp / "shared"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    assert not trustworthy_job_dir(job_dir(open_parent, "tight"))
    open_parent.chmod(0o1777)  # sticky, like /tmp: only the entry's owner may rename it
    assert trustworthy_job_dir(str(open_parent / "tight"))
    proc = FakeProc(Path(root))
    proc.add(40, "python3", cmdline=SCRIPT + ["--spoof"], starttime=4000, environ={RUN_MARK: run_mark(loose, "x")})
    proc.add(41, "python3", cmdline=SCRIPT + ["--spoof"], starttime=4100, environ={RUN_MARK: run_mark(through_link, RUN_A)})
    job, _others = select(root, b)
    assert {40, 41} <= job


def test_only_the_selection_s_processes_and_their_ancestors_are_read(host, monkeypatch):
    root, _a, b, _tmp = host
    read: list[int] = []
    real = signal_gate.read_environ_value

    def counting(proc_root: str, pid: int, name: str):
        read.append(pid)
        return real(proc_root, pid, name)

    monkeypatch.setattr(signal_gate, "read_environ_value", counting)
    proc = FakeProc(Path(root))
    for pid in range(100, 140):  # bystanders the selection does not name
        proc.add(pid, "sleep", cmdline=["sleep", "1000"], environ={})
    job, _others = select(root, b, match=[r"--worker"])
    assert job == set()
    assert set(read) <= {22, 21, 20}, read


def test_own_job_dir_is_checked_naming_the_option():
    checks = OptionChecks()
    assert own_job_dir({"job_name": None, "job_state_dir": "/var/lib/gpuops"}, checks) is None
    assert own_job_dir({"job_name": "train", "job_state_dir": "/var/lib/gpuops/"}, checks) == "/var/lib/gpuops/train"
    assert checks.problems == []
    assert own_job_dir({"job_name": "../etc", "job_state_dir": "/var/lib/gpuops"}, checks) is None
    assert own_job_dir({"job_name": "t", "job_state_dir": "state"}, checks) is None
    assert [p.option for p in checks.problems] == ["job_name", "job_state_dir"]
    assert "'../etc' is not a train_launch job name" in checks.problems[0].reason
    assert os.sep not in "train"


# --- issue 24, item 4: what a process says about itself never outranks its ancestry --------------

def test_a_mark_that_spells_the_own_job_dir_otherwise_is_the_own_job(host):
    """``//tmp/.../a`` is the directory ``/tmp/.../a``: a worker of A whose mark spells it so is A's."""
    root, a, b, _tmp = host
    spelled = "/" + a  # POSIX keeps a leading "//" through normpath
    FakeProc(Path(root)).add(26, "python3", ppid=21, pgid=21, cmdline=SCRIPT + ["--respelled"], starttime=2600,
                             environ={RUN_MARK: run_mark(spelled, RUN_A), SUPERVISOR_MARK: spelled})
    assert not trustworthy_job_dir(spelled)
    job, others = select(root, a)
    assert 26 in job and 26 not in others.claimed


def test_a_worker_of_a_carrying_b_s_marks_is_a_s_and_the_conflict_is_a_finding(host):
    """Both jobs run as one user, so A's worker can copy B's environment: its ancestry (A's proven
    supervisor) says A, its marks say B. It is A's for A's clean-up, and A's (left alone) for B's."""
    root, a, b, _tmp = host
    FakeProc(Path(root)).add(25, "python3", ppid=21, pgid=21, cmdline=SCRIPT + ["--copied"], starttime=3200,
                             environ={RUN_MARK: run_mark(b, "b0"), SUPERVISOR_MARK: b})
    job, others = select(root, a)
    assert 25 in job and 25 not in others.claimed
    verdict = Verdict()
    others.add_findings(verdict)
    (conflict,) = [f for f in verdict.findings if f.kind == "mark_conflict"]
    assert conflict.pids == (25,) and conflict.escalation.value == "signals"
    assert b in conflict.why and a in conflict.why
    # B's clean-up leaves it to A, naming the conflict too.
    job_b, others_b = select(root, b)
    assert job_b == {31} and others_b.claimed[25].job_dir == a
    verdict_b = Verdict()
    others_b.add_findings(verdict_b)
    assert [f.pids for f in verdict_b.findings if f.kind == "mark_conflict"] == [(25,)]


# --- the run-id fence: a selection for an older run of its job leaves the job's newer live run alone --------------

def test_a_selection_for_an_older_run_leaves_the_newer_live_run_alone(host):
    """Two relaunch runs at once: B's clean-up is for run "old" (what its look saw), A has since started RUN_A
    (supervisor 20, leader 21). A's run - its proven supervisor and everything below it, 23 without any mark
    included - is left alone and reported; a leftover of the old run (40, orphaned to init) is still taken."""
    root, a, _b, _tmp = host
    FakeProc(Path(root)).add(40, "python3", cmdline=SCRIPT + ["--old-worker"], starttime=1500,
                             environ={RUN_MARK: run_mark(a, "old")})
    job, others = select(root, a, expect="old")
    assert job == {40}
    assert {pid: (claim.newer_run, claim.run_id, claim.proof) for pid, claim in others.claimed.items()} == {
        21: (True, RUN_A, SUPERVISOR_PROOF), 22: (True, RUN_A, SUPERVISOR_PROOF), 23: (True, RUN_A, SUPERVISOR_PROOF),
        31: (False, "b0", RUN_MARK_PROOF)}  # B's, another job, as without the fence
    assert others.superseded() == {"run_id": RUN_A, "pid": 21, "starttime": 2100}
    assert [(entry["pid"], entry["newer_run"], entry["job_dir"]) for entry in others.report()] == [
        (21, True, a), (22, True, a), (23, True, a), (31, False, _b)]
    verdict = Verdict()
    others.add_findings(verdict)
    assert [(str(f.kind), f.escalation.value, list(f.pids)) for f in verdict.findings] == [
        ("other_job", "none", [31]), ("other_job", "none", [21, 22, 23])]
    assert "this job's newer run a1b2, started meanwhile by another run" in verdict.findings[1].why
    # "" (the look saw no run): any live run is newer.
    job, others = select(root, a, expect="")
    assert job == {40} and others.superseded()["run_id"] == RUN_A


@pytest.mark.parametrize("expect", [RUN_A, None])
def test_the_expected_run_or_no_fence_is_the_selection_s_as_before(host, expect):
    root, a, _b, _tmp = host
    job, others = select(root, a, expect=expect)
    assert job == {21, 22, 23} and set(others.claimed) == {31} and others.superseded() is None


def test_a_newer_run_that_does_not_run_is_no_newer_run(host):
    """The recorded run ended (its leader is gone): nothing of it to protect, the selection takes what is left."""
    root, a, _b, _tmp = host
    shutil.rmtree(Path(root) / "21")
    job, others = select(root, a, expect="old")
    assert others.superseded() is None and job == {22, 23}


def test_the_fence_believes_only_records_nobody_else_could_have_written(host):
    root, a, _b, _tmp = host
    Path(a).chmod(0o777)
    job, others = select(root, a, expect="old")
    assert others.superseded() is None and job == {21, 22, 23}
