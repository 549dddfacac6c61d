"""_launch/sharing.py: a start never takes the live log (or the records) of another job, whatever the spelling.

The other job is real: a process carrying its run's mark, recorded in its run.json, as the supervisor
would have started it; a dead or lying record of it blocks nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.sharing import check_not_shared, sharing_problems
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import options_from_params
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import RUN_MARK, process_starttime, run_mark
from tests.harness.procstates import wait_until


def params(tmp_path: Path, log_path: str, name: str = "second") -> dict:
    return {
        "name": name, "state": "started", "command": ["python3", "train.py"], "shell": False,
        "chdir": None, "env": {}, "user": None, "group": None, "log_path": log_path,
        "keep_logs": 5, "state_dir": str(tmp_path / "state"), "backend": "auto", "startup_timeout": 60,
        "min_uptime": 5, "ready_regex": None, "term_timeout": 30, "remove_paths": [], "log_tail_lines": 20,
    }


def problems(tmp_path: Path, log_path: str, name: str = "second") -> list[str]:
    found = sharing_problems(options_from_params(params(tmp_path, log_path, name)))
    assert all(problem.option == "log_path" for problem in found), found
    return [problem.reason for problem in found]


@pytest.fixture(name="logs")
def logs_fixture(tmp_path: Path) -> Path:
    directory = tmp_path / "logs"
    directory.mkdir()
    return directory


@pytest.fixture(name="first")
def first_fixture(tmp_path: Path, logs: Path):
    """Job "first", running: its leader carries the run's mark and writes logs/train.log."""
    job_dir = tmp_path / "state" / "first"
    job_dir.mkdir(parents=True)
    log = logs / "train.log"
    log.write_text("step 1\n")
    env = dict(os.environ, **{RUN_MARK: run_mark(str(job_dir), "run1")})
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
    # Until its exec, the child has pytest's environment, without the mark.
    wait_until(lambda: RUN_MARK.encode() in Path(f"/proc/{proc.pid}/environ").read_bytes(), what="the exec")
    run = {"run_id": "run1", "pid": proc.pid, "starttime": process_starttime(proc.pid), "backend": "supervisor",
           "spec_hash": "h", "log_path": str(log)}
    (job_dir / "run.json").write_text(json.dumps(run))
    yield proc
    proc.kill()
    proc.wait()


def test_the_live_log_of_another_job_is_refused_however_it_is_spelt(tmp_path: Path, logs: Path, first) -> None:
    (tmp_path / "linked").symlink_to(logs)  # root's link in a directory only root may write: followed
    spellings = [str(logs / "train.log"), "/" + str(logs / "train.log"), f"{logs}/./train.log",
                 f"{logs}/../logs/train.log", str(tmp_path / "linked" / "train.log")]
    for spelling in spellings:
        found = problems(tmp_path, spelling)
        assert len(found) == 1, (spelling, found)
        assert "job 'first'" in found[0] and f"pid {first.pid}" in found[0] and "share" in found[0], found


def test_a_name_in_the_other_logs_rotation_is_refused_both_ways(tmp_path: Path, logs: Path, first) -> None:
    # Its rotation would move logs/train.log.1 (this job's live log) to .2; this job's would move its log.
    for name in ("train.log.1", "train.log.12", "train.log.failed"):
        assert problems(tmp_path, str(logs / name)), name
    (logs / "run.log").write_text("")
    for name in ("train.log.x", "train.log1", "train.lo", "run.log", "other.log"):
        assert problems(tmp_path, str(logs / name)) == [], name


def test_a_hard_link_to_the_live_log_is_refused(tmp_path: Path, logs: Path, first) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.link(logs / "train.log", elsewhere / "copy.log")
    assert "job 'first'" in problems(tmp_path, str(elsewhere / "copy.log"))[0]


def test_a_job_that_ended_or_a_record_that_lies_blocks_nothing(tmp_path: Path, logs: Path, first) -> None:
    log = str(logs / "train.log")
    run_file = tmp_path / "state" / "first" / "run.json"
    run = json.loads(run_file.read_text())
    # A record naming a live process that is not the run's (no mark, not below its supervisor).
    lying = dict(run, pid=os.getpid(), starttime=process_starttime(os.getpid()))
    run_file.write_text(json.dumps(lying))
    assert problems(tmp_path, log) == []
    run_file.write_text(json.dumps(run))
    assert problems(tmp_path, log)
    (tmp_path / "state" / "first" / "exit.json").write_text(json.dumps({"run_id": "run1", "exit_code": 0}))
    assert problems(tmp_path, log) == []
    os.unlink(tmp_path / "state" / "first" / "exit.json")
    first.kill()
    first.wait()
    assert problems(tmp_path, log) == []
    run_file.write_text("{not json")
    assert problems(tmp_path, log) == []


def test_the_job_itself_is_not_another_job(tmp_path: Path, logs: Path, first) -> None:
    assert problems(tmp_path, str(logs / "train.log"), name="first") == []


def test_a_job_another_task_is_starting_is_seen_by_its_launch(tmp_path: Path, logs: Path) -> None:
    job_dir = tmp_path / "state" / "starting"
    job_dir.mkdir(parents=True)
    (job_dir / "launch.json").write_text(json.dumps({"run_id": "r2", "log_path": str(logs / "train.log")}))
    (logs / "train.log").write_text("")
    assert problems(tmp_path, str(logs / "train.log")) == []  # nobody works on it: a launch of the past
    fd = os.open(job_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        found = problems(tmp_path, str(logs / "train.log"))
        assert len(found) == 1 and "job 'starting'" in found[0] and "another task" in found[0], found
    finally:
        os.close(fd)
    assert problems(tmp_path, str(logs / "train.log")) == []


def test_a_log_among_the_records_of_a_job_is_refused(tmp_path: Path, first) -> None:
    found = problems(tmp_path, str(tmp_path / "state" / "first" / "run.json"))
    assert len(found) == 1 and "state directory of job 'first'" in found[0]
    # The job's own directory too, before it exists: its records would be rotated as logs.
    found = problems(tmp_path, str(tmp_path / "state" / "second" / "exit.json"))
    assert len(found) == 1 and "state directory of job 'second'" in found[0]
    assert problems(tmp_path, str(tmp_path / "state" / "train.log")) == []


def test_the_refusal_names_the_option_and_escapes_what_it_quotes(tmp_path: Path, logs: Path, first) -> None:
    hostile = logs / "tr\x1b]0;owned\x07ain.log"
    hostile.write_text("")
    run_file = tmp_path / "state" / "first" / "run.json"
    run_file.write_text(json.dumps(dict(json.loads(run_file.read_text()), log_path=str(hostile))))
    with pytest.raises(OptionsInvalid) as caught:
        check_not_shared(options_from_params(params(tmp_path, str(hostile))))
    assert caught.value.options == ["log_path"]
    text = str(caught.value)
    assert "\x1b" not in text and "\x07" not in text and "\\x1b" in text


def test_no_state_dir_or_no_log_directory_yet_is_nothing_shared(tmp_path: Path) -> None:
    assert problems(tmp_path, str(tmp_path / "nowhere" / "train.log")) == []


def test_two_job_names_for_one_state_directory_are_refused(tmp_path: Path, logs: Path) -> None:
    (tmp_path / "state" / "first").mkdir(parents=True)
    (tmp_path / "state" / "second").symlink_to(tmp_path / "state" / "first")  # root's: followed
    found = sharing_problems(options_from_params(params(tmp_path, str(logs / "own.log"))))
    assert [problem.option for problem in found] == ["state_dir"] and "job 'first'" in found[0].reason
    os.unlink(tmp_path / "state" / "second")
    assert sharing_problems(options_from_params(params(tmp_path, str(logs / "own.log")))) == []
