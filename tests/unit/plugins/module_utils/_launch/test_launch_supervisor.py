"""launch_supervisor: the supervisor program run for real, and the detaching spawn."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import supervisor as launch_supervisor
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import (
    exit_fields,
    install_supervisor,
    read_json,
    record_systemd_exit,
    signal_identity,
    spawn_detached,
    write_json_atomic,
)
from tests.harness.procstates import SAVES_ON_SIGTERM, wait_until

DEMO = str(Path(__file__).resolve().parents[5] / "playbooks" / "files" / "demo_train.py")


def children_of(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.fixture
def job_dir(tmp_path):
    directory = tmp_path / "job"
    directory.mkdir()
    return directory


def launch(job_dir: Path, argv: list[str], log: Path, linger: str = "never", run_id: str = "r1") -> subprocess.Popen:
    """Run the installed copy of the supervisor as our child, so the test can wait for it."""
    write_json_atomic(str(job_dir / "launch.json"), {
        "run_id": run_id, "argv": argv, "env": {"PATH": os.environ["PATH"]}, "chdir": str(job_dir),
        "user": None, "group": None, "spec_hash": "h", "log_path": str(log)})
    script = install_supervisor(str(job_dir))
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, script, "run", str(job_dir), linger], stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL)


def test_supervisor_reaps_orphans_forwards_sigterm_and_records_the_exit(job_dir, tmp_path) -> None:
    log = tmp_path / "train.log"
    pids = tmp_path / "workers"
    supervisor = launch(job_dir, [sys.executable, DEMO, "--workers", "2", "--worker-seconds", "0.5",
                                  "--pid-file", str(pids)], log)
    try:
        wait_until((job_dir / "run.json").exists)
        run = read_json(str(job_dir / "run.json"))
        assert run["supervisor_pid"] == supervisor.pid and run["pgid"] == run["pid"] and run["run_id"] == "r1"
        assert os.getpgid(run["pid"]) == run["pid"]  # the job leads a group of its own
        wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2)
        workers = [int(p) for p in pids.read_text().split()]
        # Orphaned at once, the workers are adopted by the supervisor (subreaper), then reaped by it.
        assert set(workers) <= set(children_of(supervisor.pid)) | {w for w in workers if not Path(f"/proc/{w}").exists()}
        wait_until(lambda: not any(Path(f"/proc/{w}").exists() for w in workers))
        assert not (job_dir / "exit.json").exists()
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    record = json.loads((job_dir / "exit.json").read_text())
    assert record["run_id"] == "r1" and record["exit_code"] == 0 and record["exit_signal"] is None
    assert "got signal 15" in log.read_text()
    assert oct((job_dir / "exit.json").stat().st_mode & 0o777) == "0o600"


def test_supervisor_records_a_failing_job_and_a_missing_program(job_dir, tmp_path) -> None:
    log = tmp_path / "train.log"
    supervisor = launch(job_dir, [sys.executable, DEMO, "--exit-after", "0", "--exit-code", "3"], log)
    assert supervisor.wait(timeout=30) == 0
    assert read_json(str(job_dir / "exit.json"))["exit_code"] == 3
    supervisor = launch(job_dir, ["/nonexistent/program"], log)
    assert supervisor.wait(timeout=30) == 1
    assert "No such file" in read_json(str(job_dir / "exit.json"))["error"]


def test_supervisor_lingers_where_nothing_reaps_it_and_takes_the_next_run(job_dir, tmp_path) -> None:
    log = tmp_path / "train.log"
    supervisor = launch(job_dir, [sys.executable, DEMO, "--exit-after", "0", "--exit-code", "3"], log, linger="always")
    try:
        wait_until((job_dir / "idle.json").exists)
        idle = read_json(str(job_dir / "idle.json"))
        assert idle["supervisor_pid"] == supervisor.pid and idle["last_run_id"] == "r1"
        assert supervisor.poll() is None and read_json(str(job_dir / "exit.json"))["exit_code"] == 3
        log.rename(str(log) + ".1")  # rotated, as the module does before a start
        write_json_atomic(str(job_dir / "launch.json"), {
            "run_id": "r2", "argv": [sys.executable, DEMO, "--exit-after", "0", "--exit-code", "4"],
            "env": {"PATH": os.environ["PATH"]}, "chdir": str(job_dir), "log_path": str(log)})
        supervisor.send_signal(signal.SIGUSR1)
        wait_until(lambda: (read_json(str(job_dir / "exit.json")) or {}).get("run_id") == "r2")
        assert read_json(str(job_dir / "exit.json"))["exit_code"] == 4
        assert "exiting with code 4" in log.read_text()  # the new run writes to the new log
        assert "exiting with code 4" not in Path(str(log) + ".1").read_text()
        assert read_json(str(job_dir / "run.json"))["supervisor_pid"] == supervisor.pid
        wait_until(lambda: (read_json(str(job_dir / "idle.json")) or {}).get("last_run_id") == "r2")
        supervisor.send_signal(signal.SIGTERM)  # idle: told to end, it ends
        assert supervisor.wait(timeout=30) == 0
        assert not (job_dir / "idle.json").exists()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


@pytest.mark.parametrize("sigcgt, sigign, reaps", [
    ("0000000000000000", "0000000000000000", False),  # sleep as a container init
    ("0000000000010000", "0000000000000000", True),   # catches SIGCHLD (systemd, tini, bash)
    ("0000000000000000", "0000000000010000", True),   # ignores SIGCHLD: the kernel reaps
    ("00000000000004e8", "0000000000001000", False),  # polls wait() without a handler
])
def test_parent_reaps(tmp_path, sigcgt, sigign, reaps) -> None:
    status = tmp_path / str(os.getppid()) / "status"
    status.parent.mkdir()
    status.write_text(f"Name:\tinit\nSigBlk:\t0000000000000000\nSigIgn:\t{sigign}\nSigCgt:\t{sigcgt}\n")
    assert launch_supervisor.parent_reaps(str(tmp_path)) is reaps
    assert launch_supervisor.parent_reaps(str(tmp_path / "missing")) is True


def test_supervisor_copy_runs_without_the_collection(job_dir) -> None:
    script = install_supervisor(str(job_dir))
    assert "ansible_collections" not in [line.split()[1] for line in Path(script).read_text().splitlines()
                                         if line.startswith(("import ", "from "))]
    proc = subprocess.run([sys.executable, "-I", script], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_spawn_detached_leaves_the_session_and_closes_fds(tmp_path) -> None:
    log = tmp_path / "out.log"
    report = tmp_path / "report.json"
    keep_open = os.open(os.devnull, os.O_RDONLY)  # inheritable: must not reach the daemon
    os.set_inheritable(keep_open, True)
    code = ("import json,os,sys; print('hello'); json.dump({'sid': os.getsid(0), 'pid': os.getpid(), "
            "'fds': sorted(os.listdir('/proc/self/fd')), 'stdin': os.readlink('/proc/self/fd/0'), "
            "'ppid': os.getppid(), 'cwd': os.getcwd()}, open(sys.argv[1], 'w'))")
    try:
        spawn_detached([sys.executable, "-c", code, str(report)], str(log))
    finally:
        os.close(keep_open)
    wait_until(lambda: report.exists() and report.stat().st_size > 0)
    wait_until(lambda: read_json(str(report)) is not None)
    seen = read_json(str(report))
    # A session of its own (setsid in the first child), but not its leader (second fork), so it
    # can never acquire a controlling terminal.
    assert seen["sid"] != os.getsid(0) and seen["sid"] != seen["pid"]
    assert seen["stdin"] == "/dev/null" and seen["cwd"] == "/"
    assert seen["ppid"] != os.getpid()  # the intermediate child exited: we are not its parent
    assert set(seen["fds"]) <= {"0", "1", "2", "3"}  # 3: the listing's own directory fd
    wait_until(lambda: "hello" in log.read_text())


def test_atomic_write_and_read(tmp_path) -> None:
    path = str(tmp_path / "state.json")
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert read_json(path) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    (tmp_path / "partial.json").write_text('{"a": ')
    assert read_json(str(tmp_path / "partial.json")) is None
    assert read_json(str(tmp_path / "missing.json")) is None


def test_exit_fields() -> None:
    assert exit_fields(3 << 8) == {"exit_code": 3, "exit_signal": None}
    assert exit_fields(signal.SIGKILL) == {"exit_code": None, "exit_signal": "SIGKILL"}


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"EXIT_CODE": "exited", "EXIT_STATUS": "3", "SERVICE_RESULT": "exit-code"}, (3, None)),
        ({"EXIT_CODE": "exited", "EXIT_STATUS": "0", "SERVICE_RESULT": "success"}, (0, None)),
        ({"EXIT_CODE": "killed", "EXIT_STATUS": "TERM", "SERVICE_RESULT": "success"}, (None, "SIGTERM")),
        ({"EXIT_CODE": "dumped", "EXIT_STATUS": "SEGV", "SERVICE_RESULT": "core-dump"}, (None, "SIGSEGV")),
    ],
)
def test_record_systemd_exit(tmp_path, environ, expected) -> None:
    record_systemd_exit(str(tmp_path), "r9", environ)
    record = read_json(str(tmp_path / "exit.json"))
    assert (record["exit_code"], record["exit_signal"]) == expected
    assert record["run_id"] == "r9" and record["service_result"] == environ["SERVICE_RESULT"]


def test_source_is_this_module() -> None:
    assert "class Supervisor" in launch_supervisor.supervisor_source()


def test_forwarding_reaches_only_group_members_below_the_supervisor_and_by_identity() -> None:
    # A group of ours (leader + child) and a stranger that joins no group of ours: only our
    # descendants in the group count, and a start time that is not the process's own is refused.
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                              process_group=0)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    try:
        members = wait_until(lambda: len(launch_supervisor.group_members_below(leader.pid, os.getpid())) == 2
                             and launch_supervisor.group_members_below(leader.pid, os.getpid()), what="the child")
        assert leader.pid in {pid for pid, _start in members}
        assert launch_supervisor.group_members_below(leader.pid, stranger.pid) == []  # none of them below the stranger
        start = launch_supervisor.process_starttime(stranger.pid)
        assert launch_supervisor.signal_identity(stranger.pid, start - 1, signal.SIGTERM) is False
        assert stranger.poll() is None
        for pid, starttime in members:
            assert launch_supervisor.signal_identity(pid, starttime, signal.SIGKILL) is True
        assert leader.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in (leader, stranger):
            proc.kill()
            proc.wait()


def test_the_private_copy_runs_alone_with_its_jobfiles_and_safepath(tmp_path) -> None:
    """The copy imports nothing from the collection: jobfiles.py and safepath.py lie next to it, and the
    live health's judgement (health.py) and writer (textfile.py) with the standard-library files they import."""
    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o700)
    script = install_supervisor(str(job_dir))
    assert sorted(os.listdir(job_dir)) == ["checkpoints.py", "health.py", "health_judge.py", "health_reads.py", "jobfiles.py", "live.py",
                                           "live_gpus.py", "options.py", "polling.py", "safepath.py", "supervisor.py",
                                           "terminal.py", "textfile.py", "verdict.py", "xid.py"]
    # The live look at the job's GPUs imports alone from the copies too, and its NVML child runs alone.
    alone = subprocess.run([sys.executable, "-I", "-B", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import live_gpus, live",
                            str(job_dir)], env={}, cwd="/", capture_output=True, text=True, timeout=60, check=False)
    assert alone.returncode == 0, alone.stderr
    child = subprocess.run([sys.executable, "-I", str(job_dir / "health_reads.py"), str(tmp_path)], env={}, cwd="/",
                           capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0 and "error" in json.loads(child.stdout), child.stdout + child.stderr
    for name in os.listdir(job_dir):
        assert (job_dir / name).stat().st_mode & 0o777 == 0o600
    # -I and an empty environment, from /: no collection, no PYTHONPATH, nothing but the copies.
    shown = subprocess.run([sys.executable, "-I", script], env={}, cwd="/", capture_output=True, text=True,
                           timeout=60, check=False)
    assert shown.returncode == 2 and shown.stderr.startswith("usage: supervisor.py"), shown.stderr
    # record-exit goes through jobfiles' atomic write in the copy.
    recorded = subprocess.run([sys.executable, "-I", script, "record-exit", str(job_dir), "r1"], cwd="/",
                              env={"EXIT_CODE": "exited", "EXIT_STATUS": "3", "SERVICE_RESULT": "exit-code"},
                              capture_output=True, text=True, timeout=60, check=False)
    assert recorded.returncode == 0, recorded.stderr
    assert json.loads((job_dir / "exit.json").read_text())["exit_code"] == 3


# --- chdir: walked or entered as the job's user, never followed as root ----------------------------


@pytest.fixture(name="swapped_workdir")
def swapped_workdir_fixture():
    """/tmp/gpuops-chdir-*/ (0755): vault/ is root's (0700) with inner/ (0755) and its secret (0644) in it,
    which nobody cannot reach by path; home/ is nobody's, and nobody swapped its work/ for a link to
    vault/inner. Yields (the chdir, the directory work/ was moved to)."""
    base = Path(tempfile.mkdtemp(prefix="gpuops-chdir-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "vault").mkdir(mode=0o700)
        (base / "vault" / "inner").mkdir(mode=0o755)
        (base / "vault" / "inner" / "secret").write_text("root's secret\n")
        (base / "home").mkdir()
        os.chown(base / "home", 65534, 65534)
        as_nobody = {"user": 65534, "group": 65534, "extra_groups": [], "timeout": 30}
        subprocess.run(["mkdir", str(base / "home" / "work")], check=True, **as_nobody)
        subprocess.run(["sh", "-c", f"echo nobody\\'s own > {base}/home/work/secret"], check=True, **as_nobody)
        subprocess.run(["mv", str(base / "home" / "work"), str(base / "home" / "work.old")], check=True, **as_nobody)
        subprocess.run(["ln", "-s", str(base / "vault" / "inner"), str(base / "home" / "work")], check=True, **as_nobody)
        yield str(base / "home" / "work"), str(base / "home" / "work.old")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def write_launch(job_dir: Path, log: Path, chdir: str, user: str | None) -> None:
    write_json_atomic(str(job_dir / "launch.json"), {
        "run_id": "r1", "argv": ["/bin/cat", "secret"], "env": {"PATH": "/usr/bin:/bin"}, "chdir": chdir,
        "user": user, "group": None, "spec_hash": "h", "log_path": str(log)})


def run_backend(backend: str, job_dir: Path, log: Path) -> int:
    """The supervisor (`run`) or the systemd unit's main process (`exec`), for real, as root."""
    script = install_supervisor(str(job_dir))
    argv = [sys.executable, "-I", script, "run", str(job_dir), "never"] if backend == "supervisor" else \
        [sys.executable, "-I", script, "exec", str(job_dir), "r1"]
    with open(log, "ab") as out:
        return subprocess.run(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd="/", timeout=60,
                              check=False).returncode


@pytest.mark.parametrize("backend", ["supervisor", "systemd-exec"])
@pytest.mark.parametrize("user", ["nobody", None], ids=["as-nobody", "as-root"])
def test_a_chdir_swapped_for_a_symlink_is_never_followed_as_root(
        job_dir, tmp_path, swapped_workdir, backend, user) -> None:
    """Between two runs the job's user swaps its working directory for a link into a root-only place:
    the job must not start there (it would read root's file through its working directory)."""
    planted, _real = swapped_workdir
    log = tmp_path / "train.log"
    log.touch()
    write_launch(job_dir, log, planted, user)
    code = run_backend(backend, job_dir, log)
    assert "root's secret" not in log.read_text()
    assert code == 1
    error = read_json(str(job_dir / "exit.json"))["error"]
    if user == "nobody":
        # Entered as nobody, after dropping root: nobody may not pass vault/.
        assert f"the working directory '{planted}' cannot be entered as user nobody: Permission denied" in error, error
    else:
        # A job of root's: walked as the log is; a link another user can change is refused.
        assert f"{planted} is a symbolic link that a user other than root can change" in error, error


@pytest.mark.parametrize("backend", ["supervisor", "systemd-exec"])
def test_a_chdir_the_jobs_user_may_enter_is_its_working_directory(job_dir, tmp_path, swapped_workdir, backend) -> None:
    _planted, real = swapped_workdir
    log = tmp_path / "train.log"
    log.touch()
    os.chown(log, 65534, 65534)
    write_launch(job_dir, log, real, "nobody")
    assert run_backend(backend, job_dir, log) == 0
    assert "nobody's own" in log.read_text()


def test_a_systemd_start_that_fails_after_dropping_root_is_recorded_as_a_start_failure(job_dir, tmp_path,
                                                                                       swapped_workdir) -> None:
    """The unit's main process cannot write the record once it is the job's user: the error of an exec
    that fails then (an interpreter that is gone) still reaches exit.json through ExecStopPost."""
    _planted, real = swapped_workdir
    broken = Path(real).parent / "broken.sh"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    log = tmp_path / "train.log"
    log.touch()
    write_launch(job_dir, log, real, "nobody")
    record = read_json(str(job_dir / "launch.json"))
    write_json_atomic(str(job_dir / "launch.json"), dict(record, argv=[str(broken)]))
    assert run_backend("systemd-exec", job_dir, log) == 127
    script = str(job_dir / "supervisor.py")
    recorded = subprocess.run([sys.executable, "-I", script, "record-exit", str(job_dir), "r1"], cwd="/",
                              env={"EXIT_CODE": "exited", "EXIT_STATUS": "127", "SERVICE_RESULT": "exit-code"},
                              capture_output=True, text=True, timeout=60, check=False)
    assert recorded.returncode == 0, recorded.stderr
    ended = read_json(str(job_dir / "exit.json"))
    assert ended["exit_code"] == 127 and f"cannot start ['{broken}']" in ended["error"], ended
    assert "No such file or directory" in ended["error"]
    assert "start_error.txt" not in os.listdir(job_dir)  # taken into exit.json


@pytest.mark.parametrize("use_pidfd", [True, False])
def test_a_forwarded_sigterm_reaches_a_stopped_member_with_sigcont(tmp_path, monkeypatch, use_pidfd) -> None:
    """The supervisor's own copy of the gate continues a stopped member after SIGTERM, as the gate does."""
    if not use_pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    saved = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, "-c", SAVES_ON_SIGTERM, str(saved)], stdout=subprocess.PIPE, text=True)
    try:
        assert int(proc.stdout.readline()) == proc.pid
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", what="T")
        starttime = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        assert signal_identity(proc.pid, starttime, signal.SIGTERM) is True
        assert proc.wait(timeout=10) == 0 and saved.read_text() == "saved"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
