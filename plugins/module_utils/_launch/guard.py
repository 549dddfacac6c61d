# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The crash-loop guard: at most max_relaunches relaunches after a failure within relaunch_window.

A job that crashes at step 3 every time would otherwise be relaunched by every scheduled run of
the relaunch, for ever, each time burning the start-up of a GPU job. The history lives on the
target with the job's records (``relaunches.json``), so every controller, schedule and AWX job
that relaunches this job counts against the same limit. Wall-clock seconds since the epoch: the
history must survive reboots, which a monotonic clock does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What an entry keeps: a record's other fields never reach the task's result.
ENTRY_KEYS = ("at", "at_iso", "run_id", "health")
HISTORY_FILE = "relaunches.json"
# How far ahead of now a relaunch time may lie and still count (a clock set back by up to a day).
FUTURE_TOLERANCE = 86400.0
# The history never grows beyond this many entries, whatever the window.
HISTORY_LIMIT = 1000


@dataclass(frozen=True)
class RelaunchGuard:
    """The limit; max_relaunches None means no limit (the history is kept anyway)."""

    max_relaunches: int | None
    window: float

    def recent(self, history: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        """The relaunches within the window around `now`."""
        return [entry for entry in history if _within(entry, now, self.window)]

    def allows(self, history: list[dict[str, Any]], now: float) -> bool:
        return self._allows(len(self.recent(history, now)))

    def _allows(self, recent: int) -> bool:
        return self.max_relaunches is None or recent < self.max_relaunches

    def report(self, history: list[dict[str, Any]], now: float, needed: bool) -> dict[str, Any]:
        """What the result says: the limit, the recent relaunches, and whether this one is refused."""
        recent = self.recent(history, now)
        return {
            "max_relaunches": self.max_relaunches,
            "relaunch_window": self.window,
            "recent": len(recent),
            "history": recent[-20:],
            "needed": needed,
            "would_refuse": needed and not self._allows(len(recent)),
        }

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


def with_relaunch(history: list[dict[str, Any]], entry: dict[str, Any], now: float, window: float) -> dict[str, Any]:
    """The new relaunches.json: `entry` added, entries older than the window dropped."""
    kept = [old for old in history if _within(old, now, window)]
    kept.append(entry)
    return {"relaunches": kept[-HISTORY_LIMIT:]}
