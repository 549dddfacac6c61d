# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The relaunch's GPU gate: from a health look (gpu_health's result) and the host's quarantine record, may
the job launch, on which GPUs, does a GPU reset come first, or is it refused with the evidence.

A pure function of its inputs (no I/O), so that the module (gpu_gate) and the unit tests decide alike:

* every GPU healthy and none quarantined: launch as always (no CUDA_VISIBLE_DEVICES of the gate's);
* a GPU that only a reset clears, resets allowed and not yet done this run: reset it, look again (a container's
  GPU on its Proxmox node, ``reset_on``: the relaunch resets it there and the container looks again);
* a GPU that a reset does not clear (a host reboot, or service), or one quarantined earlier: the job
  launches on the other GPUs when it declared it can (``min_gpus``) and enough are left, named by UUID;
  otherwise it is refused, naming each bad GPU with its evidence;
* a finding of the host's that no listed GPU carries (an XID of a GPU that fell off the bus, NVML lost
  before any GPU could be read): refused, since nothing can be routed around.

Every GPU found bad is to be quarantined (``quarantine``), whatever the outcome, until a person clears it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, worst

LAUNCH, RESET, REFUSE = "launch", "reset", "refuse"
# What the evidence of one GPU keeps of its XID bursts (their text is already bounded and escaped).
XID_KEYS = ("xid", "class", "first", "last", "lines", "text")
MAX_REASONS = 8


@dataclass(frozen=True)
class GatePolicy:
    """What the inventory allows: resets at all, resets on this machine (False: a container whose GPUs its
    Proxmox node owns, `owner`, which resets them), and the fewest GPUs the job can run on (0: every one it
    was given)."""

    reset_allowed: bool = False
    reset_here: bool = True
    owner: str = ""
    min_gpus: int = 0


def _level(word: Any) -> Escalation:
    try:
        return Escalation(word)
    except ValueError:
        return Escalation.HOST_ACTION  # a word outside the vocabulary blocks rather than passes


def evidence(gpu: Mapping[str, Any]) -> dict[str, Any]:
    """What a person needs to see of one bad GPU: index, UUID, bus id, what clears it, why, the XIDs with their
    time and text, NVML's recovery action and the row-remap counts (None where not read)."""
    reads = gpu.get("reads") if isinstance(gpu.get("reads"), Mapping) else {}
    recovery = reads.get("recovery_action") or {}
    remap = reads.get("remapped_rows") or {}
    findings = [f for f in gpu.get("findings") or [] if isinstance(f, Mapping) and f.get("escalation") != Escalation.NONE.value]
    return {
        "index": gpu.get("index"), "uuid": str(gpu.get("uuid") or ""), "pci_bus_id": str(gpu.get("pci_bus_id") or ""),
        "escalation": _level(gpu.get("escalation")).value,
        "reasons": [escape_controls(str(f.get("why")))[:400] for f in findings][:MAX_REASONS],
        "xids": [{key: burst.get(key) for key in XID_KEYS} for burst in gpu.get("xids") or [] if isinstance(burst, Mapping)
                 and burst.get("class") not in ("application", "informational")][:MAX_REASONS],
        "recovery_action": recovery.get("action") if recovery.get("status") == "ok" else None,
        "remapped_rows": remap.get("value") if remap.get("status") == "ok" else None,
    }


def _named(entry: Mapping[str, Any]) -> str:
    parts = ", ".join(str(part) for part in (entry.get("uuid"), entry.get("pci_bus_id")) if part)
    return escape_controls(f"GPU {entry.get('index')} ({parts})" if parts else f"GPU {entry.get('index')}")


def _said(entry: Mapping[str, Any]) -> str:
    named = _named(entry)
    # gpu_health's reasons each name their GPU: the name is said once, in front.
    reasons = [reason[len(named) + 2:] if reason.startswith(named + ": ") else reason for reason in entry.get("reasons") or []]
    why = "; ".join(reasons) or entry.get("quarantined_why") or entry["escalation"]
    return f"{named}: {why}"


def decide(health: Mapping[str, Any], quarantined: Mapping[str, Mapping[str, Any]], policy: GatePolicy,
           reset_done: bool = False) -> dict[str, Any]:
    """The gate's answer for one look. Keys: ``outcome`` (launch, reset, refuse), ``escalation`` (the worst of
    the bad GPUs', or the host's), ``bad`` (each bad GPU's evidence, ``quarantined`` true for one an earlier
    run quarantined), ``reset`` (the indices to reset, outcome reset), ``visible`` (the UUIDs the job launches
    on when the gate leaves GPUs out, else []; ``visible_indices`` their indices), ``quarantine`` (the evidence of the GPUs to quarantine now),
    ``reset_on`` (outcome reset: the Proxmox node that resets them, by ``reset_uuids``; "" for this machine),
    ``why`` (one sentence)."""
    gpus = [gpu for gpu in health.get("gpus") or [] if isinstance(gpu, Mapping)]
    good: list[Mapping[str, Any]] = []
    bad: list[dict[str, Any]] = []
    for gpu in gpus:
        level = _level(gpu.get("escalation"))
        record = quarantined.get(str(gpu.get("uuid") or ""))
        if level != Escalation.NONE:
            bad.append(dict(evidence(gpu), quarantined=record is not None))
        elif record is not None:
            bad.append(dict(evidence(gpu), escalation=_level(record.get("escalation")).value, quarantined=True,
                            quarantined_why=f"quarantined since {record.get('since')}: {'; '.join(record.get('reasons') or [])}"))
        else:
            good.append(gpu)
    host_level = _level(health.get("escalation"))
    gpu_level = worst(_level(entry["escalation"]) for entry in bad)
    answer: dict[str, Any] = {"outcome": LAUNCH, "escalation": gpu_level.value, "bad": bad, "reset": [], "visible": [],
                              "visible_indices": [], "reset_uuids": [], "reset_on": "",
                              "quarantine": [entry for entry in bad if not entry["quarantined"]], "why": ""}
    if host_level.rank > gpu_level.rank or (not gpus and host_level != Escalation.NONE):
        # A finding no listed GPU carries: nothing to route around.
        reasons = "; ".join(escape_controls(str(r)) for r in (health.get("reasons") or [])[:MAX_REASONS])
        return dict(answer, outcome=REFUSE, escalation=host_level.value,
                    why=f"the host's GPUs need {host_level.value}, on no GPU that can be left out: {reasons}")
    if not bad:
        return dict(answer, why=f"{len(gpus)} GPU(s) healthy, none quarantined")
    resettable = [entry for entry in bad if entry["escalation"] == Escalation.GPU_RESET.value and not entry["quarantined"]]
    hard = [entry for entry in bad if entry not in resettable]
    usable_after_reset = len(good) + len(resettable)
    routable = not hard or (policy.min_gpus > 0 and usable_after_reset >= policy.min_gpus)
    if resettable and policy.reset_allowed and not reset_done and routable:
        where = "" if policy.reset_here else f" on their Proxmox node {escape_controls(policy.owner)}"
        return dict(answer, outcome=RESET, quarantine=[], reset=[entry["index"] for entry in resettable],
                    reset_uuids=[entry["uuid"] for entry in resettable], reset_on="" if policy.reset_here else policy.owner,
                    why=f"{', '.join(_named(e) for e in resettable)} need(s) a GPU reset{where}, which the inventory allows")
    said = "; ".join(_said(entry) for entry in bad)
    if policy.min_gpus > 0 and len(good) >= policy.min_gpus:
        kept = sorted(good, key=lambda gpu: gpu.get("index") or 0)
        return dict(answer, visible=[str(gpu.get("uuid")) for gpu in kept], visible_indices=[gpu.get("index") for gpu in kept],
                    why=f"launched on {len(good)} healthy GPU(s) of {len(gpus)} (job_launch_min_gpus {policy.min_gpus}), "
                        f"without {said}")
    return dict(answer, outcome=REFUSE, why=f"{said}{_unless(bad, good, policy, reset_done)}")


def _unless(bad: list[dict[str, Any]], good: list[Mapping[str, Any]], policy: GatePolicy, reset_done: bool) -> str:
    """What would have let it launch, for the refusal's message."""
    parts = []
    if any(entry["escalation"] == Escalation.GPU_RESET.value and not entry["quarantined"] for entry in bad):
        if reset_done:
            parts.append("a GPU reset did not clear it")
        elif not policy.reset_allowed:
            parts.append("resets are not allowed for this host (relaunch_gpu_reset_allowed)")
    if any(entry["quarantined"] for entry in bad):
        parts.append("a quarantined GPU stays out until a person clears it (relaunch_gpu_quarantine_clear)")
    if policy.min_gpus > 0:
        parts.append(f"{len(good)} healthy GPU(s) left, fewer than job_launch_min_gpus {policy.min_gpus}")
    else:
        parts.append("the job needs every one of its GPUs (set job_launch_min_gpus where it can run on fewer)")
    return " (" + "; ".join(parts) + ")"


def cuda_visible_devices(visible: list[str]) -> str:
    """The job's CUDA_VISIBLE_DEVICES for the GPUs the gate leaves it: their UUIDs, comma-separated ("" for none)."""
    return ",".join(visible)
