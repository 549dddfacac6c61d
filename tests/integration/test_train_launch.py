"""train_launch for real: ansible-playbook on localhost and inside a never-reaping PID namespace.

Every test launches the demo job (playbooks/files/demo_train.py) through the real module and checks
the real process table afterwards. The namespace's init (``sleep``) never reaps, so a process the job
orphans would stay a zombie there for ever unless the supervisor, its subreaper, reaps it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.launch_targets import DEMO, Target, in_pid_namespace, on_localhost, playbook_popen, readable_by_all
from tests.harness.pidns import pid_namespace
from tests.harness.playbook import REPO, run_playbook
from tests.harness.procstates import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(params=["localhost", "pidns"])
def target(request, tmp_path):
    with (on_localhost if request.param == "localhost" else in_pid_namespace)(tmp_path) as where:
        yield where


@pytest.fixture
def local(tmp_path):
    with on_localhost(tmp_path) as where:
        yield where


def job_processes(target: Target, result: dict) -> dict:
    """Processes of the run `result` describes: its group, and everything below its supervisor."""
    table = target.processes()
    members = {pid: proc for pid, proc in table.items() if proc.pgid == result["pgid"]}
    pending = [result["supervisor_pid"]]
    while pending:
        parent = pending.pop()
        for proc in table.values():
            if proc.ppid == parent and proc.pid not in members:
                members[proc.pid] = proc
                pending.append(proc.pid)
    return members


def umask_of(target: Target, pid: int) -> str:
    """The Umask: line of a running process's /proc/PID/status (what the kernel applies to its new files)."""
    status = Path(f"/proc/{target.host_pid(pid)}/status").read_text()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:"))


def test_lifecycle(target: Target, tmp_path: Path) -> None:
    """Start survives the launcher; orphans reaped; idempotent; restarted rotates; spec change restarts; stop."""
    worker_pids = tmp_path / "workers.pids"
    start = target.launch_task(
        command=target.demo("--workers", "2", "--worker-seconds", "1", "--pid-file", str(worker_pids)))
    # The play goes on to a task that waits for ever, so the launching session is still there when
    # the test kills its whole process group (ansible-playbook, its workers, the connection).
    hang = {"name": "hold the session open", "ansible.builtin.command": "sleep 300"}
    launcher = playbook_popen(target, [start, hang], tmp_path / "launcher.out")
    try:
        run = wait_until(lambda: target.read_state("job", "run.json"), what="run.json")
        wait_until(lambda: "step 1 " in Path(target.log()).read_text(), what="the ready line")
        wait_until(lambda: "sleep 300" in (tmp_path / "launcher.out").read_text() or
                   "hold the session open" in (tmp_path / "launcher.out").read_text(), what="the hanging task")
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=60)
    target.remember(run)
    assert "launch" in (tmp_path / "launcher.out").read_text()

    # The orphaned workers end after 1 s; the supervisor (their subreaper) reaps them: no zombie,
    # even in the namespace whose init never reaps.
    workers = [int(line) for line in wait_until(lambda: worker_pids.read_text().split(), what="worker pids")]
    assert len(workers) == 2
    wait_until(lambda: not set(workers) & set(target.processes()), what="workers reaped")
    if target.namespace is not None:
        zombies = [proc for proc in target.processes().values() if proc.zombie]
        assert zombies == [], zombies
    table = target.processes()
    assert run["pid"] in table and not table[run["pid"]].zombie, "the job died with its launcher"
    # The job's files are the user's: systemd's default umask, not the supervisor's own 0077.
    assert umask_of(target, run["pid"]) == "0022"
    assert umask_of(target, run["supervisor_pid"]) == "0077"
    # The supervisor runs its private copy (Ansible's temporary files are long gone), in a session
    # of its own, with stdin from /dev/null, stdout and stderr to the log, and no other fd open but
    # the two ends of its own wake-up pipe (signal.set_wakeup_fd: a SIGCHLD ends its wait at once).
    assert table[run["supervisor_pid"]].args.endswith(f"{target.state_dir}/job/supervisor.py run {target.state_dir}/job")
    supervisor_fds = Path(f"/proc/{target.host_pid(run['supervisor_pid'])}/fd")
    fds = {int(fd.name): os.readlink(fd) for fd in supervisor_fds.iterdir()}
    wake = {fd: link for fd, link in fds.items() if fd > 2}
    assert {fd: fds[fd] for fd in (0, 1, 2)} == {0: "/dev/null", 1: target.log(), 2: target.log()}
    assert len(wake) == 2 and len(set(wake.values())) == 1 and next(iter(wake.values())).startswith("pipe:"), fds

    # Same spec again: nothing to do (and the play returns while the job keeps printing).
    again = target.play([start])
    assert again.rc == 0, again.stdout
    same = again.result("launch")
    assert same["changed"] is False
    assert same["pid"] == run["pid"] and same["running"] is True

    # restarted: a new process, the previous log kept as train.log.1.
    restarted = target.play([dict(start, **{"gpuops.relaunch.train_launch": dict(
        start["gpuops.relaunch.train_launch"], state="restarted")})]).result("launch")
    assert restarted["changed"] is True and restarted["running"] is True
    assert restarted["pid"] != run["pid"]
    assert restarted["rotated_log"] == target.log() + ".1"
    old_log = Path(target.log() + ".1").read_text()
    assert f"demo_train pid {run['pid']} " in old_log and "step 1 " in old_log
    assert f"demo_train pid {restarted['pid']} " in Path(target.log()).read_text()
    assert f"demo_train pid {run['pid']} " not in Path(target.log()).read_text()
    assert restarted["previous"]["pid"] == run["pid"]
    assert restarted["previous"]["exit_code"] == 0  # the demo ends cleanly on SIGTERM
    assert run["pid"] not in target.processes()

    # A spec change (one more env variable) with state=started restarts.
    # The umask option takes effect with it (alone it restarts nothing: it is not part of the spec).
    changed_spec = dict(start["gpuops.relaunch.train_launch"], env={"RUN": "2"}, umask="0027")
    second = target.play([{"name": "launch", "gpuops.relaunch.train_launch": changed_spec}]).result("launch")
    assert second["changed"] is True and second["pid"] != restarted["pid"]
    assert umask_of(target, second["pid"]) == "0027"
    assert second["spec_hash"] != restarted["spec_hash"]
    assert second["previous"]["pid"] == restarted["pid"]
    assert Path(target.log() + ".2").read_text() == old_log

    # stopped: nothing of the job left, no zombie of it; a second stop changes nothing.
    stop = {"name": "stop", "gpuops.relaunch.train_launch": {
        "name": "job", "state": "stopped", "state_dir": target.state_dir, "term_timeout": 5}}
    stopped = target.play([stop]).result("stop")
    assert stopped["changed"] is True and stopped["running"] is False
    assert stopped["exit_code"] == 0 and stopped["exit_signal"] is None and stopped["ended_at"]
    assert stopped["stop"]["escalated"] is False
    assert job_processes(target, second) == {}
    leftovers = [proc for proc in target.processes().values()
                 if proc.pid in (second["pid"], restarted["pid"], run["pid"]) or target.mine(proc)]
    assert leftovers == []
    if target.namespace is not None:
        # PID 1 there never reaps, so the supervisor did not exit (it would stay a zombie for ever):
        # it waits idle, and took over the later runs instead of a new supervisor each time.
        assert [proc for proc in target.processes().values() if proc.zombie] == []
        assert second["supervisor_pid"] == restarted["supervisor_pid"] == run["supervisor_pid"]
        assert target.read_state("job", "idle.json")["supervisor_pid"] == run["supervisor_pid"]
    assert target.play([stop]).result("stop")["changed"] is False


def test_start_fails_with_exit_code_and_log_tail(target: Target) -> None:
    run = target.play([target.launch_task(
        command=target.demo("--exit-after", "1", "--exit-code", "3", "--ready-after", "5"),
        min_uptime=3, startup_timeout=20)])
    result = run.result("launch")
    assert run.rc != 0 and result["failed"] is True
    assert result["exit_code"] == 3 and result["exit_signal"] is None
    assert "exit code 3" in result["msg"]
    assert "exiting with code 3" in result["log_tail"]
    assert result["running"] is False
    assert not [proc for proc in target.processes().values() if target.mine(proc)]


def test_start_fails_at_deadline_without_ready_line(local: Target) -> None:
    run = local.play([local.launch_task(command=local.demo("--no-ready"), startup_timeout=2)])
    result = run.result("launch")
    assert result["failed"] is True
    assert "ready_regex" in result["msg"] and "appeared" in result["msg"]
    assert "setup 3/3" in result["log_tail"]
    # The job that never proved itself is not left running (a re-run must not call it started).
    assert result["stopped_after_failure"] is True and result["running"] is False
    assert result["pid"] not in local.processes()


def test_runs_as_the_requested_user(local: Target) -> None:
    # nobody runs a copy of the demo it can read: the checkout may lie under a 0700 directory.
    with readable_by_all(DEMO) as copies:
        started = local.play([local.launch_task(command=local.demo(script=copies[DEMO]), user="nobody",
                                                group="nogroup")]).result("launch")
        assert started["changed"] is True and started["running"] is True, started
        status = Path(f"/proc/{started['pid']}/status").read_text()
        uid = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        gid = next(line.split()[1:] for line in status.splitlines() if line.startswith("Gid:"))
        assert set(uid) == {"65534"} and set(gid) == {"65534"}
        assert Path(local.log()).stat().st_uid == 65534  # the log belongs to the job's user
        stop = {"name": "stop", "gpuops.relaunch.train_launch": {
            "name": "job", "state": "stopped", "state_dir": local.state_dir}}
        assert local.play([stop]).result("stop")["changed"] is True


def test_a_start_that_cannot_work_changes_nothing(local: Target) -> None:
    """A missing program or a NUL in env is refused before the running job is stopped or its log rotated."""
    running = local.play([local.launch_task()]).result("launch")
    log_before = Path(local.log()).read_text()
    for bad in ({"command": ["/nonexistent/train"]}, {"env": {"SEED": "1\u0000 2"}}):
        result = local.play([local.launch_task(**bad)]).result("launch")
        assert result["failed"] is True and result["changed"] is False
        assert result["msg"].startswith(("command: '/nonexistent/train' is not an executable file",
                                         "env: the value of SEED contains a NUL byte"))
    assert not Path(local.log() + ".1").exists() and Path(local.log()).read_text().startswith(log_before)
    again = local.play([local.launch_task()]).result("launch")
    assert again["changed"] is False and again["pid"] == running["pid"]


def test_stop_escalates_to_sigkill_and_ends_escaped_workers(local: Target, tmp_path: Path) -> None:
    """A job that ignores SIGTERM and a worker that left its process group: both end."""
    pids = tmp_path / "workers.pids"
    start = local.launch_task(command=local.demo(
        "--ignore-term", "--workers", "1", "--worker-seconds", "300", "--worker-setsid", "--pid-file", str(pids)))
    started = local.play([start]).result("launch")
    worker = int(wait_until(lambda: pids.read_text().split(), what="worker pid")[0])
    table = local.processes()
    assert table[worker].pgid != started["pgid"]  # it left the job's group ...
    assert table[worker].ppid == started["supervisor_pid"]  # ... but the subreaper adopted it
    stopped = local.play([{"name": "stop", "gpuops.relaunch.train_launch": {
        "name": "job", "state": "stopped", "state_dir": local.state_dir, "term_timeout": 1}}]).result("stop")
    assert stopped["changed"] is True and stopped["stop"]["escalated"] is True
    assert stopped["exit_signal"] == "SIGKILL"
    assert worker in stopped["stop"]["signalled"]
    table = local.processes()
    assert worker not in table and started["pid"] not in table
    # The supervisor has exited (perhaps still waiting for this machine's slow PID 1 to reap it),
    # or, where it judged that its parent never reaps, waits idle with no child.
    supervisor = table.get(started["supervisor_pid"])
    idle = local.read_state("job", "idle.json")
    assert supervisor is None or supervisor.zombie or (idle and idle["supervisor_pid"] == supervisor.pid)
    assert not [proc for proc in table.values() if proc.ppid == started["supervisor_pid"]]


def test_check_mode_starts_nothing(local: Target) -> None:
    cache = local.work / "torchinductor_root"
    cache.mkdir()
    Path(local.log()).write_text("previous run\n")
    run = local.play([local.launch_task(remove_paths=[str(cache)])], check=True)
    result = run.result("launch")
    assert result["changed"] is True and "would start" in result["msg"]
    assert result["rotated_log"] == local.log() + ".1" and result["removed_paths"] == [str(cache)]
    assert cache.exists() and Path(local.log()).read_text() == "previous run\n"
    assert not Path(local.log() + ".1").exists() and not Path(local.state_dir).exists()
    assert not [proc for proc in local.processes().values() if local.mine(proc)]


def test_check_mode_stop_of_running_job(local: Target) -> None:
    started = local.play([local.launch_task()]).result("launch")
    stop = {"name": "stop", "gpuops.relaunch.train_launch": {
        "name": "job", "state": "stopped", "state_dir": local.state_dir}}
    would = local.play([stop], check=True).result("stop")
    assert would["changed"] is True and "would stop" in would["msg"]
    assert started["pid"] in local.processes()
    assert local.play([stop]).result("stop")["changed"] is True


@pytest.fixture(name="ns")
def ns_fixture(tmp_path):
    with in_pid_namespace(tmp_path) as where:
        yield where


def test_absent_stops_the_job_ends_its_idle_supervisor_and_removes_its_records(ns: Target, tmp_path: Path) -> None:
    """Where PID 1 never reaps, a stopped job's supervisor waits idle: absent ends it too, then removes the records."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    started = ns.play([ns.launch_task(metrics_dir=str(metrics), metrics_host="ct")]).result("launch")
    live_file = metrics / "gpuops_job_job.prom"
    assert started["running"] is True and live_file.is_file()
    job_dir = Path(ns.state_dir) / "job"
    absent = {"name": "absent", "gpuops.relaunch.train_launch": {
        "name": "job", "state": "absent", "state_dir": ns.state_dir, "term_timeout": 5}}
    # Check mode says what it would stop and remove, and does none of it.
    would = ns.play([absent], check=True).result("absent")
    assert would["changed"] is True and would["removed"] == [str(job_dir), str(live_file)]
    assert would["msg"] == f"would stop the job (pid {started['pid']}), remove {job_dir}, {live_file}"
    assert started["pid"] in ns.processes() and job_dir.is_dir() and live_file.is_file()
    # For real: stopped as state=stopped stops it, the supervisor (idle once the job is gone) ended, all removed.
    gone = ns.play([absent]).result("absent")
    assert gone["changed"] is True and gone["removed"] == [str(job_dir), str(live_file)], gone
    assert gone["stop"]["escalated"] is False and gone["exit_code"] == 0
    assert gone["idle_supervisor"] == {"pid": started["supervisor_pid"], "signal": "SIGTERM", "sent": True}
    table = ns.processes()
    assert not [proc for proc in table.values() if ns.mine(proc) and not proc.zombie]
    # The ended supervisor stays a zombie of the never-reaping PID 1, and nothing else of the job.
    assert [proc.pid for proc in table.values() if proc.zombie] == [started["supervisor_pid"]]
    assert not job_dir.exists() and not live_file.exists() and Path(ns.log()).is_file()  # the log is kept
    again = ns.play([absent]).result("absent")
    assert again["changed"] is False and again["removed"] == [] and again["msg"] == "absent: no records of this job"
    # A link at the job's name is removed, never followed out of state_dir.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "run.json").write_text("{}")
    (Path(ns.state_dir) / "linked").symlink_to(elsewhere)
    linked = ns.play([{"name": "absent", "gpuops.relaunch.train_launch": {
        "name": "linked", "state": "absent", "state_dir": ns.state_dir}}]).result("absent")
    assert linked["changed"] is True and linked["removed"] == [f"{ns.state_dir}/linked"], linked
    assert not (Path(ns.state_dir) / "linked").is_symlink() and (elsewhere / "run.json").read_text() == "{}"


def test_the_stop_playbook_stops_the_job_and_ends_its_idle_supervisor(ns: Target) -> None:
    """gpuops.relaunch.stop: the job of the named host (its job_launch_* variables) stopped, the supervisor that would
    wait idle where PID 1 never reaps ended too, the records kept; check mode only says so; one line per host."""
    started = ns.play([ns.launch_task()]).result("launch")
    assert started["running"] is True
    job_vars = {"stop_hosts": "ct", "job_launch_name": "job", "job_launch_state_dir": ns.state_dir,
                "job_launch_log_path": ns.log(), "job_launch_term_timeout": 5}
    stop_playbook = str(REPO / "playbooks" / "stop.yml")
    would = run_playbook(stop_playbook, inventory=ns.inventory, extra_vars=job_vars, check=True)
    assert would.rc == 0, would.stdout
    assert f"ct [job]: would stop the job (pid {started['pid']}) with SIGTERM" in would.stdout
    assert started["pid"] in ns.processes()
    done = run_playbook(stop_playbook, inventory=ns.inventory, extra_vars=job_vars)
    assert done.rc == 0, done.stdout
    stopped = done.result("Stop the job, end its idle supervisor, keep its records")
    assert stopped["changed"] is True and stopped["exit_code"] == 0, stopped
    assert stopped["idle_supervisor"] == {"pid": started["supervisor_pid"], "signal": "SIGTERM", "sent": True}
    assert f"ct [job]: stopped; its idle supervisor (pid {started['supervisor_pid']}) ended" in done.stdout
    table = ns.processes()
    assert not [proc for proc in table.values() if ns.mine(proc) and not proc.zombie]
    # The ended supervisor stays a zombie of the never-reaping PID 1, and nothing else of the job.
    assert [proc.pid for proc in table.values() if proc.zombie] == [started["supervisor_pid"]]
    assert ns.read_state("job", "run.json")["run_id"] == started["run_id"]  # the records stay


def test_remove_paths_before_start(local: Target) -> None:
    cache = local.work / "torchinductor_root"
    (cache / "sub").mkdir(parents=True)
    (cache / "sub" / "kernel.so").write_text("x")
    stale = local.work / "stale.lock"
    stale.write_text("")
    result = local.play([local.launch_task(remove_paths=[str(cache), str(stale), str(local.work / "absent")])]
                        ).result("launch")
    assert result["changed"] is True
    assert result["removed_paths"] == [str(cache), str(stale)]
    assert not cache.exists() and not stale.exists()


@pytest.fixture
def read_only_dir(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_bad_input_fails_clearly_and_starts_nothing(local: Target, read_only_dir: Path) -> None:
    cases = {
        "empty command": ({"command": []}, "command:"),
        "string without shell": ({"command": "python3 train.py"}, "shell=true"),
        "relative log path": ({"log_path": "train.log"}, "log_path:"),
        "unknown user": ({"user": "no-such-user-gpuops"}, "user: no such user"),
        "unknown group": ({"group": "no-such-group-gpuops"}, "group: no such group"),
        "unwritable log dir": ({"log_path": str(read_only_dir / "train.log")}, "is on a read-only file system"),
        # A missing log directory is created by the start, where it can be.
        "log dir that cannot be created": ({"log_path": str(read_only_dir / "nope" / "train.log")},
                                           f"cannot create the log directory '{read_only_dir}/nope': {read_only_dir} "
                                           "is on a read-only file system"),
        "log dir under a file": ({"log_path": str(local.work / "inventory" / "logs" / "train.log")},
                                 "inventory is not a directory"),
        "invalid regex": ({"ready_regex": "step ("}, "ready_regex:"),
        "unsafe name": ({"name": "../evil"}, "name:"),
        "remove root": ({"remove_paths": ["/tmp/.."]}, "remove_paths:"),
        "relative remove path": ({"remove_paths": ["tmp/x"]}, "remove_paths:"),
        "min_uptime beyond deadline": ({"min_uptime": 30, "startup_timeout": 5}, "min_uptime:"),
        "unquoted umask": ({"umask": 18}, "umask: must be a string of 3 or 4 octal digits"),
        "umask beyond 0777": ({"umask": "1777"}, "umask: must be a string of 3 or 4 octal digits"),
    }
    tasks = []
    for title, (options, _expected) in cases.items():
        task = local.launch_task(task_name=title, **options)
        task["ignore_errors"] = True
        tasks.append(task)
    run = local.play(tasks)
    for title, (_options, expected) in cases.items():
        result = run.result(title)
        assert result.get("failed") is True, (title, result)
        assert expected in result["msg"], (title, result["msg"])
        assert "Traceback" not in result["msg"] and result.get("changed") is False
    assert not Path(local.state_dir).exists()
    assert not Path(local.log()).exists()
    assert not [proc for proc in local.processes().values() if local.mine(proc)]


def test_job_launch_role_starts_and_stops(local: Target) -> None:
    role_vars = {
        "job_launch_name": "role-job",
        "job_launch_command": local.demo(),
        "job_launch_log_path": str(local.work / "logs" / "train.log"),
        "job_launch_state_dir": local.state_dir,
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 0.5,
        "job_launch_startup_timeout": 20,
        "job_launch_term_timeout": 5,
    }
    start = {"name": "start via role", "ansible.builtin.include_role": {"name": "gpuops.relaunch.job_launch"},
             "vars": role_vars}
    stop = {"name": "stop via role", "ansible.builtin.include_role": {
        "name": "gpuops.relaunch.job_launch", "tasks_from": "stop"}, "vars": role_vars}
    show = {"name": "show", "ansible.builtin.debug": {"var": "job_launch_result"}}
    show_stop = {"name": "show stop", "ansible.builtin.debug": {"var": "job_launch_stop_result"}}
    # Check mode first, as playbooks/relaunch.yml probes: the log directory does not exist yet.
    probe = local.play([start, show], check=True)
    assert probe.rc == 0, probe.stdout[-3000:]
    assert probe.result("show")["job_launch_result"]["changed"] is True
    assert not (local.work / "logs").exists() and not Path(local.state_dir).exists()
    # The grace is job_launch_term_timeout, its one name: job_launch_stop_timeout, a name never
    # released, is refused as a misspelt variable before anything runs (ignored here, to go on).
    without_grace = {key: value for key, value in role_vars.items() if key != "job_launch_term_timeout"}
    probes = []
    for title, probe_vars in (("term_timeout", dict(role_vars, job_launch_term_timeout=7)),
                              ("stop_timeout", dict(without_grace, job_launch_stop_timeout=7))):
        stop_in_check_mode = {"name": "gpuops.relaunch.job_launch", "tasks_from": "stop",
                              "apply": {"check_mode": True, "ignore_errors": title == "stop_timeout"}}
        probes += [{"name": f"stop probe {title}", "ansible.builtin.include_role": stop_in_check_mode,
                    "vars": probe_vars},
                   {"name": f"show probe {title}", "ansible.builtin.debug": {"var": "job_launch_stop_result"}}]
    absent = {"name": "absent via role", "ansible.builtin.include_role": {
        "name": "gpuops.relaunch.job_launch", "tasks_from": "absent"}, "vars": role_vars}
    show_absent = {"name": "show absent", "ansible.builtin.debug": {"var": "job_launch_absent_result"}}
    run = local.play([start, show, *probes, stop, show_stop, absent, show_absent])
    assert run.rc == 0, run.stdout[-3000:]
    launched = run.result("show")["job_launch_result"]
    local.remember(launched)
    assert launched["changed"] is True and launched["ready_line"].startswith("step 1 ")
    assert launched["elapsed"] > 0 and "ready_after" not in launched  # elapsed: the one name for the seconds
    assert run.result("show probe term_timeout")["job_launch_stop_result"]["msg"].endswith("SIGKILL after 7s")
    refused = run.result("show probe stop_timeout")["job_launch_stop_result"]
    assert refused["failed"] is True and "invocation" not in refused, refused
    assert refused["msg"].startswith("job_launch_stop_timeout is not a variable of gpuops.relaunch"), refused["msg"]
    stopped = run.result("show stop")["job_launch_stop_result"]
    assert stopped["changed"] is True and stopped["running"] is False
    assert launched["pid"] not in local.processes()
    # Done with it: the records go (the stopped job's idle supervisor with them), the log stays.
    removed = run.result("show absent")["job_launch_absent_result"]
    assert removed["changed"] is True and str(Path(local.state_dir) / "role-job") in removed["removed"], removed
    assert not (Path(local.state_dir) / "role-job").exists() and (local.work / "logs" / "train.log").is_file()


@pytest.mark.parametrize("entry, missing", [
    ("main", "job_launch_name"), ("main", "job_launch_command"), ("stop", "job_launch_name"), ("health", "job_launch_name"),
])
def test_job_launch_role_needs_a_name_and_a_command(local: Target, entry: str, missing: str) -> None:
    """No default name (a second job would replace the first, and a stop would end a job called
    `train`) and no default command: the role fails naming the variable, and nothing changes."""
    role_vars = {
        "job_launch_name": "role-job",
        "job_launch_command": local.demo(),
        "job_launch_log_path": str(local.work / "logs" / "train.log"),
        "job_launch_state_dir": local.state_dir,
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 0.5,
    }
    del role_vars[missing]
    include = {"name": "include", "ansible.builtin.include_role": {"name": "gpuops.relaunch.job_launch", "tasks_from": entry},
               "vars": role_vars}
    run = local.play([include])
    assert run.rc != 0
    failures = [result for results in run.tasks.values() for result in results if result.get("failed")]
    assert len(failures) == 1 and failures[0]["msg"].endswith(f"missing required arguments: {missing}"), failures
    assert not (local.work / "logs").exists() and not Path(local.state_dir).exists()
    assert not [proc for proc in local.processes().values() if local.mine(proc)]


def test_job_launch_role_default_log_follows_the_name(local: Target) -> None:
    """Two jobs, two names, two logs: the default log path is /var/log/gpuops/NAME.log (asked in
    check mode, as relaunch.yml probes: nothing is created)."""
    probes = []
    for name in ("job-one", "job-two"):
        role = {"name": "gpuops.relaunch.job_launch", "apply": {"check_mode": True}}
        probes += [{"name": f"probe {name}", "ansible.builtin.include_role": role,
                    "vars": {"job_launch_name": name, "job_launch_command": local.demo(),
                             "job_launch_state_dir": local.state_dir, "job_launch_probe": True}},
                   {"name": f"show {name}", "ansible.builtin.debug": {"var": "job_launch_result"}}]
    run = local.play(probes)
    assert run.rc == 0, run.stdout[-3000:]
    for name in ("job-one", "job-two"):
        probe = run.result(f"show {name}")["job_launch_result"]
        assert probe["log_path"] == f"/var/log/gpuops/{name}.log" and probe["operation"] == "start", probe
    assert not Path(local.state_dir).exists()


# A stand-in supervisor with a wide window between reaping its last child and going idle (the real one's
# is milliseconds: it records the exit and refreshes the live file first). It carries the supervisor mark,
# so the stop proves it as the job's supervisor and its child as the run's member by descent.
SLOW_TO_SETTLE = r"""
import json, os, signal, sys, time
sys.path[:0] = [sys.argv[1]]
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.backends import SupervisorBackend
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import SUPERVISOR_MARK, process_starttime
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords
job_dir = sys.argv[2]
os.makedirs(job_dir, mode=0o700)
read_end, write_end = os.pipe()
supervisor = os.fork()
if supervisor == 0:
    os.setsid()  # the stop never signals the group of the process running it
    os.environ[SUPERVISOR_MARK] = job_dir
    os.set_inheritable(write_end, True)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.execv(sys.executable, [sys.executable, "-c", '''
import json, os, signal, sys, time
job_dir, ready = sys.argv[1], int(sys.argv[2])
leader = os.fork()
if leader == 0:
    os.execv("/bin/sleep", ["sleep", "600"])
os.write(ready, str(leader).encode())
os.close(ready)
os.waitpid(leader, 0)
time.sleep(0.5)
with open(os.path.join(job_dir, "idle.json"), "w") as idle:
    json.dump({"supervisor_pid": os.getpid(), "supervisor_starttime": int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])}, idle)
signal.pause()
''', job_dir, str(write_end)])
os.close(write_end)
leader = int(os.read(read_end, 64))
run = {"run_id": "settle", "pid": leader, "starttime": process_starttime(leader),
       "supervisor_pid": supervisor, "supervisor_starttime": process_starttime(supervisor)}
backend = SupervisorBackend(JobRecords(job_dir), sys.executable)
outcome = backend.stop(run, type("Options", (), {"term_timeout": 5})())
idle = backend.idle_supervisor()
print(json.dumps({"gone": outcome.gone, "idle": idle, "supervisor": supervisor}))
os.kill(supervisor, signal.SIGKILL)
"""


def test_stop_returns_once_the_supervisor_has_settled(tmp_path: Path) -> None:
    """The stop waits until the supervisor that reaped the job has gone idle (or exited): state=absent and a
    start look for the idle supervisor right after the stop, and one that went idle a moment later was missed
    (absent removed the records under it, without ending it)."""
    collections = Path(__file__).resolve().parents[2] / ".build" / "collections"
    with pid_namespace() as namespace:
        done = namespace.run_inside([sys.executable, "-I", "-c", SLOW_TO_SETTLE, str(collections), str(tmp_path / "job")])
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["gone"] is True
    assert seen["idle"] is not None and seen["idle"]["supervisor_pid"] == seen["supervisor"], seen
