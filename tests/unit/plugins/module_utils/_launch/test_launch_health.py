"""_launch/health.py: the last progress line, the bound on when it was written, and the verdict."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import (
    HealthReport,
    Progress,
    epoch_of,
    judge,
    last_progress,
    leader_stopped_state,
    measure,
    stopped_state,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import process_starttime
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import HEALTH_WORDS, Escalation, Health, worst

STEP = re.compile(r"^step (\d+) ")
RUN = {"run_id": "r1", "pid": 42, "started_at": "2026-12-03T10:00:00+00:00"}
START = epoch_of(RUN["started_at"])


def write(path, text: str, mtime: float | None = None) -> str:
    path.write_bytes(text.encode())
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return str(path)


def test_the_vocabulary_is_additive() -> None:
    assert HEALTH_WORDS == ("running", "stalled", "finished", "crashed", "missing", "stopped")
    assert worst([Escalation.SIGNALS, Escalation.CONTAINER_REBOOT]) is Escalation.CONTAINER_REBOOT
    assert [state.failed for state in Health] == [False, True, False, True, True, False]


def test_the_last_progress_line_and_what_follows_it(tmp_path) -> None:
    log = write(tmp_path / "log", "setup\nstep 1 a\nstep 2 b\nwarning\n\n")
    found = last_progress(log, STEP)
    assert found.step == "2" and found.line == "step 2 b" and found.trailing is True
    assert found.line_end == len("setup\nstep 1 a\nstep 2 b")
    quiet = last_progress(write(tmp_path / "q", "step 7 x\n  \n"), STEP)
    assert quiet.step == "7" and quiet.trailing is False


def test_lines_across_chunks_and_carriage_returns(tmp_path) -> None:
    text = "step 1 x\n" + "noise " * 50 + "\nstep 12 y\r" + "z" * 30 + "\n"
    found = last_progress(write(tmp_path / "log", text), STEP, chunk=7)
    assert found.step == "12" and found.line == "step 12 y" and found.trailing is True
    assert found.line_end == text.index("\r")


def test_the_search_is_bounded(tmp_path) -> None:
    found = last_progress(write(tmp_path / "log", "step 1 x\n" + "n\n" * 100), STEP, limit=50, chunk=16)
    assert found.line is None and found.whole is False


def test_no_group_reports_the_match_and_links_are_not_followed(tmp_path) -> None:
    assert last_progress(write(tmp_path / "log", "iter 5 ok\n"), re.compile(r"iter \d+")).step == "iter 5"
    (tmp_path / "link").symlink_to(tmp_path / "log")
    assert last_progress(str(tmp_path / "link"), STEP).readable is False
    assert last_progress(None, STEP).readable is False


def test_the_bound_is_the_log_mtime_when_nothing_follows(tmp_path) -> None:
    log = last_progress(write(tmp_path / "log", "step 3 x\n", START + 50), STEP)
    progress = measure(log, "r1", START, None, START + 100)
    assert progress.seen_at == START + 50 and progress.basis == "log_mtime"


def test_a_progress_record_of_the_same_line_tightens_the_bound(tmp_path) -> None:
    log = last_progress(write(tmp_path / "log", "step 3 x\nwarning\n", START + 90), STEP)
    record = Progress("3", "step 3 x", START + 20, "log_mtime", log.line_end).record("r1")
    assert measure(log, "r1", START, record, START + 100).seen_at == START + 20
    # Another run's record, or another line, is not this line.
    assert measure(log, "r2", START, record, START + 100).seen_at == START + 90
    assert measure(log, "r1", START, dict(record, line_end=1), START + 100).seen_at == START + 90


def test_before_the_first_step_the_start_counts(tmp_path) -> None:
    log = last_progress(write(tmp_path / "log", "loading\n", START + 80), STEP)
    progress = measure(log, "r1", START, None, START + 100)
    assert progress.seen_at == START and progress.basis == "run_start" and progress.step is None


def test_an_unreadable_log_gives_no_verdict_of_stall(tmp_path) -> None:
    progress = measure(last_progress(str(tmp_path / "none"), STEP), "r1", START, None, START + 1000)
    report = judge(RUN, None, None, True, progress, 1.0, START + 1000)
    assert report.state is Health.RUNNING and "cannot be measured" in report.reason


@pytest.mark.parametrize("seen, state", [(START + 98.5, Health.RUNNING), (START + 98, Health.STALLED)])
def test_stalled_only_after_stall_after(seen, state) -> None:
    report = judge(RUN, None, None, True, Progress("3", "step 3", seen, "log_mtime"), 2.0, START + 100)
    assert report.state is state
    assert report.as_dict()["last_step"] == "3"


def test_no_stall_detection_without_stall_after() -> None:
    report = judge(RUN, None, None, True, Progress("3", "step 3", START, "log_mtime"), None, START + 10 ** 6)
    assert report.state is Health.RUNNING


@pytest.mark.parametrize("record, state", [
    ({"exit_code": 0, "exit_signal": None}, Health.FINISHED),
    ({"exit_code": 3, "exit_signal": None}, Health.CRASHED),
    ({"exit_code": None, "exit_signal": "SIGKILL"}, Health.CRASHED),
    ({"error": "cannot start"}, Health.CRASHED),
])
def test_ended_runs(record, state) -> None:
    report = judge(RUN, dict(record, run_id="r1"), None, False, None, None, START)
    assert report.state is state and report.as_dict()["exit_code"] == record.get("exit_code")


@pytest.mark.parametrize("code, named", [(137, "SIGKILL"), (143, "SIGTERM"), (139, "SIGSEGV"), (130, "SIGINT")])
def test_a_shell_status_of_a_killed_process_is_a_crash_that_names_the_signal(code, named) -> None:
    """A shell (shell=true, with pipefail) reports a process ended by signal N as 128+N."""
    report = judge(RUN, {"run_id": "r1", "exit_code": code, "exit_signal": None}, None, False, None, None, START)
    assert report.state is Health.CRASHED
    assert f"exit code {code} (128+{code - 128}: how a shell reports a process ended by {named})" in report.reason


def test_exit_codes_that_are_no_signal_are_not_named_as_one() -> None:
    for code in (3, 128, 255):
        report = judge(RUN, {"run_id": "r1", "exit_code": code, "exit_signal": None}, None, False, None, None, START)
        assert report.state is Health.CRASHED and "128+" not in report.reason


def test_an_exit_record_of_another_run_does_not_count() -> None:
    assert judge(RUN, {"run_id": "old", "exit_code": 0}, None, False, None, None, START).state is Health.MISSING


def test_missing() -> None:
    assert judge(None, None, None, False, None, None, START).state is Health.MISSING
    gone = judge(RUN, None, None, False, None, None, START)
    assert gone.state is Health.MISSING and gone.run_id == "r1" and gone.has_run


@pytest.mark.parametrize("found, state", [("running", Health.STOPPED), ("stalled", Health.STALLED),
                                          ("crashed", Health.CRASHED), ("missing", Health.MISSING),
                                          ("finished", Health.STOPPED), ("bogus", Health.STOPPED), (None, Health.STOPPED)])
def test_a_run_this_module_stopped_keeps_what_was_found(found, state) -> None:
    # A run stopped while missing (its main process gone without an exit record, part of its tree
    # left) is still a failure once the stop has written its exit: the guard counts it, it resumes.
    stop = {"run_id": "r1", "health": found, "requested_at": "t"}
    report = judge(RUN, {"run_id": "r1", "exit_code": None, "exit_signal": "SIGTERM"}, stop, False, None, None, START)
    assert report.state is state and report.stopped is True
    assert report.state.failed is (found in ("stalled", "crashed", "missing"))


@pytest.mark.parametrize("state", list(Health))
def test_the_log_tail_goes_with_failures_only(state) -> None:
    found = HealthReport(state, "x", log_tail=["boom"]).as_dict()
    assert found.get("log_tail") == (["boom"] if state in (Health.CRASHED, Health.STALLED, Health.MISSING) else None)


@pytest.mark.parametrize("lie", [0, START - 1, START + 1000, -1e300])
def test_a_progress_record_that_lies_about_the_time_is_not_believed(tmp_path, lie) -> None:
    # Before the run, or still to come: believed, it would make a running job stalled at once.
    log = last_progress(write(tmp_path / "log", "step 3 x\nwarning\n", START + 90), STEP)
    record = dict(Progress("3", "step 3 x", START + 20, "log_mtime", log.line_end).record("r1"), first_seen=lie)
    assert measure(log, "r1", START, record, START + 100).seen_at == START + 90


# --- issue 24, item 7: a main process held still is named so --------------------------------------

@pytest.mark.parametrize("state, wchan, named", [
    ("T", "do_signal_stop", "stopped by a signal (state T, wchan do_signal_stop"),
    ("t", "ptrace_stop", "stopped by a debugger (state t, wchan ptrace_stop"),
    ("S", "do_freezer_trap", "frozen by a cgroup freezer (state S, wchan do_freezer_trap)"),
    ("D", "__refrigerator", "frozen by a cgroup freezer (state D, wchan __refrigerator)"),
    ("T", "", "wchan ?"),
    ("T", "x\x1b[2Jy", "wchan x\\x1b[2Jy"),  # a wait channel is read from /proc, still escaped
    ("S", "ep_poll", None),
    ("R", "", None),
])
def test_what_holds_a_process_still_is_said_in_words(state, wchan, named) -> None:
    said = stopped_state(state, wchan)
    assert (said is None) if named is None else (named in said)


def test_the_verdict_names_a_held_main_process_before_running_or_a_stall() -> None:
    held = stopped_state("T", "do_signal_stop")
    running = judge(RUN, None, None, True, None, None, START + 10, held)
    assert running.state is Health.RUNNING and running.reason.startswith("alive, but stopped by a signal")
    stalled = judge(RUN, None, None, True, Progress("3", "step 3", START, "log_mtime"), 2.0, START + 100, held)
    assert stalled.state is Health.STALLED and "stopped by a signal" in stalled.reason and "no progress" in stalled.reason
    ended = judge(RUN, {"run_id": "r1", "exit_code": 0, "exit_signal": None}, None, False, None, None, START + 10, held)
    assert "stopped by a signal" not in ended.reason  # an ended run is not held by anything


def test_a_real_stopped_process_is_read_as_stopped_by_a_signal() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        starttime = process_starttime(proc.pid)
        assert leader_stopped_state(proc.pid, starttime) is None
        os.kill(proc.pid, signal.SIGSTOP)
        assert Deadline(10).poll(lambda: leader_stopped_state(proc.pid, starttime) is not None)
        assert leader_stopped_state(proc.pid, starttime).startswith("stopped by a signal (state T")
        assert leader_stopped_state(proc.pid, starttime + 1) is None  # another process's start time: not it
    finally:
        proc.kill()
        proc.wait()


def test_a_progress_line_of_megabytes_is_read_by_chunks_and_kept_cut(tmp_path) -> None:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import LINE_LIMIT
    huge = "step 4 " + "\x1b" * (6 * 1024 * 1024)
    text = "step 3 a\n" + huge + "\nnoise\n"
    found = last_progress(write(tmp_path / "log", text), STEP)
    assert found.step == "4" and found.trailing is True
    assert found.line_end == len("step 3 a\n" + huge)
    # Cut before escaping: the kept line is a few KiB, not 24 MiB, and says how long the line was.
    assert found.line.endswith(" [cut: %d bytes in all]" % len(huge)) and len(found.line) < 5 * LINE_LIMIT
    assert len(Progress(found.step, found.line, 1.0, "log_mtime", found.line_end).record("r1")["line"]) < 5 * LINE_LIMIT
    # A line longer than the limit whose head is blank space is still a line (something follows the step).
    after = last_progress(write(tmp_path / "blank", "step 5 b\n" + " " * (LINE_LIMIT + 10) + "x\n"), STEP)
    assert after.step == "5" and after.trailing is True
