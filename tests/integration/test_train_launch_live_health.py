"""The job's live health on the node (train_launch's metrics_dir), for real, without Ansible looking.

The job is the demo trainer, launched through the real module inside a PID namespace whose init
never reaps (every signal stays inside it). After the start, no task runs while the test waits: the
file changes only because the node (the supervisor, from its private copy) rewrites it. Each wait
polls the file against a generous deadline, never a fixed sleep; how fast the node is goes to the
bench (bench/live_health_cpu.py), not here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import LINE_LIMIT
from tests.harness.gpu_holder import sim_gpu
from tests.harness.launch_targets import Target, in_pid_namespace
from tests.harness.procstates import wait_until
from tests.harness.prometheus import PROMTOOL, check_metrics, parse_exposition, sample

pytestmark = pytest.mark.slow

PROGRESS = r"^step (\d+) "
HOST = 'gpu-node-7 "b"'  # an inventory hostname is any text: the label keeps it, escaped
DEADLINE = 60
# The live file's series of the job's whole life (its lifetime.json), without the run's label.
LIFETIME_SERIES = {"gpuops_job_relaunches_total", "gpuops_job_last_failure", "gpuops_job_last_failure_timestamp_seconds",
                   "gpuops_job_last_failure_exit_code"}


@pytest.fixture(name="ns")
def ns_fixture(tmp_path):
    with in_pid_namespace(tmp_path) as where:
        yield where


def textfiles(target: Target) -> Path:
    directory = target.work / "textfiles"
    directory.mkdir(mode=0o755, exist_ok=True)
    return directory


def once(target: Target, state: str = "started", **options: Any) -> dict[str, Any]:
    task = target.launch_task(task_name="t", state=state, min_uptime=0.2, **options)
    if state in ("health", "stopped"):
        for key in ("command", "ready_regex", "min_uptime", "startup_timeout"):
            task["gpuops.relaunch.train_launch"].pop(key, None)
    result = target.play([task]).result("t")
    assert result.get("failed") is not True, result
    return result


def live(target: Target) -> dict:
    """The live file as Prometheus reads it ({} while there is none)."""
    path = textfiles(target) / "gpuops_job_job.prom"
    try:
        return parse_exposition(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def state_of(samples: dict) -> str | None:
    states = [dict(labels)["state"] for (name, labels), value in samples.items()
              if name == "gpuops_job_health" and value == 1]
    return states[0] if len(states) == 1 else None


def labels(run: str, **extra: str) -> dict[str, str]:
    # The live file's series also name the job's rank 0 (the host itself, for a job of one host) and the run.
    return {"gpuops_job": "job", "gpuops_host": HOST, "gpuops_rank0": HOST, "gpuops_run": run, **extra}


def file_says(target: Target, wanted: str) -> dict:
    """Poll the file (no task runs meanwhile) until it says `wanted`; its samples."""
    return wait_until(lambda: live(target) if state_of(live(target)) == wanted else None,
                      timeout=DEADLINE, what=f"the live file to say {wanted}", interval=0.2)


def test_the_node_keeps_the_live_file_through_progress_a_stop_a_kill_and_a_relaunch(ns: Target) -> None:
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2")
    first = once(ns, command=command, progress_regex=PROGRESS, stall_after=3, metrics_dir=str(textfiles(ns)),
                 metrics_host=HOST)
    run = first["run_id"]
    assert first["running"] is True and first["live_metrics"] == str(textfiles(ns) / "gpuops_job_job.prom")
    # Written by the start itself: running, at once.
    assert state_of(live(ns)) == "running"

    # Progress, as the node sees it while no task runs: the step moves on in the file.
    seen = wait_until(lambda: sample(live(ns), "gpuops_job_last_step", **labels(run)), timeout=DEADLINE,
                      what="a step in the live file", interval=0.2)
    wait_until(lambda: (sample(live(ns), "gpuops_job_last_step", **labels(run)) or 0) > seen, timeout=DEADLINE,
               what="a later step in the live file", interval=0.2)
    running = live(ns)
    assert sample(running, "gpuops_job_seconds_since_progress", **labels(run)) is not None
    assert sample(running, "gpuops_job_live_timestamp_seconds", **labels(run)) is not None
    if PROMTOOL.is_file():
        checked = check_metrics(textfiles(ns) / "gpuops_job_job.prom")
        assert checked.returncode == 0, checked.stdout + checked.stderr

    # Frozen (SIGSTOP): no progress line any more, so the node says stalled once stall_after has passed.
    leader = ns.host_pid(first["pid"])
    assert leader is not None
    os.kill(leader, signal.SIGSTOP)  # inside the namespace: the job this test started
    stalled = file_says(ns, "stalled")
    assert sample(stalled, "gpuops_job_seconds_since_progress", **labels(run)) >= 3
    # A bare state=health (no progress_regex, no stall_after) judges by the rule stored with the run.
    bare = once(ns, "health")
    assert bare["health"]["state"] == "stalled", bare["health"]
    assert bare["live_metrics"] == first["live_metrics"]

    # Killed: the file says crashed (the supervisor writes it when it reaps the job).
    os.kill(leader, signal.SIGKILL)
    crashed = file_says(ns, "crashed")
    assert not {"gpuops_job_seconds_since_progress", "gpuops_job_last_step"} & {name for name, _l in crashed}

    # The relaunch: the file says the new run runs when the task ends.
    again = once(ns, command=command, progress_regex=PROGRESS, stall_after=3, metrics_dir=str(textfiles(ns)),
                 metrics_host=HOST)
    assert again["changed"] is True and again["health"]["state"] == "crashed" and again["pid"] != first["pid"]
    assert state_of(live(ns)) == "running"
    # Another run, other series: its failure alerts anew (Alertmanager groups by gpuops_run).
    assert {dict(labels).get("gpuops_run") for name, labels in live(ns)
            if name not in LIFETIME_SERIES} == {again["run_id"]} != {run}
    # The job's life spans its runs: its relaunch counter and last failure carry no gpuops_run (a counter per
    # run would start again at every relaunch). The failure it followed: crashed by SIGKILL, no exit code.
    relaunched = live(ns)
    job_labels = {key: value for key, value in labels(run).items() if key != "gpuops_run"}
    assert sample(relaunched, "gpuops_job_relaunches_total", **job_labels) == 1
    assert sample(relaunched, "gpuops_job_last_failure", **job_labels, health="crashed", signal="SIGKILL",
                  cause="unknown") == 1
    assert sample(relaunched, "gpuops_job_last_failure_timestamp_seconds", **job_labels) > 0
    assert "gpuops_job_last_failure_exit_code" not in {name for name, _labels in relaunched}
    if PROMTOOL.is_file():
        checked = check_metrics(textfiles(ns) / "gpuops_job_job.prom")
        assert checked.returncode == 0, checked.stdout + checked.stderr

    # Stopped by train_launch: the file says so.
    once(ns, "stopped")
    file_says(ns, "stopped")
    # Only the live file is in the directory: nothing half-written left beside it.
    assert [path.name for path in textfiles(ns).iterdir()] == ["gpuops_job_job.prom"]


def gpu_word(samples: dict, run: str, gpu: str) -> str | None:
    words = [dict(found)["escalation"] for (name, found), value in samples.items()
             if name == "gpuops_gpu_health" and value == 1 and dict(found).get("gpu") == gpu
             and dict(found).get("gpuops_run") == run]
    return words[0] if len(words) == 1 else None


def test_the_live_file_says_the_jobs_gpus_health_and_a_gpu_that_needs_a_reset_when_the_job_dies(ns: Target) -> None:
    """The simulated NVML's state is changed by this (real) process while the job runs; the node's own child
    reads it (python3 -I, pynvml from where the module found it), with no task running."""
    with sim_gpu(devices=2) as gpu:
        command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2")
        task = ns.launch_task(task_name="t", command=command, min_uptime=0.2, metrics_dir=str(textfiles(ns)),
                              metrics_host=HOST, metrics_gpus=["0", gpu.devices[1]["uuid"]])
        task["environment"] = {"PYTHONPATH": str(gpu.pinned_bindings())}
        first = ns.play([task]).result("t")
        assert first.get("failed") is not True, first
        run = first["run_id"]
        healthy = wait_until(lambda: live(ns) if gpu_word(live(ns), run, "1") == "none" else None, timeout=DEADLINE,
                             what="the job's GPUs in the live file", interval=0.2)
        assert gpu_word(healthy, run, "0") == "none"
        assert sample(healthy, "gpuops_gpu_recovery_action", **labels(run, gpu="1", uuid=gpu.devices[1]["uuid"])) == 0
        assert sample(healthy, "gpuops_gpu_look_ok", **labels(run)) == 1
        if PROMTOOL.is_file():
            checked = check_metrics(textfiles(ns) / "gpuops_job_job.prom")
            assert checked.returncode == 0, checked.stdout + checked.stderr

        # The driver now asks for a reset of GPU 1, and the job dies: the node looks at once when it reaps it.
        gpu.devices[1]["recovery_action"] = 1
        gpu.save()
        leader = ns.host_pid(first["pid"])
        assert leader is not None
        os.kill(leader, signal.SIGKILL)  # inside the namespace: the job this test started
        crashed = wait_until(lambda: live(ns) if state_of(live(ns)) == "crashed" and gpu_word(live(ns), run, "1")
                             == "gpu_reset" else None, timeout=DEADLINE, what="crashed with GPU 1 needing a reset",
                             interval=0.2)
        assert gpu_word(crashed, run, "0") == "none"
        assert sample(crashed, "gpuops_gpu_recovery_action", **labels(run, gpu="1", uuid=gpu.devices[1]["uuid"])) == 1


def test_a_finished_job_is_finished_in_the_live_file_and_a_start_without_metrics_dir_removes_it(ns: Target) -> None:
    done = ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--finish-at-step", "3")
    started = once(ns, command=done, metrics_dir=str(textfiles(ns)), metrics_host=HOST)
    finished = file_says(ns, "finished")
    assert sample(finished, "gpuops_job_health", **labels(started["run_id"], state="crashed")) == 0
    # No run keeps the file any more: left, its series would clash with the relaunch's file.
    later = once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2"))
    assert later["live_metrics"] is None and list(textfiles(ns).iterdir()) == []


def test_a_metrics_dir_that_cannot_work_is_refused_before_anything_changes(ns: Target) -> None:
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2")
    task = ns.launch_task(task_name="t", command=command, metrics_dir=str(ns.work / "typo"), metrics_host=HOST)
    refused = ns.play([task]).result("t")
    assert refused["failed"] is True and not (ns.work / "typo").exists()
    assert [p["option"] for p in refused["option_problems"]] == ["metrics_dir"]
    assert "does not exist" in refused["option_problems"][0]["reason"]
    task = ns.launch_task(task_name="t", command=command, metrics_dir=str(textfiles(ns)))
    refused = ns.play([task]).result("t")
    assert refused["failed"] is True and [p["option"] for p in refused["option_problems"]] == ["metrics_host"]
    assert not (Path(ns.state_dir) / "job" / "run.json").exists()


def test_a_progress_line_of_megabytes_keeps_the_records_small_and_the_stall_found(ns: Target) -> None:
    """Each step line is 6 MiB; after step 3 the job chatters (the log's mtime moves), so only the node's
    progress record can tell the stall: it must stay small enough to be read back."""
    padding = 6 * 1024 * 1024
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--stall-at-step", "3",
                      "--stall-chatter", "0.1", "--step-padding", str(padding))
    first = once(ns, command=command, progress_regex=PROGRESS, stall_after=1, metrics_dir=str(textfiles(ns)),
                 metrics_host=HOST)
    assert first["running"] is True and first["ready_line"].endswith(" bytes in all]")
    assert len(first["ready_line"]) < 2 * LINE_LIMIT
    # The supervisor notes the step in progress.json and reads it back: the stall is found.
    stalled = file_says(ns, "stalled")
    assert sample(stalled, "gpuops_job_last_step", **labels(first["run_id"])) == 3
    record = Path(ns.state_dir) / "job" / "progress.json"
    assert record.stat().st_size < 4 * LINE_LIMIT
    health = once(ns, "health")["health"]
    assert health["state"] == "stalled" and health["progress_basis"] == "progress_record"
    assert health["last_step"] == "3" and health["last_progress_line"].startswith("step 3 loss=")
    assert health["last_progress_line"].endswith(f" [cut: {len('step 3 loss=0.8333 ') + padding} bytes in all]")
    assert all(len(line) < 2 * LINE_LIMIT for line in health["log_tail"])
