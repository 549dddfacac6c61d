"""_launch/readiness.py: the proof of start, polled against a deadline (a fake clock keeps it exact)."""

from __future__ import annotations

import re

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.readiness import (
    LogScanner,
    describe_exit,
    wait_ready,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from tests.harness.clock import FakeClock


class FakeProbe:
    def __init__(self, clock: FakeClock, dies_at: float | None = None, record: dict | None = None) -> None:
        self.clock = clock
        self.dies_at = dies_at
        self.record = record

    def alive(self) -> bool:
        return self.dies_at is None or self.clock.now < self.dies_at

    def exit_record(self) -> dict | None:
        return self.record if not self.alive() else None


def writer(path, schedule):
    """Append scheduled text to the log when the fake clock passes each time."""
    pending = sorted(schedule.items())

    def act(now: float) -> None:
        while pending and pending[0][0] <= now:
            _when, text = pending.pop(0)
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(text)
    return act


def test_scanner_reads_incrementally_and_waits_for_whole_lines(tmp_path) -> None:
    log = tmp_path / "train.log"
    scanner = LogScanner(str(log), re.compile(r"^step 1 "))
    assert scanner.scan() is None and not scanner.exists()
    log.write_text("setup\nstep 1 lo")
    assert scanner.scan() is None  # the line is not finished yet
    with open(log, "a", encoding="utf-8") as handle:
        handle.write("ss=2.5\nstep 2\n")
    assert scanner.scan() == "step 1 loss=2.5"
    assert scanner.scan() == "step 1 loss=2.5"


def test_scanner_at_the_end_accepts_an_unfinished_last_line(tmp_path) -> None:
    log = tmp_path / "train.log"
    log.write_text("step 1 no newline")
    scanner = LogScanner(str(log), re.compile("step 1"))
    assert scanner.scan() is None
    assert scanner.scan_including_partial() == "step 1 no newline"


def test_ready_after_min_uptime_and_ready_line(tmp_path) -> None:
    log = tmp_path / "train.log"
    clock = FakeClock()
    clock.on_sleep.append(writer(log, {0.2: "setup\n", 3.0: "step 1 loss=1\n"}))
    result = wait_ready(FakeProbe(clock), LogScanner(str(log), re.compile("^step 1 ")), 1.0,
                        Deadline(10, clock, clock.sleep))
    assert result.ready and result.ready_line == "step 1 loss=1"
    assert 3.0 <= result.waited < 3.2


def test_min_uptime_alone(tmp_path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    clock = FakeClock()
    result = wait_ready(FakeProbe(clock), LogScanner(str(log), None), 2.0, Deadline(10, clock, clock.sleep))
    assert result.ready and 2.0 <= result.waited < 2.2 and result.ready_line is None


def test_death_during_startup_reports_the_exit(tmp_path) -> None:
    log = tmp_path / "train.log"
    clock = FakeClock()
    clock.on_sleep.append(writer(log, {0.1: "boom\n"}))
    probe = FakeProbe(clock, dies_at=1.0, record={"exit_code": 3, "exit_signal": None})
    result = wait_ready(probe, LogScanner(str(log), re.compile("step")), 5.0, Deadline(10, clock, clock.sleep))
    assert not result.ready and result.exit == {"exit_code": 3, "exit_signal": None}
    assert result.reason == "the job ended during startup with exit code 3"


def test_deadline_without_ready_line(tmp_path) -> None:
    log = tmp_path / "train.log"
    log.write_text("setup\n")
    clock = FakeClock()
    result = wait_ready(FakeProbe(clock), LogScanner(str(log), re.compile("^step")), 1.0,
                        Deadline(4, clock, clock.sleep))
    assert not result.ready and result.exit is None
    assert "no line matching ready_regex '^step' appeared" in result.reason
    assert 4.0 <= result.waited < 4.2


def test_deadline_without_log(tmp_path) -> None:
    clock = FakeClock()
    result = wait_ready(FakeProbe(clock), LogScanner(str(tmp_path / "none.log"), None), 0.0,
                        Deadline(1, clock, clock.sleep))
    assert not result.ready and "did not appear" in result.reason


def test_describe_exit() -> None:
    assert describe_exit({"exit_code": None, "exit_signal": "SIGKILL"}) == "signal SIGKILL"
    assert describe_exit({"exit_code": 0, "exit_signal": None}) == "exit code 0"
    assert describe_exit({"error": "cannot start"}) == "cannot start"
    assert "unknown" in describe_exit(None)


def test_the_scanner_keeps_only_the_head_of_a_line_of_megabytes(tmp_path) -> None:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import LINE_LIMIT
    log = tmp_path / "train.log"
    huge = "ready " + "\x1b" * (3 * 1024 * 1024)
    log.write_text("setup\r\n" + huge[:100])
    scanner = LogScanner(str(log), re.compile(r"^ready "))
    assert scanner.scan() is None
    with open(log, "a", encoding="utf-8") as handle:
        handle.write(huge[100:])
    assert scanner.scan() is None and len(scanner.partial) == LINE_LIMIT  # unfinished: only its head is kept
    assert scanner.scan_including_partial().endswith(" [cut: %d bytes in all]" % len(huge))
    assert len(scanner.matched_line) < 5 * LINE_LIMIT
    ended = LogScanner(str(log), re.compile(r"^ready "))
    with open(log, "a", encoding="utf-8") as handle:
        handle.write("\r\n")
    assert ended.scan().startswith("ready \\x1b\\x1b") and len(ended.matched_line) < 5 * LINE_LIMIT
