# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The judge: what the job's records and the process table say now - read-only.

Every state starts here: the recorded run and whether it runs, whether anything of it is still
active, its health (_launch/health.py) and the crash-loop guard's view of a start now. The one write
it may make is bookkeeping, not a change of the job: outside check mode, when it first saw the run's
last progress line (progress.json), so that a later task can tell a stall.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.backends import Backend, make_backend
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import (
    HISTORY_FILE,
    Failure,
    RelaunchDelay,
    RelaunchGuard,
    history_entries,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import (
    PROGRESS_FILE,
    STOP_FILE,
    HealthReport,
    after_failed_start,
    epoch_of,
    judge,
    last_progress,
    leader_stopped_state,
    measure,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import LAUNCH_FILE
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.live import stall_rule
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import tail
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords, JobStatus
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import LaunchOptions
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline


@dataclass(frozen=True)
class Judgement:
    """The job as the task found it, before it acted."""

    status: JobStatus
    # Whether anything of the recorded run still runs (its tree, or its unit).
    active: bool
    # The backend the recorded run was started with (the supervisor where none was).
    recorded: Backend
    health: HealthReport
    guard: RelaunchGuard
    history: tuple[dict[str, Any], ...]
    # Wall-clock seconds since the epoch when the guard was asked.
    now: float
    # The failure a relaunch now would follow: the step its run reached, its cause (the guard's budget).
    failure: Failure = Failure()

    @property
    def relaunch(self) -> bool:
        """Whether a start now is a relaunch after a failure (what the guard counts)."""
        return self.health.state.failed and self.health.has_run

    @property
    def guard_report(self) -> dict[str, Any]:
        return self.guard.report(list(self.history), self.now, self.relaunch, self.failure)


@dataclass
class JobJudge:
    """Judges one job; `note_progress` says whether it may note progress (outside check mode)."""

    options: LaunchOptions
    records: JobRecords
    python: str
    wall_clock: Callable[[], float]
    note_progress: bool
    # How long a run whose main process has just ended may take to get its exit record.
    settle_wait: float

    def judge(self, history_cleared: bool = False) -> Judgement:
        """The judgement; `history_cleared`: the guard sees no history (reset_guard, in check mode too)."""
        status = self.records.status()
        recorded = make_backend(status.backend or "supervisor", self.records, self.options.name, self.python)
        active = status.run is not None and recorded.active(status.run)
        health = self._health(status)
        history = () if history_cleared else tuple(history_entries(self.records.read(HISTORY_FILE)))
        options = self.options
        guard = RelaunchGuard(options.max_relaunches, options.relaunch_window,
                              RelaunchDelay(options.relaunch_delay, options.relaunch_max_delay))
        failure = Failure(self._failed_step(status, health), options.failure_cause)
        return Judgement(status, active, recorded, health, guard, history, self.wall_clock(), failure)

    def _stall_rule(self, run: dict | None) -> tuple[re.Pattern | None, float | None]:
        """The task's progress_regex and stall_after; a task that names neither, the run's own (as the node)."""
        pattern, stall_after = self.options.progress_regex, self.options.stall_after
        if pattern is None and stall_after is None and run is not None:
            regex, stall_after = stall_rule(self.launch_of(run))
            pattern = re.compile(regex) if regex is not None else None
        return pattern, stall_after

    def _failed_step(self, status: JobStatus, health: HealthReport) -> str | None:
        """The last progress step of a failed run (for the guard's budget), or None.

        A live run's is in its verdict; an ended run's is read from its log (not yet rotated: the start
        rotates it after the guard counted), where the progress line is. Only after a failure: a healthy job
        costs no log read here.
        """
        if not (health.state.failed and health.has_run):
            return None
        if health.progress is not None and health.progress.step is not None:
            return health.progress.step
        pattern, _stall_after = self._stall_rule(status.run)
        if pattern is None or status.run is None:
            return None
        return last_progress(status.run.get("log_path"), pattern).step

    def _health(self, status: JobStatus) -> HealthReport:
        """The health of the recorded run (see _launch/health.py); notes new progress if allowed."""
        options = self.options
        run = status.run
        exit_record = status.exit if run is not None else None
        if run is not None and exit_record is None and not status.running and status.start_failure is None:
            exit_record = self._settled_exit(run.get("run_id"))
        progress = None
        now = self.wall_clock()
        # A task that names no stall rule judges by the one the run was started with, as the node does.
        pattern, stall_after = self._stall_rule(run)
        if run is not None and exit_record is None and status.running and pattern is not None:
            record = self.records.read(PROGRESS_FILE)
            progress = measure(last_progress(run.get("log_path"), pattern), str(run.get("run_id")),
                               epoch_of(run.get("started_at")), record, now)
            if self.note_progress and progress.line is not None and progress.seen_at is not None and (
                    progress.basis != "progress_record") and self.records.is_real_dir():
                # Bookkeeping, not a change of the job: when this line was first seen, so that a later
                # task can tell a stall even if the job goes on printing other lines.
                self.records.write(PROGRESS_FILE, progress.record(str(run.get("run_id"))))
        # A frozen main process (SIGSTOP, a debugger, a cgroup freezer) is named as such in the reason.
        held = leader_stopped_state(run.get("pid"), run.get("starttime"), self.records.proc_root) if status.running else None
        report = judge(run, exit_record, self.records.read(STOP_FILE), status.running, progress,
                       stall_after, now, held)
        if status.start_failure is not None:
            # Nothing of that start ran: the job is what it was (see JobRecords.start_failure).
            report.reason += after_failed_start(status.start_failure)
        if report.state.failed:
            report.log_tail = tail(run.get("log_path") if run else None, options.log_tail_lines)
        return report

    def launch_of(self, run: dict | None) -> dict | None:
        """launch.json, if it is the launch of `run` (the stall rule and live file it was started with)."""
        launch = self.records.read(LAUNCH_FILE) if run is not None else None
        return launch if launch is not None and launch.get("run_id") == run.get("run_id") else None

    def _settled_exit(self, run_id: str | None) -> dict | None:
        """A main process that has just ended gets its exit record within moments: wait that long."""
        record: dict | None = None

        def recorded() -> bool:
            nonlocal record
            record = self.records.read_exit(run_id)
            return record is not None

        Deadline(self.settle_wait).poll(recorded, 0.05)
        return record
