"""playbooks/relaunch.yml on localhost, for real: a dead run is cleared and the job relaunched.

The job's script is copied to this test's own directory, so the job selector (its path) matches
this test's processes only, never a `make demo` running on the same machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.gpu_holder import sim_gpu
from tests.harness.launch_targets import end_recorded_runs
from tests.harness.playbook import REPO, run_playbook
from tests.harness.procstates import state_of, wait_until

PLAYBOOK = str(REPO / "playbooks" / "relaunch.yml")
SUMMARY = "Summarize"
PROBE = "Look at the job, decide, and relaunch a job of one host"


@pytest.fixture(name="site")
def site_fixture(tmp_path):
    """A job of this test's own: script, log, state dir, and an inventory naming them."""
    files = tmp_path / "files"
    files.mkdir()
    script = files / "demo_train.py"
    shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", script)
    shutil.copy(REPO / "playbooks" / "files" / "demo_stale_run.py", files / "demo_stale_run.py")
    host_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "job_launch_name": f"relaunch-test-{os.getpid()}",
        "job_launch_command": [sys.executable, str(script), "--workers", "1"],
        "job_launch_log_path": str(tmp_path / "logs" / "train.log"),
        "job_launch_state_dir": str(tmp_path / "state"),
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 1,
        "job_launch_startup_timeout": 60,
        "job_launch_term_timeout": 10,
        "process_cleanup_match": [f"{script}\\b".replace(".", "\\.")],
        "process_cleanup_term_timeout": 5,
        "gpu_drain_gpus_required": False,
        "gpu_drain_timeout": 20,
        "container_reset_allowed": False,
    }
    (tmp_path / "logs").mkdir()
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": {"localhost": host_vars}}}), encoding="utf-8")
    yield {"dir": tmp_path, "script": script, "inventory": str(inventory), "vars": host_vars}
    # Whatever the test left running: stop the job through the module, then end the supervisor
    # that stays idle where PID 1 would never reap it, by the pid its state file records.
    run_playbook([{
        "name": "stop", "hosts": "localhost", "gather_facts": False,
        "tasks": [{"name": "Stop", "gpuops.relaunch.train_launch": {
            "name": host_vars["job_launch_name"], "state": "stopped", "state_dir": host_vars["job_launch_state_dir"]}}],
    }], inventory=str(inventory))
    end_recorded_runs(host_vars["job_launch_state_dir"])


def stale_run(site) -> dict:
    out = subprocess.run(
        [sys.executable, str(site["script"].parent / "demo_stale_run.py"), str(site["script"])],
        capture_output=True, text=True, check=True, timeout=30,
    )
    return json.loads(out.stdout)


def summary(run) -> dict:
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.summary()


def test_relaunch_clears_a_dead_run_and_proves_the_new_one(site):
    stale = stale_run(site)
    assert state_of(stale["zombie_leader"]) == "Z"

    run = run_playbook(PLAYBOOK, inventory=site["inventory"], env={"ANSIBLE_SHOW_CUSTOM_STATS": "1"},
                       extra_vars={"relaunch_summary_dir": str(site["dir"])})
    first = summary(run)

    assert first["relaunched"] is True and first["would_relaunch"] is True and first["check_mode"] is False
    assert first["found"] == "signals" and first["job"]["operation"] == "start"
    # The probe is a question: its "would start" is not counted as a change.
    probe = run.result(PROBE)["probe"]
    assert probe["operation"] == "start" and probe["changed"] is False and probe["decision"]["action"] == "relaunch"
    # Machine-readable: set_stats data (AWX), and a JSON file on the controller.
    stats = json.loads(run.stdout)["global_custom_stats"]["relaunch_summary"]
    assert list(stats) == ["localhost"] and stats["localhost"]["job"]["pid"] == first["job"]["pid"]
    # One file per host and job (HOST@JOB.json), the fleet's apart.
    assert json.loads((site["dir"] / f"localhost@{site['vars']['job_launch_name']}.json").read_text())["relaunched"] is True
    assert set(json.loads((site["dir"] / "fleet.json").read_text())["hosts"]) == {"localhost"}
    assert {stale["main"], stale["zombie"], stale["zombie_leader"]} <= set(first["ended"])
    for pid in stale.values():
        wait_until(lambda p=pid: state_of(p) is None, what=f"stale pid {pid} to be gone")
    job = first["job"]
    assert job["ready_line"].startswith("step 1 ")
    assert state_of(int(job["pid"])) in ("S", "R")
    assert Path(job["log_path"]).read_text(encoding="utf-8").count("step 1 ") == 1
    # No stop: the probe found no run of the job (the stale run is no supervised run), so the stop
    # was skipped and the cleanup ended what was left.
    assert set(first["seconds"]) == {"cleanup", "drain", "launch"}

    # A second run with nothing to do changes nothing.
    again = run_playbook(PLAYBOOK, inventory=site["inventory"])
    second = summary(again)
    assert second["relaunched"] is False
    assert int(second["job"]["pid"]) == int(job["pid"])
    changed = [name for name, hosts in again.tasks.items() if any(h.get("changed") for h in hosts)]
    assert changed == []
    # Few tasks per host (the relaunch-as-code goals): a first relaunch at most 25, a no-op at most 8.
    assert run.tasks_run("localhost") <= 25, run.stats
    # The decision; the play's first host is not ended (it carries the fleet summary): the end_host and the
    # include skipped, the fleet summary, the failure skipped.
    assert again.tasks_run("localhost") <= 5, again.stats

    # --check --diff with a changed command: the decision shows what a restart would change, and nothing changes.
    changed_spec = [*site["vars"]["job_launch_command"], "--stall-chatter", "9"]
    diffed = run_playbook(PLAYBOOK, inventory=site["inventory"], check=True, extra_args=["--diff"],
                          extra_vars={"job_launch_command": changed_spec})
    decided = diffed.result(PROBE)
    assert decided["decision"]["action"] == "relaunch" and "command" in decided["diff"]["after"], decided
    assert "--stall-chatter" in decided["diff"]["after"] and "--stall-chatter" not in decided["diff"]["before"], decided["diff"]
    assert int(summary(diffed)["job"]["pid"]) == int(job["pid"]) and state_of(int(job["pid"])) in ("S", "R")


def test_check_mode_changes_nothing(site):
    stale = stale_run(site)
    reports = site["dir"] / "reports"
    run = run_playbook(PLAYBOOK, inventory=site["inventory"], check=True, extra_vars={"relaunch_summary_dir": str(reports)})
    result = summary(run)
    # Its reports go apart (DIR/check/), where they never replace a real run's.
    host_file = f"localhost@{site['vars']['job_launch_name']}.json"
    assert sorted(p.name for p in reports.iterdir()) == ["check"]
    assert sorted(p.name for p in (reports / "check").iterdir()) == sorted([host_file, "fleet.json"])
    assert json.loads((reports / "check" / host_file).read_text())["check_mode"] is True
    assert result["relaunched"] is False and result["check_mode"] is True
    assert result["would_relaunch"] is True and result["job"]["operation"] == "start"  # it says what it would do
    for pid in stale.values():
        assert state_of(pid) is not None  # nothing was signalled
    assert not Path(site["vars"]["job_launch_state_dir"]).exists() or not any(
        Path(site["vars"]["job_launch_state_dir"]).iterdir())
    assert not Path(site["vars"]["job_launch_log_path"]).exists()
    # Now for real, so the fixture's clean-up finds no stale run of this test left over.
    checked = {path.name: path.read_bytes() for path in (reports / "check").iterdir()}
    summary(run_playbook(PLAYBOOK, inventory=site["inventory"], extra_vars={"relaunch_summary_dir": str(reports)}))
    assert json.loads((reports / host_file).read_text())["check_mode"] is False and (reports / "fleet.json").is_file()
    assert {path.name: path.read_bytes() for path in (reports / "check").iterdir()} == checked
    for pid in stale.values():
        wait_until(lambda p=pid: state_of(p) is None, what=f"stale pid {pid} to be gone")


def test_relaunch_force_restarts_a_healthy_job(site):
    first = summary(run_playbook(PLAYBOOK, inventory=site["inventory"]))
    forced = summary(run_playbook(PLAYBOOK, inventory=site["inventory"], extra_vars={"relaunch_force": True, "relaunch_hosts": "localhost"}))
    assert forced["relaunched"] is True
    assert int(forced["job"]["pid"]) != int(first["job"]["pid"])
    assert state_of(int(first["job"]["pid"])) is None
    rotated = list(Path(site["vars"]["job_launch_log_path"]).parent.glob("train.log.*"))
    assert rotated, "the first run's log was kept"


def test_the_drain_alone_gets_gpu_drain_environment(site):
    """A job of one host is relaunched in one task (plugin_utils/relaunch_steps), its steps' module runs on one
    connection: gpu_drain_environment (the simulated NVML's bindings and state file) reaches the drain, which finds
    the GPU through it (gpus_required), and not the launch: the incident record the launch writes for the crashed
    run holds this machine's own GPU evidence (it has no GPU and no nvidia-smi)."""
    site["vars"]["job_launch_command"] += ["--ready-after", "0.1", "--exit-after", "1.5", "--exit-code", "3"]
    inventory = Path(site["inventory"])
    inventory.write_text(json.dumps({"all": {"hosts": {"localhost": site["vars"]}}}), encoding="utf-8")
    assert summary(run_playbook(PLAYBOOK, inventory=site["inventory"]))["relaunched"] is True
    exit_record = Path(site["vars"]["job_launch_state_dir"]) / site["vars"]["job_launch_name"] / "exit.json"
    wait_until(exit_record.exists, what="the job's exit record")
    with sim_gpu(devices=1) as gpu:
        # The gate's XID cut-off: this machine's kernel log holds other tests' XID lines (test_gpu_health's).
        site["vars"].update(gpu_drain_gpus_required=True, gpu_drain_environment=gpu.env(), relaunch_gpu_xid_since=time.time(),
                            relaunch_gpu_kernel_log=False)
        inventory.write_text(json.dumps({"all": {"hosts": {"localhost": site["vars"]}}}), encoding="utf-8")
        run = run_playbook(PLAYBOOK, inventory=site["inventory"])
        crashed = summary(run)
    assert crashed["relaunched"] is True and crashed["health"]["state"] == "crashed", crashed
    drain = run.step("drain")
    assert drain["backend"] == "pynvml" and drain["gpu_present"] is True and len(drain["gpus"]) == 1, drain
    incident = json.loads(Path(crashed["incident"]).read_text(encoding="utf-8"))
    assert incident["gpu"]["available"] is False, incident["gpu"]
