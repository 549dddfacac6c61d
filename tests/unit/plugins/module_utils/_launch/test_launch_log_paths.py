"""The job log where its user can reach it: walked, never followed; and every line leaving us escaped.

The log's directory belongs to the job's user (nobody here, a real unprivileged process), who swaps
a directory on the path for a symlink into a root-only directory. Rotation, the set-aside, creation,
the tail, readiness, progress, the incidents and remove_paths must all refuse to go there. And a log
line that leaves us (log_tail, ready_line, the progress line, an incident record) carries its
control characters escaped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.executor import remove_path
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import last_progress
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.incident import thread_evidence, write_incident
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import create_log, rotate, set_aside, tail
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.readiness import LogScanner

NOBODY = 65534
# What a job can print to take over the terminal of whoever reads its log: a window title (OSC ...
# BEL), a cleared screen and a colour (CSI), a C1 CSI (U+009B, and the raw byte 0x9b), DEL, NUL.
HOSTILE = b"step 7 \x1b]0;owned\x07 \x1b[2J\x1b[31mred\x1b[0m \xc2\x9b6n \x9b \x7f\x00 \xff\n"
SHOWN = "step 7 \\x1b]0;owned\\x07 \\x1b[2J\\x1b[31mred\\x1b[0m \\x9b6n \\x9b \\x7f\\x00 \\xff"


def as_nobody(*argv: str) -> None:
    subprocess.run(argv, check=True, user=NOBODY, group=NOBODY, extra_groups=[], timeout=30)


def raw_controls(text: str) -> list[str]:
    return [char for char in text if (ord(char) < 0x20 and char != "\t") or 0x7f <= ord(char) <= 0x9f
            or 0xd800 <= ord(char) <= 0xdfff]


@pytest.fixture(name="site")
def site_fixture() -> Iterator[Path]:
    """/tmp/gpuops-logpaths-*/: home/ is nobody's (its logs/ holds the job's log), rootonly/ is root's (0700)."""
    base = Path(tempfile.mkdtemp(prefix="gpuops-logpaths-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "home").mkdir()
        os.chown(base / "home", NOBODY, NOBODY)
        as_nobody("mkdir", str(base / "home" / "logs"))
        (base / "rootonly").mkdir(mode=0o700)
        (base / "rootonly" / "train.log").write_text("root's own log\n")
        (base / "rootonly" / "precious").mkdir()
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def plant(site: Path, name: str = "logs") -> str:
    """The job's user moves its directory aside and links the name to the root-only directory."""
    as_nobody("mv", str(site / "home" / name), str(site / "home" / f"{name}.old"))
    as_nobody("ln", "-s", str(site / "rootonly"), str(site / "home" / name))
    return str(site / "home" / name / "train.log")


def untouched(site: Path) -> None:
    assert sorted(os.listdir(site / "rootonly")) == ["precious", "train.log"]
    assert (site / "rootonly" / "train.log").read_text() == "root's own log\n"


def test_rotation_set_aside_and_creation_refuse_a_planted_parent(site: Path) -> None:
    log = plant(site)
    for act in (lambda: rotate(log, 5), lambda: set_aside(log, log + ".failed"),
                lambda: create_log(log, 0o640, NOBODY, NOBODY)):
        with pytest.raises(OSError, match="home/logs is a symbolic link that a user other than root can change"):
            act()
    untouched(site)
    assert os.stat(site / "rootonly" / "train.log").st_uid == 0


def test_reading_refuses_a_planted_parent(site: Path) -> None:
    log = plant(site)
    assert tail(log, 5) == []
    scanner = LogScanner(log, re.compile("root"))
    assert scanner.scan() is None and not scanner.exists()
    progress = last_progress(log, re.compile("root"))
    assert progress.readable is False and "symbolic link" in progress.why_not


def test_remove_paths_refuse_a_planted_parent(site: Path) -> None:
    as_nobody("mkdir", str(site / "home" / "cache"))
    target = plant(site, "cache").replace("train.log", "precious")
    with pytest.raises(OSError, match="home/cache is a symbolic link"):
        remove_path(target)
    untouched(site)
    # Its own files the job's user may have removed: a real directory of its own is walked.
    as_nobody("mkdir", "-p", str(site / "home" / "cache.old" / "sub"))
    assert remove_path(str(site / "home" / "cache.old")) is True


def test_incidents_refuse_a_planted_job_directory(site: Path) -> None:
    as_nobody("ln", "-s", str(site / "rootonly"), str(site / "home" / "job"))
    with pytest.raises(OSError, match="home/job is a symbolic link"):
        write_incident(str(site / "home" / "job"), "r1", {"x": 1}, 1.0, keep=5)
    untouched(site)


def test_a_missing_log_directory_is_created_and_the_log_given_to_the_user(site: Path) -> None:
    log = site / "home" / "logs" / "deeper" / "train.log"
    create_log(str(log), 0o640, NOBODY, NOBODY)
    assert log.is_file() and log.stat().st_uid == NOBODY and (log.stat().st_mode & 0o777) == 0o640
    assert (log.parent.stat().st_mode & 0o777) == 0o755


def test_every_log_line_that_leaves_us_is_escaped(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"setup\n" + HOSTILE + b"tail \x1b[1A\rover\n")
    assert tail(str(log), 5) == ["setup", SHOWN, "tail \\x1b[1A", "over"]
    # The pattern sees the line as written (it may match the escape itself); the result is escaped.
    scanner = LogScanner(str(log), re.compile("\x1b\\[2J"))
    assert scanner.scan() == SHOWN
    progress = last_progress(str(log), re.compile(r"^step (\d+ \x1b\S*)"))
    assert progress.line == SHOWN and progress.step == "7 \\x1b]0;owned\\x07"
    for text in (*tail(str(log), 5), scanner.scan(), progress.line, progress.step):
        assert not raw_controls(text), text


def test_an_incident_record_quotes_escaped_names(tmp_path: Path) -> None:
    # A process names itself: comm (and a thread's name) and cmdline are the job's to choose.
    name = "\x1b]0;t\x07"
    ready = threading.Event()
    done = threading.Event()

    def named() -> None:
        with open("/proc/thread-self/comm", "w", encoding="utf-8") as handle:
            handle.write(name)
        ready.set()
        done.wait(30)

    thread = threading.Thread(target=named)
    thread.start()
    try:
        ready.wait(30)
        table = ProcessTable.scan()
        record = thread_evidence(table, [os.getpid()])
    finally:
        done.set()
        thread.join()
    threads = record[0]["threads"]
    assert "\\x1b]0;t\\x07" in [entry["comm"] for entry in threads]
    assert not raw_controls(json.dumps(record, ensure_ascii=False))
