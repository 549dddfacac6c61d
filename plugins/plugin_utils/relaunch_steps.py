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

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import (
    RelaunchInputError, clearance, gate_refusal, gate_reset_done, hardware_caused, superseded,
)

# The gate's answers (module gpu_gate, plugins/module_utils/_gpu/gate.py).
REFUSE, RESET, SKIP = "refuse", "reset", "skip"
# gpu_mem_wait's error_kind for a GPU the hardware must fix (query.GPU_LOST, query.RESET_REQUIRED): the gate's to judge.
GPU_HARDWARE_ERRORS = ("gpu_lost", "reset_required")

# Runs a step's module on the target: (module, the options this step gives, with the drain's environment)
# -> its result. The other options come from the role variables (plugin_utils/role_vars).
StepRunner = Callable[[str, Mapping[str, Any], bool], dict[str, Any]]

# How a failure names its step (the launch of a rank is the role's task of that name, roles/relaunch/tasks/steps.yml).
STEP_NAMES = {
    "stop": "Stop the job and wait until its whole process tree is gone",
    "cleanup": "End what the last run left behind with the least force that works",
    "drain": "Wait until the GPUs are released",
    "clearance": "Check that nothing left blocks the launch",
    "gate": "Check the GPUs' hardware before the launch",
    "launch": "Launch the job and prove it started",
}


def relaunch_steps(run: StepRunner, decision: Mapping[str, Any], reset_allowed: bool, check_mode: bool,
                   host: str, launch: bool = True, gate: Mapping[str, Any] | None = None,
                   launch_env: Mapping[str, Any] | None = None, node_reset_timeout: float | None = None) -> dict[str, Any]:
    """Stop (where something runs), clean up, drain (unless a newer run was left alone), check the clearance and,
    with `launch`, launch, stopping at the first step that fails. Returns each step's result by name under
    ``steps`` (a step that did not run is None), ``failure`` ("STEP NAME: message", or None), ``unreachable``
    (the step that failed lost the host) and ``reset`` (only a container reboot helps and the inventory allows
    it: the role reboots, looks again and launches, roles/relaunch/tasks/steps.yml). A rank of a multi-rank job
    launches after its barrier, in the role (`launch` false).

    After the clearance, the GPU gate (module gpu_gate, its options `gate`) looks at the hardware where the drain
    looked at GPUs: ``refused`` is then its refusal (the host's message, with the evidence), and ``launch_env`` the
    job's environment with the gate's CUDA_VISIBLE_DEVICES where it leaves GPUs out (`launch_env`: the job's).

    A container's GPU that its Proxmox node must reset (the gate's ``reset``, naming the node): ``node_reset`` says
    what the role does next (roles/relaunch/tasks/gpu_node_reset.yml) - ``node``, ``uuids``, ``reset_timeout``
    (`node_reset_timeout`, None: gpu_reset's default), ``gate`` (this gate's options, for its look again),
    ``drain`` (the drain stopped at that GPU and looks again after the reset) and ``env`` (the launch's
    environment, to which the look again may add CUDA_VISIBLE_DEVICES); nothing is launched here."""
    steps: dict[str, Any] = {name: None for name in STEP_NAMES}
    outcome: dict[str, Any] = {"steps": steps, "failure": None, "unreachable": False, "reset": False, "refused": None,
                               "launch_env": None, "node_reset": None}

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
    hardware = False
    if not superseded(steps["cleanup"]):
        steps["drain"] = run("gpu_mem_wait", {}, True)
        # A GPU lost or requiring a reset stops the drain's query: the gate judges that GPU (and may leave it out).
        hardware = bool(steps["drain"].get("failed")) and steps["drain"].get("error_kind") in GPU_HARDWARE_ERRORS
        # A timeout is an answer (with its escalation) for the clearance; a broken query or a bad option is not.
        if steps["drain"].get("unreachable") or (
                steps["drain"].get("failed") and "escalation" not in steps["drain"] and not hardware):
            return failed("drain", steps["drain"])
    steps["clearance"] = clearance(steps["cleanup"], {} if hardware else steps["drain"] or {}, reset_allowed, False,
                                   check_mode, host)
    if steps["clearance"]["blocked"]:
        return failed("clearance", {}, steps["clearance"]["blocked"])
    if steps["clearance"]["reset"]:
        outcome["reset"] = True
    steps["gate"] = gate_step(run, steps["drain"], gate or {})
    if _failed(steps["gate"]):
        return failed("gate", steps["gate"])
    if steps["gate"].get("outcome") == REFUSE:
        outcome["refused"] = gate_refusal(host, steps["gate"])
        return outcome
    if steps["gate"].get("outcome") == RESET and steps["gate"].get("reset_node") and not check_mode:
        outcome["node_reset"] = {"node": str(steps["gate"]["reset_node"]), "uuids": list(steps["gate"].get("reset_uuids") or []),
                                 "reset_timeout": node_reset_timeout, "gate": dict(gate or {}), "drain": hardware,
                                 "env": dict(launch_env or {})}
        return outcome
    if hardware:
        # The drain stopped at the bad GPU. Where the gate left it out, the drain looks again at the GPUs the job
        # gets, by index (gpu_mem_wait then reads only those, not the bad GPU, which would stop it again); where
        # the gate reset it here and it came back clean, at every GPU; otherwise it stays stopped.
        if steps["gate"].get("visible"):
            again: dict[str, Any] = {"devices": [str(i) for i in steps["gate"].get("visible_indices") or []]}
        elif gate_reset_done(steps["gate"]):
            again = {}
        else:
            return failed("drain", steps["drain"])
        steps["drain"] = run("gpu_mem_wait", again, True)
        if _failed(steps["drain"]) or steps["drain"].get("released") is False:
            return failed("drain", steps["drain"])
    if steps["gate"].get("cuda_visible_devices"):
        outcome["launch_env"] = dict(launch_env or {}, CUDA_VISIBLE_DEVICES=steps["gate"]["cuda_visible_devices"])
    if outcome["reset"] or not launch:
        return outcome
    start: dict[str, Any] = {"state": "started"}
    if decision.get("resume_mode"):
        # The start resumes exactly as the decision said (always or never).
        start["resume"] = decision["resume_mode"]
    if outcome["launch_env"] is not None:
        start["env"] = outcome["launch_env"]
    if hardware_caused(steps["gate"]):
        start["failure_cause"] = "hardware"
    if decision.get("checkpoint_step") is not None:
        # The ranks' joint choice (relaunch_flow.shared_checkpoint_step).
        start["checkpoint_step"] = decision["checkpoint_step"]
    steps["launch"] = run("train_launch", start, False)
    if _failed(steps["launch"]):
        return failed("launch", steps["launch"])
    return outcome


def _failed(answer: Mapping[str, Any]) -> bool:
    return bool(answer.get("failed") or answer.get("unreachable"))


def gate_step(run: StepRunner, drain: Mapping[str, Any] | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """The GPU gate's answer: gpu_gate's module run where the drain looked at GPUs, else a skip that says why (no
    module run: a newer run's GPUs the clean-up left alone, or no GPU on the host with gpus_required false)."""
    if not drain:
        return {"outcome": SKIP, "changed": False, "why": "the drain did not run (a newer run holds the GPUs): no GPU gate"}
    if drain.get("gpu_present") is False:
        return {"outcome": SKIP, "changed": False,
                "why": "the drain found no GPU on this host (gpu_drain_gpus_required false): no GPU gate"}
    return run("gpu_gate", options, True)


def check_gpu_node(host: str, node: Any, inventory_hosts: list[str]) -> None:
    """relaunch_gpu_node names the Proxmox node that resets this container's GPUs: an inventory host (reached by
    its own connection), not this host. RelaunchInputError, before anything changed, otherwise."""
    if not node:
        return
    if not isinstance(node, str):
        raise RelaunchInputError(f"{host}: nothing was done: relaunch_gpu_node must be an inventory hostname, got {type(node).__name__}")
    if node == host:
        raise RelaunchInputError(f"{host}: nothing was done: relaunch_gpu_node names this host itself; it names the Proxmox "
                                 f"node whose GPUs this container uses (unset it for a bare host)")
    if node not in inventory_hosts:
        raise RelaunchInputError(f"{host}: nothing was done: relaunch_gpu_node {escape_controls(node)[:200]!r} is not a host "
                                 f"of the inventory; name the Proxmox node as an inventory host, reached by its own connection")
