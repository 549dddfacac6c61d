"""train_launch under attack: recycled pids, lying records, a helper of the job running the stop,
links and FIFOs where the log should be, numbers that never end, starts that cannot work.

Everything that could signal a stranger runs inside a private PID namespace (the job, the stranger
and the module all live there); the file tests run on localhost, where only the test's own job runs.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests.harness.launch_targets import PYTHON, Target, in_pid_namespace, on_localhost
from tests.harness.playbook import BIN, REPO
from tests.harness.procstates import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def ns_target(tmp_path):
    with in_pid_namespace(tmp_path) as where:
        yield where


@pytest.fixture
def local(tmp_path):
    with on_localhost(tmp_path) as where:
        yield where


def stop_task(target: Target, **options) -> dict:
    args = {"name": "job", "state": "stopped", "state_dir": target.state_dir, "term_timeout": 2}
    args.update(options)
    return {"name": "stop", "gpuops.relaunch.train_launch": args}


# Inside the namespace: make the next fork get pid P (ns_last_pid), and there play a classic daemon:
# the child calls setsid (a group with id P) and forks a grandchild into it; with "--leave" the child
# exits and leaves the group leaderless, as a double-forking daemon does.
STRANGER = textwrap.dedent(r"""
    import json, os, sys, time
    target, leave = int(sys.argv[1]), sys.argv[2] == "--leave"
    r, w = os.pipe()
    with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
        handle.write(str(target - 1))
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)  # so the caller's pipes close when we are done talking
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.close(r); os.close(w)
            time.sleep(300); os._exit(0)
        os.write(w, json.dumps({"child": os.getpid(), "grandchild": grandchild}).encode())
        os.close(w)
        if leave:
            os._exit(0)
        time.sleep(300); os._exit(0)
    os.close(w)
    print(os.read(r, 4096).decode(), flush=True)
    if leave:
        os.waitpid(child, 0)
""")


def stat_inside(target: Target, pid: int) -> str | None:
    host = target.host_pid(pid)
    try:
        return Path(f"/proc/{host}/stat").read_text() if host else None
    except OSError:
        return None


def alive_inside(target: Target, pid: int) -> bool:
    stat = stat_inside(target, pid)
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def starttime_inside(target: Target, pid: int) -> int:
    return int(stat_inside(target, pid).rsplit(")", 1)[1].split()[19])


@pytest.mark.parametrize("leave", [True, False], ids=["leaderless-group", "live-pid"])
def test_a_recycled_pid_and_group_are_never_signalled(ns_target: Target, leave: bool) -> None:
    """Finding 1: a stopped run's pid P, reused by a daemon's group P, is someone else's."""
    first = ns_target.play([ns_target.launch_task()]).result("launch")
    assert ns_target.play([stop_task(ns_target)]).result("stop")["changed"] is True
    recycled = ns_target.namespace.run_inside(
        [PYTHON, "-c", STRANGER, str(first["pid"]), "--leave" if leave else "--stay"])
    assert recycled.returncode == 0, recycled.stderr
    stranger = json.loads(recycled.stdout)
    table = ns_target.processes()
    assert table[stranger["grandchild"]].pgid == first["pgid"]  # the very group id the record holds
    if not leave:
        assert stranger["child"] == first["pid"]  # and the very pid

    stopped = ns_target.play([stop_task(ns_target)]).result("stop")
    assert stopped["changed"] is False and stopped["msg"] == "not running"
    started = ns_target.play([ns_target.launch_task()]).result("launch")
    assert started["changed"] is True and started["msg"].startswith("started ")  # not "restarted"
    assert "stop" not in started
    assert ns_target.play([stop_task(ns_target)]).result("stop")["changed"] is True
    assert alive_inside(ns_target, stranger["grandchild"])
    if not leave:
        assert alive_inside(ns_target, stranger["child"])


def test_a_record_that_names_a_stranger_or_pid_1_is_ignored(ns_target: Target) -> None:
    """Finding 3: pids written into run.json and idle.json are proven, not trusted."""
    started = ns_target.play([ns_target.launch_task()]).result("launch")
    assert ns_target.play([stop_task(ns_target)]).result("stop")["changed"] is True
    # A stranger with the default action for SIGUSR1 and SIGTERM (both would end it).
    spawned = ns_target.namespace.run_inside(
        ["/bin/sh", "-c", "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!"])
    stranger = int(spawned.stdout)
    job_dir = Path(ns_target.state_dir, "job")
    run = json.loads((job_dir / "run.json").read_text())
    for lie in ({"pid": stranger, "starttime": starttime_inside(ns_target, stranger)},
                {"pid": 1, "starttime": starttime_inside(ns_target, 1), "supervisor_pid": 1,
                 "supervisor_starttime": starttime_inside(ns_target, 1)}):
        (job_dir / "exit.json").unlink(missing_ok=True)
        (job_dir / "run.json").write_text(json.dumps(dict(run, **lie)))
        stopped = ns_target.play([stop_task(ns_target)]).result("stop")
        assert stopped["changed"] is False and stopped["running"] is False
        assert alive_inside(ns_target, stranger) and ns_target.namespace.alive()

    # idle.json naming the stranger: the start must not SIGUSR1 it, but start a supervisor of its own.
    (job_dir / "run.json").write_text(json.dumps(run))
    supervisor = started["supervisor_pid"]
    (job_dir / "idle.json").write_text(json.dumps({
        "supervisor_pid": stranger, "supervisor_starttime": starttime_inside(ns_target, stranger)}))
    again = ns_target.play([ns_target.launch_task()]).result("launch")
    assert again["changed"] is True and again.get("running") is True, json.dumps(again)
    assert again["supervisor_pid"] not in (stranger, supervisor)
    assert alive_inside(ns_target, stranger)
    assert ns_target.play([stop_task(ns_target)]).result("stop")["changed"] is True
    assert alive_inside(ns_target, stranger)


HELPER_STOP = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: stop
      gpuops.relaunch.train_launch: {name: job, state: stopped, state_dir: STATE_DIR, term_timeout: 1}
"""


def test_a_helper_of_the_job_running_the_stop_is_not_killed(ns_target: Target, tmp_path: Path) -> None:
    """Finding 2: ansible-playbook in the job's process group (and carrying its mark) survives its stop."""
    playbook = tmp_path / "helper_stop.yml"
    playbook.write_text(HELPER_STOP.replace("STATE_DIR", ns_target.state_dir))
    out, trigger = tmp_path / "helper.out", tmp_path / "run-the-helper"
    # The job proves its start, then (once the launching task has let go of the job's lock) its
    # helper runs the stop from inside the job's process group.
    script = (f"echo 'step 1 ready'; while [ ! -e {trigger} ]; do sleep 0.1; done; "
              f"{BIN}/ansible-playbook -i localhost, -c local {playbook} > {out} 2>&1; "
              f"echo rc=$? >> {out}; exec sleep 300")
    env = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_PYTHON_INTERPRETER": PYTHON, "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
           "HOME": str(tmp_path)}
    launched = ns_target.play([ns_target.launch_task(command=script, shell=True, env=env)]).result("launch")
    assert launched["running"] is True, launched
    trigger.write_text("")
    text = wait_until(lambda: out.exists() and "rc=" in out.read_text() and out.read_text(), timeout=120,
                      what="the helper's playbook")
    assert "rc=2" in text and "rc=143" not in text, text  # the stop failed cleanly, not by SIGTERM
    assert "may never be signalled" in text and "runs this module or is one of its ancestors" in text
    stopped = ns_target.play([stop_task(ns_target)]).result("stop")
    assert stopped["changed"] is True and stopped["stop"]["signalled"]


def test_symlinks_and_fifos_at_log_path(local: Target, tmp_path: Path) -> None:
    """Finding 4: the log is never a link or a FIFO; nothing is chowned or read through one."""
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    log = Path(local.log())
    log.symlink_to(secret)
    linked = local.play([local.launch_task(user="nobody")]).result("launch")
    assert linked["failed"] is True and linked["msg"].startswith("log_path:") and "symbolic link" in linked["msg"]
    assert secret.stat().st_uid == 0 and secret.read_text() == "root only\n"
    log.unlink()
    os.mkfifo(log)
    fifo = local.play([local.launch_task()], timeout=60).result("launch")
    assert fifo["failed"] is True and "not a regular file" in fifo["msg"]
    log.unlink()

    # A link swapped in while the job runs: the result never shows the target's contents.
    started = local.play([local.launch_task()]).result("launch")
    assert started["running"] is True
    log.unlink()
    log.symlink_to(secret)
    again = local.play([local.launch_task()]).result("launch")
    assert "root only" not in json.dumps(again)
    stopped = local.play([stop_task(local)]).result("stop")
    assert stopped["changed"] is True and "root only" not in json.dumps(stopped)


def test_failed_starts_never_push_out_the_last_good_log(local: Target) -> None:
    """Finding 6: with keep_logs 2, three failed starts keep the log of the run that was proven."""
    good = local.play([local.launch_task(keep_logs=2)]).result("launch")
    assert good["running"] is True
    assert local.play([stop_task(local)]).result("stop")["changed"] is True
    good_log = Path(local.log()).read_text()
    for attempt in range(3):
        failed = local.play([local.launch_task(
            keep_logs=2, command=local.demo("--exit-after", "0.2", "--exit-code", str(10 + attempt), "--no-ready"),
        )]).result("launch")
        assert failed["failed"] is True and f"exit code {10 + attempt}" in failed["msg"]
    logs = {path.name: path.read_text() for path in Path(local.work).glob("train.log*")}
    assert good_log in logs.values()  # the proven run's log survived
    assert "exiting with code 11" in logs["train.log.failed"]  # the last failed start but one, set aside
    assert "exiting with code 12" in logs["train.log"]
    fresh = local.play([local.launch_task(keep_logs=2)]).result("launch")
    assert fresh["running"] is True and fresh["rotated_log"] == local.log() + ".failed"
    assert good_log in [path.read_text() for path in Path(local.work).glob("train.log.[0-9]")]


def test_a_new_log_path_restarts_the_job(local: Target) -> None:
    first = local.play([local.launch_task()]).result("launch")
    moved = local.play([local.launch_task(log_path=local.log("moved.log"))]).result("launch")
    assert moved["changed"] is True and moved["pid"] != first["pid"]
    assert moved["log_path"] == local.log("moved.log")
    assert f"demo_train pid {moved['pid']} " in Path(local.log("moved.log")).read_text()


NUMBERS_THAT_NEVER_END = [
    ("term_timeout", "{{ 'nan' | float }}"),
    ("startup_timeout", "{{ 'inf' | float }}"),
    ("min_uptime", 1e12),
]


def test_numbers_that_never_end_are_refused(local: Target) -> None:
    # One play, a task per case (ignore_errors), not an ansible-playbook start for each.
    tasks = [dict(local.launch_task(task_name=option, **{option: value}), ignore_errors=True)
             for option, value in NUMBERS_THAT_NEVER_END]
    run = local.play(tasks, timeout=60)
    for option, _value in NUMBERS_THAT_NEVER_END:
        result = run.result(option)
        assert result["failed"] is True and result["msg"].startswith(f"{option}: ")
        assert [problem["option"] for problem in result["option_problems"]] == [option]
    assert not Path(local.state_dir).exists()


def test_stop_timeout_is_not_a_name_of_term_timeout(local: Target) -> None:
    # One name per option: stop_timeout was never released, so it is refused, not quietly mapped.
    task = local.launch_task(stop_timeout=1)
    result = local.play([task], timeout=60).result("launch")
    assert result["failed"] is True and "stop_timeout" in result["msg"] and "Unsupported parameters" in result["msg"]
    assert not Path(local.state_dir).exists()


def test_every_bad_option_is_reported_in_one_failure(local: Target) -> None:
    task = local.launch_task(term_timeout="{{ 'nan' | float }}", keep_logs=0, ready_regex="(")
    result = local.play([task], timeout=60).result("launch")
    assert result["failed"] is True and result.get("changed") is False
    assert [problem["option"] for problem in result["option_problems"]] == ["ready_regex", "term_timeout", "keep_logs"]
    assert "ready_regex: " in result["msg"] and "term_timeout: " in result["msg"] and "keep_logs: " in result["msg"]
    assert not Path(local.state_dir).exists()


def test_a_start_that_fails_after_the_stop_is_the_relaunchs_own_failure(ns_target: Target, tmp_path: Path) -> None:
    """Issue 24 item 2: a restart stops the healthy run, then its program cannot be executed (its
    interpreter is gone: no check before the stop can see that). Nothing of the new run ran: the job
    is the run that was stopped, never missing - the crash-loop guard does not count it and the next
    start adds no resume_args."""
    broken = tmp_path / "train.sh"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    started = ns_target.play([ns_target.launch_task()]).result("launch")
    assert started["running"] is True, started
    guarded = {"max_relaunches": 0, "resume_args": ["--resume-from-checkpoint"]}
    run = ns_target.play([
        dict(ns_target.launch_task(task_name="restart", command=[str(broken)], state="restarted", **guarded),
             ignore_errors=True),
        ns_target.launch_task(task_name="probe", state="probe", **guarded),
        ns_target.launch_task(task_name="start", **guarded),
    ])
    restart = run.result("restart")
    assert restart["failed"] is True and restart["previous"]["pid"] == started["pid"], restart
    assert "No such file or directory" in restart["start_error"]
    probe = run.result("probe")
    assert probe["health"]["state"] == "stopped" and probe["health"]["run_id"] == started["run_id"], probe["health"]
    assert f"the start of run {restart['run_id']} failed before the job ran" in probe["health"]["reason"]
    assert probe["relaunch_guard"]["needed"] is False and probe["relaunch_guard"]["would_refuse"] is False
    assert probe["decision"]["action"] == "relaunch" and probe["decision"]["resume"] is False
    again = run.result("start")
    assert again["running"] is True and again["resumed"] is False, again
    assert "--resume-from-checkpoint" not in ns_target.processes()[again["pid"]].args
    assert ns_target.play([stop_task(ns_target)]).result("stop")["changed"] is True
