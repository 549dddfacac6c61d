"""train_launch's systemd backend for real: inside an LXC container whose init is systemd.

The first run builds the container's root filesystem with debootstrap (a few minutes, cached under
.build/systemd-rootfs); later runs boot it in about a second.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import systemd_ct
from tests.harness.launch_targets import DEMO
from tests.harness.playbook import run_playbook
from tests.harness.procstates import wait_until

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

JOB_DEMO = "/opt/demo_train.py"
LOG = "/var/log/train.log"
STATE_DIR = "/var/lib/gpuops-test"
METRICS_DIR = "/var/lib/node-exporter-test"
LIVE = {"metrics_dir": METRICS_DIR, "metrics_host": "ct-host", "progress_regex": r"^step (\d+) ", "stall_after": 600}


@pytest.fixture(scope="module")
def container():
    why_not = systemd_ct.available()
    if why_not:
        pytest.skip(why_not)
    rootfs = systemd_ct.ensure_rootfs()
    shutil.copy(DEMO, rootfs / JOB_DEMO.lstrip("/"))
    with systemd_ct.systemd_container(rootfs) as ct:
        for stale in (ct.path(LOG), *ct.path(LOG).parent.glob("train.log.*")):
            stale.unlink(missing_ok=True)
        shutil.rmtree(ct.path(STATE_DIR), ignore_errors=True)
        shutil.rmtree(ct.path(METRICS_DIR), ignore_errors=True)
        yield ct


def play(ct, tmp_path: Path, tasks: list[dict]):
    run = run_playbook([{"hosts": "all", "gather_facts": False, "tasks": tasks}],
                       inventory=ct.write_inventory(tmp_path / "inventory"))
    return run


def launch(name: str = "job", task: str = "launch", **options):
    args = {"name": name, "command": ["/usr/bin/python3", JOB_DEMO], "log_path": LOG, "state_dir": STATE_DIR,
            "ready_regex": "^step 1 ", "min_uptime": 0.5, "startup_timeout": 20, "term_timeout": 5}
    args.update(options)
    return {"name": task, "gpuops.relaunch.train_launch": args}


def stop_task(name: str, **options):
    return {"name": "stop", "gpuops.relaunch.train_launch": dict(
        {"name": name, "state": "stopped", "state_dir": STATE_DIR}, **options)}


def show(ct, unit: str, *props: str) -> dict[str, str]:
    out = ct.run_inside(["systemctl", "show", unit, "-p", ",".join(props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def live_state(ct) -> str | None:
    """The state the job's live file says (train_launch's metrics_dir), or None."""
    try:
        text = ct.path(METRICS_DIR + "/gpuops_job_job.prom").read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    found = re.findall(r'^gpuops_job_health\{gpuops_job="job",gpuops_host="ct-host",gpuops_rank0="ct-host",gpuops_run="\w+",state="(\w+)"\} 1$', text, re.M)
    return found[0] if len(found) == 1 else None


def test_systemd_backend_lifecycle(container, tmp_path: Path) -> None:
    ct = container
    ct.path(METRICS_DIR).mkdir(mode=0o755, exist_ok=True)
    start = launch(command=["/usr/bin/python3", JOB_DEMO, "--workers", "2", "--worker-seconds", "0.5"], **LIVE)
    run = play(ct, tmp_path, [start])
    assert run.rc == 0, run.stdout[-3000:]
    started = run.result("launch")
    assert started["backend"] == "systemd"  # auto: PID 1 is systemd here
    assert started["unit"] == "gpuops-job.service" and started["ready_line"].startswith("step 1 ")
    unit = show(ct, "gpuops-job.service", "ActiveState", "MainPID", "KillMode", "StandardOutput",
                "CollectMode", "ExecStopPost", "TimeoutStopUSec")
    assert unit["ActiveState"] == "active" and int(unit["MainPID"]) == started["pid"]
    assert unit["KillMode"] == "mixed" and unit["CollectMode"] == "inactive-or-failed"
    assert unit["TimeoutStopUSec"] == "5s"
    assert "record-exit" in unit["ExecStopPost"]
    # PID 1 is given no log path to open: the main process opened it and became the job.
    assert unit["StandardOutput"].split(":")[0] not in ("append", "file", "truncate")  # shown without its path
    fds = ct.run_inside(["readlink", f"/proc/{started['pid']}/fd/1", f"/proc/{started['pid']}/fd/2"]).stdout.split()
    assert fds == [LOG, LOG]
    environment = show(ct, "gpuops-job.service", "Environment")["Environment"]
    assert environment.startswith("GPUOPS_RELAUNCH_RUN=") and " " not in environment  # the mark, nothing else

    assert play(ct, tmp_path, [start]).result("launch")["changed"] is False

    # The node keeps the job's health live: a second unit bound to the job's looks every few seconds.
    live_unit = show(ct, "gpuops-live:job.service", "ActiveState", "BindsTo")
    assert live_unit["ActiveState"] == "active" and "gpuops-job.service" in live_unit["BindsTo"]
    assert live_state(ct) == "running"
    wait_until(lambda: re.search(r"^gpuops_job_last_step\{[^}]*\} [1-9]", ct.path(
        METRICS_DIR + "/gpuops_job_job.prom").read_text(encoding="utf-8"), re.M), timeout=60,
        what="a step in the live file", interval=0.2)

    restarted = play(ct, tmp_path, [launch(command=start["gpuops.relaunch.train_launch"]["command"],
                                           state="restarted", **LIVE)]).result("launch")
    assert restarted["changed"] is True and restarted["pid"] != started["pid"]
    assert restarted["previous"]["exit_code"] == 0  # the demo ends cleanly on SIGTERM
    assert restarted["rotated_log"] == LOG + ".1"
    assert f"demo_train pid {started['pid']} " in ct.path(LOG + ".1").read_text()
    assert live_state(ct) == "running"

    # Killed inside the container: the unit's ExecStopPost writes crashed at once, and the live unit goes with it.
    ct.run_inside(["kill", "-KILL", str(restarted["pid"])])
    wait_until(lambda: live_state(ct) == "crashed", timeout=60, what="the live file to say crashed", interval=0.2)
    wait_until(lambda: show(ct, "gpuops-live:job.service", "LoadState")["LoadState"] == "not-found", timeout=60,
               what="the live unit gone with the job's", interval=0.2)
    relaunched = play(ct, tmp_path, [start]).result("launch")
    assert relaunched["changed"] is True and relaunched["health"]["state"] == "crashed"
    assert live_state(ct) == "running"

    stop = stop_task("job")
    stopped = play(ct, tmp_path, [stop]).result("stop")
    assert stopped["changed"] is True and stopped["running"] is False
    assert stopped["exit_code"] == 0 and stopped["ended_at"]
    assert show(ct, "gpuops-job.service", "LoadState")["LoadState"] == "not-found"  # collected
    ps = ct.run_inside(["ps", "-eo", "pid=,stat=,args="]).stdout
    assert JOB_DEMO not in ps
    assert not [line for line in ps.splitlines() if line.split()[1].startswith("Z")]
    assert play(ct, tmp_path, [stop]).result("stop")["changed"] is False
    wait_until(lambda: live_state(ct) == "stopped", timeout=60, what="the live file to say stopped", interval=0.2)


def test_systemd_exit_code_survives_collect(container, tmp_path: Path) -> None:
    """A collected unit reads ExecMainStatus=0; the ExecStopPost record keeps the real code."""
    run = play(container, tmp_path, [launch(
        name="fails", command=["/usr/bin/python3", JOB_DEMO, "--exit-after", "1", "--exit-code", "3"],
        log_path="/var/log/fails.log", min_uptime=3)])
    result = run.result("launch")
    assert result["failed"] is True and result["backend"] == "systemd"
    assert result["exit_code"] == 3 and "exit code 3" in result["msg"]
    assert "exiting with code 3" in result["log_tail"]
    assert show(container, "gpuops-fails.service", "LoadState")["LoadState"] == "not-found"


def test_systemd_sigkill_when_term_is_ignored(container, tmp_path: Path) -> None:
    start = launch(name="stubborn", command=["/usr/bin/python3", JOB_DEMO, "--ignore-term"],
                   log_path="/var/log/stubborn.log", term_timeout=1)
    assert play(container, tmp_path, [start]).result("launch")["backend"] == "systemd"
    stop = stop_task("stubborn", term_timeout=1)
    stopped = play(container, tmp_path, [stop]).result("stop")
    assert stopped["changed"] is True and stopped["exit_signal"] == "SIGKILL"
    assert stopped["stop"]["escalated"] is True
    assert "--ignore-term" not in container.run_inside(["ps", "-eo", "args="]).stdout


# Run as nobody inside the container: the moment the log appears (train_launch creates it and gives it
# to the job's user), replace it with a symlink to a root-only file, before the job's output is opened.
SWAPPER = r"""
import os, stat, sys, time
path, target = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 90
while time.monotonic() < deadline:
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.symlink(target, path + ".swap")
            os.rename(path + ".swap", path)
            sys.exit(0)
    except FileNotFoundError:
        pass
    time.sleep(0.0002)
sys.exit(1)
"""


def test_a_log_swapped_for_a_symlink_after_the_checks_is_not_opened_by_root(container, tmp_path: Path) -> None:
    """StandardOutput=append:PATH had PID 1 open the path as root after our checks, following the
    symlink the job's user swapped in: the job's output went into a root-only file."""
    ct = container
    ct.run_inside(["sh", "-c", "rm -rf /var/log/swapped && mkdir /var/log/swapped && chown nobody:nogroup /var/log/swapped"
                   " && printf 'root only\\n' > /root/secret && chmod 600 /root/secret"], check=True)
    log = "/var/log/swapped/train.log"
    swapper = subprocess.Popen(  # pylint: disable=consider-using-with
        ["nsenter", f"--target={ct.init_pid}", "--mount", "--pid", "--uts", "--ipc", "--net", "--",
         "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", SWAPPER, log,
         "/root/secret"])
    try:
        result = play(ct, tmp_path, [launch(name="swapped", log_path=log, user="nobody", group="nogroup")]).result("launch")
        assert swapper.wait(timeout=120) == 0, "the log never appeared"
    finally:
        if swapper.poll() is None:
            swapper.kill()
            swapper.wait()
    assert ct.path("/root/secret").read_text() == "root only\n"
    if result.get("failed"):
        # The swap came before the open: refused (O_NOFOLLOW), and said so.
        assert f"cannot open log_path {log}: Too many levels of symbolic links" in result["msg"], result["msg"]
    else:
        # The swap came after the open: the job writes to the file it was given, never to the link's target.
        fd = ct.run_inside(["readlink", f"/proc/{result['pid']}/fd/1"]).stdout.strip()
        assert fd == log + " (deleted)", fd
    play(ct, tmp_path, [stop_task("swapped")])


def test_a_job_that_clears_its_environment_is_still_the_systemd_job(container, tmp_path: Path) -> None:
    """`env -i` drops the run's mark; the unit's control group (named after the job) still proves the
    job: a second start leaves it alone and state=health says running."""
    start = launch(name="cleared", command=["/usr/bin/env", "-i", "/usr/bin/python3", JOB_DEMO],
                   log_path="/var/log/cleared.log")
    first = play(container, tmp_path, [start]).result("launch")
    assert first["changed"] is True and first["running"] is True and first["backend"] == "systemd", json.dumps(first)
    environ = container.run_inside(["cat", f"/proc/{first['pid']}/environ"]).stdout
    assert "GPUOPS_RELAUNCH_RUN" not in environ
    second = play(container, tmp_path, [start]).result("launch")
    assert second["changed"] is False and second["pid"] == first["pid"] and second["health"]["state"] == "running"
    health = play(container, tmp_path, [stop_task("cleared", state="health")]).result("stop")
    assert health["health"]["state"] == "running" and health["running"] is True
    stopped = play(container, tmp_path, [stop_task("cleared")]).result("stop")
    assert stopped["changed"] is True and stopped["health"]["state"] == "running"
    assert "cleared.log" not in container.run_inside(["ps", "-eo", "args="]).stdout


def test_a_record_that_names_another_unit_does_not_make_a_stop_stop_it(container, tmp_path: Path) -> None:
    ct = container
    started = play(ct, tmp_path, [launch(name="liar")]).result("launch")
    assert started["unit"] == "gpuops-liar.service"
    assert show(ct, "systemd-journald.service", "ActiveState")["ActiveState"] == "active"
    # The record is a place to look, not an order: one edited to name a unit of the system...
    record = ct.path(STATE_DIR) / "liar" / "run.json"
    run = json.loads(record.read_text())
    record.write_text(json.dumps(dict(run, unit="systemd-journald.service")))
    stopped = play(ct, tmp_path, [stop_task("liar")]).result("stop")
    # ... stops the job's own unit, named after the job, and nothing else.
    assert stopped["changed"] is True and stopped["running"] is False
    assert show(ct, "gpuops-liar.service", "LoadState")["LoadState"] == "not-found"
    assert show(ct, "systemd-journald.service", "ActiveState")["ActiveState"] == "active"
