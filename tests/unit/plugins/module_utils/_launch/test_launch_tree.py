"""launch_tree: stopping a real process tree, and only its proven members."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import (
    RUN_MARK,
    SUPERVISOR_MARK,
    process_starttime,
    run_mark,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import (
    JobIdentity,
    RecordError,
    check_expect_run_id,
    leader_alive,
    look,
    prove,
    stop_tree,
    supersedes,
    wake_idle_supervisor,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base import procfs
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import REFUSED
from tests.harness.fakeproc import FakeProc

JOB_DIR = "/var/lib/gpuops-test/job"
RUN_ID = "run-1"

# A job leader with a child (in its group, like a data loader) and a grandchild that clears its
# environment; the leader may ignore SIGTERM. The leader names its child only once the child runs:
# Popen returns when the child's exec is past its point of no return, but /proc/PID/environ is empty
# until the kernel has set up the new program's stack, and a look in between finds no mark.
JOB = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(300)"],
                         stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(300)
"""


def marked_env(run_id: str = RUN_ID) -> dict:
    return dict(os.environ, **{RUN_MARK: run_mark(JOB_DIR, run_id)})


@pytest.fixture
def started():
    procs = []

    def start(mode: str, env: dict | None = None, own_group: bool = True):
        proc = subprocess.Popen([sys.executable, "-c", JOB, mode], stdout=subprocess.PIPE, text=True,
                                env=marked_env() if env is None else env,
                                process_group=0 if own_group else None)
        child = int(proc.stdout.readline())
        procs.append((proc, child))
        return proc, child

    yield start
    for proc, child in procs:
        for pid in (child, proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()


def identity(proc, **extra) -> JobIdentity:
    fields = {"pid": proc.pid, "starttime": process_starttime(proc.pid)}
    fields.update(extra)
    return JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, **fields)


def reap_soon(proc):
    """We are the test job's parent: reap it as a supervisor would, as soon as it ends."""
    thread = threading.Thread(target=proc.wait, daemon=True)
    thread.start()
    return thread


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_sigterm_ends_a_cooperative_marked_tree(started) -> None:
    proc, child = started("term")
    job = identity(proc)
    assert set(look(job).members) == {proc.pid, child}
    assert look(job).leader_running and leader_alive(job)
    reaper = reap_soon(proc)
    outcome = stop_tree(job, term_timeout=10)
    assert outcome.gone and not outcome.escalated
    assert set(outcome.signalled) == {proc.pid, child}
    reaper.join(timeout=10)
    assert proc.returncode == -signal.SIGTERM


def test_sigkill_after_term_timeout(started) -> None:
    proc, _child = started("ignore")
    reaper = reap_soon(proc)
    outcome = stop_tree(identity(proc), term_timeout=0.5)
    assert outcome.gone and outcome.escalated
    reaper.join(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def test_a_record_naming_an_unmarked_process_is_ignored_and_reported(started) -> None:
    # Real pid, real start time, even the recorded process group: but not this run's mark. This is
    # a recycled pid (another daemon's leaderless group) or a record that lies; never signalled.
    proc, child = started("term", env=dict(os.environ))
    job = identity(proc)
    view = look(job)
    assert view.members == set() and not view.leader_running and not leader_alive(job)
    assert [entry["record"] for entry in view.ignored] == ["pid"]
    assert "does not carry this run's mark" in view.ignored[0]["reason"]
    outcome = stop_tree(job, term_timeout=0.2, kill_wait=0.2)
    assert outcome.gone and outcome.signalled == [] and outcome.ignored == view.ignored
    assert alive(proc.pid) and alive(child)


def test_another_runs_mark_is_not_this_runs(started) -> None:
    proc, child = started("term", env=marked_env("another-run"))
    outcome = stop_tree(identity(proc), term_timeout=0.2, kill_wait=0.2)
    assert outcome.signalled == [] and alive(proc.pid) and alive(child)


def test_pid_1_and_the_modules_own_chain_in_a_record_are_never_signalled() -> None:
    for pid in (1, os.getpid(), os.getppid()):
        job = JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, pid=pid, starttime=process_starttime(pid),
                          supervisor_pid=pid, supervisor_starttime=process_starttime(pid))
        outcome = stop_tree(job, term_timeout=0.2, kill_wait=0.2)
        assert outcome.signalled == [] and outcome.gone
        assert {entry["record"] for entry in outcome.ignored} == {"pid", "supervisor_pid"}


def test_a_marked_member_in_the_modules_own_group_is_spared_and_reported(started) -> None:
    # A helper of the job that runs Ansible puts the controller in the job's group and mark.
    proc, child = started("term", own_group=False)
    outcome = stop_tree(identity(proc), term_timeout=0.3, kill_wait=0.3)
    assert outcome.signalled == [] and not outcome.gone
    assert {entry["pid"] for entry in outcome.remaining} == {proc.pid, child}
    assert all("process group of the Ansible process" in entry["protected"] for entry in outcome.remaining)
    assert alive(proc.pid) and alive(child)


SUPERVISOR = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env={})
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("proven", [True, False])
def test_descendants_of_a_proven_supervisor_are_members_even_without_a_mark(proven) -> None:
    env = dict(os.environ, **({SUPERVISOR_MARK: JOB_DIR} if proven else {}))
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True,
                                  env=env, process_group=0)
    child = int(supervisor.stdout.readline())
    try:
        job = JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, supervisor_pid=supervisor.pid,
                          supervisor_starttime=process_starttime(supervisor.pid))
        view = look(job)
        assert view.supervisor_alive is proven
        assert view.members == ({child} if proven else set())
        if not proven:
            assert [entry["record"] for entry in view.ignored] == ["supervisor_pid"]
        idle = {"supervisor_pid": supervisor.pid, "supervisor_starttime": process_starttime(supervisor.pid)}
        if not proven:
            assert wake_idle_supervisor(idle, JOB_DIR) == REFUSED
    finally:
        for pid in (child, supervisor.pid):
            os.kill(pid, signal.SIGKILL)
        supervisor.wait()


# A supervisor whose job starts another train_launch job: its supervisor (that job's mark) and a run
# of it (that run's mark, then a worker that cleared its environment), beside a worker of its own.
NESTING_SUPERVISOR = """
import subprocess, sys, time
SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]
own = subprocess.Popen(SLEEP, env={})
nested_supervisor = subprocess.Popen(SLEEP, env=OTHER_SUPERVISOR)
nested_run = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], env={}); "
                               "print(w.pid, flush=True); time.sleep(300)"], env=OTHER_RUN, stdout=subprocess.PIPE, text=True)
print(own.pid, nested_supervisor.pid, nested_run.pid, nested_run.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def nested_records(tmp_path: Path, nested_supervisor: int, nested_run: int) -> str:
    """A job directory only this user may write (believed), whose run record names the nested job."""
    directory = tmp_path / "nested"
    directory.mkdir(mode=0o700)
    (directory / "run.json").write_text(json.dumps({
        "run_id": "run-9", "pid": nested_run, "starttime": process_starttime(nested_run),
        "supervisor_pid": nested_supervisor, "supervisor_starttime": process_starttime(nested_supervisor)}))
    return str(directory)


@pytest.mark.parametrize("recorded", [True, False])
def test_only_a_proven_other_job_below_the_supervisor_keeps_its_subtree(tmp_path, recorded) -> None:
    """Descent stops at another job only where that job is proven: its records believed and its
    recorded supervisor or run alive and matching. Marks that name a job nobody can prove (no record)
    shield nothing: the processes are this job's, and the conflict is reported."""
    other = str(tmp_path / "nested")
    source = (NESTING_SUPERVISOR.replace("OTHER_SUPERVISOR", repr({SUPERVISOR_MARK: other}))
              .replace("OTHER_RUN", repr({RUN_MARK: run_mark(other, "run-9")})))
    supervisor = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True,
                                  env=dict(os.environ, **{SUPERVISOR_MARK: JOB_DIR}), process_group=0)
    own, nested_supervisor, nested_run, nested_worker = (int(pid) for pid in supervisor.stdout.readline().split())
    try:
        if recorded:
            nested_records(tmp_path, nested_supervisor, nested_run)
        job = JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, supervisor_pid=supervisor.pid,
                          supervisor_starttime=process_starttime(supervisor.pid))
        view = look(job)
        assert view.supervisor_alive
        if recorded:
            # The nested job's supervisor, its run and the worker that run started (no mark of its own)
            # are that job's: descent from this supervisor does not make them this job's.
            assert view.members == {own} and view.mark_conflicts == []
            assert not leader_alive(dataclasses.replace(job, pid=nested_worker, starttime=process_starttime(nested_worker)))
        else:
            assert view.members == {own, nested_supervisor, nested_run, nested_worker}
            assert {entry["pid"] for entry in view.mark_conflicts} == {nested_supervisor, nested_run}
            assert all(entry["marked_job_dir"] == other for entry in view.mark_conflicts)
    finally:
        for pid in (own, nested_supervisor, nested_worker, nested_run, supervisor.pid):
            os.kill(pid, signal.SIGKILL)
        supervisor.wait()


# A job's child that re-execs itself with marks naming another job, which does not exist.
REMARKING_CHILD = """
import os, sys, time
if sys.argv[1] == "first":
    env = dict(os.environ, GPUOPS_RELAUNCH_RUN="/var/lib/gpuops-test/ghost:run-0",
               GPUOPS_RELAUNCH_SUPERVISOR="/var/lib/gpuops-test/ghost")
    os.execve(sys.executable, [sys.executable, "-c", open(sys.argv[2]).read(), "again"], env)
print(os.getpid(), flush=True)
time.sleep(300)
"""
# Its supervisor, as the real one: it reaps its children.
REMARKING_SUPERVISOR = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, sys.argv[1], "first", sys.argv[1]], env=dict(MARKED))
child.wait()
time.sleep(300)
"""


def test_a_child_that_rewrites_its_marks_to_name_a_ghost_job_is_stopped(tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(REMARKING_CHILD)
    source = REMARKING_SUPERVISOR.replace("MARKED", repr(dict(os.environ, **{RUN_MARK: run_mark(JOB_DIR, RUN_ID)})))
    supervisor = subprocess.Popen([sys.executable, "-c", source, str(script)], stdout=subprocess.PIPE, text=True,
                                  env=dict(os.environ, **{SUPERVISOR_MARK: JOB_DIR}), process_group=0)
    child = int(supervisor.stdout.readline())
    try:
        assert b"GPUOPS_RELAUNCH_RUN=/var/lib/gpuops-test/ghost:run-0" in Path(f"/proc/{child}/environ").read_bytes()
        job = JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, supervisor_pid=supervisor.pid,
                          supervisor_starttime=process_starttime(supervisor.pid))
        outcome = stop_tree(job, term_timeout=5, kill_wait=5)
        assert outcome.gone and outcome.signalled == [child] and not outcome.escalated
        assert [entry["pid"] for entry in outcome.mark_conflicts] == [child]
        assert outcome.mark_conflicts[0]["marked_job_dir"] == "/var/lib/gpuops-test/ghost"
        assert not alive(child)
    finally:
        for pid in (child, supervisor.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        supervisor.wait()


# A job that saves a checkpoint when asked to stop (SIGTERM), frozen (SIGSTOP) when the stop comes.
CHECKPOINTING = """
import os, signal, sys, time
def save(signum, frame):
    with open(sys.argv[1], "w") as checkpoint:
        checkpoint.write("saved")
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
print(os.getpid(), flush=True)
time.sleep(300)
"""


def test_a_frozen_job_is_continued_after_sigterm_and_saves_its_checkpoint(tmp_path) -> None:
    checkpoint = tmp_path / "checkpoint"
    proc = subprocess.Popen([sys.executable, "-c", CHECKPOINTING, str(checkpoint)], stdout=subprocess.PIPE, text=True,
                            env=marked_env(), process_group=0)
    try:
        assert int(proc.stdout.readline()) == proc.pid
        os.kill(proc.pid, signal.SIGSTOP)
        assert Deadline(10).poll(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T")
        reaper = reap_soon(proc)
        outcome = stop_tree(identity(proc), term_timeout=5)
        reaper.join(timeout=10)
        assert outcome.gone and not outcome.escalated
        assert proc.returncode == 0 and checkpoint.read_text() == "saved"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A supervisor whose job leader ends in `exec env -i ...`: the leader keeps its pid and start time
# but no longer carries the run's mark (nor anything else).
CLEARING_SUPERVISOR = """
import subprocess, sys
leader = subprocess.Popen(["/bin/sh", "-c", 'exec /usr/bin/env -i "$0" -c "import time; time.sleep(300)"',
                           sys.executable], env=dict(MARKED))
print(leader.pid, flush=True)
leader.wait()
"""


@pytest.mark.parametrize("proven", [True, False])
def test_a_leader_that_cleared_its_environment_is_alive_below_its_proven_supervisor(proven) -> None:
    env = dict(os.environ, **({SUPERVISOR_MARK: JOB_DIR} if proven else {}))
    source = CLEARING_SUPERVISOR.replace("MARKED", repr({RUN_MARK: run_mark(JOB_DIR, RUN_ID), "PATH": "/usr/bin:/bin"}))
    supervisor = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True,
                                  env=env, process_group=0)
    leader = int(supervisor.stdout.readline())
    try:
        # The exec chain is done once the leader runs python without the mark.
        deadline = Deadline(30)
        assert deadline.poll(lambda: Path(f"/proc/{leader}/cmdline").read_bytes().startswith(sys.executable.encode())
                             and b"GPUOPS" not in Path(f"/proc/{leader}/environ").read_bytes())
        job = JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, pid=leader, starttime=process_starttime(leader),
                          supervisor_pid=supervisor.pid, supervisor_starttime=process_starttime(supervisor.pid))
        assert leader_alive(job) is proven and look(job).leader_running is proven
        # The recorded start time is what ties the pid to the run: another one proves nothing.
        assert not leader_alive(dataclasses.replace(job, starttime=job.starttime + 1))
        # Nor does a supervisor record of another start time (a recycled supervisor pid).
        assert not leader_alive(dataclasses.replace(job, supervisor_starttime=job.supervisor_starttime + 1))
    finally:
        for pid in (leader, supervisor.pid):
            os.kill(pid, signal.SIGKILL)
        supervisor.wait()


def test_leader_alive_sees_reuse_and_zombies() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"], env=marked_env())
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    job = JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, pid=child.pid, starttime=process_starttime(child.pid))
    assert not leader_alive(job)
    child.wait()
    assert not leader_alive(job)
    assert not leader_alive(JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID))


@pytest.mark.parametrize("run", [
    {"run_id": "a", "pid": "12"}, {"run_id": "a", "supervisor_pid": 1.5}, {"run_id": 7}, {},
])
def test_a_run_record_of_the_wrong_kind_is_a_record_error(run) -> None:
    with pytest.raises(RecordError, match="^run.json: "):
        JobIdentity.from_run(run, JOB_DIR)


UNIT_GROUP = "/system.slice/gpuops-job.service"  # JOB_DIR's name is "job"
HOST_INIT = "0::/init.scope\n"


@pytest.mark.parametrize("backend, init_cgroup, cgroup, alive", [
    ("systemd", HOST_INIT, f"0::{UNIT_GROUP}\n", True),
    ("systemd", "0::/\n", f"0::{UNIT_GROUP}\n", True),  # PID 1 at the root of a cgroup namespace
    # A container without a cgroup namespace: systemd's root is its own group, without init.scope.
    ("systemd", "0::/lxc.payload.ct/init.scope\n", f"0::/lxc.payload.ct{UNIT_GROUP}\n", True),
    ("systemd", "12:memory:/init.scope\n1:name=systemd:/init.scope\n",
     f"12:memory:{UNIT_GROUP}\n1:name=systemd:{UNIT_GROUP}\n", True),  # cgroup v1
    ("supervisor", HOST_INIT, f"0::{UNIT_GROUP}\n", False),  # only the systemd backend's runs live in a unit
    ("systemd", HOST_INIT, "0::/user.slice/user-1000.slice/user@1000.service/app.slice/gpuops-job.service\n", False),
    ("systemd", HOST_INIT, f"0::/lxc.payload.200{UNIT_GROUP}\n", False),  # a container's job seen from the host
    ("systemd", "0::/lxc.payload.ct/init.scope\n", f"0::{UNIT_GROUP}\n", False),
    ("systemd", HOST_INIT, "0::/system.slice/gpuops-other.service\n", False),
    ("systemd", HOST_INIT, f"0::{UNIT_GROUP}/extra\n", False),
    ("systemd", HOST_INIT, f"1:name=systemd:{UNIT_GROUP}\n", False),  # another hierarchy than PID 1's
])
def test_a_systemd_leader_without_its_mark_is_alive_in_its_units_control_group(tmp_path, backend, init_cgroup,
                                                                               cgroup, alive) -> None:
    """The systemd backend has no supervisor: the unit's control group below systemd's root (the unit
    named after the job, not after the record) proves a leader that cleared its environment."""
    fake = FakeProc(tmp_path)
    (fake.add(1, "systemd", ppid=0, starttime=10) / "cgroup").write_text(init_cgroup)
    leader = fake.add(50, "python3", ppid=1, starttime=5000)
    (leader / "environ").write_bytes(b"PATH=/usr/bin\0")  # `exec env -i`: no mark
    (leader / "cgroup").write_text(cgroup)
    run = {"run_id": RUN_ID, "backend": backend, "unit": "ssh.service", "pid": 50, "starttime": 5000}
    job = JobIdentity.from_run(run, JOB_DIR)
    assert leader_alive(job, str(tmp_path)) is alive
    assert (50 in look(job, str(tmp_path)).members) is alive
    # The pid with another start time (reused) is never the leader, whatever its control group.
    assert not leader_alive(dataclasses.replace(job, starttime=4999), str(tmp_path))


def test_the_look_proves_again_only_the_processes_that_carry_the_runs_mark(tmp_path, monkeypatch) -> None:
    """A process whose environment names this run is read again (its stat alone) to prove the
    environment was its own; one whose environment does not is no member whoever's it was, and is
    not read again. What the result names is escaped however late it is shown."""
    fake = FakeProc(tmp_path)
    fake.add(1, "init", ppid=0, starttime=1)
    mark = run_mark(JOB_DIR, RUN_ID)
    for pid in range(100, 120):  # bystanders: another run's mark, or none
        fake.add(pid, "python3", starttime=6000, environ={RUN_MARK: run_mark(JOB_DIR, "run-0")} if pid % 2 else {})
    fake.add(200, "\x1b]0;pwned\x07", starttime=6000, cmdline=["python3", "\x1b[2Jtrain.py"], environ={RUN_MARK: mark})
    fake.add(201, "python3", starttime=4000, environ={RUN_MARK: mark})  # this run's mark, but older than the run
    fake.add(202, "python3", starttime=6000, environ={})
    job = JobIdentity(job_dir=JOB_DIR, run_id=RUN_ID, pid=200, starttime=6000)
    table = ProcessTable.scan(str(tmp_path))
    fake.add(202, "python3", starttime=6001, environ={RUN_MARK: mark})  # its pid taken by a marked process since
    reads: list[str] = []
    real = procfs.read_small
    monkeypatch.setattr(procfs, "read_small", lambda path: reads.append(path) or real(path))
    view = prove(table, job)
    assert view.members == {200} and view.leader_running
    assert sorted(path for path in reads if not path.endswith("/environ")) == [f"{tmp_path}/200/stat", f"{tmp_path}/202/stat"]
    assert view.describe([200]) == [{"pid": 200, "ppid": 1, "state": "S", "comm": "\\x1b]0;pwned\\x07"}]
    # A look of its own reads no command line: one is read (and proven) when something asks for it.
    reads.clear()
    view = look(job, str(tmp_path))
    # (202 is a member now: the process that has its pid carries the mark and started after the run.)
    assert view.members == {200, 202} and not [path for path in reads if path.endswith("/cmdline")]
    assert view.table.processes[200].cmdline == "python3 \\x1b[2Jtrain.py"
    assert [path for path in reads if path.endswith("/cmdline")] == [f"{tmp_path}/200/cmdline"]


# --- the run-id fence ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expected,current,alive,answer", [
    (None, "y", True, False),  # no fence: today's behaviour
    ("x", None, True, False),  # no recorded run
    ("x", "x", True, False),  # the run the look saw
    ("x", "y", False, False),  # a newer run that does not run: nothing of it to protect
    ("x", "y", True, True),  # a newer live run: another relaunch's
    ("", "y", True, True),  # the look saw no run: any live run is newer
])
def test_a_newer_live_run_supersedes_the_run_a_step_was_sent_for(expected, current, alive, answer):
    asked = []

    def is_alive():
        asked.append(True)
        return alive
    assert supersedes(expected, current, is_alive) is answer
    # Liveness is read only when the runs differ.
    assert bool(asked) == (expected is not None and current is not None and current != expected)


def test_expect_run_id_is_a_run_id_or_empty_else_named():
    assert check_expect_run_id(None) is None and check_expect_run_id("") == ""
    assert check_expect_run_id("3f2a9c0e5b8d4e1f9a7c6b5d4e3f2a1b") == "3f2a9c0e5b8d4e1f9a7c6b5d4e3f2a1b"
    for bad in ("../etc", "a" * 65, "x\n", 5):
        with pytest.raises(BadOption) as caught:
            check_expect_run_id(bad)
        assert caught.value.option == "expect_run_id" and "\n" not in caught.value.reason
