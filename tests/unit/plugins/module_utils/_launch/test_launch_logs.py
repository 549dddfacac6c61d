"""_launch/logs.py: numbered rotation that never overwrites, and the log tail."""

from __future__ import annotations

import os
import re

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import rotate, rotation_plan, tail
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.readiness import LogScanner


def contents(tmp_path):
    return {path.name: path.read_text() for path in sorted(tmp_path.iterdir())}


def test_no_log_nothing_to_rotate(tmp_path) -> None:
    assert rotate(str(tmp_path / "train.log"), 5) is None
    assert not list(tmp_path.iterdir())


def test_rotation_keeps_the_newest_logs(tmp_path) -> None:
    log = tmp_path / "train.log"
    for run in range(1, 5):
        log.write_text(f"run {run}\n")
        rotate(str(log), 2)
    log.write_text("run 5\n")
    assert contents(tmp_path) == {"train.log": "run 5\n", "train.log.1": "run 4\n", "train.log.2": "run 3\n"}


def test_rotation_returns_the_new_name_and_keeps_an_empty_log(tmp_path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    assert rotate(str(log), 5) == str(log) + ".1"
    assert contents(tmp_path) == {"train.log.1": ""}


def test_smaller_keep_drops_the_oldest(tmp_path) -> None:
    log = tmp_path / "train.log"
    for number in range(1, 5):
        (tmp_path / f"train.log.{number}").write_text(f"old {number}\n")
    log.write_text("current\n")
    rotate(str(log), 2)
    assert contents(tmp_path) == {"train.log.1": "current\n", "train.log.2": "old 1\n"}


def test_plan_moves_oldest_first(tmp_path) -> None:
    log = str(tmp_path / "t.log")
    existing = {log, log + ".1", log + ".2"}
    plan = rotation_plan(log, 5, exists=existing.__contains__)
    assert plan == [(log + ".2", log + ".3"), (log + ".1", log + ".2"), (log, log + ".1")]


def test_tail(tmp_path) -> None:
    log = tmp_path / "train.log"
    log.write_text("".join(f"line {n}\n" for n in range(100)))
    assert tail(str(log), 3) == ["line 97", "line 98", "line 99"]
    assert tail(str(tmp_path / "missing.log"), 3) == []
    assert tail(None, 3) == []


def test_tail_of_a_huge_log_reads_only_its_end(tmp_path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"x" * 200_000 + b"\n\xff broken utf-8\nlast\n")
    assert tail(str(log), 2) == ["\\xff broken utf-8", "last"]  # an undecodable byte is shown as itself


def test_tail_never_reads_through_a_symlink_or_waits_on_a_fifo(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    (tmp_path / "link.log").symlink_to(secret)
    assert tail(str(tmp_path / "link.log"), 3) == []
    os.mkfifo(tmp_path / "fifo.log")
    assert tail(str(tmp_path / "fifo.log"), 3) == []  # returns at once: the open does not block


def test_the_scanner_neither_follows_a_link_nor_blocks_on_a_fifo(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("ready\n")
    (tmp_path / "link.log").symlink_to(secret)
    linked = LogScanner(str(tmp_path / "link.log"), re.compile("ready"))
    assert linked.scan() is None and not linked.exists()
    os.mkfifo(tmp_path / "fifo.log")
    fifo = LogScanner(str(tmp_path / "fifo.log"), re.compile("ready"))
    assert fifo.scan() is None and not fifo.exists()


def test_each_line_of_the_tail_is_cut_before_it_is_escaped(tmp_path) -> None:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import LINE_LIMIT
    log = tmp_path / "train.log"
    log.write_bytes(b"first\n" + b"\x1b" * 60_000 + b"\nlast\n")
    shown = tail(str(log), 3)
    assert shown[0] == "first" and shown[2] == "last"
    assert shown[1] == "\\x1b" * LINE_LIMIT + " [cut: 60000 bytes in all]"


def test_a_log_path_is_compared_as_the_kernel_resolves_it_not_as_spelt(tmp_path) -> None:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import same_log
    log = tmp_path / "logs" / "train.log"
    log.parent.mkdir()
    recorded = str(log)
    # Respelt, before the log exists and after.
    for spelling in (f"{tmp_path}//logs/train.log", f"{tmp_path}/./logs/./train.log", f"{tmp_path}/logs/train.log"):
        assert same_log(recorded, spelling) is True
    log.write_text("step 1\n")
    assert same_log(recorded, f"{tmp_path}//logs//train.log") is True
    # Another name for the same file (a hard link: the kernel's one file) is one log; another file is not.
    os.link(log, tmp_path / "logs" / "other.log")
    assert same_log(recorded, str(tmp_path / "logs" / "other.log")) is True
    assert same_log(recorded, str(tmp_path / "logs" / "train.log.1")) is False
    assert same_log(None, str(log)) is False and same_log(None, None) is True and same_log(recorded, "relative") is False
