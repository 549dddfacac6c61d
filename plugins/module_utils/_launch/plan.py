# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a start task would do: nothing, start, restart, or refuse (the crash-loop guard) - pure.

The plan is made from the judgement (what runs, its health, the guard's report) and what the file
system says a start would touch (the log it would rotate or set aside, the remove_paths there); it
does no I/O itself. Check mode and state=probe render it; the executor carries it out.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import RelaunchGuard
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import HealthReport
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobStatus
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Health


class Operation(Enum):
    """What a start task does to the job (the result's ``operation``; ``stop`` is state=stopped's)."""

    NONE = "none"
    START = "start"
    RESTART = "restart"
    STOP = "stop"


@dataclass(frozen=True)
class Plan:
    """What a start task would do, and everything its result says about that before it acts."""

    operation: Operation
    # The job runs with another spec, log path or backend than the task's.
    other_spec: bool
    # A start now replaces a run that failed (crashed, stalled, missing): counted by the guard.
    relaunch: bool
    # A start now appends resume_args.
    resume: bool
    backend: str
    spec_hash: str
    # Set when the crash-loop guard refuses the start: the refusal, before anything is stopped.
    refusal: str | None = None
    # Where the current log would go (LOG.1, or LOG.failed for a start that was never proven).
    rotated_log: str | None = None
    # The remove_paths that exist now.
    removed_paths: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """none, start, restart or refuse."""
        return "refuse" if self.refusal is not None else self.operation.value

    def why_relaunch(self, failed: Health) -> str:
        """The message's note on a relaunch after a failure (empty for any other start)."""
        return f" (the job was {failed.value}" + ("; resumed with resume_args)" if self.resume else ")")


def runs_with_this_spec(status: JobStatus, spec_hash: str, backend: str, log_path: str | None,
                        same_log: Callable[[Any, str | None], bool] = operator.eq) -> bool:
    """Whether the recorded run is of this spec, backend and log path.

    A new log_path is a change too: otherwise the result would name a log the job does not write. A new
    spelling of the same log is none (`same_log`: logs.same_log compares them as the kernel resolves them).
    """
    return (status.spec_hash == spec_hash and status.backend == backend and status.run is not None
            and same_log(status.run.get("log_path"), log_path))


def plan_start(*, always_restart: bool, status: JobStatus, active: bool, health: HealthReport, same_spec: bool,
               guard: RelaunchGuard, guard_report: dict[str, Any], resume: bool, backend: str, spec_hash: str,
               rotated_log: str | None, removed_paths: tuple[str, ...]) -> Plan:
    """The plan of state=started (`always_restart` False) or state=restarted (True)."""
    other_spec = status.running and not same_spec
    common = {"other_spec": other_spec, "relaunch": health.state.failed and health.has_run, "resume": resume,
              "backend": backend, "spec_hash": spec_hash}
    if not always_restart and status.running and same_spec and health.state != Health.STALLED:
        return Plan(Operation.NONE, **common)
    operation = Operation.RESTART if active else Operation.START
    # A crash loop is refused; a relaunch before its due time (the growing delay) too, to be retried after it.
    refusal = guard.refusal(guard_report, health.state.value) or guard.not_before(guard_report)
    return Plan(operation, refusal=refusal, rotated_log=rotated_log, removed_paths=removed_paths, **common)
