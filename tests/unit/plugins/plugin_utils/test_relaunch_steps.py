"""A relaunch's steps in the decision's task (plugin_utils/relaunch_steps): which modules run, in
which order, with which options, and where it stops. The modules themselves run for real in the integration
tests (test_relaunch_health, test_relaunch_e2e, test_train_launch_identity); here a runner replays answers."""

from __future__ import annotations

from typing import Any, Mapping

import pytest

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import RelaunchInputError, step_results
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_steps import STEP_NAMES, check_gpu_node, relaunch_steps

DECISION = {"action": "relaunch", "relaunch": True, "stop": True, "resume_mode": None, "expect_run_id": "run-a"}
CLEAN = {"changed": True, "escalation": "none", "reasons": []}
RELEASED = {"changed": False, "escalation": "none", "released": True}
STARTED = {"changed": True, "pid": 42}
HEALTHY = {"changed": False, "outcome": "launch", "escalation": "none", "bad": [], "visible": [], "cuda_visible_devices": ""}


class Replay:
    """Answers each module run with the next answer given for that step, and records what ran."""

    def __init__(self, **answers: dict[str, Any]) -> None:
        self.answers = {"stop": {"changed": True}, "cleanup": CLEAN, "drain": RELEASED, "launch": STARTED, "gate": HEALTHY,
                        **answers}
        self.ran: list[tuple[str, dict[str, Any], bool]] = []

    def __call__(self, module: str, options: Mapping[str, Any], drain_environment: bool) -> dict[str, Any]:
        self.ran.append((module, dict(options), drain_environment))
        step = {"zombie_reap": "cleanup", "gpu_mem_wait": "drain", "gpu_gate": "gate"}.get(module) or (
            "stop" if options.get("state") == "stopped" else "launch")
        return dict(self.answers[step])

    @property
    def modules(self) -> list[str]:
        return [module for module, _options, _env in self.ran]


def test_a_relaunch_stops_cleans_drains_and_launches_with_the_fence_and_the_drain_environment() -> None:
    run = Replay()
    outcome = relaunch_steps(run, dict(DECISION, resume_mode="always", checkpoint_step=200), False, False, "h1")
    assert outcome["failure"] is None and outcome["reset"] is False and outcome["unreachable"] is False
    assert run.ran == [
        ("train_launch", {"state": "stopped", "expect_run_id": "run-a"}, False),
        ("zombie_reap", {"expect_run_id": "run-a"}, False),
        ("gpu_mem_wait", {}, True),  # only the drain and the gate get gpu_drain_environment
        ("gpu_gate", {}, True),
        # the ranks' joint checkpoint step goes to the start
        ("train_launch", {"state": "started", "resume": "always", "checkpoint_step": 200}, False),
    ]
    steps = outcome["steps"]
    assert steps["launch"] == STARTED and steps["clearance"]["clear"] is True


def test_nothing_running_skips_the_stop_and_the_inventory_resume_is_not_overridden() -> None:
    run = Replay()
    outcome = relaunch_steps(run, dict(DECISION, stop=False, expect_run_id=""), False, False, "h1")
    assert run.modules == ["zombie_reap", "gpu_mem_wait", "gpu_gate", "train_launch"]
    assert run.ran[0][1] == {"expect_run_id": ""} and run.ran[-1][1] == {"state": "started"}
    assert outcome["steps"]["stop"] is None


def test_a_newer_run_left_alone_skips_the_drain_and_the_launch_finds_it() -> None:
    run = Replay(cleanup=dict(CLEAN, superseded=True, changed=False), launch={"changed": False, "pid": 7})
    outcome = relaunch_steps(run, DECISION, False, False, "h1")
    assert run.modules == ["train_launch", "zombie_reap", "train_launch"]
    assert outcome["steps"]["drain"] is None and outcome["failure"] is None


@pytest.mark.parametrize("step, answer, message", [
    ("stop", {"failed": True, "msg": "could not stop"}, "could not stop"),
    ("cleanup", {"failed": True, "msg": "expect_run_id: the job's lock: busy"}, "expect_run_id: the job's lock: busy"),
    # A drain that broke (no escalation: a bad option, a broken query) fails; a timeout is the clearance's to judge.
    ("drain", {"failed": True, "msg": "GPU query failed: hung"}, "GPU query failed: hung"),
    ("gate", {"failed": True, "msg": "GPU query failed: hung"}, "GPU query failed: hung"),
    ("launch", {"failed": True, "msg": "not proven"}, "not proven"),
    ("stop", {"unreachable": True, "msg": "ssh: timed out"}, "ssh: timed out"),
])
def test_the_first_step_that_fails_ends_the_relaunch_naming_the_step(step: str, answer: dict, message: str) -> None:
    run = Replay(**{step: answer})
    outcome = relaunch_steps(run, DECISION, False, False, "h1")
    assert outcome["failure"] == f"{STEP_NAMES[step]}: {message}"
    assert outcome["unreachable"] is bool(answer.get("unreachable"))
    order = ["stop", "cleanup", "drain", "gate", "launch"]
    assert len(run.ran) == order.index(step) + 1  # nothing after it ran
    assert all(outcome["steps"][later] is None for later in order[order.index(step) + 1:])


def test_a_drain_timeout_blocks_at_the_clearance_without_a_launch() -> None:
    timed_out = {"failed": True, "escalation": "host_action", "released": False, "msg": "not released after 5s"}
    run = Replay(drain=timed_out)
    outcome = relaunch_steps(run, DECISION, False, False, "h1")
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait"]
    assert outcome["failure"].startswith(f"{STEP_NAMES['clearance']}: h1: not relaunching. The host must act: ")
    assert outcome["steps"]["clearance"]["blocked"] and outcome["steps"]["launch"] is None


@pytest.mark.parametrize("allowed, check_mode", [(True, False), (True, True)])
def test_only_a_reboot_helps_and_it_is_allowed_stops_before_the_launch(allowed: bool, check_mode: bool) -> None:
    run = Replay(cleanup=dict(CLEAN, escalation="container_reboot", reasons=["a zombie orphan"]))
    outcome = relaunch_steps(run, DECISION, allowed, check_mode, "h1")
    assert outcome["reset"] is True and outcome["failure"] is None
    # The gate looks before the reboot: a GPU the hardware must fix refuses the job without a reboot.
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait", "gpu_gate"]


def test_only_a_reboot_helps_but_it_is_not_allowed_fails_naming_the_variable() -> None:
    run = Replay(cleanup=dict(CLEAN, escalation="container_reboot", reasons=["a zombie orphan"]))
    outcome = relaunch_steps(run, DECISION, False, False, "h1")
    assert outcome["reset"] is False
    assert "container_reset_allowed is false for this host" in outcome["failure"]


def test_the_summary_takes_the_decisions_steps_where_the_roles_tasks_did_not_run() -> None:
    decided = {"stop": {"changed": True}, "cleanup": CLEAN, "drain": RELEASED, "clearance": {"reset": True}, "launch": None}
    registered = {"probe": {"p": 1}, "stop": {"skipped": True}, "cleanup": None, "drain": {"skipped": True, "changed": False},
                  "reset": {"changed": True}, "launch": STARTED}
    merged = step_results(registered, decided)
    assert merged["stop"] == {"changed": True} and merged["cleanup"] == CLEAN and merged["drain"] == RELEASED
    assert merged["launch"] == STARTED and merged["reset"] == {"changed": True} and merged["probe"] == {"p": 1}
    # A rank's own registered steps win over anything else.
    assert step_results({"stop": {"changed": False, "rank": True}}, decided)["stop"] == {"changed": False, "rank": True}


def test_a_rank_stops_cleans_and_drains_but_launches_after_its_barrier() -> None:
    run = Replay()
    outcome = relaunch_steps(run, DECISION, False, False, "h1", launch=False)
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait", "gpu_gate"]
    assert outcome["failure"] is None and outcome["steps"]["clearance"]["clear"] is True and outcome["steps"]["launch"] is None


BAD_GPU = {"index": 1, "uuid": "GPU-1", "pci_bus_id": "00000000:3C:00.0", "escalation": "host_reboot", "quarantined": False,
           "recovery_action": "node_reboot", "remapped_rows": None, "reasons": ["XID 79"],
           "xids": [{"xid": 79, "first": 5.0, "text": "NVRM: Xid (PCI:0000:3c:00): 79, GPU has fallen off the bus."}]}


def test_the_gpu_gate_refuses_after_the_drain_and_nothing_launches() -> None:
    run = Replay(gate={"changed": True, "outcome": "refuse", "escalation": "host_reboot", "why": "GPU 1: XID 79",
                       "bad": [BAD_GPU], "visible": [], "cuda_visible_devices": ""})
    outcome = relaunch_steps(run, DECISION, False, False, "h1", gate={"state_dir": "/s"})
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait", "gpu_gate"]
    assert run.ran[3] == ("gpu_gate", {"state_dir": "/s"}, True)
    assert outcome["failure"] is None and outcome["steps"]["launch"] is None
    refused = outcome["refused"]
    assert refused.startswith("h1: not relaunching. The GPUs need host_reboot: GPU 1: XID 79.")
    assert "GPU 1 GPU-1 00000000:3C:00.0: host_reboot; recovery action node_reboot" in refused and "XID 79 at 5.0" in refused


def test_the_gpu_gate_leaves_a_gpu_out_by_uuid_in_the_jobs_environment() -> None:
    run = Replay(gate=dict(HEALTHY, visible=["GPU-0", "GPU-2"], cuda_visible_devices="GPU-0,GPU-2"))
    outcome = relaunch_steps(run, DECISION, False, False, "h1", launch_env={"A": "1"})
    assert run.ran[-1] == ("train_launch", {"state": "started", "env": {"A": "1", "CUDA_VISIBLE_DEVICES": "GPU-0,GPU-2"}}, False)
    assert outcome["launch_env"] == {"A": "1", "CUDA_VISIBLE_DEVICES": "GPU-0,GPU-2"}


def test_no_gpu_on_the_host_skips_the_gate_without_a_module_run() -> None:
    run = Replay(drain=dict(RELEASED, gpu_present=False))
    outcome = relaunch_steps(run, DECISION, False, False, "h1")
    assert "gpu_gate" not in run.modules and run.modules[-1] == "train_launch"
    assert outcome["steps"]["gate"]["outcome"] == "skip" and "gpu_drain_gpus_required false" in outcome["steps"]["gate"]["why"]


LOST = {"failed": True, "error_kind": "gpu_lost", "released": False, "msg": "GPU query failed: GPU 1 is lost"}


def test_a_lost_gpu_that_stops_the_drain_is_the_gates_to_judge() -> None:
    run = Replay(drain=LOST, gate={"changed": True, "outcome": "refuse", "escalation": "host_reboot", "why": "GPU 1 lost",
                                   "bad": [], "visible": []})
    outcome = relaunch_steps(run, DECISION, False, False, "h1")
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait", "gpu_gate"]
    assert outcome["failure"] is None and "The GPUs need host_reboot: GPU 1 lost" in outcome["refused"]


def test_left_out_by_the_gate_the_drain_looks_again_at_the_gpus_the_job_gets() -> None:
    answers = iter([LOST, RELEASED])
    run = Replay(gate=dict(HEALTHY, visible=["GPU-0"], visible_indices=[0], cuda_visible_devices="GPU-0"))

    def replay(module: str, options: Mapping[str, Any], env: bool) -> dict[str, Any]:
        if module == "gpu_mem_wait":
            run.ran.append((module, dict(options), env))
            return dict(next(answers))
        return run(module, options, env)
    outcome = relaunch_steps(replay, DECISION, False, False, "h1")
    assert [entry[:2] for entry in run.ran if entry[0] == "gpu_mem_wait"] == [("gpu_mem_wait", {}), ("gpu_mem_wait", {"devices": ["0"]})]
    assert outcome["failure"] is None and run.ran[-1][1]["env"] == {"CUDA_VISIBLE_DEVICES": "GPU-0"}


def test_a_gpu_the_gate_reset_here_is_drained_again_and_the_job_launches() -> None:
    """A bare host: the drain stopped at a GPU that required a reset, the gate reset it and found it clean: the
    drain looks again at every GPU, and the job launches (counted as the hardware's failure)."""
    answers = iter([LOST, RELEASED])
    run = Replay(gate=dict(HEALTHY, reset=[{"index": 0, "uuid": "GPU-0", "done": True, "holders": [], "why": ""}]))

    def replay(module: str, options: Mapping[str, Any], env: bool) -> dict[str, Any]:
        if module == "gpu_mem_wait":
            run.ran.append((module, dict(options), env))
            return dict(next(answers))
        return run(module, options, env)
    outcome = relaunch_steps(replay, DECISION, False, False, "h1")
    assert [entry[:2] for entry in run.ran if entry[0] == "gpu_mem_wait"] == [("gpu_mem_wait", {}), ("gpu_mem_wait", {})]
    assert outcome["failure"] is None and run.ran[-1][:2] == ("train_launch", {
        "state": "started", "failure_cause": "hardware"})


def test_a_launch_after_the_gate_found_the_hardware_at_fault_is_not_counted_by_the_guard() -> None:
    """A GPU reset, or a bad GPU left out now, made the failure the hardware's: the start says so (failure_cause),
    and the crash-loop guard does not count it; a GPU an earlier run quarantined says nothing of this failure."""
    reset = dict(HEALTHY, reset=[{"index": 1, "uuid": "GPU-1", "done": True, "holders": [], "why": ""}])
    left_out = dict(HEALTHY, bad=[BAD_GPU], visible=["GPU-0"], cuda_visible_devices="GPU-0")
    earlier = dict(HEALTHY, bad=[dict(BAD_GPU, quarantined=True)], visible=["GPU-0"], cuda_visible_devices="GPU-0")
    for gate, cause in ((reset, "hardware"), (left_out, "hardware"), (earlier, None), (HEALTHY, None)):
        run = Replay(gate=gate)
        relaunch_steps(run, DECISION, False, False, "h1")
        module, options, _drain_env = run.ran[-1]
        assert module == "train_launch" and options.get("failure_cause") == cause, gate


UUID = "GPU-5c3b1b8e-1d2f-4a7b-9e0c-000000000001"


@pytest.mark.parametrize("check_mode", [False, True])
def test_a_gpu_its_proxmox_node_must_reset_stops_before_the_launch_and_says_where(check_mode: bool) -> None:
    node = {"changed": False, "outcome": "reset", "escalation": "gpu_reset", "reset_node": "pve1", "reset_uuids": [UUID],
            "bad": [], "visible": [], "cuda_visible_devices": ""}
    run = Replay(gate=node)
    outcome = relaunch_steps(run, DECISION, False, check_mode, "ct1", gate={"state_dir": "/s"}, launch_env={"A": "1"},
                             node_reset_timeout=5.0)
    if check_mode:
        # Nothing is reset in check mode: the launch is announced as after a reset of the gate's own.
        assert outcome["node_reset"] is None and run.modules[-1] == "train_launch"
        return
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait", "gpu_gate"] and outcome["failure"] is None
    assert outcome["node_reset"] == {"node": "pve1", "uuids": [UUID], "reset_timeout": 5.0, "gate": {"state_dir": "/s"},
                                     "drain": False, "env": {"A": "1"}}


def test_the_gpu_node_must_be_an_inventory_host_other_than_the_container() -> None:
    check_gpu_node("ct1", "", ["ct1"])
    check_gpu_node("ct1", "pve1", ["ct1", "pve1"])
    for node, said in (("pve9", "'pve9' is not a host of the inventory"), ("ct1", "names this host itself"),
                       (["pve1"], "must be an inventory hostname")):
        with pytest.raises(RelaunchInputError, match=said):
            check_gpu_node("ct1", node, ["ct1", "pve1"])
