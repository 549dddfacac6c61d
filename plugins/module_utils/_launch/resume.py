# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a resuming start appends: resume_args with the newest complete checkpoint filled in.

Pure but for the resolver's reads (checkpoints.py). The control asks it before anything is stopped (so
that a refusal - no complete checkpoint, with checkpoint_missing=refuse - changes nothing, and the probe
reports the checkpoint the ranks' joint decision needs); the executor asks it again once the job is
stopped (a save that was under way then is judged as it was left) and launches with that answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.checkpoints import (
    Resolution,
    rename_torn,
    resolve,
    resume_arguments,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import LaunchOptions


@dataclass(frozen=True)
class ResumeChoice:
    """Whether the start resumes, with which arguments, from which checkpoint; or why it is refused."""

    resume: bool
    resume_args: tuple[str, ...]
    resolution: Resolution | None = None
    refusal: str | None = None

    def as_result(self) -> dict[str, Any] | None:
        """The result's ``checkpoint``: what was found, escaped (names in the job's directory are the user's)."""
        if self.resolution is None:
            return None
        found = _escaped(self.resolution.as_dict())
        found["resumed"] = self.resume
        return found


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return escape_controls(value)
    if isinstance(value, list):
        return [_escaped(item) for item in value]
    if isinstance(value, dict):
        return {key: _escaped(item) for key, item in value.items()}
    return value


def choose(options: LaunchOptions, resume: bool, rename: bool = False) -> ResumeChoice:
    """The resume of a start (`resume`: the plan's - resume_args would be appended).

    Without checkpoint_dir, resume_args as given. With it, the newest complete checkpoint (or the one of
    checkpoint_step, the ranks' joint choice): found, the placeholders are filled in; none, the start runs
    without resume_args (checkpoint_missing=fresh) or is refused (refuse). `rename`: rename torn ones aside
    (checkpoint_rename_torn; only once the job is stopped). CheckpointProblem when the directory cannot be
    judged safely.
    """
    if options.checkpoint_dir is None:
        return ResumeChoice(resume, options.resume_args)
    wanted = options.checkpoint_step if options.checkpoint_step is not None and options.checkpoint_step >= 0 else None
    resolution = resolve(options.checkpoint_dir, options.checkpoint_format, options.checkpoint_marker, wanted)
    if options.checkpoint_step == -1:
        # The ranks share no complete step: none of them resumes (what a chosen one of its own would be is kept).
        resolution.notes.append("the ranks share no complete checkpoint step")
        resolution.chosen = None
    if rename and options.checkpoint_rename_torn and resolution.torn:
        rename_torn(resolution)
    if not resume:
        return ResumeChoice(False, options.resume_args, resolution)
    if resolution.chosen is not None:
        return ResumeChoice(True, resume_arguments(options.resume_args, resolution), resolution)
    why = f"no complete checkpoint in {options.checkpoint_dir} (format {resolution.format})"
    if resolution.notes:
        why += ": " + "; ".join(resolution.notes)
    if options.checkpoint_missing == "refuse":
        return ResumeChoice(False, options.resume_args, resolution,
                            refusal=escape_controls(f"checkpoint_missing=refuse and {why}; nothing was stopped or started"))
    resolution.notes.append(f"{why}: the job starts fresh (checkpoint_missing=fresh)")
    return ResumeChoice(False, (), resolution)
