# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gate's one run on the target (module gpu_gate): the quarantine record, a health look, the decision
(gate.decide), a reset where the decision says so and the inventory allows it, a look again, and the record
updated. Change nothing in check mode: a reset is then announced, never done, and no record is written.

A container's GPUs are reset on their Proxmox node (GatePolicy.owner): the gate answers ``reset`` with the
UUIDs, the relaunch runs gpu_reset there (roles/relaunch/tasks/gpu_node_reset.yml) and gives its answer back
(``node_reset``) to this gate's second run in the container, which looks again and decides as after a reset of
its own."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_seconds
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import quarantine
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.gate import (
    LAUNCH, REFUSE, RESET, GatePolicy, cuda_visible_devices, decide,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.health import (
    HealthOptions, no_gpu_health, options_from_params, read_host,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import GpuDevice, GpuQueryError
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.reset import is_gpu_uuid, read_device, reset_gpu

SKIP = "skip"
MAX_RESET_TIMEOUT = 600.0
MAX_MIN_GPUS = 256


@dataclass(frozen=True)
class GateOptions:
    health: HealthOptions
    policy: GatePolicy
    state_dir: str
    clear_quarantine: bool
    reset_timeout: float
    job_name: str
    record_only: bool
    gpus_required: bool
    backend: str
    nvidia_smi: str
    query_timeout: float
    node_reset: dict[str, Any] | None = None


def gate_options(params: Mapping[str, Any]) -> GateOptions:
    """The module's options checked at once; OptionsInvalid naming every bad one."""
    checks = OptionChecks()
    health = None
    try:
        health = options_from_params(params)
    except OptionsInvalid as exc:
        checks.problems.extend(exc.problems)
    state_dir = str(params["state_dir"] or "")
    if not state_dir.startswith("/"):
        checks.add("state_dir", f"must be an absolute path, got {state_dir[:80]!r}")
    min_gpus = params["min_gpus"]
    if not isinstance(min_gpus, int) or not 0 <= min_gpus <= MAX_MIN_GPUS:
        checks.add("min_gpus", f"must be a whole number from 0 (every GPU) to {MAX_MIN_GPUS}, got {min_gpus!r}")
    timeout = checks.check(check_seconds, "reset_timeout", params["reset_timeout"], 0.0, MAX_RESET_TIMEOUT, allow_minimum=False)
    node_reset = checks.check(node_reset_answer, params.get("node_reset"))
    checks.raise_if_any()
    node = str(params["reset_node"] or "")
    policy = GatePolicy(reset_allowed=bool(params["reset_allowed"]), reset_here=not node, owner=node, min_gpus=int(min_gpus))
    return GateOptions(health, policy, state_dir, bool(params["clear_quarantine"]), float(timeout),  # type: ignore[arg-type]
                       str(params["job_name"] or ""), bool(params["record_only"]), bool(params["gpus_required"]),
                       str(params["backend"]), str(params["nvidia_smi"]), float(params["query_timeout"]), node_reset)


RESET_KEYS = ("index", "uuid", "done", "holders", "why")


def node_reset_answer(answer: Any) -> dict[str, Any] | None:
    """The node's reset (module gpu_reset's result: ``reset``, a list of its GPUs' answers, and ``at``, when it
    began), checked; None where none was given. A GPU counts as reset only with a GPU UUID and ``done`` true."""
    if not answer:
        return None
    if isinstance(answer, Mapping) and answer.get("unreachable") is True:
        # The node could not be reached (the role's task ignores that, so that this look refuses with why).
        return {"reset": [], "at": 0.0, "unreachable": f"the node could not be reached: {escape_controls(str(answer.get('msg') or ''))[:400]}"}
    resets = answer.get("reset") if isinstance(answer, Mapping) else None
    at = answer.get("at") if isinstance(answer, Mapping) else None
    if not isinstance(resets, list) or not all(isinstance(entry, Mapping) for entry in resets) or isinstance(at, bool) \
            or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
        raise BadOption("node_reset", "must be gpu_reset's result on the node (reset: a list of dicts, at: a time), "
                                      f"got {escape_controls(repr(answer))[:200]}")
    entries = [{key: entry.get(key) for key in RESET_KEYS} for entry in resets]
    for entry in entries:
        entry["done"] = entry["done"] is True and is_gpu_uuid(entry["uuid"])
        entry["uuid"] = escape_controls(str(entry["uuid"] or ""))[:80]
        entry["why"] = escape_controls(str(entry["why"] or ""))[:400]
    return {"reset": entries, "at": float(at), "unreachable": ""}


def _look(options: GateOptions, since: float) -> dict[str, Any]:
    """One health look (gpu_health's result); GpuQueryError where no GPU can be read."""
    health = HealthOptions(options.health.gpus, since, options.health.table, options.health.burst_window,
                           options.health.kernel_log, options.health.kernel_log_timeout)
    backend, host = read_host(health, options.backend, options.nvidia_smi, options.query_timeout)
    return dict(host.as_dict(), backend=backend)


def _device(options: GateOptions, index: int) -> GpuDevice | None:
    """GPU `index` as the driver lists it now, with its minor number; None where it cannot be read."""
    return read_device(options.backend, options.nvidia_smi, options.query_timeout, index=index)


def run_gate(options: GateOptions, check_mode: bool) -> dict[str, Any]:
    """The gate's answer (see the module's RETURN). GpuQueryError where the GPUs cannot be read and they are
    required; quarantine.QuarantineError where the record is not sound."""
    began = time.monotonic()
    record = quarantine.read(options.state_dir)
    if options.record_only:
        # Only what the record says (no look, nothing written): the relaunch's probe reads the job's launch.
        return {"outcome": "record", "why": "the quarantine record, read only", "quarantined": sorted(record["gpus"]),
                "cuda_visible_devices": quarantine.launched_on(record, options.job_name), "changed": False,
                "elapsed": round(time.monotonic() - began, 3),
                "quarantine_record": f"{options.state_dir.rstrip('/')}/{quarantine.RECORD}"}
    cleared: list[str] = []
    changed = False
    if options.clear_quarantine and (record["gpus"] or not record.get("cleared_at")):
        cleared = sorted(record["gpus"])
        # What the kernel log said before a person cleared the quarantine is not counted again.
        record = dict(record, gpus={}, cleared_at=round(time.time(), 3))
        changed = bool(cleared)
    resets: list[dict[str, Any]] = []
    node = options.node_reset
    if node is not None:
        # The look again after the node reset this container's GPUs: as after a reset of the gate's own.
        resets = node["reset"]
        done = [entry["uuid"] for entry in resets if entry["done"]]
        if done:
            record = quarantine.with_resets(record, done, node["at"])
            changed = True
    since = max(options.health.since, quarantine.last_reset(record), float(record.get("cleared_at") or 0))
    try:
        health = _look(options, since)
    except GpuQueryError as exc:
        if options.gpus_required or not exc.means_no_gpu:
            raise
        health = dict(no_gpu_health(options.health, str(exc)).as_dict(), backend="none")
        return {"outcome": SKIP, "why": f"no NVIDIA GPU on this host (gpus_required=false): the gate is skipped: {exc}",
                "gpu_present": False, "health": health, "escalation": "none", "bad": [], "visible": [], "visible_indices": [],
                "cuda_visible_devices": "", "reset": [], "quarantined": [], "quarantine_cleared": cleared,
                "changed": changed and not check_mode, "elapsed": round(time.monotonic() - began, 3),
                **_written(options, record, changed, check_mode)}
    decision = decide(health, record["gpus"], options.policy, reset_done=node is not None)
    health_after = None
    if node is not None:
        failed = [entry["why"] for entry in resets if not entry["done"]] + [node["unreachable"]] * bool(node["unreachable"])
        if failed and decision["outcome"] == REFUSE:
            decision["why"] += f"; on the node {escape_controls(options.policy.owner)}: " + "; ".join(failed)
    elif decision["outcome"] == RESET and decision["reset_on"]:
        # Announced: the node resets them (the relaunch runs gpu_reset there and this gate again).
        resets = [{"index": index, "uuid": uuid, "done": False, "holders": [],
                   "why": f"to be reset on the Proxmox node {escape_controls(decision['reset_on'])}"}
                  for index, uuid in zip(decision["reset"], decision["reset_uuids"])]
    elif decision["outcome"] == RESET and not check_mode:
        stamp = time.time()
        for index in decision["reset"]:
            answer = reset_gpu(index, lambda index=index: _device(options, index), options.nvidia_smi, options.reset_timeout)
            resets.append(answer.as_dict())
        done = [r["uuid"] for r in resets if r["done"]]
        if done:
            record = quarantine.with_resets(record, done, stamp)
            changed = True
        health_after = _look(options, stamp)
        decision = decide(health_after, record["gpus"], options.policy, reset_done=True)
        failed = [r["why"] for r in resets if not r["done"]]
        if failed and decision["outcome"] == REFUSE:
            decision["why"] += "; " + "; ".join(failed)
    elif decision["outcome"] == RESET:
        resets = [{"index": index, "uuid": "", "done": False, "holders": [], "why": "check mode: would reset"}
                  for index in decision["reset"]]
    if decision["quarantine"]:
        record = quarantine.added(record, decision["quarantine"])
        changed = True
    if options.job_name and decision["outcome"] == LAUNCH:
        noted = quarantine.with_launch(record, options.job_name, cuda_visible_devices(decision["visible"]))
        changed = changed or noted != record
        record = noted
    return {"outcome": decision["outcome"], "why": decision["why"], "gpu_present": True, "health": health,
            "reset_node": decision["reset_on"], "reset_uuids": decision["reset_uuids"],
            "health_after": health_after, "escalation": decision["escalation"], "bad": decision["bad"],
            "visible": decision["visible"], "visible_indices": decision["visible_indices"], "cuda_visible_devices": cuda_visible_devices(decision["visible"]),
            "reset": resets, "quarantined": sorted(record["gpus"]), "quarantine_cleared": cleared,
            "changed": changed and not check_mode, "elapsed": round(time.monotonic() - began, 3),
            **_written(options, record, changed, check_mode)}


def _written(options: GateOptions, record: Mapping[str, Any], changed: bool, check_mode: bool) -> dict[str, Any]:
    """Write the record where it changed (not in check mode); the record's path."""
    if changed and not check_mode:
        quarantine.write(options.state_dir, record)
    return {"quarantine_record": f"{options.state_dir.rstrip('/')}/{quarantine.RECORD}"}


__all__ = ["GateOptions", "LAUNCH", "REFUSE", "RESET", "SKIP", "gate_options", "run_gate"]
