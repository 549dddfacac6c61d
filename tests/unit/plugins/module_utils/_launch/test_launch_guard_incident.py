"""_launch/guard.py and _launch/incident.py: the crash-loop guard's count, the incident records."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import (
    CAUSE_HARDWARE,
    Failure,
    RelaunchDelay,
    RelaunchGuard,
    counts,
    history_entries,
    lifetime_record,
    relaunch_entry,
    with_relaunch,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.incident import (
    existing_incident,
    py_spy_dumps,
    thread_evidence,
    write_incident,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from tests.harness.clock import FakeClock
from tests.harness.fakeproc import FakeProc


def test_the_guard_counts_within_the_window() -> None:
    guard = RelaunchGuard(2, 100.0)
    history = [{"at": 0.0}, {"at": 50.0}]
    assert guard.allows(history, 99.0) is False
    assert guard.allows(history, 100.0) is True  # the first has left the window
    report = guard.report(history, 120.0, needed=True)
    assert report["recent"] == 1 and report["would_refuse"] is False
    assert guard.report(history, 60.0, needed=False)["would_refuse"] is False  # nothing to refuse
    refusal = guard.refusal(guard.report(history, 60.0, needed=True), "crashed")
    assert "max_relaunches=2" in refusal and "relaunch_window=100s" in refusal and "2 times" in refusal


def _relaunched(guard: RelaunchGuard, history: list, now: float, failure: Failure) -> list:
    """The history after a relaunch now (as the executor writes it), or AssertionError if refused."""
    report = guard.report(history, now, True, failure)
    assert not report["would_refuse"], guard.refusal(report, "crashed")
    return history + [relaunch_entry(now, f"r{len(history)}", "crashed", report)]


def test_a_job_that_progressed_between_crashes_is_not_a_crash_loop() -> None:
    guard = RelaunchGuard(2, 3600.0)
    history: list = []
    for at, step in ((0.0, "500"), (10.0, "900"), (20.0, "1400"), (30.0, "2000")):
        history = _relaunched(guard, history, at, Failure(step))
    assert [entry["counted"] for entry in history] == [True, False, False, False]
    assert "got past step 1400" in history[-1]["why"]
    assert guard.report(history, 40.0, True, Failure("2000"))["would_refuse"] is False  # one counted, at step 2000
    # ... and then dies at the same step: counted again, and refused past the limit as today.
    history = _relaunched(guard, history, 40.0, Failure("2000"))
    report = guard.report(history, 50.0, True, Failure("2000"))
    assert report["recent"] == 2 and report["recent_all"] == 5 and report["would_refuse"] is True


def test_a_job_that_dies_at_the_same_step_is_refused_as_today() -> None:
    guard = RelaunchGuard(2, 3600.0)
    history = _relaunched(guard, [], 0.0, Failure("3"))
    history = _relaunched(guard, history, 10.0, Failure("3"))
    assert guard.report(history, 20.0, True, Failure("3"))["would_refuse"] is True
    assert guard.report(history, 20.0, True, Failure("2.5"))["would_refuse"] is True  # went back: no progress
    # No progress_regex (no step), a step that is no number: every failure counts, as before.
    assert counts(Failure(None), {"step": "3"})[0] is True
    assert counts(Failure("epoch-4"), {"step": "epoch-3"})[0] is True
    assert counts(Failure("nan"), {"step": "3"})[0] is True
    assert counts(Failure("4"), None)[0] is True


def test_a_failure_the_hardware_caused_is_not_counted() -> None:
    guard = RelaunchGuard(1, 3600.0)
    history = _relaunched(guard, [], 0.0, Failure("3"))
    assert guard.report(history, 5.0, True, Failure("3"))["would_refuse"] is True
    hardware = Failure("3", CAUSE_HARDWARE)
    report = guard.report(history, 5.0, True, hardware)
    assert report["would_refuse"] is False and report["counts"] is False and "hardware" in report["why"]
    history = _relaunched(guard, history, 5.0, hardware)
    assert history[-1]["cause"] == "hardware" and history[-1]["counted"] is False
    assert guard.report(history, 6.0, True, Failure("3"))["recent"] == 1


def test_entries_written_before_the_budget_knew_why_count() -> None:
    entries = history_entries({"relaunches": [{"at": 1.0, "counted": False, "why": "x", "junk": 1}, {"at": 2.0}]})
    assert entries == [{"at": 1.0, "counted": False, "why": "x"}, {"at": 2.0}]
    assert RelaunchGuard(1, 100.0).report(entries, 3.0, True)["recent"] == 1


def test_a_step_is_kept_bounded() -> None:
    entry = relaunch_entry(1.0, "r", "crashed", RelaunchGuard(1, 9.0).report([], 1.0, True, Failure("9" * 500)))
    assert len(entry["step"]) == 64


def test_a_job_that_keeps_failing_waits_longer_each_time() -> None:
    delay = RelaunchDelay(30.0, 100.0)
    assert [delay.seconds(n) for n in range(6)] == [0.0, 30.0, 60.0, 100.0, 100.0, 100.0]
    assert RelaunchDelay().seconds(5) == 0.0  # the default: no delay, today's behaviour
    assert RelaunchDelay(1.0, 86400.0).seconds(10 ** 6) == 86400.0  # no overflow
    guard = RelaunchGuard(None, 3600.0, delay)
    first = guard.report([], 0.0, True, Failure("3"))
    assert first["delay"] == 0.0 and first["wait"] == 0.0 and guard.not_before(first) is None
    history = _relaunched(guard, [], 0.0, Failure("3"))
    early = guard.report(history, 10.0, True, Failure("3"))
    assert early["delay"] == 30.0 and early["wait"] == 20.0 and early["due_at"] == 30.0
    assert "due 30s after the last one" in guard.not_before(early)
    due = guard.report(history, 30.0, True, Failure("3"))
    assert due["wait"] == 0.0 and guard.not_before(due) is None
    history = _relaunched(guard, history, 30.0, Failure("3"))
    assert guard.report(history, 31.0, True, Failure("3"))["due_at"] == 90.0  # doubled: 60s after the last
    # A relaunch that does not count (progress, hardware) is never delayed.
    assert guard.report(history, 31.0, True, Failure("4"))["wait"] == 0.0
    assert guard.report(history, 31.0, True, Failure("3", CAUSE_HARDWARE))["wait"] == 0.0
    assert guard.report(history, 31.0, False, Failure("3"))["wait"] == 0.0  # no relaunch needed


def test_no_limit_and_zero() -> None:
    assert RelaunchGuard(None, 10.0).allows([{"at": 1.0}] * 50, 2.0) is True
    assert RelaunchGuard(0, 10.0).allows([], 2.0) is False


def test_a_clock_set_back_does_not_reopen_the_gate() -> None:
    assert RelaunchGuard(1, 100.0).allows([{"at": 500.0}], 10.0) is False


def test_the_history_is_read_soundly_and_pruned() -> None:
    assert history_entries({"relaunches": [{"at": 2}, {"at": "x"}, "junk", {"at": True}, {"at": 1.5}]}) == [
        {"at": 1.5}, {"at": 2}]
    assert history_entries(None) == [] and history_entries({"relaunches": "no"}) == []
    updated = with_relaunch([{"at": 1.0}, {"at": 95.0}], {"at": 100.0}, 100.0, 10.0)
    assert updated == {"relaunches": [{"at": 95.0}, {"at": 100.0}]}


def test_the_lifetime_count_outlives_the_window_and_keeps_the_last_failure() -> None:
    guard = RelaunchGuard(3, 10.0)
    history: list = []
    lifetime = None
    for at, code, signal in ((0.0, 3, None), (50.0, None, "SIGKILL"), (100.0, 1, None)):
        entry = relaunch_entry(at, f"run{at:g}", "crashed", guard.report(history, at, True))
        history = with_relaunch(history, entry, at, 10.0)["relaunches"]
        lifetime = lifetime_record(lifetime, entry, {"exit_code": code, "exit_signal": signal})
    # The guard's window holds the last relaunch only; the job's life all three.
    assert len(history) == 1 and lifetime["relaunches"] == 3 and lifetime["first_at"] == 0.0
    assert lifetime["last_failure"] == {"at": 100.0, "at_iso": "1970-01-01T00:01:40+00:00", "run_id": "run100",
                                        "health": "crashed", "cause": "unknown", "step": None, "exit_code": 1,
                                        "exit_signal": None}
    # A record that is not sound starts the count again rather than failing the relaunch.
    assert lifetime_record({"relaunches": "many", "first_at": True}, entry, {})["relaunches"] == 1


def test_incident_records_one_per_run_newest_kept(tmp_path) -> None:
    job = str(tmp_path)
    paths = [write_incident(job, f"run{n}", {"n": n}, 1000.0 + n, keep=2)[0] for n in range(3)]
    assert sorted(os.listdir(tmp_path / "incidents")) == sorted(os.path.basename(p) for p in paths[1:])
    assert json.loads(open(paths[2], encoding="utf-8").read()) == {"n": 2}
    assert oct(os.stat(paths[2]).st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "incidents").st_mode & 0o777) == "0o700"
    assert existing_incident(job, "run2") == paths[2] and existing_incident(job, "run0") is None


def test_an_incident_directory_that_is_a_link_is_refused(tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "incidents").symlink_to(elsewhere)
    os.lchown(tmp_path / "job" / "incidents", 65534, 65534)  # a link another user than root could plant
    with pytest.raises(OSError, match="incidents is a symbolic link that a user other than root can change"):
        write_incident(str(tmp_path / "job"), "r", {}, 1.0, keep=5)
    assert existing_incident(str(tmp_path / "job"), "r") is None
    assert not os.listdir(elsewhere)


def test_threads_of_this_process_are_described() -> None:
    table = ProcessTable.scan()
    described = thread_evidence(table, [os.getpid(), 10 ** 7])
    assert [entry["pid"] for entry in described] == [os.getpid()]
    assert described[0]["threads"] and {"tid", "state", "wchan", "comm"} <= set(described[0]["threads"][0])


def test_py_spy_is_optional() -> None:
    assert py_spy_dumps([1], which=lambda name: None)["available"] is False


def test_py_spy_is_bounded_and_never_fails() -> None:
    clock = FakeClock()
    calls = []

    def run(argv, **kwargs):
        calls.append((argv, kwargs["timeout"]))
        if argv[-1] == "2":
            clock.now += 25
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        clock.now += 10  # the budget is spent after this one
        return subprocess.CompletedProcess(argv, 0, b"Thread 1 (idle)\n", b"")

    dumps = py_spy_dumps([3, 2, 5], which=lambda name: "/usr/bin/py-spy", run=run, clock=clock)["dumps"]
    assert calls[0] == (["/usr/bin/py-spy", "dump", "--pid", "2"], 10.0) and calls[1][1] == 5.0 and len(calls) == 2
    assert "did not answer" in dumps[0]["error"] and dumps[1]["stacks"] == "Thread 1 (idle)\n"
    assert "budget" in dumps[2]["error"]


def test_a_time_far_ahead_does_not_close_the_gate_for_ever_and_only_known_fields_are_kept() -> None:
    # A clock that jumped a year ahead once, or a record that lies: such entries do not count.
    assert RelaunchGuard(1, 100.0).allows([{"at": 10.0 + 366 * 86400}], 10.0) is True
    assert history_entries({"relaunches": [{"at": 1.0, "run_id": "r", "junk": "x" * 1000}]}) == [{"at": 1.0, "run_id": "r"}]


def test_the_evidence_names_a_process_held_still_in_words(tmp_path) -> None:
    """A frozen member (SIGSTOP: state T, its main thread in do_signal_stop) is named so; a running one is not."""
    proc = FakeProc(tmp_path)
    proc.add(1, "init", ppid=0)
    proc.add(40, "python3", state="T", starttime=4000)
    proc.add_thread(40, 40, "python3", state="T", wchan="do_signal_stop")
    proc.add(41, "python3", starttime=4100)
    proc.add_thread(41, 41, "python3", wchan="ep_poll")
    described = {entry["pid"]: entry for entry in thread_evidence(ProcessTable.scan(str(tmp_path)), [40, 41])}
    assert described[40]["frozen"].startswith("stopped by a signal (state T, wchan do_signal_stop")
    assert "frozen" not in described[41]
