"""A relaunch's steps in the decision's task (plugin_utils/relaunch_steps): which modules run, in
which order, with which options, and where it stops. The modules themselves run for real in the integration
tests (test_relaunch_health, test_relaunch_e2e, test_train_launch_identity); here a runner replays answers."""

from __future__ import annotations

from typing import Any, Mapping

import pytest

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import step_results
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_steps import STEP_NAMES, relaunch_steps

DECISION = {"action": "relaunch", "relaunch": True, "stop": True, "resume_mode": None, "expect_run_id": "run-a"}
CLEAN = {"changed": True, "escalation": "none", "reasons": []}
RELEASED = {"changed": False, "escalation": "none", "released": True}
STARTED = {"changed": True, "pid": 42}


class Replay:
    """Answers each module run with the next answer given for that step, and records what ran."""

    def __init__(self, **answers: dict[str, Any]) -> None:
        self.answers = {"stop": {"changed": True}, "cleanup": CLEAN, "drain": RELEASED, "launch": STARTED, **answers}
        self.ran: list[tuple[str, dict[str, Any], bool]] = []

    def __call__(self, module: str, options: Mapping[str, Any], drain_environment: bool) -> dict[str, Any]:
        self.ran.append((module, dict(options), drain_environment))
        step = {"zombie_reap": "cleanup", "gpu_mem_wait": "drain"}.get(module) or (
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
        ("gpu_mem_wait", {}, True),  # only the drain gets gpu_drain_environment
        # the ranks' joint checkpoint step goes to the start
        ("train_launch", {"state": "started", "resume": "always", "checkpoint_step": 200}, False),
    ]
    steps = outcome["steps"]
    assert steps["launch"] == STARTED and steps["clearance"]["clear"] is True


def test_nothing_running_skips_the_stop_and_the_inventory_resume_is_not_overridden() -> None:
    run = Replay()
    outcome = relaunch_steps(run, dict(DECISION, stop=False, expect_run_id=""), False, False, "h1")
    assert run.modules == ["zombie_reap", "gpu_mem_wait", "train_launch"]
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
    ("launch", {"failed": True, "msg": "not proven"}, "not proven"),
    ("stop", {"unreachable": True, "msg": "ssh: timed out"}, "ssh: timed out"),
])
def test_the_first_step_that_fails_ends_the_relaunch_naming_the_step(step: str, answer: dict, message: str) -> None:
    run = Replay(**{step: answer})
    outcome = relaunch_steps(run, DECISION, False, False, "h1")
    assert outcome["failure"] == f"{STEP_NAMES[step]}: {message}"
    assert outcome["unreachable"] is bool(answer.get("unreachable"))
    order = ["stop", "cleanup", "drain", "launch"]
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
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait"]


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
    assert run.modules == ["train_launch", "zombie_reap", "gpu_mem_wait"]
    assert outcome["failure"] is None and outcome["steps"]["clearance"]["clear"] is True and outcome["steps"]["launch"] is None
