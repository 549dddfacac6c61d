# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""train_launch's logic: bring a job to the requested state and prove it.

``started`` is idempotent like a service: the same spec running means nothing to do; a different
spec (or backend) running means restart; nothing running means start. ``restarted`` always stops
(if running) and starts. ``stopped`` ends the job's whole tree. A start rotates the previous log,
removes ``remove_paths``, launches through the backend and returns only when the proof of start
holds; if it does not, the job is stopped again (so that a second run does not mistake a job that
never proved itself for a running one) and the task fails with the exit status and the log tail.
"""

from __future__ import annotations

import grp
import pwd
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import systemd
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import (
    HISTORY_FILE,
    RelaunchGuard,
    history_entries,
    with_relaunch,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import (
    PROGRESS_FILE,
    STOP_FILE,
    HealthReport,
    epoch_of,
    iso,
    judge,
    last_progress,
    measure,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.incident import (
    INCIDENT_LOG_LINES,
    existing_incident,
    py_spy_dumps,
    thread_evidence,
    write_incident,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import (
    create_log,
    failed_log_name,
    rotate,
    rotation_plan,
    set_aside,
    tail,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.readiness import LogScanner, wait_ready
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords, new_run_id
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import DEFAULT_PATH, LaunchOptions, preflight_start
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import (
    FAILED_START_FILE,
    IDLE_FILE,
    LAUNCH_FILE,
    RUN_MARK,
    SUPERVISOR_MARK,
    install_supervisor,
    process_starttime,
    run_mark,
    spawn_detached,
    utc_now,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import (
    KILL_WAIT,
    StopOutcome,
    leader_alive,
    look,
    stop_tree,
    supervisor_alive,
    wake_idle_supervisor,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import SENT
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Health

LOG_MODE = 0o640
EXIT_RECORD_WAIT = 5.0
# A main process that has just ended gets its exit record within moments (its supervisor writes it
# right after reaping, systemd's ExecStopPost right after the unit stops): wait that long before
# calling a run without one missing.
EXIT_SETTLE_WAIT = 2.0
# What the result says about the run that a (re)start replaced.
PREVIOUS_RUN_KEYS = ("run_id", "pid", "pgid", "starttime", "started_at", "supervisor_pid", "unit",
                     "exit_code", "exit_signal", "ended_at", "start_error")


class LaunchError(Exception):
    """The job could not be brought to the requested state; `result` says what is known."""

    def __init__(self, msg: str, result: dict[str, Any]) -> None:
        super().__init__(msg)
        self.result = result


class Backend(Protocol):
    name: str

    def start(self, options: LaunchOptions, launch: dict[str, Any]) -> None:
        """Start the job described by `launch` (run id, argv, env ...)."""

    def run_record(self, run_id: str) -> dict | None:
        """run.json once the job of `run_id` has been started (None until then)."""

    def active(self, run: dict) -> bool:
        """Whether anything of the recorded run still runs (the job's tree, or its unit)."""

    def stop(self, run: dict, options: LaunchOptions) -> StopOutcome:
        """End the recorded run's whole tree."""


class RecordedRunProbe:
    """JobProbe over the state directory: the exit record of one run and its main process."""

    def __init__(self, records: JobRecords, backend: Backend, run_id: str) -> None:
        self.records = records
        self.backend = backend
        self.run_id = run_id
        self.run: dict | None = None

    def exit_record(self) -> dict | None:
        return self.records.read_exit(self.run_id)

    def alive(self) -> bool:
        if self.run is None:
            self.run = self.backend.run_record(self.run_id)
            if self.run is None:
                return True  # still starting: the deadline bounds how long that may take
        identity = self.records.identity(self.run)
        return identity is not None and leader_alive(identity, self.records.proc_root)


class SupervisorBackend:
    """The job under a detached per-job supervisor that is its subreaper (see _launch/supervisor.py)."""

    name = "supervisor"

    def __init__(self, records: JobRecords, python: str) -> None:
        self.records = records
        self.python = python

    def idle_supervisor(self) -> dict | None:
        """idle.json, if the supervisor it names is proven to be this job's, alive, waiting for the next run."""
        idle = self.records.read(IDLE_FILE)
        if idle and supervisor_alive(idle.get("supervisor_pid"), idle.get("supervisor_starttime"),
                                     self.records.job_dir, self.records.proc_root):
            return idle
        return None

    def is_idle(self, run: dict) -> Callable[[], bool]:
        def idle() -> bool:
            found = self.idle_supervisor()
            return found is not None and found.get("supervisor_pid") == run.get("supervisor_pid")
        return idle

    def start(self, options: LaunchOptions, launch: dict[str, Any]) -> None:
        script = install_supervisor(self.records.job_dir)
        self.records.write_launch(launch)
        idle = self.idle_supervisor()
        # The supervisor stayed because nothing could reap it: it takes the new run, if the gate
        # lets the wake-up through; otherwise a new supervisor does.
        if idle is not None and wake_idle_supervisor(idle, self.records.job_dir, self.records.proc_root) == SENT:
            return
        # -I and a minimal environment: nothing of the Ansible connection's Python set-up carries
        # over. SUPERVISOR_MARK is how a later task proves this process is the job's supervisor.
        spawn_detached([self.python, "-I", script, "run", self.records.job_dir], launch["log_path"], LOG_MODE,
                       env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", SUPERVISOR_MARK: self.records.job_dir})

    def run_record(self, run_id: str) -> dict | None:
        run = self.records.read_run()
        return run if run is not None and run.get("run_id") == run_id else None

    def active(self, run: dict) -> bool:
        identity = self.records.identity(run)
        return identity is not None and not look(identity, self.records.proc_root, self.is_idle(run)).gone()

    def stop(self, run: dict, options: LaunchOptions) -> StopOutcome:
        identity = self.records.identity(run)
        if identity is None:
            return StopOutcome()
        return stop_tree(identity, options.term_timeout, self.records.proc_root, supervisor_idle=self.is_idle(run))


class SystemdBackend:
    """The job as a transient systemd unit (see _launch/systemd.py)."""

    name = "systemd"

    def __init__(self, records: JobRecords, python: str, job_name: str) -> None:
        self.records = records
        self.python = python
        self.unit = systemd.unit_name(job_name)

    def start(self, options: LaunchOptions, launch: dict[str, Any]) -> None:
        script = install_supervisor(self.records.job_dir)
        self.records.write_launch(launch)
        # The main process opens the log and becomes the job (supervisor.py exec): systemd never
        # opens the log path itself.
        cmd = systemd.systemd_run_argv(
            unit=self.unit,
            exec_job=[self.python, "-I", script, "exec", self.records.job_dir, launch["run_id"]],
            mark={RUN_MARK: run_mark(self.records.job_dir, launch["run_id"])},
            term_timeout=options.term_timeout,
            record_exit=[self.python, "-I", script, "record-exit", self.records.job_dir, launch["run_id"]],
            description=f"gpuops.relaunch job {options.name} (spec {launch['spec_hash'][:12]})",
        )
        systemd.start_unit(cmd)
        shown = systemd.show(self.unit)
        pid = systemd.main_pid(shown)
        self.records.write_run({
            "run_id": launch["run_id"],
            "spec_hash": launch["spec_hash"],
            "backend": self.name,
            "unit": self.unit,
            "invocation_id": shown.get("InvocationID"),
            "pid": pid or None,
            "pgid": pid or None,
            "starttime": _starttime(pid, self.records.proc_root),
            "started_at": utc_now(),
            "log_path": launch["log_path"],
        })

    def run_record(self, run_id: str) -> dict | None:
        run = self.records.read_run()
        return run if run is not None and run.get("run_id") == run_id else None

    # The unit is always the one named after this job, never the record's "unit": a record that
    # names ssh.service must not make a stop stop it.
    def active(self, run: dict) -> bool:
        shown = systemd.show(self.unit)
        if systemd.unit_active(shown) and shown.get("InvocationID") == run.get("invocation_id"):
            return True
        identity = self.records.identity(run)
        return identity is not None and leader_alive(identity, self.records.proc_root)

    def stop(self, run: dict, options: LaunchOptions) -> StopOutcome:
        systemd.stop_unit(self.unit, options.term_timeout + KILL_WAIT + 30)
        outcome = StopOutcome(signalled=[run["pid"]] if run.get("pid") else [])
        deadline = Deadline(KILL_WAIT)
        outcome.gone = deadline.poll(lambda: not self.active(run))
        return outcome


def _starttime(pid: int, proc_root: str) -> int | None:
    return process_starttime(pid, proc_root) if pid else None


def resolve_backend(requested: str) -> str:
    """auto: systemd where PID 1 is systemd (and systemd-run exists), else the supervisor."""
    if requested != "auto":
        return requested
    if systemd.systemd_is_init() and shutil.which(systemd.SYSTEMD_RUN):
        return "systemd"
    return "supervisor"


def make_backend(name: str, records: JobRecords, job_name: str, python: str) -> Backend:
    if name == "systemd":
        return SystemdBackend(records, python, job_name)
    return SupervisorBackend(records, python)


def remove_path(path: str) -> bool:
    """Remove a file, link or directory tree (never following a link); False if it was not there.

    Its directory is walked from / (a symlink another user can change is refused) and the removal
    happens relative to it, by descriptors all the way down (see _base/safepath.py).
    """
    directory, name = safepath.split(path)
    try:
        parent = safepath.walk(directory)
    except FileNotFoundError:
        return False
    with parent:
        return safepath.remove_at(parent.fd, name)


def _run_fields(run: dict | None) -> dict[str, Any]:
    if not run:
        return {}
    keys = ("run_id", "pid", "pgid", "starttime", "started_at", "spec_hash", "supervisor_pid", "unit")
    return {key: run.get(key) for key in keys if key in run}


def _exit_fields(record: dict | None) -> dict[str, Any]:
    if not record:
        return {}
    fields = {key: record.get(key) for key in ("exit_code", "exit_signal", "ended_at")}
    if record.get("error"):
        fields["start_error"] = record["error"]
    return fields


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
    # this family imports only _base and itself). Given the run's live member pids.
    gpu_evidence: Callable[[list[int]], dict] | None = None

    def __post_init__(self) -> None:
        self.records = JobRecords(self.options.job_dir, self.proc_root)
        self.result: dict[str, Any] = {
            "changed": False,
            "name": self.options.name,
            "state": self.options.state,
            "log_path": self.options.log_path,
            "state_dir": self.options.job_dir,
        }
        self.found = HealthReport(Health.MISSING, "not judged yet")
        self.preflight_passed = False

    def apply(self) -> dict[str, Any]:
        begun = time.monotonic()
        try:
            return self._apply()
        finally:
            # Records that were not sound were ignored (never used to signal): say so.
            if self.records.problems:
                self.result["record_problems"] = list(self.records.problems)
            self.result["elapsed"] = round(time.monotonic() - begun, 3)

    def _apply(self) -> dict[str, Any]:
        # state=health only reads (and notes progress where the job's directory exists already).
        if not self.check_mode and self.options.state != "health":
            if self.options.state in ("started", "restarted") and not self.records.is_real_dir():
                # No record of any run, so only a start can follow: one that cannot work creates nothing.
                self._preflight()
            self.records.ensure_dir()
            # Long enough for another task to stop the job and prove a new start.
            self.records.lock(self.options.term_timeout + KILL_WAIT + self.options.startup_timeout + 60)
        status = self.records.status()
        recorded = make_backend(status.backend or "supervisor", self.records, self.options.name, self.python)
        active = status.run is not None and recorded.active(status.run)
        self.result["backend"] = status.backend
        self.result.update(_run_fields(status.run))
        if self.options.log_path is None and status.run:
            self.result["log_path"] = status.run.get("log_path")
        self.found = self._judge(status)
        self.result["health"] = self.found.as_dict()
        if self.options.state == "health":
            return self._health_only(status, active)
        self.result["incident"] = None
        if not self.check_mode and self.found.state.failed and self.found.has_run:
            # Before anything is signalled: a hang is gone once the job is killed. A missing run (its
            # main process gone without an exit record) has evidence only while some of its tree is
            # left to stop; with nothing left, its health and log say it all.
            self._incident(status.run, write=self.found.state != Health.MISSING or active)
        if self.options.state == "stopped":
            return self._stopped(status.run, recorded, active)
        return self._started(status, recorded, active)

    # --- health ----------------------------------------------------------------------------

    def _judge(self, status) -> HealthReport:
        """The health of the recorded run (see _launch/health.py); notes new progress outside check mode."""
        options = self.options
        run = status.run
        exit_record = status.exit if run is not None else None
        if run is not None and exit_record is None and not status.running:
            exit_record = self._settled_exit(run.get("run_id"))
        progress = None
        now = self.wall_clock()
        if run is not None and exit_record is None and status.running and options.progress_regex is not None:
            record = self.records.read(PROGRESS_FILE)
            progress = measure(last_progress(run.get("log_path"), options.progress_regex), str(run.get("run_id")),
                               epoch_of(run.get("started_at")), record, now)
            if not self.check_mode and progress.line is not None and progress.seen_at is not None and (
                    progress.basis != "progress_record") and self.records.is_real_dir():
                # Bookkeeping, not a change of the job: when this line was first seen, so that a later
                # task can tell a stall even if the job goes on printing other lines.
                self.records.write(PROGRESS_FILE, progress.record(str(run.get("run_id"))))
        report = judge(run, exit_record, self.records.read(STOP_FILE), status.running, progress,
                       options.stall_after, now)
        if report.state.failed:
            report.log_tail = tail(run.get("log_path") if run else None, options.log_tail_lines)
        return report

    def _settled_exit(self, run_id: str | None) -> dict | None:
        record: dict | None = None

        def recorded() -> bool:
            nonlocal record
            record = self.records.read_exit(run_id)
            return record is not None

        Deadline(EXIT_SETTLE_WAIT).poll(recorded, 0.05)
        return record

    def _guard(self) -> tuple[RelaunchGuard, list[dict], float, bool]:
        """The crash-loop guard, the history, now, and whether a start now is a relaunch after a failure."""
        guard = RelaunchGuard(self.options.max_relaunches, self.options.relaunch_window)
        history = history_entries(self.records.read(HISTORY_FILE))
        now = self.wall_clock()
        relaunch = self.found.state.failed and self.found.has_run
        self.result["relaunch_guard"] = guard.report(history, now, relaunch)
        return guard, history, now, relaunch

    def _health_only(self, status, active: bool) -> dict[str, Any]:
        """state=health: the verdict, and whether the guard would let a relaunch through; nothing changes."""
        self._guard()
        result = self.result
        result["running"] = status.running
        result["operation"] = "none"
        result["msg"] = f"{self.found.state.value}: {self.found.reason}"
        if active and not status.running:
            result["msg"] += " (processes of the run are still there)"
        result["log_tail"] = tail(result.get("log_path"), self.options.log_tail_lines)
        return result

    def _incident(self, run: dict, write: bool = True) -> None:
        """The incident record of the failed run: one per run, written (if `write`) before any signal."""
        identity = self.records.identity(run)
        # A run id names the record's file: one that is not a run id (a record that lies) never does.
        run_id = identity.run_id if identity is not None else "unsound-run-record"
        job_dir = self.records.job_dir
        existing = existing_incident(job_dir, run_id)
        if existing is not None or not write:
            self.result["incident"] = existing
            return
        members: list[int] = []
        processes: list[dict] = []
        if identity is not None:
            view = look(identity, self.proc_root)
            members = view.live
            processes = thread_evidence(view.table, members)
        now = self.wall_clock()
        log_path = run.get("log_path")
        record = {
            "name": self.options.name,
            "run_id": run_id,
            "written_at": iso(now),
            "health": self.found.as_dict(),
            "log_path": log_path,
            "log_tail": tail(log_path, INCIDENT_LOG_LINES),
            "processes": processes,
            "py_spy": py_spy_dumps(members) if members else {"skipped": "no live process of the run"},
            "gpu": self.gpu_evidence(members) if self.gpu_evidence is not None else {"available": False},
        }
        try:
            path, _removed = write_incident(job_dir, run_id, record, now, self.options.keep_logs)
        except OSError as exc:
            raise LaunchError(f"cannot write the incident record in {job_dir}/incidents: {exc.strerror or exc}; "
                              "nothing was signalled", self.result) from None
        self.result["incident"] = path

    # --- stopped ---------------------------------------------------------------------------

    def _stopped(self, run: dict | None, recorded: Backend, active: bool) -> dict[str, Any]:
        result = self.result
        result["running"] = False
        result["operation"] = "stop" if active else "none"
        if not active:
            result.update(_exit_fields(self.records.read_exit(run.get("run_id")) if run else None))
            result["msg"] = "not running"
            result["log_tail"] = tail(result.get("log_path"), self.options.log_tail_lines)
            return result
        result["changed"] = True
        if self.check_mode:
            result["running"] = True
            result["msg"] = f"would stop the job (pid {run.get('pid')}) with SIGTERM, then SIGKILL after {self.options.term_timeout:g}s"
            return result
        outcome = self._stop(run, recorded)
        result["log_tail"] = tail(result.get("log_path"), self.options.log_tail_lines)
        result["msg"] = "stopped" + (" (SIGKILL was needed)" if outcome.escalated else "")
        return result

    def _stop(self, run: dict, recorded: Backend, found: str | None = None) -> StopOutcome:
        # What was found before the stop, for the next task: a run stopped while stalled is still
        # a stalled run to relaunch (with resume_args), one stopped while healthy is not.
        self.records.write(STOP_FILE, {"run_id": run.get("run_id"), "requested_at": utc_now(),
                                       "health": found or self.found.state.value})
        outcome = recorded.stop(run, self.options)
        record: dict | None = None

        def recorded_exit() -> bool:
            nonlocal record
            record = self.records.read_exit(run.get("run_id"))
            return record is not None

        Deadline(EXIT_RECORD_WAIT).poll(recorded_exit)
        self.result.update(_exit_fields(record))
        self.result["stop"] = {
            "signalled": outcome.signalled,
            # systemd escalates by itself: its record of a SIGKILL end says it had to.
            "escalated": outcome.escalated or bool(record and record.get("exit_signal") == "SIGKILL"),
            "unreapable_zombies": outcome.unreapable_zombies,
            "ignored": outcome.ignored,
        }
        if not outcome.gone:
            self.result["stop"]["remaining"] = outcome.remaining
            protected = [entry for entry in outcome.remaining if "protected" in entry]
            why = (f"; {len(protected)} of them may never be signalled (see stop.remaining[].protected)"
                   if protected else "")
            raise LaunchError(
                f"the job's processes did not end after SIGTERM, {self.options.term_timeout:g}s and "
                f"SIGKILL: still there: {outcome.remaining}{why}",
                self.result,
            )
        return outcome

    # --- started / restarted ---------------------------------------------------------------

    def _started(self, status, recorded: Backend, active: bool) -> dict[str, Any]:
        options = self.options
        spec = options.spec
        if spec is None:  # options_from_params requires a command for these states
            raise LaunchError("command: required with state=" + options.state, self.result)
        backend_name = resolve_backend(options.backend)
        result = self.result
        # A new log_path is a change too: otherwise we would report a log the job does not write.
        same_log = status.run is not None and status.run.get("log_path") == options.log_path
        same = status.spec_hash == spec.spec_hash and status.backend == backend_name and same_log
        guard, history, now, relaunch = self._guard()
        resume = bool(options.resume_args) and (
            relaunch if options.resume == "auto" else options.resume == "always" and self.found.has_run)
        result["resumed"] = False
        if options.state == "started" and status.running and same and self.found.state != Health.STALLED:
            result["running"] = True
            result["operation"] = "none"
            result["msg"] = "already running with the same spec"
            result["log_tail"] = tail(options.log_path, options.log_tail_lines)
            return result
        action = "restart" if active else "start"
        result["operation"] = action
        if result["relaunch_guard"]["would_refuse"]:
            # Before anything is stopped: a crash loop is stopped here, with the evidence kept.
            refusal = guard.refusal(result["relaunch_guard"]["recent"], self.found.state.value)
            if self.check_mode:
                result.update(running=status.running, msg="would refuse: " + refusal)
                return result
            result["running"] = status.running
            result["log_tail"] = tail(result.get("log_path"), options.log_tail_lines)
            raise LaunchError(refusal, result)
        result["running"] = status.running
        self._preflight()
        result["changed"] = True
        if self.check_mode:
            result["resumed"] = resume
            result["running"] = active
            failed_log = self._failed_start_log()
            plan = rotation_plan(options.log_path, options.keep_logs) if options.log_path else []
            result.update(
                backend=backend_name,
                spec_hash=spec.spec_hash,
                rotated_log=failed_log or (plan[-1][1] if plan else None),
                removed_paths=[path for path in options.remove_paths if safepath.lexists(path)],
                msg=f"would {action} the job with backend {backend_name}" + self._why_relaunch(relaunch, resume),
            )
            for key in ("pid", "pgid", "starttime", "started_at", "run_id", "supervisor_pid", "unit"):
                if not active:
                    result.pop(key, None)
            return result
        if relaunch:
            # Counted before the stop and the start: a start that fails counts too.
            self.records.write(HISTORY_FILE, with_relaunch(history, {
                "at": now, "at_iso": iso(now), "run_id": self.found.run_id, "health": self.found.state.value,
            }, now, options.relaunch_window))
        if active:
            self._stop(status.run, recorded)
        elif status.exit is not None:
            result.update(_exit_fields(status.exit))
        previous = {key: result.pop(key) for key in PREVIOUS_RUN_KEYS if key in result}
        if previous:
            result["previous"] = previous
        result["rotated_log"] = self._set_aside_log()
        result["removed_paths"] = [path for path in options.remove_paths if remove_path(path)]
        result["resumed"] = resume
        return self._launch(backend_name, action, resume)

    def _preflight(self) -> None:
        """Everything the start needs (spec.preflight_start), before anything is stopped, rotated or created.

        The probe (check mode) fails here too, so a relaunch it lets through does not stop a healthy
        job and then fail.
        """
        if self.preflight_passed:
            return
        try:
            preflight_start(self.options)
        except OptionsInvalid as exc:
            self.result["option_problems"] = exc.as_result()["option_problems"]
            raise LaunchError(str(exc), self.result) from None
        self.preflight_passed = True

    def _why_relaunch(self, relaunch: bool, resume: bool) -> str:
        if not relaunch:
            return ""
        return f" (the job was {self.found.state.value}" + ("; resumed with resume_args)" if resume else ")")

    def _launch(self, backend_name: str, action: str, resume: bool = False) -> dict[str, Any]:
        options = self.options
        spec = options.spec
        result = self.result
        backend = make_backend(backend_name, self.records, options.name, self.python)
        run_id = new_run_id()
        launch = {
            "run_id": run_id,
            # resume_args after a failure; the spec hash stays the job's own (see JobSpec.argv_with).
            "argv": spec.argv_with(options.resume_args if resume else ()),
            "resumed": resume,
            "env": spec.job_environment(),
            "chdir": spec.chdir,
            "user": spec.user,
            "group": spec.group,
            "spec_hash": spec.spec_hash,
            "log_path": options.log_path,
        }
        self._create_log(spec.user, spec.group)
        result.update(backend=backend_name, spec_hash=spec.spec_hash, run_id=run_id)
        # Until proven, this run's log is a failed start's: the next start sets it aside instead
        # of rotating it in, so failed starts never push out the log of the last run that worked.
        self.records.write(FAILED_START_FILE, {"run_id": run_id, "log_path": options.log_path})
        deadline = Deadline(options.startup_timeout)
        try:
            backend.start(options, launch)
        except OSError as exc:
            raise LaunchError(f"cannot start the job: {exc}", result) from None
        probe = RecordedRunProbe(self.records, backend, run_id)
        readiness = wait_ready(probe, LogScanner(options.log_path, options.ready_regex), options.min_uptime, deadline)
        run = probe.run or backend.run_record(run_id)
        result.update(_run_fields(run))
        result["ready_line"] = readiness.ready_line
        # Deprecated name, kept for playbooks that read it: the launch-to-proof part of `elapsed`.
        result["ready_after"] = round(readiness.waited, 3)
        if readiness.ready:
            self.records.remove(FAILED_START_FILE)
            result["running"] = True
            result["msg"] = (f"{action}ed with backend {backend_name}; proof of start holds"
                             + self._why_relaunch(self.found.state.failed and self.found.has_run, resume))
            result["log_tail"] = tail(options.log_path, options.log_tail_lines)
            return result
        reason = readiness.reason
        if run is None and readiness.exit is None:
            reason = f"the backend did not report the job started within {options.startup_timeout:g}s"
        result.update(_exit_fields(readiness.exit))
        if run is not None and backend.active(run):
            self._stop(run, backend, Health.CRASHED.value)
            result["stopped_after_failure"] = True
        result["running"] = False
        result["log_tail"] = tail(options.log_path, options.log_tail_lines)
        raise LaunchError(f"the start of job {options.name!r} was not proven: {reason}", result)

    def _failed_start_log(self) -> str | None:
        """Where the log at log_path goes if it is the log of a start that was never proven."""
        failed = self.records.read(FAILED_START_FILE)
        launched = self.records.read(LAUNCH_FILE)
        log_path = self.options.log_path
        if (failed and launched and failed.get("run_id") == launched.get("run_id")
                and failed.get("log_path") == log_path and safepath.lexists(log_path)):
            return failed_log_name(log_path)
        return None

    def _set_aside_log(self) -> str | None:
        """Rotate the previous log, or set a failed start's log aside as LOG.failed (one kept)."""
        failed_log = self._failed_start_log()
        if failed_log is None:
            return rotate(self.options.log_path, self.options.keep_logs)
        set_aside(self.options.log_path, failed_log)
        return failed_log

    def _create_log(self, user: str | None, group: str | None) -> None:
        """Create (or append to) the log as a regular file of its own, and give it to the job's user.

        Its directory is created if missing; never through a symlink, never a FIFO or a file with
        other hard links: what is chowned is exactly what was just opened (see logs.create_log).
        """
        log_path = self.options.log_path
        uid = pwd.getpwnam(user).pw_uid if user is not None else -1
        gid = grp.getgrnam(group).gr_gid if group is not None else (
            pwd.getpwnam(user).pw_gid if user is not None else -1)
        try:
            create_log(log_path, LOG_MODE, uid, gid)
        except OSError as exc:
            raise LaunchError(f"log_path: cannot open {log_path} as a regular file of its own: "
                              f"{exc.strerror or exc} (a symlink, FIFO, device or hard link there is refused)",
                              self.result) from None
