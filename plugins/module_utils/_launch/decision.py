# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The relaunch's policy: whether a job is relaunched, left alone or refused, and why.

Pure: the verdict on the job (HealthReport), whether it runs with another spec, log path or backend,
the crash-loop guard's report and ``force`` in, a :class:`Decision` out. Decide on ``action`` (or
``relaunch``), never on ``why``: the text is for people.

Whether a start appends resume_args is decided here too, once (:func:`would_resume`): the probe's
decision says it and names the ``resume_mode`` that makes the start do the same, and the start
(plan.py's Plan.resume) is made with the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import RelaunchGuard
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import HealthReport
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Action, Health


class LaunchState(Enum):
    """train_launch's ``state`` values: the module's choices and the words other plugins use."""

    STARTED = "started"
    RESTARTED = "restarted"
    STOPPED = "stopped"
    HEALTH = "health"
    PROBE = "probe"


STATE_WORDS = tuple(state.value for state in LaunchState)
# The states that launch the job (a command and a log path are needed).
START_STATES = (LaunchState.STARTED.value, LaunchState.RESTARTED.value)
# The states that plan a start (a command and a log path are needed).
PLANNING_STATES = START_STATES + (LaunchState.PROBE.value,)
# The states that return a decision.
DECIDING_STATES = (LaunchState.STARTED.value, LaunchState.RESTARTED.value, LaunchState.HEALTH.value,
                   LaunchState.PROBE.value)


ACTION_WORDS = tuple(action.value for action in Action)


def would_resume(resume_args: tuple[str, ...], resume: str, health: HealthReport) -> bool:
    """Whether a start now appends resume_args: auto after a failed run, always after any run, never.

    The one rule, for the probe's decision and for the start alike; never on a first launch.
    """
    if not resume_args:
        return False
    if resume == "auto":
        return health.state.failed and health.has_run
    return resume == "always" and health.has_run


def resume_mode_for(resume: bool) -> str:
    """The resume value that makes a later start of the same run do what `resume` says.

    A relaunch stops the job before it starts it again, and the stop records the health it found, so
    the start would judge the same; told ``always`` or ``never``, it cannot judge otherwise. With
    ``always`` the start still appends resume_args only after a run (:func:`would_resume`).
    """
    return "always" if resume else "never"


@dataclass(frozen=True)
class Decision:
    """What the relaunch does, why (for people), whether the start appends resume_args, and whether a start
    told to resume (resume_mode always: the other ranks of a multi-rank job one of whose ranks failed) would."""

    action: Action
    why: str
    resume: bool = False
    resumable: bool = False
    # When a relaunch left alone for the growing delay is due (ISO 8601), else None.
    due_at: str | None = None

    @property
    def relaunch(self) -> bool:
        return self.action is Action.RELAUNCH

    def as_dict(self) -> dict[str, Any]:
        decided = {"action": self.action.value, "relaunch": self.relaunch, "why": self.why, "resume": self.resume,
                   "resume_mode": resume_mode_for(self.resume), "resumable": self.resumable}
        if self.due_at is not None:
            decided["due_at"] = self.due_at
        return decided


def _finished(health: HealthReport) -> str:
    return f"the job finished (exit code {health.exit.get('exit_code')} at {health.exit.get('ended_at')})"


def _wanted(health: HealthReport, other_spec: bool, force: bool) -> tuple[bool, str]:
    """Whether a relaunch is wanted, and why (the wording of playbooks/relaunch.yml)."""
    if health.state.failed or health.state is Health.STOPPED:
        return True, f"the job is {health.state.value}: {health.reason}"
    if health.state is Health.FINISHED:
        if force:
            return True, f"forced (relaunch_force), although {_finished(health)}"
        return False, f"left alone: {_finished(health)}; relaunch_force relaunches it"
    if other_spec:
        return True, "the job runs with another spec, log path or backend"
    if force:
        return True, f"forced (relaunch_force): it runs with this spec ({health.reason})"
    return False, f"left alone: it runs with this spec ({health.reason})"


def decide(health: HealthReport, other_spec: bool, guard: RelaunchGuard, guard_report: dict[str, Any],
           force: bool, resume: bool, resume_args: tuple[str, ...] = ()) -> Decision:
    """The decision on one job.

    `other_spec`: the job runs with another spec, log path or backend than the task's (what
    state=started would restart). `guard_report`: RelaunchGuard.report for a start now. `resume`: whether
    a start now appends resume_args (the plan's); a decision that relaunches nothing never resumes.
    `resume_args`: the task's, for ``resumable`` (would_resume told always).
    """
    wanted, why = _wanted(health, other_spec, force)
    resumable = would_resume(resume_args, "always", health)
    if not wanted:
        return Decision(Action.NONE, why, resumable=resumable)
    refusal = guard.refusal(guard_report, health.state.value)
    if refusal is not None:
        # The same text state=started fails with: the guard counts, the decision only reports.
        return Decision(Action.REFUSED, refusal, resumable=resumable)
    not_yet = guard.not_before(guard_report)
    if not_yet is not None:
        # The growing delay: left alone now, not refused - the next relaunch run after due_at (the event
        # path's repeated alert, a schedule) relaunches it. Nothing waits here, no worker is held.
        return Decision(Action.NONE, not_yet, resumable=resumable, due_at=guard_report.get("due_at_iso"))
    return Decision(Action.RELAUNCH, why, resume, resumable)
