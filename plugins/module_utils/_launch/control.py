# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""train_launch's logic: bring a job to the requested state and prove it.

``started`` is idempotent like a service: the same spec running means nothing to do; a different
spec (or backend) running means restart; nothing running means start. ``restarted`` always stops
(if running) and starts. ``stopped`` ends the job's whole tree. ``health`` and ``probe`` only ask:
the verdict, and (probe) what ``started`` would do. A start rotates the previous log, removes
``remove_paths``, launches through the backend and returns only when the proof of start holds; if it
does not, the job is stopped again (so that a second run does not mistake a job that never proved
itself for a running one) and the task fails with the exit status and the log tail.

One task is four steps, each its own unit: the judge (judge.py) reads what runs and how it is
doing; the plan (plan.py) and the decision (decision.py) say what to do, purely; the executor
(executor.py) does it; the result is built here, at the end, from the three.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.backends import SupervisorBackend, resolve_backend
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.decision import (
    START_STATES,
    STATE_WORDS,
    Decision,
    LaunchState,
    decide,
    would_resume,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import HealthReport
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import LAUNCH_FILE
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.judge import JobJudge, Judgement
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.live import EXIT_SETTLE_WAIT, live_path, refresh_once, remove_live_file
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import rotation_plan, same_log, tail
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.plan import (
    Operation,
    Plan,
    plan_start,
    runs_with_this_spec,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import (
    PREVIOUS_RUN_KEYS,
    JobRecords,
    StateDirProblem,
    exit_fields,
    failed_start_log,
    reset_history,
    run_fields,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import LaunchOptions, denied, preflight_start, what_to_set
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import KILL_WAIT, end_idle_supervisor, supervisor_alive, supersedes
from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import SENT
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Health

if TYPE_CHECKING:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.executor import Executor

# The executor (executor.py, and through it the start path: incident records, readiness, the supervisor,
# systemd) is imported by the first task that changes the job. Every module run compiles what it imports
# afresh (AnsiballZ imports from a zip), and a probe or health check of a healthy job changes nothing.

# state=absent: the job stopped as state=stopped stops it, its idle supervisor ended, its records (and
# the live file they name) removed. Only this module acts on it: no plugin plans or decides on it.
ABSENT = "absent"
MODULE_STATES = STATE_WORDS + (ABSENT,)
# The states that change the job, and so work under the job's lock.
CHANGING_STATES = START_STATES + (LaunchState.STOPPED.value, ABSENT)
# How long an idle supervisor may take to end after its SIGTERM (it has no child to wait for).
IDLE_END_WAIT = 10.0
# How often state=health with wait_for judges the job again (a look at its records, processes and log).
HEALTH_WAIT_INTERVAL = 0.5


class LaunchError(Exception):
    """The job could not be brought to the requested state; `result` says what is known."""

    def __init__(self, msg: str, result: dict[str, Any]) -> None:
        super().__init__(msg)
        self.result = result


def _with_done(result: dict[str, Any], executor: Executor) -> dict[str, Any]:
    """The result with what the executor did: a replaced run's own fields went under `previous`."""
    if executor.replaced:
        for key in PREVIOUS_RUN_KEYS:
            result.pop(key, None)
    result.update(executor.done)
    return result


@dataclass
class LaunchController:
    """Applies one train_launch task."""

    options: LaunchOptions
    check_mode: bool
    python: str = sys.executable
    proc_root: str = "/proc"
    # Wall clock (seconds since the epoch): log mtimes, the records' times and the relaunch history
    # are wall-clock times that must survive a reboot. A parameter so that tests move it.
    wall_clock: Callable[[], float] = time.time
    # GPU memory per holder for the incident record (the module passes the _gpu family's query;
    # this family imports only _base, _metrics' textfile writer and itself). Given the run's live member pids.
    gpu_evidence: Callable[[list[int]], dict] | None = None
    # --diff: a start (also in check mode, and the probe) returns what it changes in the recorded spec.
    diff: bool = False

    def __post_init__(self) -> None:
        self.records = JobRecords(self.options.job_dir, self.proc_root)
        self.preflight_passed = False
        self.executor: Executor | None = None

    @property
    def state(self) -> str:
        return self.options.state

    @property
    def probing(self) -> bool:
        """state=probe: the plan rendered, nothing of the job changed (outside check mode too)."""
        return self.state == LaunchState.PROBE.value

    def apply(self) -> dict[str, Any]:
        begun = time.monotonic()
        try:
            return self._finish(self._apply(), begun)
        except LaunchError as exc:
            self._finish(exc.result, begun)
            raise

    def _finish(self, result: dict[str, Any], begun: float) -> dict[str, Any]:
        # Records that were not sound were ignored (never used to signal): say so.
        if self.records.problems:
            result["record_problems"] = list(self.records.problems)
        result["elapsed"] = round(time.monotonic() - begun, 3)
        return result

    def _executor(self, health: HealthReport) -> Executor:
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.executor import Executor  # pylint: disable=import-outside-toplevel
        return Executor(self.options, self.records, health, self.python, self.proc_root,
                        self.wall_clock, self.gpu_evidence)

    # --- the steps -------------------------------------------------------------------------

    def _apply(self) -> dict[str, Any]:
        options = self.options
        result: dict[str, Any] = {"changed": False, "name": options.name, "state": self.state,
                                  "log_path": options.log_path, "state_dir": options.job_dir}
        self._check_records_readable(result)
        try:
            self._take_lock(result)
        except StateDirProblem as exc:
            raise self._state_dir_refused(result, exc.strerror, exc.cause) from None
        cleared = None
        if options.reset_guard:
            # Before the judgement, so that the guard, the plan and the decision see a clear history.
            cleared = reset_history(self.records, write=not self.check_mode)
        judge = JobJudge(options, self.records, self.python, self.wall_clock,
                         note_progress=not self.check_mode, settle_wait=EXIT_SETTLE_WAIT)
        judgement = judge.judge(history_cleared=options.reset_guard)
        if options.wait_for:
            judgement = self._wait_for_health(judge, judgement)
        status = judgement.status
        result["backend"] = status.backend
        result.update(run_fields(status.run))
        if options.log_path is None and status.run:
            result["log_path"] = status.run.get("log_path")
        result["health"] = judgement.health.as_dict()
        # The recorded run's live file (the node keeps the health there), if its start set metrics_dir.
        result["live_metrics"] = live_path(judge.launch_of(status.run))
        if result["live_metrics"] is not None and judgement.health.state is Health.MISSING and not self.check_mode:
            # Nothing on the node writes it any more (the supervisor or the unit is gone with the job,
            # a reboot): the task that finds the run missing says so there (never raises).
            refresh_once(self.options.job_dir, str(status.run.get("run_id")))
        if cleared is not None:
            result["guard_cleared"] = cleared
            result["changed"] = cleared > 0
        if self.state == LaunchState.HEALTH.value:
            return self._health_only(result, judgement)
        if self.state == LaunchState.STOPPED.value and options.expect_run_id is not None:
            # The run-id fence, under the job's lock and before any evidence is written: a newer run
            # than the one this stop was for is another task's relaunch, not this stop's to end.
            newer = self._newer_run(judgement)
            result.update(superseded=newer is not None, newer_run=newer)
            if newer is not None:
                return self._superseded(result, newer)
        result["incident"] = None
        health = judgement.health
        # state=absent removes the records an incident record would go to: it writes none.
        if not self.check_mode and not self.probing and self.state != ABSENT and health.state.failed and health.has_run:
            # Before anything is signalled: a hang is gone once the job is killed. A missing run (its
            # main process gone without an exit record) has evidence only while some of its tree is
            # left to stop; with nothing left, its health and log say it all.
            executor = self._task_executor(judgement)
            self._execute(result, executor, executor.incident, status.run,
                          write=health.state != Health.MISSING or judgement.active)
            result["incident"] = executor.done.get("incident")
        if self.state == LaunchState.STOPPED.value:
            return self._stopped(result, judgement)
        if self.state == ABSENT:
            return self._absent(result, judgement)
        return self._started(result, judgement)

    def _check_records_readable(self, result: dict[str, Any]) -> None:
        """A job directory this user may not enter is not a job without records (health would say missing)."""
        try:
            with safepath.walk(self.options.job_dir) as found:
                # Reached is not readable: the walk passes directories it may only search.
                if not os.access(".", os.R_OK | os.X_OK, dir_fd=found.fd, effective_ids=os.access in os.supports_effective_ids):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except OSError as exc:
            if denied(exc):
                raise self._state_dir_refused(result, f"cannot read the job's records in {self.options.job_dir}: "
                                              f"{exc.strerror or exc}", exc) from None

    @staticmethod
    def _state_dir_refused(result: dict[str, Any], reason: str, cause: OSError) -> LaunchError:
        """The failure for records that cannot be kept or read in state_dir, naming what to set where this user may not."""
        if denied(cause):
            reason += what_to_set("state_dir")
        result["option_problems"] = [{"option": "state_dir", "reason": reason}]
        return LaunchError(f"state_dir: {reason}", result)

    def _take_lock(self, result: dict[str, Any]) -> None:
        """The job's lock, for a task that changes the job (or clears its history); no probe waits for it."""
        if self.check_mode:
            return
        if self.state == ABSENT:
            if not self.records.is_real_dir():
                return  # no records to remove; none are created for it
        elif self.state in CHANGING_STATES:
            if self.state in START_STATES and not self.records.is_real_dir():
                # No record of any run, so only a start can follow: one that cannot work creates nothing.
                self._preflight(result)
            self.records.ensure_dir()
        elif not (self.options.reset_guard and self.records.is_real_dir()):
            # health and probe write nothing under the lock (progress.json is replaced atomically).
            return
        # Long enough for another task to stop the job and prove a new start.
        self.records.lock(self.options.term_timeout + KILL_WAIT + self.options.startup_timeout + 60)

    def _task_executor(self, judgement: Judgement) -> Executor:
        """The task's one executor (what its steps did accumulates there), made by the first step that changes the job."""
        if self.executor is None:
            self.executor = self._executor(judgement.health)
        return self.executor

    def _execute(self, result: dict[str, Any], executor: Executor, step: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
        """One step of the executor; its failure is a LaunchError with everything known so far."""
        # Imported already with the executor (see _executor).
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.executor import ExecutionFailed  # pylint: disable=import-outside-toplevel
        try:
            return step(*args, **kwargs)
        except ExecutionFailed as exc:
            raise LaunchError(str(exc), _with_done(result, executor)) from None

    def _decision(self, judgement: Judgement, other_spec: bool, resume: bool) -> Decision:
        return decide(judgement.health, other_spec, judgement.guard, judgement.guard_report, self.options.force, resume,
                      self.options.resume_args)

    # --- health ----------------------------------------------------------------------------

    def _wait_for_health(self, judge: JobJudge, judgement: Judgement) -> Judgement:
        """state=health with wait_for: judge again until the verdict is one of wait_for or wait_timeout passes
        (the last judgement is returned either way; _health_only says which)."""
        wanted = self.options.wait_for
        latest = [judgement]

        def reached() -> bool:
            if latest[-1].health.state.value in wanted:
                return True
            latest.append(judge.judge(history_cleared=self.options.reset_guard))
            return latest[-1].health.state.value in wanted

        Deadline(self.options.wait_timeout).poll(reached, HEALTH_WAIT_INTERVAL)
        return latest[-1]

    def _health_only(self, result: dict[str, Any], judgement: Judgement) -> dict[str, Any]:
        """state=health: the verdict, and whether the guard would let a relaunch through; nothing changes."""
        options = self.options
        result["relaunch_guard"] = judgement.guard_report
        # No command: a job that runs with another spec cannot be told apart here (state=probe can).
        resume = would_resume(options.resume_args, options.resume, judgement.health)
        result["decision"] = self._decision(judgement, False, resume).as_dict()
        result["running"] = judgement.status.running
        result["operation"] = Operation.NONE.value
        result["msg"] = f"{judgement.health.state.value}: {judgement.health.reason}"
        if judgement.active and not judgement.status.running:
            result["msg"] += " (processes of the run are still there)"
        result["log_tail"] = tail(result.get("log_path"), options.log_tail_lines)
        if options.wait_for and judgement.health.state.value not in options.wait_for:
            raise LaunchError(f"job {options.name} was not {' or '.join(options.wait_for)} within wait_timeout "
                              f"{options.wait_timeout:g}s: {result['msg']}", result)
        return result

    # --- stopped ---------------------------------------------------------------------------

    def _stopped(self, result: dict[str, Any], judgement: Judgement) -> dict[str, Any]:
        run = judgement.status.run
        result["running"] = False
        result["operation"] = Operation.STOP.value if judgement.active else Operation.NONE.value
        if not judgement.active:
            result.update(exit_fields(self.records.read_exit(run.get("run_id")) if run else None))
            result["msg"] = "not running"
            result["log_tail"] = tail(result.get("log_path"), self.options.log_tail_lines)
            return self._stopped_supervisor(result)
        result["changed"] = True
        if self.check_mode:
            result["running"] = True
            result["msg"] = (f"would stop the job (pid {run.get('pid')}) with SIGTERM, then SIGKILL after "
                             f"{self.options.term_timeout:g}s")
            return self._stopped_supervisor(result)
        executor = self._task_executor(judgement)
        outcome = self._execute(result, executor, executor.stop, run, judgement.recorded)
        _with_done(result, executor)
        result["log_tail"] = tail(result.get("log_path"), self.options.log_tail_lines)
        result["msg"] = "stopped" + (" (SIGKILL was needed)" if outcome.escalated else "")
        return self._stopped_supervisor(result)

    def _stopped_supervisor(self, result: dict[str, Any]) -> dict[str, Any]:
        """With end_supervisor: the idle supervisor that stays where nothing reaps (see supervisor.py) is ended
        too, as state=absent ends it; the records stay. In check mode it is only named."""
        if not self.options.end_supervisor:
            return result
        idle = self._idle_supervisor()
        if idle is None:
            return result
        result["changed"] = True
        if self.check_mode:
            result["msg"] += f"; would end its idle supervisor (pid {idle.get('supervisor_pid')})"
            return result
        self._end_idle_supervisor(result, idle)
        result["msg"] += f"; its idle supervisor (pid {idle.get('supervisor_pid')}) ended"
        return result

    def _newer_run(self, judgement: Judgement) -> dict[str, Any] | None:
        """The job's recorded run, where it is a newer live run than expect_run_id (tree.supersedes), else None."""
        run = judgement.status.run
        current = run.get("run_id") if run else None
        if not supersedes(self.options.expect_run_id, current, lambda: judgement.status.running):
            return None
        return {key: run.get(key) for key in ("run_id", "pid", "starttime", "started_at")}

    def _superseded(self, result: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
        """state=stopped with expect_run_id, when a newer run runs: nothing is stopped, and the result says why."""
        expected = self.options.expect_run_id
        was = f"run {expected}" if expected else "no run (the look saw none)"
        result.update(running=True, operation=Operation.NONE.value, incident=None)
        result["msg"] = (f"left alone: the job runs a newer run ({newer.get('run_id')}, pid {newer.get('pid')}) than the "
                         f"one this stop was for ({was}), started meanwhile by another task: nothing was stopped")
        result["log_tail"] = tail(result.get("log_path"), self.options.log_tail_lines)
        return result

    # --- absent ----------------------------------------------------------------------------

    def _absent(self, result: dict[str, Any], judgement: Judgement) -> dict[str, Any]:
        """state=absent: stop what runs (as state=stopped), end the idle supervisor, remove the records.

        The records go last, after everything that could fail: a job that could not be stopped keeps
        them, so a later task can still prove and stop it.
        """
        job_dir = self.options.job_dir
        result["running"] = False
        result["removed"] = []
        live_file = result.get("live_metrics")
        there = [path for path in (job_dir, live_file) if path is not None and safepath.lexists(path)]
        idle = None if judgement.active else self._idle_supervisor()
        result["operation"] = Operation.STOP.value if judgement.active else Operation.NONE.value
        if not there:
            result["msg"] = "absent: no records of this job"
            return result
        result["changed"] = True
        if self.check_mode:
            result["running"] = judgement.active
            result["removed"] = there
            doing = [f"stop the job (pid {judgement.status.run.get('pid')})"] if judgement.active else []
            if idle is not None:
                doing.append(f"end its idle supervisor (pid {idle.get('supervisor_pid')})")
            result["msg"] = "would " + ", ".join(doing + ["remove " + ", ".join(there)])
            return result
        if judgement.active:
            executor = self._task_executor(judgement)
            self._execute(result, executor, executor.stop, judgement.status.run, judgement.recorded)
            _with_done(result, executor)
            idle = self._idle_supervisor()  # where nothing reaps it, the supervisor now waits idle
        if idle is not None:
            self._end_idle_supervisor(result, idle)
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.executor import remove_path  # pylint: disable=import-outside-toplevel
        if live_file is not None and remove_live_file(live_file):
            result["removed"].append(live_file)
        if remove_path(job_dir):
            result["removed"].insert(0, job_dir)
        result["msg"] = "removed " + ", ".join(result["removed"]) if result["removed"] else "absent"
        return result

    def _idle_supervisor(self) -> dict | None:
        """idle.json, where it names this job's supervisor, alive and waiting for the next run."""
        return SupervisorBackend(self.records, self.python).idle_supervisor()

    def _end_idle_supervisor(self, result: dict[str, Any], idle: dict) -> None:
        """SIGTERM to the proven idle supervisor, and wait until it has ended; the records stay if it does not."""
        pid, starttime = idle.get("supervisor_pid"), idle.get("supervisor_starttime")
        answer = end_idle_supervisor(idle, self.options.job_dir, self.proc_root)
        result["idle_supervisor"] = {"pid": pid, "signal": "SIGTERM", "sent": answer == SENT}
        if not Deadline(IDLE_END_WAIT).poll(lambda: not supervisor_alive(pid, starttime, self.options.job_dir,
                                                                         self.proc_root)):
            raise LaunchError(f"the job's idle supervisor (pid {pid}) did not end after SIGTERM ({answer}); "
                              f"its records in {self.options.job_dir} are kept", result)

    # --- started / restarted / probe -------------------------------------------------------

    def _plan(self, judgement: Judgement, rendered: bool) -> Plan:
        """What state=started (or restarted) would do; what a start would rotate and remove only when `rendered`."""
        options = self.options
        spec = options.spec
        backend = resolve_backend(options.backend)
        rotated_log: str | None = None
        removed_paths: tuple[str, ...] = ()
        if rendered:
            rotation = rotation_plan(options.log_path, options.keep_logs) if options.log_path else []
            rotated_log = failed_start_log(self.records, options.log_path) or (rotation[-1][1] if rotation else None)
            removed_paths = tuple(path for path in options.remove_paths if safepath.lexists(path))
        return plan_start(
            always_restart=self.state == LaunchState.RESTARTED.value,
            status=judgement.status, active=judgement.active, health=judgement.health,
            same_spec=runs_with_this_spec(judgement.status, spec.spec_hash, backend, options.log_path, same_log),
            guard=judgement.guard, guard_report=judgement.guard_report,
            resume=would_resume(options.resume_args, options.resume, judgement.health),
            backend=backend, spec_hash=spec.spec_hash, rotated_log=rotated_log, removed_paths=removed_paths)

    def _started(self, result: dict[str, Any], judgement: Judgement) -> dict[str, Any]:
        options = self.options
        if options.spec is None:  # options_from_params requires a command for these states
            raise LaunchError("command: required with state=" + self.state, result)
        rendered = self.check_mode or self.probing
        plan = self._checkpoint(result, self._plan(judgement, rendered))
        status = judgement.status
        result["relaunch_guard"] = judgement.guard_report
        result["decision"] = self._decision(judgement, plan.other_spec, plan.resume).as_dict()
        result["resumed"] = False
        if plan.operation is Operation.NONE:
            result["running"] = True
            result["operation"] = Operation.NONE.value
            result["msg"] = "already running with the same spec"
            result["log_tail"] = tail(options.log_path, options.log_tail_lines)
            return result
        result["operation"] = plan.operation.value
        result["running"] = status.running
        if plan.refusal is not None:
            # Before anything is stopped: a crash loop is stopped here, with the evidence kept.
            if rendered:
                result["msg"] = "would refuse: " + plan.refusal
                return result
            result["log_tail"] = tail(result.get("log_path"), options.log_tail_lines)
            raise LaunchError(plan.refusal, result)
        self._preflight(result)
        if self.diff:
            result["diff"] = self._spec_diff(judgement, plan)
        if rendered:
            return self._render(result, plan, judgement)
        self._claim_log(result)
        result["changed"] = True
        executor = self._task_executor(judgement)
        self._execute(result, executor, executor.start, plan, judgement)
        return _with_done(result, executor)

    def _checkpoint(self, result: dict[str, Any], plan: Plan) -> Plan:
        """With checkpoint_dir: the newest complete checkpoint (resume.choose) in the result, and the plan's
        resume as it allows (none complete: fresh, or refused here, before anything is stopped)."""
        if self.options.checkpoint_dir is None:
            return plan
        # pylint: disable-next=import-outside-toplevel
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.checkpoints import CheckpointProblem
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.resume import choose  # pylint: disable=import-outside-toplevel
        try:
            choice = choose(self.options, plan.resume)
        except CheckpointProblem as exc:
            reason = escape_controls(str(exc))
            result["option_problems"] = [{"option": "checkpoint_dir", "reason": reason}]
            raise LaunchError(f"checkpoint_dir: {reason}", result) from None
        result["checkpoint"] = choice.as_result()
        if choice.refusal is not None and plan.operation is not Operation.NONE:
            raise LaunchError(choice.refusal, result)
        return dataclasses.replace(plan, resume=choice.resume)

    def _spec_diff(self, judgement: Judgement, plan: Plan) -> dict[str, str]:
        """--diff: the recorded run's launch beside the one this start writes, the fields that differ."""
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec_diff import (  # pylint: disable=import-outside-toplevel
            spec_diff, spec_fields)
        run = judgement.status.run
        recorded = self.records.read(LAUNCH_FILE) if run else None
        if recorded is not None and recorded.get("run_id") != run.get("run_id"):
            recorded = None
        before_header = f"recorded run {run.get('run_id')}" if recorded is not None else "no recorded run"
        return spec_diff(spec_fields(recorded, judgement.status.backend),
                         spec_fields(self.options.launch_fields(plan.resume), plan.backend),
                         before_header, f"{plan.operation.value} with this task's spec")

    def _render(self, result: dict[str, Any], plan: Plan, judgement: Judgement) -> dict[str, Any]:
        """The plan as check mode says it (and state=probe, which changes nothing: changed stays false)."""
        if not self.probing:
            result["changed"] = True
        result.update(
            resumed=plan.resume,
            running=judgement.active,
            backend=plan.backend,
            spec_hash=plan.spec_hash,
            rotated_log=plan.rotated_log,
            removed_paths=list(plan.removed_paths),
            msg=(f"would {plan.operation.value} the job with backend {plan.backend}"
                 + (plan.why_relaunch(judgement.health.state) if plan.relaunch else "")),
        )
        if not judgement.active:
            for key in ("pid", "pgid", "starttime", "started_at", "run_id", "supervisor_pid", "unit"):
                result.pop(key, None)
        return result

    def _preflight(self, result: dict[str, Any]) -> None:
        """Everything the start needs (spec.preflight_start), and a log no other live job holds (sharing.py),
        before anything is stopped, rotated or created.

        The probe (state=probe, and check mode) fails here too, so a relaunch it lets through does not
        stop a healthy job and then fail.
        """
        if self.preflight_passed:
            return
        problems: list[BadOption] = []
        # The machine's checks, then the other jobs': a log another live job writes is never taken over.
        # sharing.py only here: a probe of a job that runs with this spec never gets this far.
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.sharing import check_not_shared  # pylint: disable=import-outside-toplevel
        for check in (lambda: preflight_start(self.options), lambda: check_not_shared(self.options, self.proc_root)):
            try:
                check()
            except OptionsInvalid as exc:
                problems.extend(exc.problems)
        if problems:
            invalid = OptionsInvalid(problems)
            result["option_problems"] = invalid.as_result()["option_problems"]
            raise LaunchError(str(invalid), result)
        self.preflight_passed = True

    def _claim_log(self, result: dict[str, Any]) -> None:
        """The log checked once more and claimed in one step (sharing.claim_log), under the job's lock and before
        anything is stopped or rotated: of two starts on one log at the same instant, one is refused."""
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.sharing import claim_log  # pylint: disable=import-outside-toplevel
        try:
            claim_log(self.options, self.proc_root)
        except OptionsInvalid as exc:
            result["option_problems"] = exc.as_result()["option_problems"]
            raise LaunchError(str(exc), result) from None

    def _create_log(self, user: str | None, group: str | None) -> None:
        """The executor's creation of the log (see Executor.create_log), failing as a LaunchError."""
        executor = self._executor(HealthReport(Health.MISSING, "not judged"))
        result = {"changed": False, "name": self.options.name, "state": self.state}
        self._execute(result, executor, executor.create_log, user, group)
