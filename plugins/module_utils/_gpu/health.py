# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpu_health's options and its look at a host: the kernel log, then NVML's reads of every GPU.

The judgement itself (what each read and each XID means, the host's verdict) is health_judge.py's,
which the node's live health shares; its names are imported here for gpu_health and the relaunch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_seconds, check_timeout
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, FindingKind
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.health_judge import (  # noqa: F401  pylint: disable=unused-import
    RECOVERY_ACTIONS,
    THROTTLE_WARNINGS,
    GpuHealth,
    HostHealth,
    host_lost,
    judge_host,
    judge_reads,
    judge_xids,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (
    GPU_LOST,
    RESET_REQUIRED,
    GpuDevice,
    GpuQueryError,
    open_gpu_source,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.wait import resolve_devices
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.xid import XidRule, read_kernel_log, xid_table

MAX_BURST_WINDOW = 3600.0
MAX_READ_TIMEOUT = 600.0


@dataclass(frozen=True)
class HealthOptions:
    gpus: tuple[str, ...]
    since: float
    table: dict[int, XidRule]
    burst_window: float
    kernel_log: bool
    kernel_log_timeout: float


def options_from_params(params: Mapping[str, Any], now: float | None = None) -> HealthOptions:
    """The module's options checked at once; OptionsInvalid naming every bad one."""
    checks = OptionChecks()
    gpus = tuple(str(gpu).strip() for gpu in params["devices"])
    if not all(gpus):
        checks.add("devices", f"entries must not be empty, got {params['devices']!r}")
    since = checks.check(_since, params["since"], time.time() if now is None else now)
    table = checks.check(xid_table, params["xid_overrides"])
    window = checks.check(check_seconds, "burst_window", params["burst_window"], 0.0, MAX_BURST_WINDOW)
    timeout = checks.check(check_seconds, "kernel_log_timeout", params["kernel_log_timeout"], 0.0, MAX_READ_TIMEOUT,
                           allow_minimum=False)
    checks.check(check_timeout, "query_timeout", params["query_timeout"], MAX_READ_TIMEOUT)
    checks.raise_if_any()
    return HealthOptions(gpus, float(since), dict(table or {}), float(window), bool(params["kernel_log"]),  # type: ignore[arg-type]
                         float(timeout))  # type: ignore[arg-type]


def _since(value: Any, now: float) -> float:
    """Seconds since the epoch; a negative number counts back from now (-3600: the last hour)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise BadOption("since", f"must be seconds since the epoch (or negative: seconds before now), got {str(value)[:40]!r}") from None
    if not math.isfinite(seconds):
        raise BadOption("since", f"must be a finite number, got {value!r}")
    if seconds > now + 86400:
        raise BadOption("since", f"{seconds:g} is more than a day in the future")
    return now + seconds if seconds < 0 else seconds


# --- the look -----------------------------------------------------------------------------------

def read_host(options: HealthOptions, backend: str, nvidia_smi: str, query_timeout: float) -> tuple[str, HostHealth]:
    """(backend, the host's health): the kernel log first (it needs no GPU), then the GPUs.

    GpuQueryError where no GPU can be read at all, except a GPU lost or requiring a reset, which is a verdict.
    BadOption (naming ``devices``) for a selected GPU that is not on the host.
    """
    scan = read_kernel_log(options.since, options.kernel_log_timeout) if options.kernel_log else None
    source = None
    try:
        source = open_gpu_source(backend, nvidia_smi, query_timeout)
        # One health read of every GPU, selected afterwards: a lost GPU fails only its own entry. The
        # nvidia-smi fallback reads what its -q -x report has (NvidiaSmiSession.health).
        entries = source.health(None)  # type: ignore[attr-defined]
        if options.gpus:
            listed = [GpuDevice(index=e["index"], uuid=str(e.get("uuid", "")), name="", total_bytes=0, used_bytes=0)
                      for e in entries]
            indices = set(resolve_devices(listed, list(options.gpus)))
            entries = [e for e in entries if e["index"] in indices]
        return source.backend, judge_host(entries, scan, options.table, options.burst_window, all_gpus=not options.gpus)
    except GpuQueryError as exc:
        if exc.kind not in (GPU_LOST, RESET_REQUIRED):
            raise
        return (source.backend if source else "none"), host_lost(exc.kind, str(exc), scan, options.table, options.burst_window)
    finally:
        if source is not None:
            source.close()


def no_gpu_health(options: HealthOptions, why: str) -> HostHealth:
    """A host without a usable GPU (gpus_required=false): nothing to judge but the kernel log."""
    scan = read_kernel_log(options.since, options.kernel_log_timeout) if options.kernel_log else None
    health = judge_host([], scan, options.table, options.burst_window)
    if [f for f in health.judgement.findings if f.kind == FindingKind.HEALTHY.value]:
        health.judgement.findings = []
        health.judgement.add(FindingKind.HEALTHY, Escalation.NONE, f"no NVIDIA GPU on this host: {escape_controls(why)[:300]}")
    return health
