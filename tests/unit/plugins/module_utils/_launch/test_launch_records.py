"""launch_records: the job's state directory, read as regular files only, never trusted blindly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import (
    RUN_MARK,
    process_starttime,
    run_mark,
)

NOBODY = 65534


def test_state_dirs_are_private_and_the_lock_has_a_deadline(tmp_path) -> None:
    first = JobRecords(str(tmp_path / "state" / "job"))
    first.ensure_dir()
    assert oct((tmp_path / "state").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "state" / "job").stat().st_mode & 0o777) == "0o700"
    first.lock(1)
    with pytest.raises(OSError, match="another train_launch task"):
        JobRecords(str(tmp_path / "state" / "job")).lock(0.3)


def test_a_state_dir_that_is_a_file_or_a_link_is_named(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="^state_dir: .*not a directory"):
        JobRecords(str(tmp_path / "file" / "job")).ensure_dir()
    (tmp_path / "state").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "state" / "job")
    os.lchown(tmp_path / "state" / "job", NOBODY, NOBODY)  # planted by another user than root
    with pytest.raises(OSError, match="^state_dir: .*/state/job is a symbolic link that a user other than root can change"):
        JobRecords(str(tmp_path / "state" / "job")).ensure_dir()
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_lock_file_that_is_a_symlink_is_refused(tmp_path, records) -> None:
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, tmp_path / "job" / ".lock")
    with pytest.raises(OSError, match="^state_dir: cannot open the lock"):
        records.lock(1)
    assert target.read_text() == "keep"


@pytest.fixture
def records(tmp_path) -> JobRecords:
    job = JobRecords(str(tmp_path / "job"))
    job.ensure_dir()
    return job


@pytest.fixture
def marked_sleeper(tmp_path):
    """A process that carries run "a"'s mark of tmp_path/job, as a job the supervisor started would."""
    job_dir = str(tmp_path / "job")
    env = dict(os.environ, **{RUN_MARK: run_mark(job_dir, "a")})
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
    yield proc
    proc.kill()
    proc.wait()


def test_status_follows_the_run_and_its_exit(tmp_path, records, marked_sleeper) -> None:
    assert records.status().run is None and not records.status().running
    run = {"run_id": "a", "pid": marked_sleeper.pid, "starttime": process_starttime(marked_sleeper.pid),
           "backend": "supervisor", "spec_hash": "h"}
    records.write_run(run)
    status = records.status()
    assert status.running and status.backend == "supervisor" and status.spec_hash == "h"
    (tmp_path / "job" / "exit.json").write_text('{"run_id": "older", "exit_code": 1}')
    assert records.status().running and records.read_exit("a") is None
    (tmp_path / "job" / "exit.json").write_text('{"run_id": "a", "exit_code": 0}')
    assert not records.status().running and records.status().exit == {"run_id": "a", "exit_code": 0}
    assert records.problems == []


def test_a_recorded_process_without_the_runs_mark_is_not_running(records) -> None:
    # This test's own process: real pid, real start time, but no mark of run "a".
    records.write_run({"run_id": "a", "pid": os.getpid(), "starttime": process_starttime(os.getpid())})
    assert records.status().run is not None and not records.status().running


@pytest.mark.parametrize("content, problem", [
    ('{"run_id": "a", "pid": "abc", "starttime": 1}', "pid is not a process number"),
    ('{"run_id": "a", "pid": true, "starttime": 1}', "pid is not a process number"),
    ('{"run_id": "a", "pid": -4, "starttime": 1}', "pid is not a process number"),
    ('{"pid": 5, "starttime": 1}', "run_id is missing"),
    ('{"run_id": "a", "pid"', "is not valid JSON"),
    ('[1, 2]', "does not hold a JSON object"),
])
def test_a_record_that_is_not_sound_is_reported_and_ignored(tmp_path, records, content, problem) -> None:
    (tmp_path / "job" / "run.json").write_text(content)
    status = records.status()
    assert status.run is None and not status.running
    assert len(records.problems) == 1 and problem in records.problems[0] and "ignored" in records.problems[0]


def test_records_are_never_read_through_a_symlink_or_from_a_fifo(tmp_path, records) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"run_id": "a", "pid": 1, "starttime": 0}')
    os.symlink(elsewhere, tmp_path / "job" / "run.json")
    os.mkfifo(tmp_path / "job" / "exit.json")
    assert records.read_run() is None and records.read_exit() is None  # returns at once: no FIFO wait
    assert any("run.json cannot be read safely" in p for p in records.problems)
    assert any("exit.json cannot be read safely" in p for p in records.problems)


def test_is_real_dir_is_false_for_a_symlink_to_a_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    os.lchown(tmp_path / "link", NOBODY, NOBODY)
    assert JobRecords(str(real)).is_real_dir() is True
    assert JobRecords(str(tmp_path / "link")).is_real_dir() is False
    # A link only root can change (root's, in a directory only root may write) is the system's own.
    (tmp_path / "root-link").symlink_to(real)
    assert JobRecords(str(tmp_path / "root-link")).is_real_dir() is True
    assert JobRecords(str(tmp_path / "missing")).is_real_dir() is False


def test_a_start_failure_stands_for_the_run_it_replaced_only_while_it_is_the_last_start(tmp_path, records) -> None:
    job = tmp_path / "job"
    replaced = {"run_id": "a", "pid": 4194000, "starttime": 5, "backend": "supervisor"}
    ended = {"run_id": "a", "exit_code": 3}
    records.write_run(replaced)
    records.write("failed_start.json", {"run_id": "b", "log_path": "/l", "replaces": {"run": replaced, "exit": ended}})
    # Proven yet? Not while exit.json says nothing of "b" (it may be starting), nor if "b" ran and ended.
    (job / "exit.json").write_text('{"run_id": "b", "exit_code": 1}')
    assert records.start_failure() is None
    (job / "exit.json").write_text('{"run_id": "b", "error": "cannot start [\'x\']: Permission denied"}')
    status = records.status()
    assert status.run == replaced and status.exit == ended and not status.running
    assert status.start_failure["run_id"] == "b" and "Permission denied" in status.start_failure["error"]
    # The systemd backend records the failed run itself: still the run it replaced that is judged.
    records.write_run({"run_id": "b", "pid": 4194001, "starttime": 6, "backend": "systemd"})
    assert records.status().run == replaced
    # A later run recorded: the record is not about the last start.
    records.write_run({"run_id": "c", "pid": 4194002, "starttime": 7, "backend": "supervisor"})
    assert records.start_failure() is None and records.status().run["run_id"] == "c"
    # A record from before the start kept the replaced run (no "replaces"): as it was, never a guess.
    records.write_run(replaced)
    records.write("failed_start.json", {"run_id": "b", "log_path": "/l"})
    assert records.start_failure() is None and records.status().exit is None
