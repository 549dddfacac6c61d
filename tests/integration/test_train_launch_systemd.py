"""train_launch's systemd backend for real: inside an LXC container whose init is systemd.

The first run builds the container's root filesystem with debootstrap (a few minutes, cached under
.build/systemd-rootfs); later runs boot it in about a second.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.harness import systemd_ct
from tests.harness.launch_targets import DEMO
from tests.harness.playbook import run_playbook

pytestmark = [pytest.mark.lxc, pytest.mark.slow]

JOB_DEMO = "/opt/demo_train.py"
LOG = "/var/log/train.log"
STATE_DIR = "/var/lib/gpuops-test"


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
        yield ct


def play(ct, tmp_path: Path, tasks: list[dict]):
    run = run_playbook([{"hosts": "all", "gather_facts": False, "tasks": tasks}],
                       inventory=ct.write_inventory(tmp_path / "inventory"))
    return run


def launch(name: str = "job", task: str = "launch", **options):
    args = {"name": name, "command": ["/usr/bin/python3", JOB_DEMO], "log_path": LOG, "state_dir": STATE_DIR,
            "ready_regex": "^step 1 ", "min_uptime": 0.5, "startup_timeout": 20, "stop_timeout": 5}
    args.update(options)
    return {"name": task, "gpuops.relaunch.train_launch": args}


def stop_task(name: str, **options):
    return {"name": "stop", "gpuops.relaunch.train_launch": dict(
        {"name": name, "state": "stopped", "state_dir": STATE_DIR}, **options)}


def show(ct, unit: str, *props: str) -> dict[str, str]:
    out = ct.run_inside(["systemctl", "show", unit, "-p", ",".join(props)]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_systemd_backend_lifecycle(container, tmp_path: Path) -> None:
    ct = container
    start = launch(command=["/usr/bin/python3", JOB_DEMO, "--workers", "2", "--worker-seconds", "0.5"])
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

    assert play(ct, tmp_path, [start]).result("launch")["changed"] is False

    restarted = play(ct, tmp_path, [launch(command=start["gpuops.relaunch.train_launch"]["command"],
                                           state="restarted")]).result("launch")
    assert restarted["changed"] is True and restarted["pid"] != started["pid"]
    assert restarted["previous"]["exit_code"] == 0  # the demo ends cleanly on SIGTERM
    assert restarted["rotated_log"] == LOG + ".1"
    assert f"demo_train pid {started['pid']} " in ct.path(LOG + ".1").read_text()

    stop = stop_task("job")
    stopped = play(ct, tmp_path, [stop]).result("stop")
    assert stopped["changed"] is True and stopped["running"] is False
    assert stopped["exit_code"] == 0 and stopped["ended_at"]
    assert show(ct, "gpuops-job.service", "LoadState")["LoadState"] == "not-found"  # collected
    ps = ct.run_inside(["ps", "-eo", "pid=,stat=,args="]).stdout
    assert JOB_DEMO not in ps
    assert not [line for line in ps.splitlines() if line.split()[1].startswith("Z")]
    assert play(ct, tmp_path, [stop]).result("stop")["changed"] is False


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
                   log_path="/var/log/stubborn.log", stop_timeout=1)
    assert play(container, tmp_path, [start]).result("launch")["backend"] == "systemd"
    stop = stop_task("stubborn", stop_timeout=1)
    stopped = play(container, tmp_path, [stop]).result("stop")
    assert stopped["changed"] is True and stopped["exit_signal"] == "SIGKILL"
    assert stopped["stop"]["escalated"] is True
    assert "--ignore-term" not in container.run_inside(["ps", "-eo", "args="]).stdout
