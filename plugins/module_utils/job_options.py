# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The option spec shared by the modules that select a job (see doc fragment job_selection)."""

from __future__ import annotations

from typing import Any, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils.procfs import compile_patterns
from ansible_collections.gpuops.relaunch.plugins.module_utils.selection import (
    DEFAULT_PROTECTED,
    JobSelector,
)

JOB_SELECTION_SPEC: dict[str, dict[str, Any]] = {
    "match": {"type": "list", "elements": "str", "default": []},
    "pids": {"type": "list", "elements": "int", "default": []},
    "include_descendants": {"type": "bool", "default": True},
    "protected": {"type": "list", "elements": "str", "default": list(DEFAULT_PROTECTED)},
    "gpu_device_glob": {"type": "str", "default": "/dev/nvidia*"},
    "proc_root": {"type": "path", "default": "/proc"},
}


def job_selection_from_params(params: Mapping[str, Any]) -> tuple[JobSelector, tuple[Pattern[str], ...]]:
    """The selector and protected patterns; ValueError names the option that is wrong."""
    bad_pids = [pid for pid in params["pids"] if pid <= 0]
    if bad_pids:
        raise ValueError(f"pids: process IDs must be positive integers, got {bad_pids}")
    if not params["gpu_device_glob"]:
        raise ValueError("gpu_device_glob: must not be empty")
    selector = JobSelector.from_options(params["match"], params["pids"], params["include_descendants"])
    protected = tuple(compile_patterns(params["protected"], "protected"))
    return selector, protected
