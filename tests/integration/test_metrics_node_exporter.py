"""Health as metrics, against real parts: a real relaunch (playbooks/relaunch.yml on localhost, the
simulated NVML driven as in the other GPU tests) writes its textfile with relaunch_metrics_dir;
Debian's promtool checks it and Debian's node_exporter (textfile collector only, on a loopback port)
serves it. Both come unpacked from `make prometheus-tools`; without them these tests skip, naming it.

The job's script is copied to this test's own directory, so the clean-up's selector matches this
test's processes only.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import time

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import HEALTH_WORDS
from ansible_collections.gpuops.relaunch.plugins.module_utils._metrics.textfile import ACTION_WORDS

from tests.harness.gpu_holder import sim_gpu
from tests.harness.launch_targets import end_recorded_runs
from tests.harness.playbook import REPO, SUMMARY_TASKS, run_playbook
from tests.harness.prometheus import NODE_EXPORTER, PROMTOOL, check_metrics, names, node_exporter, require, sample

PLAYBOOK = str(REPO / "playbooks" / "relaunch.yml")
SUMMARY = "Summarize"
# The goal of the relaunch-as-code issue: a no-op relaunch costs at most this many tasks per host.
NOOP_TASKS = 5
# The inventory hostname: every series names it (gpuops_host), as node_exporter's instance cannot.
HOST = "localhost"


@pytest.fixture(autouse=True)
def _binaries():
    require(PROMTOOL, NODE_EXPORTER)


@pytest.fixture(name="site")
def site_fixture(tmp_path):
    """A job of this test's own, and the textfile collector's directory."""
    files = tmp_path / "files"
    files.mkdir()
    script = files / "demo_train.py"
    shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", script)
    textfiles = tmp_path / "node-exporter"
    textfiles.mkdir(mode=0o755)
    host_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "job_launch_name": f"metrics-test-{os.getpid()}",
        "job_launch_command": [sys.executable, str(script), "--workers", "1"],
        "job_launch_log_path": str(tmp_path / "logs" / "train.log"),
        "job_launch_state_dir": str(tmp_path / "state"),
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 1,
        "job_launch_startup_timeout": 60,
        "job_launch_term_timeout": 10,
        "process_cleanup_match": [f"{script}\\b".replace(".", "\\.")],
        "process_cleanup_term_timeout": 5,
        "gpu_drain_timeout": 20,
        "container_reset_allowed": False,
        "relaunch_metrics_dir": str(textfiles),
        # The GPU gate judges by NVML alone: other tests write XID lines into the machine's one kernel log.
        "relaunch_gpu_kernel_log": False,
    }
    (tmp_path / "logs").mkdir()
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": {"localhost": host_vars}}}), encoding="utf-8")
    yield {"dir": tmp_path, "inventory": str(inventory), "vars": host_vars, "textfiles": textfiles,
           "file": textfiles / f"gpuops_relaunch_{host_vars['job_launch_name']}.prom"}
    run_playbook([{
        "name": "stop", "hosts": "localhost", "gather_facts": False,
        "tasks": [{"name": "Stop", "gpuops.relaunch.train_launch": {
            "name": host_vars["job_launch_name"], "state": "stopped", "state_dir": host_vars["job_launch_state_dir"]}}],
    }], inventory=str(inventory))
    end_recorded_runs(host_vars["job_launch_state_dir"])


def summary_result(run) -> dict:
    """The result of the task that summarized the host (the decision for a host that needed nothing, else
    Summarize), with its summary under "summary"."""
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
    for name in SUMMARY_TASKS[::-1]:
        if name in run.tasks and "relaunch_summary" in (run.result(name).get("ansible_facts") or {}):
            result = run.result(name)
            return dict(result, summary=result["ansible_facts"]["relaunch_summary"])
    raise AssertionError(f"no summary: {sorted(run.tasks)}")


def test_a_relaunch_writes_metrics_that_promtool_and_node_exporter_read(site):
    job = site["vars"]["job_launch_name"]
    path = site["file"]
    with sim_gpu(devices=2) as gpu:
        before = time.time()
        run = run_playbook(PLAYBOOK, inventory=site["inventory"], env=gpu.env())
        result = summary_result(run)
        first = result["summary"]
        after = time.time()
        assert first["relaunched"] is True and first["health"]["state"] == "missing"
        # Written by the task that relaunched the job (changed: the relaunch), no task more; the report is no change of
        # its own (the no-op run below changes nothing).
        assert result["metrics_path"] == str(path) and result["changed"] is True
        assert stat.S_ISREG(path.lstat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o644
        assert [p.name for p in site["textfiles"].iterdir()] == [path.name]  # no temporary file left
        checked = check_metrics(path)
        assert checked.returncode == 0, checked.stdout + checked.stderr

        with node_exporter(site["textfiles"], site["dir"]) as exporter:
            samples = exporter.scrape_until(lambda s: "gpuops_job_health" in names(s), "the relaunch's metrics")
            assert sample(samples, "node_textfile_scrape_error") == 0
            # Every series names the job and the inventory host with the collection's own labels.
            ours = [dict(labels) for name, labels in samples if name.startswith("gpuops_")]
            assert ours and all(l["gpuops_job"] == job and l["gpuops_host"] == HOST and "job" not in l for l in ours)
            for word in HEALTH_WORDS:
                # The job after the run acted (its new run runs), and apart from it what the probe saw before.
                assert sample(samples, "gpuops_job_health", gpuops_job=job, gpuops_host=HOST, state=word) == (word == "running")
                assert sample(samples, "gpuops_relaunch_probe_health", gpuops_job=job, gpuops_host=HOST,
                              state=word) == (word == "missing")
            for word in ACTION_WORDS:
                assert sample(samples, "gpuops_relaunch_last_action", gpuops_job=job, gpuops_host=HOST, action=word) == (word == "relaunch")
            assert sample(samples, "gpuops_relaunch_found", gpuops_job=job, gpuops_host=HOST, escalation=first["found"]) == 1
            assert sample(samples, "gpuops_job_recent_relaunches", gpuops_job=job, gpuops_host=HOST) == first["relaunch_guard"]["recent"]
            assert sample(samples, "gpuops_relaunch_gpu_released", gpuops_job=job, gpuops_host=HOST) == 1
            assert sample(samples, "gpuops_relaunch_container_reset", gpuops_job=job, gpuops_host=HOST) == 0
            # The drain's last look, per GPU, as the summary has it.
            assert [g["index"] for g in first["gpus"]] == [0, 1]
            for entry in first["gpus"]:
                assert sample(samples, "gpuops_gpu_memory_used_mib", gpuops_job=job, gpuops_host=HOST, gpu=str(entry["index"]),
                              uuid=entry["uuid"]) == entry["used_mib"]
            written = sample(samples, "gpuops_relaunch_last_run_timestamp_seconds", gpuops_job=job, gpuops_host=HOST)
            assert before <= written <= after

            # A symlink planted at the file's name, to a file of root's: the next run replaces the
            # link and never writes through it.
            victim = site["dir"] / "victim"
            victim.write_text("root's file\n", encoding="utf-8")
            path.unlink()
            path.symlink_to(victim)

            again = run_playbook(PLAYBOOK, inventory=site["inventory"], env=gpu.env())
            second = summary_result(again)["summary"]
            assert second["status"] == "unchanged" and second["job"]["pid"] == first["job"]["pid"]
            # A no-op run writes the metrics and still changes nothing, in no more tasks than before.
            changed = [name for name, hosts in again.tasks.items() if any(h.get("changed") for h in hosts)]
            assert changed == []
            assert again.tasks_run("localhost") <= NOOP_TASKS, again.stats
            assert victim.read_text(encoding="utf-8") == "root's file\n"
            assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o644

            def newer(s):
                stamp = sample(s, "gpuops_relaunch_last_run_timestamp_seconds", gpuops_job=job, gpuops_host=HOST)
                return stamp is not None and stamp > written
            samples = exporter.scrape_until(newer, "the no-op run's metrics")
            assert sample(samples, "node_textfile_scrape_error") == 0
            assert sample(samples, "gpuops_job_health", gpuops_job=job, gpuops_host=HOST, state="running") == 1
            assert sample(samples, "gpuops_relaunch_last_action", gpuops_job=job, gpuops_host=HOST, action="none") == 1
            # Nothing was looked at and nothing drained: left out, not guessed.
            assert not {"gpuops_relaunch_found", "gpuops_relaunch_gpu_released", "gpuops_gpu_memory_used_mib"} & names(samples)
        checked = check_metrics(path)
        assert checked.returncode == 0, checked.stdout + checked.stderr


NASTY_JOBS = ['quote"d', "new\nline", "back\\slash", 'all"\\\n3']


def test_job_names_that_need_escaping_cannot_break_the_file(tmp_path):
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    run = run_playbook([{
        "name": "metrics", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable},
        "tasks": [{"name": f"job {index}", "gpuops.relaunch.relaunch_metrics": {
            "dir": str(textfiles), "job": job, "host": "{{ inventory_hostname }}",
            "summary": {"health": {"state": "crashed"}, "action": "refused", "relaunch_guard": {"recent": 3}},
            "gpus": [{"index": 0, "uuid": "GPU-a", "used_mib": 12.5}]}} for index, job in enumerate(NASTY_JOBS)],
    }])
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
    files = sorted(textfiles.iterdir())
    assert len(files) == len(NASTY_JOBS)  # one file each: no two names made safe alike
    for path in files:
        checked = check_metrics(path)
        assert checked.returncode == 0, f"{path.name}: {checked.stdout}{checked.stderr}"
    with node_exporter(textfiles, tmp_path) as exporter:
        samples = exporter.scrape_until(lambda s: sum(n == "gpuops_job_recent_relaunches" for n, _l in s) == len(NASTY_JOBS),
                                        "every job's metrics")
        assert sample(samples, "node_textfile_scrape_error") == 0
        for job in NASTY_JOBS:
            assert sample(samples, "gpuops_job_health", gpuops_job=job, gpuops_host=HOST, state="crashed") == 1
            assert sample(samples, "gpuops_relaunch_last_action", gpuops_job=job, gpuops_host=HOST, action="refused") == 1
            assert sample(samples, "gpuops_gpu_memory_used_mib", gpuops_job=job, gpuops_host=HOST, gpu="0", uuid="GPU-a") == 12.5


def summarize_play(metrics_dir: str, check: bool = False) -> list[dict]:
    results = {"probe": {"health": {"state": "running"}, "decision": {"action": "none"}}, "decision": {"action": "none"}}
    return [{
        "name": "summary", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable},
        "tasks": [{"name": SUMMARY, "check_mode": check, "ignore_errors": True, "gpuops.relaunch.relaunch_summary": {
            "results": results, "job_name": "j", "metrics_dir": metrics_dir}}],
    }]


def test_check_mode_writes_no_metrics_and_a_missing_directory_fails_the_host(tmp_path):
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    checked = run_playbook(summarize_play(str(textfiles), check=True)).result(SUMMARY)
    assert not checked.get("failed") and checked["metrics_path"] == str(textfiles / "gpuops_relaunch_j.prom")
    assert checked["metrics_changed"] is True and list(textfiles.iterdir()) == []

    missing = run_playbook(summarize_play(str(tmp_path / "typo"))).result(SUMMARY)
    assert missing["failed"] is True
    assert missing["msg"].startswith(f"metrics_dir: {tmp_path / 'typo'} does not exist"), missing["msg"]
    assert not (tmp_path / "typo").exists()
