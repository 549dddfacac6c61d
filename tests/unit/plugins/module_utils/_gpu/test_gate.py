"""The relaunch's GPU gate (_gpu/gate.py), its quarantine record (_gpu/quarantine.py) and the reset's holder
look (_gpu/reset.py)."""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import gate, quarantine, reset
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.health import judge_host
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import GpuDevice

OK_READS = {"recovery_action": {"value": 0}, "remapped_rows": {"value": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False}},
            "retired_pages_pending": {"value": False}, "ecc_uncorrected_volatile": {"value": 0},
            "nvlink": {"unsupported": "no NVLink"}, "throttle_reasons": {"value": 0}}


def look(*faults: dict) -> dict:
    """gpu_health's result for GPUs 0..n-1, each with its reads overridden by `faults[i]`."""
    entries = [{"index": i, "uuid": f"GPU-{i}", "pci_bus_id": f"00000000:{0x3B + i:02X}:00.0", "identity_errors": [],
                "reads": dict(OK_READS, **fault)} for i, fault in enumerate(faults)]
    return judge_host(entries, None, {}).as_dict()


PENDING = {"remapped_rows": {"value": {"corrected": 0, "uncorrected": 1, "pending": True, "failure": False}},
           "recovery_action": {"value": 1}}
REBOOT = {"recovery_action": {"value": 2}}
FAILED_REMAP = {"remapped_rows": {"value": {"corrected": 0, "uncorrected": 9, "pending": False, "failure": True}}}


def test_healthy_gpus_launch_as_always():
    answer = gate.decide(look({}, {}), {}, gate.GatePolicy())
    assert (answer["outcome"], answer["visible"], answer["bad"], answer["quarantine"]) == ("launch", [], [], [])


def test_the_safe_default_refuses_a_gpu_that_needs_a_reset_and_quarantines_it():
    answer = gate.decide(look({}, PENDING), {}, gate.GatePolicy())
    assert answer["outcome"] == "refuse" and answer["escalation"] == "gpu_reset"
    [bad] = answer["bad"]
    assert (bad["index"], bad["uuid"], bad["pci_bus_id"], bad["recovery_action"]) == (1, "GPU-1", "00000000:3C:00.0", "gpu_reset")
    assert bad["remapped_rows"]["pending"] is True
    assert answer["quarantine"] == [bad]
    assert "relaunch_gpu_reset_allowed" in answer["why"] and answer["why"].count("GPU 1 (GPU-1, 00000000:3C:00.0)") == 1


def test_a_reset_where_allowed_then_a_refusal_when_it_did_not_clear():
    policy = gate.GatePolicy(reset_allowed=True)
    first = gate.decide(look({}, PENDING), {}, policy)
    assert (first["outcome"], first["reset"], first["quarantine"]) == ("reset", [1], [])
    again = gate.decide(look({}, PENDING), {}, policy, reset_done=True)
    assert again["outcome"] == "refuse" and "a GPU reset did not clear it" in again["why"]
    assert gate.decide(look({}, {}), {}, policy, reset_done=True)["outcome"] == "launch"


def test_a_container_s_gpu_is_reset_on_the_node_that_owns_it_by_uuid():
    node = gate.GatePolicy(reset_allowed=True, reset_here=False, owner="pve1")
    answer = gate.decide(look({}, PENDING), {}, node)
    assert (answer["outcome"], answer["reset_on"], answer["reset_uuids"], answer["quarantine"]) == ("reset", "pve1", ["GPU-1"], [])
    assert "on their Proxmox node pve1" in answer["why"]
    # The look again after the node's reset: still bad is refused (and quarantined), clean launches.
    again = gate.decide(look({}, PENDING), {}, node, reset_done=True)
    assert again["outcome"] == "refuse" and "a GPU reset did not clear it" in again["why"] and again["quarantine"]
    assert gate.decide(look({}, {}), {}, node, reset_done=True)["outcome"] == "launch"
    # Not allowed: refused as on a bare host, nothing reset.
    refused = gate.decide(look({}, PENDING), {}, gate.GatePolicy(reset_here=False, owner="pve1"))
    assert refused["outcome"] == "refuse" and refused["reset_uuids"] == [] and "relaunch_gpu_reset_allowed" in refused["why"]


@pytest.mark.parametrize("text, ok", [("GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001", True),
                                      ("gpu-5C3B1B8E-1D2F-4A7B-9E0C-000000000001", True),
                                      ("MIG-5c3b1b8e-1d2f-4a7b-9e0c-000000000001", False),
                                      ("GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001 -r", False),
                                      ("GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001\n", False), ("1", False), ("", False), (None, False)])
def test_only_a_whole_gpu_uuid_reaches_the_reset_command(text, ok):
    assert reset.is_gpu_uuid(text) is ok


def test_a_bad_uuid_is_not_reset_and_nothing_is_looked_up(tmp_path):
    looked = []
    answer = reset.reset_by_uuid("GPU-1; reboot", lambda: looked.append(1), str(tmp_path / "nvidia-smi"), 1.0)
    assert (answer.done, looked) == (False, []) and "is not a GPU's UUID" in answer.why
    gone = reset.reset_by_uuid("GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000009", lambda: None, "nvidia-smi", 1.0)
    assert not gone.done and "no such GPU" in gone.why


def test_the_node_s_answer_is_checked_before_the_gate_counts_a_reset():
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.gate_run import node_reset_answer
    uuid = "GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001"
    answer = node_reset_answer({"reset": [{"index": 3, "uuid": uuid, "done": True, "holders": [], "why": ""},
                                          {"index": 4, "uuid": "GPU-x", "done": True, "why": "\x1b[2J"}], "at": 5.0})
    assert [entry["done"] for entry in answer["reset"]] == [True, False] and answer["at"] == 5.0
    assert answer["reset"][1]["why"] == "\\x1b[2J"
    assert node_reset_answer(None) is None and node_reset_answer({}) is None
    unreached = node_reset_answer({"unreachable": True, "msg": "ssh: connect to host pve1 port 22: No route"})
    assert unreached["reset"] == [] and "could not be reached: ssh: connect" in unreached["unreachable"]
    for bad in ({"reset": "x", "at": 1}, {"reset": [], "at": float("nan")}, {"reset": [], "at": True}, ["x"]):
        with pytest.raises(BadOption) as caught:
            node_reset_answer(bad)
        assert caught.value.option == "node_reset"


@pytest.mark.parametrize("fault, escalation", [(REBOOT, "host_reboot"), (FAILED_REMAP, "host_action")])
def test_what_a_reset_cannot_clear_is_refused_even_where_resets_are_allowed(fault, escalation):
    answer = gate.decide(look({}, fault), {}, gate.GatePolicy(reset_allowed=True))
    assert answer["outcome"] == "refuse" and answer["escalation"] == escalation and answer["reset"] == []


def test_a_job_with_a_minimum_launches_on_the_healthy_gpus_by_uuid():
    answer = gate.decide(look({}, REBOOT, {}), {}, gate.GatePolicy(min_gpus=2))
    assert (answer["outcome"], answer["visible"], answer["visible_indices"]) == ("launch", ["GPU-0", "GPU-2"], [0, 2])
    assert [bad["index"] for bad in answer["quarantine"]] == [1]
    assert gate.cuda_visible_devices(answer["visible"]) == "GPU-0,GPU-2"
    # Too few left: refused, naming the GPU.
    short = gate.decide(look({}, REBOOT, REBOOT), {}, gate.GatePolicy(min_gpus=2))
    assert short["outcome"] == "refuse" and "1 healthy GPU(s) left, fewer than job_launch_min_gpus 2" in short["why"]


def test_a_quarantined_gpu_stays_out_though_it_looks_healthy_now():
    record = {"GPU-1": {"escalation": "host_reboot", "since": 1.0, "reasons": ["XID 79"]}}
    answer = gate.decide(look({}, {}), record, gate.GatePolicy(reset_allowed=True))
    assert answer["outcome"] == "refuse" and answer["quarantine"] == [] and answer["bad"][0]["quarantined"] is True
    assert "relaunch_gpu_quarantine_clear" in answer["why"]
    assert gate.decide(look({}, {}), record, gate.GatePolicy(min_gpus=1))["visible"] == ["GPU-0"]


def test_a_finding_of_the_host_no_listed_gpu_carries_is_refused():
    health = look({})
    health.update(escalation="host_reboot", reasons=["a GPU NVML does not list: XID 79"])
    answer = gate.decide(health, {}, gate.GatePolicy(min_gpus=1))
    assert answer["outcome"] == "refuse" and answer["escalation"] == "host_reboot" and "XID 79" in answer["why"]


def test_the_quarantine_record_round_trips_and_refuses_what_is_not_sound(tmp_path):
    state = str(tmp_path / "state")
    assert quarantine.read(state) == {"version": 1, "gpus": {}, "resets": {}}
    bad = gate.decide(look(REBOOT), {}, gate.GatePolicy())["quarantine"]
    record = quarantine.with_resets(quarantine.added(quarantine.read(state), bad, now=5.0), ["GPU-0"], now=7.0)
    quarantine.write(state, record)
    assert oct(os.stat(state).st_mode & 0o777) == "0o700"
    again = quarantine.read(state)
    assert again["gpus"]["GPU-0"]["since"] == 5.0 and quarantine.last_reset(again) == 7.0
    # A second quarantine of the same GPU keeps its first time.
    assert quarantine.added(again, bad, now=9.0)["gpus"]["GPU-0"]["since"] == 5.0
    path = tmp_path / "state" / quarantine.RECORD
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(quarantine.QuarantineError, match="not a quarantine record"):
        quarantine.read(state)
    path.unlink()
    os.symlink("/etc/hostname", path)
    with pytest.raises(quarantine.QuarantineError, match="cannot be read safely"):
        quarantine.read(state)


def test_a_gpu_whose_device_file_is_unknown_is_never_reset():
    device = GpuDevice(index=0, uuid="GPU-0", name="", total_bytes=0, used_bytes=0, minor_unknown="no minor")
    answer = reset.reset_gpu(0, lambda: device, "/bin/true", 1.0)
    assert not answer.done and "no look can prove that nothing holds it" in answer.why


def test_the_record_notes_the_gpus_a_job_was_launched_on_and_forgets_them_when_it_gets_all_again():
    record = quarantine.with_launch({"gpus": {}}, "llm", "GPU-0,GPU-2")
    assert quarantine.launched_on(record, "llm") == "GPU-0,GPU-2" and quarantine.launched_on(record, "other") == ""
    assert quarantine.launched_on(quarantine.with_launch(record, "llm", ""), "llm") == ""
