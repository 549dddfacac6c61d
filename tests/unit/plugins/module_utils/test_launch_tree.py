"""launch_tree: stopping a real process tree, and only it."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils.launch_supervisor import process_starttime
from ansible_collections.gpuops.relaunch.plugins.module_utils.launch_tree import (
    JobIdentity,
    StopOutcome,
    TreeView,
    _send,
    look,
    stop_tree,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils.procfs import ProcessTable

# A job leader in its own group with a child in the group; the leader may ignore SIGTERM.
JOB = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.fixture
def started():
    procs = []

    def start(mode: str):
        proc = subprocess.Popen([sys.executable, "-c", JOB, mode], stdout=subprocess.PIPE, text=True,
                                process_group=0)
        child = int(proc.stdout.readline())
        procs.append(proc)
        return proc, child

    yield start
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def identity(proc) -> JobIdentity:
    return JobIdentity(pid=proc.pid, starttime=process_starttime(proc.pid), pgid=proc.pid)


def reap_soon(proc):
    """We are the test job's parent: reap it as a supervisor would, as soon as it ends."""
    thread = threading.Thread(target=proc.wait, daemon=True)
    thread.start()
    return thread


def test_sigterm_ends_a_cooperative_tree(started) -> None:
    proc, child = started("term")
    job = identity(proc)
    assert set(look(job).members) == {proc.pid, child}
    reaper = reap_soon(proc)
    outcome = stop_tree(job, stop_timeout=10)
    assert outcome.gone and not outcome.escalated
    assert set(outcome.signalled) == {proc.pid, child}
    reaper.join(timeout=10)
    assert proc.returncode == -signal.SIGTERM


def test_sigkill_after_stop_timeout(started) -> None:
    proc, child = started("ignore")
    job = identity(proc)
    reaper = reap_soon(proc)
    outcome = stop_tree(job, stop_timeout=0.5)
    assert outcome.gone and outcome.escalated
    reaper.join(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert not Path(f"/proc/{proc.pid}").exists()


def test_nothing_to_stop_and_reused_pids_are_left_alone(started) -> None:
    proc, child = started("term")
    # Same pid, another start time: a different process that merely reuses the numbers.
    stranger = JobIdentity(pid=proc.pid, starttime=process_starttime(proc.pid) - 1, pgid=proc.pid)
    view = look(stranger)
    assert proc.pid not in view.members  # the leader is not the recorded one
    gone = JobIdentity(pid=2 ** 22 - 7, starttime=1, pgid=2 ** 22 - 7)
    outcome = stop_tree(gone, stop_timeout=1)
    assert outcome.gone and outcome.signalled == []
    assert proc.poll() is None and Path(f"/proc/{child}").exists()


def test_never_signals_its_own_group() -> None:
    # A recorded "job" that is in fact this test's own process group: nothing in it is signalled
    # (the group also holds whatever started the test, such as the shell pipeline around it).
    own = JobIdentity(pid=os.getpid(), starttime=process_starttime(os.getpid()), pgid=os.getpgrp())
    view = look(own)
    assert os.getpid() in view.members
    outcome = stop_tree(own, stop_timeout=0.2, kill_wait=0.2)
    assert outcome.signalled == []
    assert not outcome.gone


def test_a_member_outside_the_group_whose_pid_was_reused_is_not_signalled():
    # The scan saw the pid with another start time: the process there now is someone else's.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], process_group=0)
    try:
        table = ProcessTable.scan("/proc")
        seen = table.processes[bystander.pid]
        table.processes[bystander.pid] = dataclasses.replace(seen, starttime=seen.starttime - 1, pgid=-1)
        identity = JobIdentity(pid=bystander.pid, starttime=seen.starttime - 1, pgid=-1)
        view = TreeView(table=table, identity=identity, members={bystander.pid}, supervisor_alive=False)
        outcome = StopOutcome()
        _send(view, signal.SIGKILL, outcome)
        assert outcome.signalled == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
