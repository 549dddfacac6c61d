# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A GPU's health judged in the collection's one vocabulary, from NVML's reads and the kernel log's XIDs.

Per GPU, each finding says what clears it (:class:`Escalation`): ``gpu_reset`` (a remap or page
retirement pending, uncorrectable ECC errors, NVLink down, the recovery action asking for a reset,
NVML saying a reset is required, a reset-class XID), ``host_reboot`` (the GPU is lost, the recovery
action asks for a node reboot, XID 79), ``host_action`` (a row remap failed: no reset helps, the
GPU needs service; a recovery action this collection does not know). A throttle is a warning
(``none``); so is an XID that is the application's. The host's verdict is the worst of its GPUs'.

The judgement only: gpu_health (health.py) and the node's live health (live_gpus.py, run from a
private copy next to the job's supervisor) judge with this one file. Standard library only, and
only files that are standard library only too (imported by bare name in the private copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

if not __package__:
    # The private copy next to the supervisor's (see _launch/supervisor.py): its neighbours are copies too.
    from health_reads import GPU_LOST, READS, RESET_REQUIRED, kind_of_code  # pylint: disable=import-error
    from terminal import escape_controls  # pylint: disable=import-error
    from verdict import Escalation, FindingKind, Verdict  # pylint: disable=import-error
    from xid import (  # pylint: disable=import-error
        APPLICATION, DEFAULT_BURST_WINDOW, INFORMATIONAL, REBOOT_HOST, RESET_GPU, UNKNOWN, WORKFLOW, KernelLogScan,
        XidBurst, XidRule, bursts, nvml_bus_id, parse_bus_id, rule_for)
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, FindingKind, Verdict
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.health_reads import (
        GPU_LOST,
        READS,
        RESET_REQUIRED,
        kind_of_code,
    )
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.xid import (
        APPLICATION,
        DEFAULT_BURST_WINDOW,
        INFORMATIONAL,
        REBOOT_HOST,
        RESET_GPU,
        UNKNOWN,
        WORKFLOW,
        KernelLogScan,
        XidBurst,
        XidRule,
        bursts,
        nvml_bus_id,
        parse_bus_id,
        rule_for,
    )

# NVML's recovery actions (nvmlDeviceGpuRecoveryAction_t) and what clears each.
RECOVERY_ACTIONS: dict[int, tuple[str, Escalation]] = {
    0: ("none", Escalation.NONE),
    1: ("gpu_reset", Escalation.GPU_RESET),
    2: ("node_reboot", Escalation.HOST_REBOOT),
    3: ("drain_p2p", Escalation.GPU_RESET),        # stop the peer-to-peer work on it, then look again
    4: ("drain_and_reset", Escalation.GPU_RESET),
    5: ("recover_imex_domain", Escalation.HOST_ACTION),  # the IMEX domain's operator acts
    6: ("bus_reset", Escalation.GPU_RESET),
    7: ("system_reboot", Escalation.HOST_REBOOT),
}

# Throttle (clocks event) reasons that say the hardware protects itself: a warning, not a verdict.
THROTTLE_WARNINGS = {0x8: "hw_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}

_XID_ESCALATION = {APPLICATION: Escalation.NONE, INFORMATIONAL: Escalation.NONE, RESET_GPU: Escalation.GPU_RESET,
                   REBOOT_HOST: Escalation.HOST_REBOOT, UNKNOWN: Escalation.NONE}


# --- the judgement -----------------------------------------------------------------------------------


@dataclass
class GpuHealth:
    """One GPU: what it is, what each read said, its XID bursts, and the findings."""

    index: int | None
    uuid: str = ""
    pci_bus_id: str = ""
    reads: dict[str, dict[str, Any]] = field(default_factory=dict)
    xids: list[dict[str, Any]] = field(default_factory=list)
    judgement: Verdict = field(default_factory=Verdict)

    @property
    def escalation(self) -> Escalation:
        return self.judgement.escalation

    @property
    def where(self) -> str:
        name = f"GPU {self.index}" if self.index is not None else "a GPU NVML does not list"
        details = ", ".join(part for part in (self.uuid, self.pci_bus_id) if part)
        return f"{name} ({details})" if details else name

    def add(self, kind: FindingKind, escalation: Escalation, why: str) -> None:
        self.judgement.add(kind, escalation, f"{self.where}: {why}")

    def as_dict(self) -> dict[str, Any]:
        findings = [f.as_dict() for f in self.judgement.findings]
        warnings = [f["why"] for f in findings if f["kind"] == FindingKind.THROTTLE.value]
        return {"index": self.index, "uuid": self.uuid, "pci_bus_id": self.pci_bus_id,
                "escalation": self.escalation.value, "healthy": self.escalation == Escalation.NONE,
                "reads": self.reads, "xids": self.xids, "findings": findings, "warnings": warnings}


def _lost_or_reset(gpu: GpuHealth, code: Any, detail: str) -> bool:
    """A finding for NVML error 15/28 (lost) or 16 (reset required); False for any other code."""
    kind = kind_of_code(code) if isinstance(code, int) else None
    if kind == GPU_LOST:
        gpu.add(FindingKind.GPU_LOST, Escalation.HOST_REBOOT, f"the GPU is lost ({escape_controls(detail)[:200]})")
        return True
    if kind == RESET_REQUIRED:
        gpu.add(FindingKind.RESET_REQUIRED, Escalation.GPU_RESET, f"the GPU requires a reset ({escape_controls(detail)[:200]})")
        return True
    return False


def judge_reads(entry: Mapping[str, Any]) -> GpuHealth:
    """The findings of one GPU's NVML reads (an entry of health_reads.gpu_health_reads)."""
    gpu = GpuHealth(index=entry.get("index"), uuid=escape_controls(str(entry.get("uuid", "")))[:80],
                    pci_bus_id=escape_controls(str(entry.get("pci_bus_id", "")))[:40])
    if "error" in entry:
        error = entry["error"]
        if not _lost_or_reset(gpu, error.get("error"), str(error.get("detail", ""))):
            gpu.add(FindingKind.GPU_LOST, Escalation.HOST_ACTION,
                    f"NVML gives no handle for it: {escape_controls(str(error.get('detail', '')))[:200]}")
        return gpu
    lost = False
    for problem in entry.get("identity_errors", []):
        if not lost:
            lost = _lost_or_reset(gpu, problem.get("error"), str(problem.get("detail", "")))
    reads = entry.get("reads", {})
    for name in READS:
        read = reads.get(name, {"unsupported": "not read"})
        if "value" in read:
            gpu.reads[name] = {"status": "ok", "value": read["value"]}
            _judge_value(gpu, name, read["value"])
        elif "unsupported" in read:
            gpu.reads[name] = {"status": "unsupported", "why": escape_controls(str(read["unsupported"]))[:200]}
        else:
            detail = escape_controls(str(read.get("detail", "")))[:200]
            gpu.reads[name] = {"status": "error", "why": detail}
            if not lost:
                lost = _lost_or_reset(gpu, read.get("error"), detail)
    return gpu


def _judge_value(gpu: GpuHealth, name: str, value: Any) -> None:
    if name == "recovery_action":
        word, escalation = RECOVERY_ACTIONS.get(value, (f"unknown ({value})", Escalation.HOST_ACTION))
        gpu.reads[name]["action"] = word
        if escalation != Escalation.NONE:
            gpu.add(FindingKind.RECOVERY_ACTION, escalation, f"NVML's recovery action is {word}")
    elif name == "remapped_rows":
        if value.get("failure"):
            gpu.add(FindingKind.ROW_REMAP, Escalation.HOST_ACTION,
                    f"a row remap failed ({value.get('uncorrected')} uncorrectable rows): no reset helps, the GPU needs service")
        elif value.get("pending"):
            gpu.add(FindingKind.ROW_REMAP, Escalation.GPU_RESET, "a row remap is pending: a GPU reset activates it")
    elif name == "retired_pages_pending" and value:
        gpu.add(FindingKind.RETIRED_PAGES, Escalation.GPU_RESET, "retired pages are pending: a GPU reset retires them")
    elif name == "ecc_uncorrected_volatile" and value:
        gpu.add(FindingKind.ECC_ERRORS, Escalation.GPU_RESET,
                f"{value} uncorrectable ECC errors since the GPU was last reset")
    elif name == "nvlink" and value.get("down"):
        gpu.add(FindingKind.NVLINK_DOWN, Escalation.GPU_RESET, f"NVLink links down: {value['down']}")
    elif name == "throttle_reasons":
        active = [word for bit, word in THROTTLE_WARNINGS.items() if value & bit]
        gpu.reads[name]["active"] = active
        if active:
            gpu.add(FindingKind.THROTTLE, Escalation.NONE, f"the hardware slows the GPU down: {', '.join(active)} (a warning)")


def judge_xids(gpu: GpuHealth, found: list[XidBurst], table: Mapping[int, XidRule]) -> None:
    """The findings of one GPU's XID bursts; a rule counts once its number of bursts is reached."""
    recovery_read = gpu.reads.get("recovery_action", {}).get("status") == "ok"
    by_code: dict[int, list[XidBurst]] = {}
    for burst in found:
        by_code.setdefault(burst.code, []).append(burst)
        gpu.xids.append({**burst.as_dict(), "class": rule_for(table, burst.code).xid_class})
    for code, code_bursts in sorted(by_code.items()):
        rule = rule_for(table, code)
        if len(code_bursts) < rule.bursts:
            continue
        last = code_bursts[-1]
        said = f"XID {code} ({rule.summary}; {rule.xid_class}) x{sum(b.lines for b in code_bursts)} lines in {len(code_bursts)} burst(s), last: {last.text}"
        if rule.xid_class == WORKFLOW:
            escalation = Escalation.NONE if recovery_read else Escalation.GPU_RESET
            why = ("the recovery action read says what it needs" if recovery_read
                   else "the recovery action cannot be read here, so a reset is assumed")
            gpu.add(FindingKind.XID, escalation, f"{said} ({why})")
        else:
            gpu.add(FindingKind.XID, _XID_ESCALATION[rule.xid_class], said)


@dataclass
class HostHealth:
    gpus: list[GpuHealth]
    unmatched: list[dict[str, Any]]
    judgement: Verdict
    kernel_log: KernelLogScan | None

    @property
    def escalation(self) -> Escalation:
        return self.judgement.escalation

    def as_dict(self) -> dict[str, Any]:
        verdict = self.judgement.as_dict()
        return {"gpus": [gpu.as_dict() for gpu in self.gpus], "unmatched_xids": self.unmatched,
                "healthy": self.escalation == Escalation.NONE,
                "kernel_log": self.kernel_log.as_dict() if self.kernel_log else {"status": "not_read", "why": "kernel_log=false"},
                **verdict}


def judge_host(entries: list[Mapping[str, Any]], scan: KernelLogScan | None, table: Mapping[int, XidRule],
               burst_window: float = DEFAULT_BURST_WINDOW, all_gpus: bool = True) -> HostHealth:
    """Each GPU's findings, its XIDs matched by bus id; XIDs of a bus no selected GPU has count for the host
    only when every GPU was selected (a GPU that fell off the bus may be missing from NVML's list)."""
    gpus = [judge_reads(entry) for entry in entries]
    by_bus = {parse_bus_id(gpu.pci_bus_id): gpu for gpu in gpus if parse_bus_id(gpu.pci_bus_id)}
    found = bursts(scan.lines, burst_window) if scan else []
    per_gpu: dict[int, list[XidBurst]] = {}
    orphans: list[XidBurst] = []
    for burst in found:
        gpu = by_bus.get(burst.bus)
        if gpu is None:
            orphans.append(burst)
        else:
            per_gpu.setdefault(id(gpu), []).append(burst)
    for gpu in gpus:
        judge_xids(gpu, per_gpu.get(id(gpu), []), table)
    judgement = Verdict()
    for gpu in gpus:
        judgement.extend(gpu.judgement)
    unmatched = []
    by_unlisted: dict[tuple, list[XidBurst]] = {}
    for burst in orphans:
        by_unlisted.setdefault(burst.bus, []).append(burst)
    for bus, bus_bursts in by_unlisted.items():
        ghost = GpuHealth(index=None, pci_bus_id=nvml_bus_id(bus))
        judge_xids(ghost, bus_bursts, table)
        unmatched.extend(ghost.xids)
        if all_gpus:
            judgement.extend(ghost.judgement)
    if not judgement.findings:
        judgement.add(FindingKind.HEALTHY, Escalation.NONE, "nothing found on the selected GPUs")
    return HostHealth(gpus, unmatched, judgement, scan)


def host_lost(error_kind: str, detail: str, scan: KernelLogScan | None, table: Mapping[int, XidRule],
              burst_window: float) -> HostHealth:
    """NVML itself reports a GPU lost or requiring a reset before any GPU can be read (nvmlInit, the count)."""
    health = judge_host([], scan, table, burst_window)
    health.judgement.findings = [f for f in health.judgement.findings if f.kind != FindingKind.HEALTHY.value]
    kind, escalation = ((FindingKind.GPU_LOST, Escalation.HOST_REBOOT) if error_kind == GPU_LOST
                        else (FindingKind.RESET_REQUIRED, Escalation.GPU_RESET))
    health.judgement.add(kind, escalation, f"NVML: {escape_controls(detail)[:300]}")
    return health
