# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The option spec shared by the modules that select a job (see doc fragment job_selection)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils.procfs import ProcessTable, compile_patterns
from ansible_collections.gpuops.relaunch.plugins.module_utils.selection import (
    DEFAULT_PROTECTED,
    JobSelector,
    Protection,
)

JOB_SELECTION_SPEC: dict[str, dict[str, Any]] = {
    "match": {"type": "list", "elements": "str", "default": []},
    "pids": {"type": "list", "elements": "int", "default": []},
    "include_descendants": {"type": "bool", "default": True},
    "allow_broad": {"type": "bool", "default": False},
    "protected": {"type": "list", "elements": "str", "default": list(DEFAULT_PROTECTED)},
    "gpu_device_glob": {"type": "str", "default": "/dev/nvidia*"},
    "proc_root": {"type": "path", "default": "/proc"},
}


class BroadSelectionError(ValueError):
    """The selection names more than a job; `job` is what it would have selected."""

    SHOWN = 5

    def __init__(self, reasons: list[str], job: list[dict[str, Any]]) -> None:
        more = len(reasons) - self.SHOWN
        shown = "; ".join(reasons[: self.SHOWN]) + (f" (and {more} more)" if more > 0 else "")
        super().__init__(
            f"{shown}. Refused; nothing was touched: name the job itself (for example "
            "/workspace/run/train\\.py\\b or its pids), or set allow_broad: true if every unprotected process "
            "this selects may really be ended"
        )
        self.reasons = reasons
        self.job = job


def job_selection_from_params(params: Mapping[str, Any]) -> tuple[JobSelector, tuple[Pattern[str], ...]]:
    """The selector and protected patterns; ValueError names the option that is wrong."""
    bad_pids = [pid for pid in params["pids"] if pid <= 0]
    if bad_pids:
        raise ValueError(f"pids: process IDs must be positive integers, got {bad_pids}")
    if not params["gpu_device_glob"]:
        raise ValueError("gpu_device_glob: must not be empty")
    selector = JobSelector.from_options(
        params["match"], params["pids"], params["include_descendants"], params["allow_broad"],
    )
    protected = tuple(compile_patterns(params["protected"], "protected"))
    return selector, protected


def own_pid_in(proc_root: str) -> int:
    """This process's pid in the PID namespace of `proc_root`; 0 when it has none there."""
    try:
        return int(os.readlink(os.path.join(proc_root, "self")))
    except (OSError, ValueError):
        return 0


def refuse_broad_selection(selector: JobSelector, protected: tuple[Pattern[str], ...], proc_root: str) -> None:
    """Raise BroadSelectionError when `selector` is too broad (see selection.selection_floor) on a
    fresh look at `proc_root`, unless it allows that. An empty selection is for the caller to judge."""
    if selector.allow_broad or selector.is_empty:
        return
    table = ProcessTable.scan(proc_root)
    protection = Protection(table, protected)
    reasons = selector.too_broad(table, protection, own_pid_in(proc_root))
    if reasons:
        processes = table.processes
        job = [
            {"pid": pid, "starttime": processes[pid].starttime, "comm": processes[pid].comm}
            for pid in sorted(selector.select(table, protection))
        ]
        raise BroadSelectionError(reasons, job)
