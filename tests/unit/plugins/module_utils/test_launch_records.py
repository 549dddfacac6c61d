"""launch_records: the job's state directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils.launch_records import JobRecords, process_alive
from ansible_collections.gpuops.relaunch.plugins.module_utils.launch_supervisor import process_starttime


def test_state_dirs_are_private_and_the_lock_has_a_deadline(tmp_path) -> None:
    first = JobRecords(str(tmp_path / "state" / "job"))
    first.ensure_dir()
    assert oct((tmp_path / "state").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "state" / "job").stat().st_mode & 0o777) == "0o700"
    first.lock(1)
    with pytest.raises(OSError, match="another train_launch task"):
        JobRecords(str(tmp_path / "state" / "job")).lock(0.3)


def test_status_follows_the_run_and_its_exit(tmp_path) -> None:
    records = JobRecords(str(tmp_path / "job"))
    records.ensure_dir()
    assert records.status().run is None and not records.status().running
    me = {"run_id": "a", "pid": os.getpid(), "starttime": process_starttime(os.getpid()),
          "backend": "supervisor", "spec_hash": "h"}
    records.write_run(me)
    status = records.status()
    assert status.running and status.backend == "supervisor" and status.spec_hash == "h"
    (tmp_path / "job" / "exit.json").write_text('{"run_id": "older", "exit_code": 1}')
    assert records.status().running and records.read_exit("a") is None
    (tmp_path / "job" / "exit.json").write_text('{"run_id": "a", "exit_code": 0}')
    assert not records.status().running and records.status().exit == {"run_id": "a", "exit_code": 0}


def test_process_alive_sees_reuse_and_zombies() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_starttime(child.pid)
    assert process_alive(os.getpid(), process_starttime(os.getpid()))
    assert not process_alive(os.getpid(), process_starttime(os.getpid()) - 1)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert not process_alive(child.pid, start)
    child.wait()
    assert not process_alive(child.pid, start) and not process_alive(None, None)
