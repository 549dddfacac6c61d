# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A relaunch's steps after its decision, inside the decision's own task: stop, clean up, drain, the clearance
and (for a job of one host) the launch, each step a module run on the target over the task's connection.

Nothing waits for another host between these steps, so they run in one task: a task costs the controller a
worker, the task's templating and its callbacks, about twice what a second module run in the same task costs
(see docs guide_performance). The ranks of a multi-rank job run them in their joint decision's task and
launch after their barrier, in the role's tasks (roles/relaunch/tasks/steps.yml), where the linear
strategy holds every rank until all are ready. A failure is named by its step (STEP_NAMES).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import clearance, superseded

# Runs a step's module on the target: (module, the options this step gives, with the drain's environment)
# -> its result. The other options come from the role variables (plugin_utils/role_vars).
StepRunner = Callable[[str, Mapping[str, Any], bool], dict[str, Any]]

# How a failure names its step (the launch of a rank is the role's task of that name, roles/relaunch/tasks/steps.yml).
STEP_NAMES = {
    "stop": "Stop the job and wait until its whole process tree is gone",
    "cleanup": "End what the last run left behind with the least force that works",
    "drain": "Wait until the GPUs are released",
    "clearance": "Check that nothing left blocks the launch",
    "launch": "Launch the job and prove it started",
}


def relaunch_steps(run: StepRunner, decision: Mapping[str, Any], reset_allowed: bool, check_mode: bool,
                   host: str, launch: bool = True) -> dict[str, Any]:
    """Stop (where something runs), clean up, drain (unless a newer run was left alone), check the clearance and,
    with `launch`, launch, stopping at the first step that fails. Returns each step's result by name under
    ``steps`` (a step that did not run is None), ``failure`` ("STEP NAME: message", or None), ``unreachable``
    (the step that failed lost the host) and ``reset`` (only a container reboot helps and the inventory allows
    it: the role reboots, looks again and launches, roles/relaunch/tasks/steps.yml). A rank of a multi-rank job
    launches after its barrier, in the role (`launch` false)."""
    steps: dict[str, Any] = {name: None for name in STEP_NAMES}
    outcome: dict[str, Any] = {"steps": steps, "failure": None, "unreachable": False, "reset": False}

    def failed(name: str, answer: Mapping[str, Any], message: Any = None) -> dict[str, Any]:
        outcome["failure"] = f"{STEP_NAMES[name]}: {message or answer.get('msg') or 'failed'}"
        outcome["unreachable"] = bool(answer.get("unreachable"))
        return outcome

    # The stop and the clean-up are for the run the probe saw (the run-id fence, see relaunch_flow.decide).
    fence = {"expect_run_id": decision.get("expect_run_id") or ""}
    if decision.get("stop"):
        steps["stop"] = run("train_launch", dict(fence, state="stopped"), False)
        if _failed(steps["stop"]):
            return failed("stop", steps["stop"])
    steps["cleanup"] = run("zombie_reap", fence, False)
    if _failed(steps["cleanup"]):
        return failed("cleanup", steps["cleanup"])
    if not superseded(steps["cleanup"]):
        steps["drain"] = run("gpu_mem_wait", {}, True)
        # A timeout is an answer (with its escalation) for the clearance; a broken query or a bad option is not.
        if steps["drain"].get("unreachable") or (steps["drain"].get("failed") and "escalation" not in steps["drain"]):
            return failed("drain", steps["drain"])
    steps["clearance"] = clearance(steps["cleanup"], steps["drain"] or {}, reset_allowed, False, check_mode, host)
    if steps["clearance"]["blocked"]:
        return failed("clearance", {}, steps["clearance"]["blocked"])
    if steps["clearance"]["reset"]:
        outcome["reset"] = True
    if outcome["reset"] or not launch:
        return outcome
    start = {"state": "started"}
    if decision.get("resume_mode"):
        # The start resumes exactly as the decision said (always or never).
        start["resume"] = decision["resume_mode"]
    if decision.get("checkpoint_step") is not None:
        # The ranks' joint choice (relaunch_flow.shared_checkpoint_step).
        start["checkpoint_step"] = decision["checkpoint_step"]
    steps["launch"] = run("train_launch", start, False)
    if _failed(steps["launch"]):
        return failed("launch", steps["launch"])
    return outcome


def _failed(answer: Mapping[str, Any]) -> bool:
    return bool(answer.get("failed") or answer.get("unreachable"))
