"""train_launch's job identity for real: a job that clears its environment is still the job, and a job
that really went missing stays missing through its stop (the crash-loop guard counts it).

Everything runs inside a PID namespace whose init never reaps, so every signal (the module's and
this test's) stays inside it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.harness.launch_targets import DEMO, PYTHON, Target, in_pid_namespace
from tests.harness.pidns import process_starttime
from tests.harness.procstates import wait_until

pytestmark = pytest.mark.slow

RESUME = ["--resume", "latest"]


@pytest.fixture(name="ns")
def ns_fixture(tmp_path):
    with in_pid_namespace(tmp_path) as where:
        yield where


def job_dir(target: Target) -> Path:
    return Path(target.state_dir) / "job"


def ask(target: Target, state: str, check: bool = False, **options: Any) -> dict[str, Any]:
    """One train_launch task (health and stopped take no command); its result."""
    task = target.launch_task(task_name="t", state=state, resume_args=RESUME, max_relaunches=3, **options)
    if state in ("health", "stopped"):
        for key in ("command", "ready_regex", "min_uptime", "startup_timeout", "resume_args"):
            task["gpuops.relaunch.train_launch"].pop(key, None)
    result = target.play([task], check=check).result("t")
    assert result.get("failed") is not True or state == "started", result
    return result


def environ_inside(target: Target, pid: int) -> bytes:
    host = target.host_pid(pid)
    assert host is not None, f"pid {pid} is not in the namespace"
    return Path(f"/proc/{host}/environ").read_bytes()


def kill_inside(target: Target, pid: int) -> None:
    """SIGKILL the namespace's `pid` by its host pid, if that is still the process just looked up."""
    host = target.host_pid(pid)
    starttime = process_starttime(host) if host else None
    if host and starttime is not None and process_starttime(host) == starttime:
        os.kill(host, signal.SIGKILL)


def demo_args(target: Target) -> list[str]:
    return ["--tag", str(target.work), "--ready-after", "0.1", "--step-interval", "0.2"]


# The wrapper a job runs: `env -i` as the command itself, or a shell script that ends in `exec env -i`
# (as `su -`, `sudo -i` and container runtimes do, the job's environment is replaced).
WRAPPERS = {
    "env-i": lambda target: {"command": ["/usr/bin/env", "-i", PYTHON, DEMO, *demo_args(target)]},
    "sh-exec-env-i": lambda target: {
        "command": f"echo wrapper here; exec env -i {PYTHON} {DEMO} {shlex.join(demo_args(target))}", "shell": True},
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_a_job_that_clears_its_environment_is_still_the_job(ns: Target, wrapper: str) -> None:
    spec = WRAPPERS[wrapper](ns)
    first = ask(ns, "started", **spec)
    assert first["changed"] is True and first["running"] is True, first
    assert b"GPUOPS_RELAUNCH_RUN" not in environ_inside(ns, first["pid"])  # the mark is really gone
    # Descent from the proven supervisor proves it: the same spec running is left alone.
    second = ask(ns, "started", **spec)
    assert second["changed"] is False and second["operation"] == "none", second
    assert second["pid"] == first["pid"] and second["run_id"] == first["run_id"]
    assert second["health"]["state"] == "running"
    health = ask(ns, "health")
    assert health["health"]["state"] == "running" and health["running"] is True
    assert health["relaunch_guard"]["needed"] is False
    # A stop of a healthy job is no failure: nothing to count, nothing to resume.
    stopped = ask(ns, "stopped")
    assert stopped["changed"] is True and first["pid"] in stopped["stop"]["signalled"]
    assert stopped["incident"] is None and stopped["health"]["state"] == "running"
    after = ask(ns, "health")
    assert after["health"]["state"] == "stopped" and after["relaunch_guard"]["needed"] is False
    assert not (job_dir(ns) / "relaunches.json").exists()


def test_a_run_whose_record_points_at_a_gone_process_stays_missing_through_its_stop(ns: Target) -> None:
    """The supervisor's record names a leader that is gone (a record restored from another run): the
    run is missing though its supervisor and its real job live; the stop ends them and the supervisor
    records the exit, and the run is still missing - counted by the guard and resumed."""
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2")
    first = ask(ns, "started", command=command)
    assert first["running"] is True
    gone = ns.namespace.run_inside([PYTHON, "-c", "import os; print(os.getpid())"])
    gone_pid = int(gone.stdout)
    run_file = job_dir(ns) / "run.json"
    run = json.loads(run_file.read_text())
    run_file.write_text(json.dumps(dict(run, pid=gone_pid, pgid=gone_pid)))

    missing = ask(ns, "health")
    assert missing["health"]["state"] == "missing" and missing["relaunch_guard"]["needed"] is True
    assert "the recorded process" in missing["health"]["reason"]

    stopped = ask(ns, "stopped")
    assert stopped["changed"] is True and first["pid"] in stopped["stop"]["signalled"]
    assert stopped["health"]["state"] == "missing" and stopped["ended_at"]  # the supervisor recorded the end
    # Evidence before the stop signalled anything: the job's processes as they were.
    incident = json.loads(Path(stopped["incident"]).read_text())
    assert incident["health"]["state"] == "missing" and incident["run_id"] == first["run_id"]
    assert first["pid"] in [entry["pid"] for entry in incident["processes"]]

    # The supervisor has recorded the exit now: the run is still missing, not stopped.
    after = ask(ns, "health")
    assert after["health"]["state"] == "missing" and after["health"]["stopped"] is True
    assert after["health"]["ended_at"] == stopped["ended_at"] and after["relaunch_guard"]["needed"] is True
    assert after["health"]["log_tail"]  # a failure's log tail goes with it

    again = ask(ns, "started", command=command)
    assert again["changed"] is True and again["running"] is True and again["resumed"] is True
    assert again["health"]["state"] == "missing" and again["incident"] == stopped["incident"]
    assert "resuming from latest" in Path(ns.log()).read_text()
    history = json.loads((job_dir(ns) / "relaunches.json").read_text())["relaunches"]
    assert [(entry["health"], entry["run_id"]) for entry in history] == [("missing", first["run_id"])]


def test_a_job_killed_behind_its_supervisors_back_is_missing_with_evidence(ns: Target, tmp_path: Path) -> None:
    """The supervisor, then the job's leader, killed from outside (no exit record): the job's workers
    run on. The stop ends them after writing the incident record; the relaunch counts and resumes."""
    pids = tmp_path / "workers.pids"
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--workers", "2",
                      "--worker-seconds", "300", "--pid-file", str(pids))
    first = ask(ns, "started", command=command)
    workers = [int(pid) for pid in wait_until(lambda: len(pids.read_text().split()) == 2 and pids.read_text().split(),
                                              what="worker pids")]
    for pid in (first["supervisor_pid"], first["pid"]):  # the supervisor first: nothing records the end
        kill_inside(ns, pid)
    wait_until(lambda: all(ns.processes().get(pid) is None or ns.processes()[pid].zombie
                           for pid in (first["supervisor_pid"], first["pid"])), what="the leader and supervisor gone")

    stopped = ask(ns, "stopped")
    assert stopped["changed"] is True and stopped["health"]["state"] == "missing"
    assert set(workers) <= set(stopped["stop"]["signalled"])
    incident = json.loads(Path(stopped["incident"]).read_text())
    assert set(workers) <= {entry["pid"] for entry in incident["processes"]}
    assert all(ns.processes().get(pid) is None or ns.processes()[pid].zombie for pid in workers)

    again = ask(ns, "started", command=command)
    assert again["running"] is True and again["resumed"] is True and again["health"]["state"] == "missing"
    assert again["incident"] == stopped["incident"]
    history = json.loads((job_dir(ns) / "relaunches.json").read_text())["relaunches"]
    assert [entry["health"] for entry in history] == ["missing"]


# A trainer whose worker re-execs itself with GPUOPS_* marks that name another job, one that does not
# exist (an environment variable is anyone's to set): what a process says about itself shields nothing.
REMARKING_TRAINER = """
import os, subprocess, sys, time
if len(sys.argv) > 1 and sys.argv[1] == "worker":
    if os.environ.get("GPUOPS_RELAUNCH_SUPERVISOR") != "/var/lib/gpuops/ghost":
        env = dict(os.environ, GPUOPS_RELAUNCH_RUN="/var/lib/gpuops/ghost:0a1b", GPUOPS_RELAUNCH_SUPERVISOR="/var/lib/gpuops/ghost")
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    with open(sys.argv[2], "w") as out:
        out.write(str(os.getpid()))
    time.sleep(3600)
subprocess.Popen([sys.executable, __file__, "worker", sys.argv[1]])
step = 0
while True:
    step += 1
    print("step %d loss 0.1" % step, flush=True)
    time.sleep(0.2)
"""


def test_a_worker_that_rewrites_its_marks_to_name_a_ghost_job_is_stopped_with_the_job(ns: Target, tmp_path: Path) -> None:
    script = ns.work / "remarking.py"
    script.write_text(REMARKING_TRAINER, encoding="utf-8")
    worker_file = tmp_path / "worker.pid"
    first = ask(ns, "started", command=[PYTHON, str(script), str(worker_file)])
    assert first["running"] is True, first
    worker = int(wait_until(lambda: worker_file.exists() and worker_file.read_text(), what="the re-marked worker"))
    assert b"GPUOPS_RELAUNCH_SUPERVISOR=/var/lib/gpuops/ghost" in environ_inside(ns, worker)

    stopped = ask(ns, "stopped", term_timeout=10)
    assert stopped["changed"] is True and "failed" not in stopped, stopped
    assert {first["pid"], worker} <= set(stopped["stop"]["signalled"]), stopped["stop"]
    assert [(entry["pid"], entry["marked_job_dir"]) for entry in stopped["stop"]["mark_conflicts"]] == [
        (worker, "/var/lib/gpuops/ghost")]
    assert ns.processes().get(worker) is None or ns.processes()[worker].zombie
    # The next start is not blocked by what the stop could not end.
    again = ask(ns, "started", command=[PYTHON, str(script), str(worker_file)])
    assert again["running"] is True and again["changed"] is True, again


def test_a_relaunch_that_looked_at_an_older_run_leaves_the_newer_run_alone(ns: Target) -> None:
    """Two relaunch runs at once (the watchdog's and an alert's): run B looked at the crashed run X, run A
    then relaunched the job as run Y. B's stop and clean-up, given the run B's decision saw (as the relaunch
    role passes it), must not end Y: both say that a newer run superseded the one they were sent for. A stop
    by hand, without the run it expects, still stops the job."""
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--workers", "1", "--worker-seconds", "600")
    first = ask(ns, "started", command=command)
    assert first["running"] is True
    kill_inside(ns, first["pid"])
    wait_until(lambda: (ns.read_state("job", "exit.json") or {}).get("run_id") == first["run_id"], what="X's exit record")
    # Run B's look: the crashed run X.
    seen = ask(ns, "probe", command=command)
    assert seen["health"]["state"] == "crashed" and seen["health"]["run_id"] == first["run_id"], seen["health"]
    # Run A relaunches it: run Y.
    fresh = ask(ns, "started", command=command)
    assert fresh["changed"] is True and fresh["running"] is True and fresh["run_id"] != first["run_id"]
    host = ns.host_pid(fresh["pid"])
    started = process_starttime(host)

    # Run B's stop and clean-up, as the relaunch role runs them (expecting the run its decision saw).
    stop = ask(ns, "stopped", expect_run_id=seen["health"]["run_id"])
    assert stop["changed"] is False and stop["superseded"] is True, stop
    assert stop["newer_run"]["run_id"] == fresh["run_id"] and stop["newer_run"]["pid"] == fresh["pid"], stop
    cleanup = ns.play([{"name": "reap", "gpuops.relaunch.zombie_reap": {
        "match": [re.escape(f"--tag {ns.work}")], "job_name": "job", "job_state_dir": ns.state_dir,
        "expect_run_id": seen["health"]["run_id"], "term_timeout": 2}}]).result("reap")
    assert "failed" not in cleanup and cleanup["changed"] is False and cleanup["signals_sent"] == 0, cleanup
    assert cleanup["superseded"] is True and cleanup["newer_run"]["run_id"] == fresh["run_id"], cleanup
    assert cleanup["escalation"] == "none", cleanup
    assert process_starttime(host) == started and ns.host_pid(fresh["pid"]) == host  # Y runs on, the same process
    still = ask(ns, "health")
    assert still["health"]["state"] == "running" and still["run_id"] == fresh["run_id"]

    # The same through the relaunch's own path, as run B goes on after its decision. B's decision is given B's look
    # (the job's rank look, here of a job of one rank: a job of one host would probe again) and runs B's steps in its
    # task (plugin_utils/relaunch_steps): B saw X's worker still running, so it stops; the stop and the clean-up leave Y
    # alone and the drain is skipped; the role's launch starts nothing, and the summary says why.
    role_vars = {"job_launch_name": "job", "job_launch_command": command, "job_launch_log_path": ns.log(),
                 "job_launch_state_dir": ns.state_dir, "job_launch_ready_regex": "^step 1 ", "job_launch_min_uptime": 0.5,
                 "job_launch_startup_timeout": 20, "job_launch_term_timeout": 5, "job_launch_resume_args": RESUME,
                 "process_cleanup_match": [re.escape(f"--tag {ns.work}")], "process_cleanup_term_timeout": 2,
                 "gpu_drain_gpus_required": False, "gpu_drain_timeout": 5}
    rank = {"index": 0, "of": 1, "ranks": ["{{ inventory_hostname }}"], "master_addr": "127.0.0.1", "master_port": 29500}
    steps = ns.play([
        {"name": "B's decision", "gpuops.relaunch.relaunch_decision": {"rank_looks": [{"probe": seen, "rank": rank}],
                                                                       "job_name": "job"},
         "vars": role_vars, "register": "relaunch_ranks_decided"},
        {"name": "B's launch", "gpuops.relaunch.role_step": {"module": "train_launch", "options": {"state": "started"}},
         "vars": role_vars, "register": "relaunch_launch"},
        {"name": "B's summary", "gpuops.relaunch.relaunch_summary": {
            "results": {"probe": seen, "decision": "{{ relaunch_decision }}", "launch": "{{ relaunch_launch }}"},
            "decision_steps": "{{ relaunch_ranks_decided.steps }}",
            "job_name": "job", "summary_dir": "", "metrics_dir": "", "fail_host": False}},
    ])
    assert steps.rc == 0, steps.stdout[-3000:]
    decided = steps.result("B's decision")
    assert decided["decision"]["expect_run_id"] == first["run_id"] and decided["decision"]["stop"] is True, decided
    assert decided["steps"]["stop"]["superseded"] is True and decided["steps"]["cleanup"]["superseded"] is True
    assert decided["steps"]["drain"] is None and decided["steps"]["clearance"]["clear"] is True, decided["steps"]
    launch = steps.result("B's launch")
    assert launch["changed"] is False and launch["pid"] == fresh["pid"], launch
    summary = steps.result("B's summary")["ansible_facts"]["relaunch_summary"]
    assert summary["status"] == "unchanged" and summary["relaunched"] is False, summary
    assert summary["why"].endswith(f"the job already ran with this spec (pid {fresh['pid']}), started meanwhile by another "
                                   f"run: this run started nothing"), summary["why"]
    assert process_starttime(host) == started and ns.host_pid(fresh["pid"]) == host

    # The run the stop expects is the recorded one: it stops as it always did; so does a stop by hand.
    expected = ask(ns, "stopped", check=True, expect_run_id=fresh["run_id"])
    assert expected["changed"] is True and expected["superseded"] is False, expected
    by_hand = ask(ns, "stopped")
    assert by_hand["changed"] is True and "superseded" not in by_hand, by_hand
    assert ns.host_pid(fresh["pid"]) is None or process_starttime(host) != started


def test_a_fenced_clean_up_waits_for_the_jobs_lock(ns: Target) -> None:
    """A start in progress holds the job's lock and records its run only after it launched it; a clean-up
    for an older run (expect_run_id) takes that lock before it looks, so it never sees the new run
    unrecorded. Here the test holds the lock: the clean-up waits with the lock file open, and goes on,
    leaving the job (which no run of the job owns) to the selection as before, once it is free."""
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2")
    first = ask(ns, "started", command=command)
    stopped = ask(ns, "stopped")
    assert stopped["changed"] is True, stopped
    lock = job_dir(ns) / ".lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    done: dict[str, Any] = {}

    def clean_up() -> None:
        done["run"] = ns.play([{"name": "reap", "gpuops.relaunch.zombie_reap": {
            "match": [re.escape(f"--tag {ns.work}")], "job_name": "job", "job_state_dir": ns.state_dir,
            "expect_run_id": first["run_id"], "term_timeout": 2}}])
    worker = threading.Thread(target=clean_up)
    try:
        worker.start()
        wait_until(lambda: any(opened(pid, lock) for pid in other_pids()), what="the clean-up waiting on the job's lock")
        assert worker.is_alive() and "run" not in done
    finally:
        os.close(holder)
        worker.join(timeout=120)
    cleanup = done["run"].result("reap")
    assert "failed" not in cleanup and cleanup["superseded"] is False and cleanup["newer_run"] is None, cleanup


def other_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]


def opened(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open (its fd links), read as far as it still exists."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False
