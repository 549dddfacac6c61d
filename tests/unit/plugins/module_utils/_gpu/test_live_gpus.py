"""The node's live look at a job's GPUs (_gpu/live_gpus.py): the real child against the simulated NVML,
the deadline on a hung driver, the quarantine record, and the GPU series of the live file."""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import live_gpus, quarantine
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import install_supervisor
from ansible_collections.gpuops.relaunch.plugins.module_utils._metrics.textfile import live_metrics, render
from tests.harness.gpu_holder import sim_gpu
from tests.harness.prometheus import parse_exposition, sample

NOW = 1_767_225_600.0
HOST = "gpu-node-1"


@pytest.fixture(name="job_dir")
def job_dir_fixture(tmp_path):
    directory = tmp_path / "state" / "job"
    directory.mkdir(parents=True, mode=0o700)
    install_supervisor(str(directory))  # the private copies the node's child runs
    return directory


def test_the_child_reads_the_jobs_gpus_and_the_judgement_is_gpu_healths(job_dir):
    with sim_gpu(devices=3) as gpu:
        gpu.devices[1]["recovery_action"] = 2   # node reboot
        gpu.devices[2]["remapped_rows"] = [0, 0, 1, 0]  # a remap pending: a reset
        gpu.save()
        watch = live_gpus.GpuWatch(str(job_dir), {"devices": ["1", gpu.devices[2]["uuid"]],
                                                  "nvml_path": str(gpu.pinned_bindings())}, since=None)
        seen = watch.look()
    assert seen["ok"] is True, seen
    assert [(g["index"], g["escalation"], g["recovery_action"]) for g in seen["gpus"]] == [
        (1, "host_reboot", 2), (2, "gpu_reset", 0)]
    # Not due again: the same look, no second child.
    assert watch.look() is seen
    # Once the job ends, one look at once.
    assert watch.look(now=True) is not seen


def test_a_hung_driver_is_killed_at_the_deadline_and_said(job_dir):
    with sim_gpu(devices=1) as gpu:
        gpu.fault("nvmlDeviceGetRemappedRows", hang=True)
        watch = live_gpus.GpuWatch(str(job_dir), {"devices": ["0"], "nvml_path": str(gpu.pinned_bindings())},
                                   since=None, timeout=0.5)
        seen = watch.look()
    assert seen["ok"] is False and "longer than 0.5s" in seen["why"] and seen["gpus"] == []


def test_a_gpu_lost_before_any_read_is_a_host_reboot_for_each_of_the_jobs_gpus(job_dir):
    with sim_gpu(devices=2) as gpu:
        gpu.fault("nvmlDeviceGetCount", "GPU_IS_LOST")
        watch = live_gpus.GpuWatch(str(job_dir), {"devices": ["0", "1"], "nvml_path": str(gpu.pinned_bindings())},
                                   since=None)
        seen = watch.look()
    assert seen["ok"] is False
    assert [(g["index"], g["escalation"]) for g in seen["gpus"]] == [(0, "host_reboot"), (1, "host_reboot")]


def test_the_quarantine_record_counts_only_where_it_is_roots(tmp_path):
    assert live_gpus.quarantined_uuids(str(tmp_path)) is None  # no record: not said
    # The record as the relaunch's gate writes it (its file name and format).
    quarantine.write(str(tmp_path), {"gpus": {"GPU-a": {"why": "XID 79"}}, "resets": {}})
    record = tmp_path / live_gpus.QUARANTINE_FILE
    assert record.is_file() and live_gpus.QUARANTINE_FILE == quarantine.RECORD
    record.chmod(0o644)
    assert live_gpus.quarantined_uuids(str(tmp_path)) == {"GPU-a"}
    record.chmod(0o666)  # anyone could write it: not a record to believe
    assert live_gpus.quarantined_uuids(str(tmp_path)) is None
    record.chmod(0o600)
    os.chown(record, 65534, 65534)
    assert live_gpus.quarantined_uuids(str(tmp_path)) is None


def test_the_live_file_carries_each_gpus_series_with_the_jobs_labels():
    look = {"at": NOW, "ok": True, "gpus": [
        {"index": 0, "uuid": "GPU-a", "escalation": "none", "recovery_action": 0, "last_xid": None, "quarantined": None},
        {"index": 3, "uuid": "GPU-b", "escalation": "host_reboot", "recovery_action": None, "last_xid": 79,
         "last_xid_at": NOW - 5, "quarantined": True}]}
    samples = parse_exposition(render(live_metrics("llm", HOST, {"state": "crashed"}, NOW, run="r1", gpus=look)))
    job = {"gpuops_job": "llm", "gpuops_host": HOST, "gpuops_rank0": HOST, "gpuops_run": "r1"}
    bad = {**job, "gpu": "3", "uuid": "GPU-b"}
    assert sample(samples, "gpuops_gpu_health", **bad, escalation="host_reboot") == 1
    assert sample(samples, "gpuops_gpu_health", **bad, escalation="none") == 0
    assert sample(samples, "gpuops_gpu_last_xid", **bad) == 79
    assert sample(samples, "gpuops_gpu_quarantined", **bad) == 1
    # What was not read is left out: GPU 0 has no XID, no quarantine record; GPU 3 no recovery action.
    assert sample(samples, "gpuops_gpu_last_xid", **job, gpu="0", uuid="GPU-a") is None
    assert sample(samples, "gpuops_gpu_recovery_action", **bad) is None
    assert sample(samples, "gpuops_gpu_look_ok", **job) == 1
    # Four verdict series per GPU, whatever it says: no series comes and goes with the verdict.
    assert len([name for name, _labels in samples if name == "gpuops_gpu_health"]) == 8
    # A job without GPUs named has none of them.
    plain = parse_exposition(render(live_metrics("llm", HOST, {"state": "running"}, NOW)))
    assert not [name for name, _labels in plain if name.startswith("gpuops_gpu_")]


def test_the_watch_looks_at_most_once_a_period(job_dir):
    clock = [0.0]
    watch = live_gpus.GpuWatch(str(job_dir), {"devices": ["0"], "nvml_path": None}, since=None, clock=lambda: clock[0],
                               python="/nonexistent/python")
    first = watch.look()
    assert first["ok"] is False and "cannot start" in first["why"]
    clock[0] = live_gpus.GPU_PERIOD - 1
    assert watch.look() is first
    clock[0] = live_gpus.GPU_PERIOD
    assert watch.look() is not first
