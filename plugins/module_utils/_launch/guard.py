# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The crash-loop guard: at most max_relaunches relaunches after a failure within relaunch_window.

A job that crashes at step 3 every time would otherwise be relaunched by every scheduled run of
the relaunch, for ever, each time burning the start-up of a GPU job. The history lives on the
target with the job's records (``relaunches.json``), so every controller, schedule and AWX job
that relaunches this job counts against the same limit. Wall-clock seconds since the epoch: the
history must survive reboots, which a monotonic clock does not.

The budget knows why (issue 36): a relaunch counts only when the failure it follows could be the job's
and the run made no progress. Each entry says so when it is written (``counted``, ``why``): a failure
the caller says the hardware caused (``failure_cause=hardware``, what the GPU health gate tells the
start) is not counted, and neither is one whose run got past the step the run before it reached (both
steps numbers, read with progress_regex). Without a progress_regex every failure counts, as before.

And a job that keeps failing waits: the n-th counted relaunch in the window (n >= 2) is due
``relaunch_delay * 2**(n-2)`` seconds (at most ``relaunch_max_delay``) after the last relaunch, as
systemd's RestartSec/RestartSteps/RestartMaxDelaySec grow a unit's restart delay. The guard only says
when a relaunch is due (:meth:`RelaunchGuard.not_before`); nothing here sleeps: the decision leaves a job
that is not due yet alone, and a start before its time is refused, to be retried (see decision.py).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

# What an entry keeps: a record's other fields never reach the task's result.
ENTRY_KEYS = ("at", "at_iso", "run_id", "health", "step", "cause", "counted", "why")
# failure_cause's words: `hardware` is what the GPU health gate says; a relaunch after it is not counted.
CAUSE_UNKNOWN = "unknown"
CAUSE_HARDWARE = "hardware"
CAUSES = (CAUSE_UNKNOWN, CAUSE_HARDWARE)
# A step is the job's text (its log): an entry keeps at most this much of it.
STEP_LIMIT = 64
HISTORY_FILE = "relaunches.json"
# How far ahead of now a relaunch time may lie and still count (a clock set back by up to a day).
FUTURE_TOLERANCE = 86400.0
# The history never grows beyond this many entries, whatever the window.
HISTORY_LIMIT = 1000


@dataclass(frozen=True)
class Failure:
    """The failure a relaunch now would follow: the step its run reached (None: no progress line, or no
    progress_regex) and what caused it (CAUSES; the caller's word, see failure_cause)."""

    step: str | None = None
    cause: str = CAUSE_UNKNOWN


def _number(step: Any) -> float | None:
    """A step as a finite number, or None (a step that is no number is never compared)."""
    if not isinstance(step, str):
        return None
    try:
        value = float(step.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def counts(failure: Failure, before: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether a relaunch after `failure` counts against the guard, and why (for people).

    `before`: the last entry of the history (the failure of the run before this one), or None.
    """
    if failure.cause == CAUSE_HARDWARE:
        return False, "not counted: the hardware caused the failure (failure_cause=hardware)"
    reached, earlier = _number(failure.step), _number((before or {}).get("step"))
    if reached is not None and earlier is not None and reached > earlier:
        return False, f"not counted: the run got past step {before['step']} (it reached step {failure.step})"
    if failure.step is None:
        return True, "counted: no progress step is known (no progress_regex, or no progress line)"
    if before is None or earlier is None:
        return True, f"counted: reached step {failure.step}, and no earlier step to compare with"
    return True, f"counted: reached step {failure.step}, not past step {before['step']} of the run before"


def _counted(entry: dict[str, Any]) -> bool:
    """An entry written before the budget knew why (no `counted`) counts, as it did."""
    return entry.get("counted") is not False


@dataclass(frozen=True)
class RelaunchDelay:
    """The growing delay: `base` seconds before the second counted relaunch in the window, doubling for
    each one more, at most `cap`; a base of 0 never delays (the default: today's behaviour)."""

    base: float = 0.0
    cap: float = 600.0

    def seconds(self, counted_before: int) -> float:
        """The delay of a counted relaunch after `counted_before` counted ones in the window."""
        if self.base <= 0 or counted_before < 1:
            return 0.0
        # min() before the power: 2**1000 overflows a float, and the cap is reached long before.
        return min(self.base * 2 ** min(counted_before - 1, 64), self.cap)


@dataclass(frozen=True)
class RelaunchGuard:
    """The limit; max_relaunches None means no limit (the history is kept anyway)."""

    max_relaunches: int | None
    window: float
    delay: RelaunchDelay = RelaunchDelay()

    def recent(self, history: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        """The relaunches within the window around `now`, counted or not."""
        return [entry for entry in history if _within(entry, now, self.window)]

    def counted(self, history: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        """The relaunches within the window that count against the limit."""
        return [entry for entry in self.recent(history, now) if _counted(entry)]

    def allows(self, history: list[dict[str, Any]], now: float, failure: Failure | None = None) -> bool:
        """Whether a relaunch now after `failure` is within the limit (one that does not count always is)."""
        this_counts, _why = counts(failure or Failure(), history[-1] if history else None)
        return not this_counts or self._allows(len(self.counted(history, now)))

    def _allows(self, recent: int) -> bool:
        return self.max_relaunches is None or recent < self.max_relaunches

    def report(self, history: list[dict[str, Any]], now: float, needed: bool,
               failure: Failure | None = None) -> dict[str, Any]:
        """What the result says: the limit, the recent relaunches, whether this one counts, is refused, and
        when it is due (`due_at`, `wait`: the growing delay)."""
        recent = self.recent(history, now)
        counted = [entry for entry in recent if _counted(entry)]
        failure = failure or Failure()
        this_counts, why = counts(failure, history[-1] if history else None)
        delay = self.delay.seconds(len(counted)) if needed and this_counts else 0.0
        due_at = recent[-1]["at"] + delay if delay and recent else None
        wait = max(due_at - now, 0.0) if due_at is not None else 0.0
        return {
            "max_relaunches": self.max_relaunches,
            "relaunch_window": self.window,
            "recent": len(counted),
            "recent_all": len(recent),
            "history": recent[-20:],
            "needed": needed,
            "counts": needed and this_counts,
            "why": why if needed else None,
            "step": failure.step,
            "cause": failure.cause,
            "would_refuse": needed and this_counts and not self._allows(len(counted)),
            "delay": delay,
            "due_at": due_at,
            "due_at_iso": _iso(due_at),
            "wait": round(wait, 3),
        }

    def not_before(self, report: dict[str, Any]) -> str | None:
        """Why a start now must wait (the growing delay), or None when it is due: retry after `due_at`."""
        if not report.get("needed") or not report.get("wait"):
            return None
        return (f"not relaunching yet: the job failed again without progress ({report['recent']} counted "
                f"relaunches within relaunch_window={self.window:g}s), so this relaunch is due "
                f"{report['delay']:g}s after the last one, at {report['due_at_iso']} (in {report['wait']:g}s; "
                f"relaunch_delay={self.delay.base:g}, relaunch_max_delay={self.delay.cap:g}); a relaunch run "
                "after that time relaunches it")

    def refusal(self, report: dict[str, Any], health: str) -> str | None:
        """Why a start now is refused, or None when it is not: the one place the guard says no.

        `report`: :meth:`report` for a start now; `health`: the verdict's word. The decision (decision.py)
        and the plan (plan.py) both take their refusal from here, so a probe and a start say the same.
        """
        if not report.get("would_refuse"):
            return None
        recent = report["recent"]
        return (f"not relaunching: the job is {health}, and it was relaunched after a failure {recent} times "
                f"within the last relaunch_window={self.window:g}s (max_relaunches={self.max_relaunches}); "
                "look at the evidence, fix the cause, then raise the limit (max_relaunches), wait, or reset the "
                "guard with reset_guard=true / job_launch_reset_guard=true")


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat()


def relaunch_entry(now: float, run_id: str | None, health: str, report: dict[str, Any]) -> dict[str, Any]:
    """The history entry of a relaunch made now (`report`: :meth:`RelaunchGuard.report` for it)."""
    step = report.get("step")
    return {"at": now, "at_iso": _iso(now), "run_id": run_id, "health": health,
            "step": step[:STEP_LIMIT] if isinstance(step, str) else None, "cause": report.get("cause", CAUSE_UNKNOWN),
            "counted": report.get("counts") is not False, "why": report.get("why")}


def _within(entry: dict[str, Any], now: float, window: float) -> bool:
    """Within the window before `now`, or ahead of it by less than a day (or the window): a clock set
    back must not reopen the gate, but a time far ahead (a clock that jumped, a record that lies)
    must not close it for ever."""
    ahead = entry["at"] - now
    return -window < ahead < max(window, FUTURE_TOLERANCE)


def history_entries(record: dict | None) -> list[dict[str, Any]]:
    """The sound entries of relaunches.json (each with a numeric `at`), oldest first."""
    entries = (record or {}).get("relaunches")
    if not isinstance(entries, list):
        return []
    sound = [{key: entry[key] for key in ENTRY_KEYS if key in entry} for entry in entries
             if isinstance(entry, dict) and isinstance(entry.get("at"), (int, float)) and not isinstance(entry.get("at"), bool)]
    return sorted(sound, key=lambda entry: entry["at"])


def lifetime_record(previous: dict | None, entry: dict[str, Any], health: dict[str, Any]) -> dict[str, Any]:
    """The new lifetime.json: one more relaunch after a failure, ever (reset_guard and the window leave the count
    alone: a counter only grows), and the failure it followed (`entry`: relaunch_entry's; `health`: the
    HealthReport's as_dict, for the exit code or signal)."""
    before = (previous or {}).get("relaunches")
    count = before if isinstance(before, int) and not isinstance(before, bool) and before >= 0 else 0
    first = (previous or {}).get("first_at")
    first_at = first if isinstance(first, (int, float)) and not isinstance(first, bool) else entry["at"]
    return {
        "relaunches": count + 1,
        "first_at": first_at,
        "first_at_iso": _iso(first_at),
        "last_failure": {
            "at": entry["at"], "at_iso": entry.get("at_iso"), "run_id": entry.get("run_id"),
            "health": entry.get("health"), "cause": entry.get("cause"), "step": entry.get("step"),
            "exit_code": health.get("exit_code"), "exit_signal": health.get("exit_signal"),
        },
    }


def with_relaunch(history: list[dict[str, Any]], entry: dict[str, Any], now: float, window: float) -> dict[str, Any]:
    """The new relaunches.json: `entry` added, entries older than the window dropped."""
    kept = [old for old in history if _within(old, now, window)]
    kept.append(entry)
    return {"relaunches": kept[-HISTORY_LIMIT:]}
