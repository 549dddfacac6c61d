# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The executor: what changes the job - the incident record, the relaunch history, the stop, the
rotation, the removal, the launch and its proof of start - in that order, and nothing else.

It records what it did in `done` (keys of the task's result); the controller builds the result from
the judgement, the plan and `done`. A step that fails raises ExecutionFailed, and `done` still says
what happened up to there.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
from dataclasses import dataclass, field
from typing import Any, Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.backends import LOG_MODE, Backend, RecordedRunProbe, make_backend
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import (
    HISTORY_FILE, lifetime_record, relaunch_entry, with_relaunch)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import STOP_FILE, HealthReport, iso
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.judge import Judgement
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.live import live_path, refresh_once, remove_live_file
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import create_log, rotate, set_aside, tail
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.plan import Plan
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import (
    PREVIOUS_RUN_KEYS,
    JobRecords,
    exit_fields,
    failed_start_log,
    new_run_id,
    run_fields,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import LaunchOptions
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import FAILED_START_FILE, LAUNCH_FILE, LIFETIME_FILE, utc_now
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import StopOutcome, look
from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import format_pids
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Health

# incident.py, readiness.py and the textfile writer are imported by the step that uses them: every
# task imports this module, a module run compiles what it imports afresh, and a probe uses none of them.

# How long a stopped run may take to get its exit record.
EXIT_RECORD_WAIT = 5.0


class ExecutionFailed(Exception):
    """A step of the executor failed; its `done` says what happened before."""


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


@dataclass
class Executor:
    """Carries out one task's changes on the job judged `health`."""

    options: LaunchOptions
    records: JobRecords
    health: HealthReport
    python: str
    proc_root: str
    wall_clock: Callable[[], float]
    gpu_evidence: Callable[[list[int]], dict] | None = None
    # What was done, as keys of the task's result.
    done: dict[str, Any] = field(default_factory=dict)
    # The start replaced the recorded run: its fields are in done["previous"], no longer the result's own.
    replaced: bool = False
    # The exit record the last stop waited for (how the stopped run ended).
    stopped_exit: dict | None = None

    # --- evidence --------------------------------------------------------------------------

    def incident(self, run: dict, write: bool = True) -> None:
        """The incident record of the failed run: one per run, written (if `write`) before any signal."""
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.incident import (  # pylint: disable=import-outside-toplevel
            INCIDENT_LOG_LINES, existing_incident, py_spy_dumps, thread_evidence, write_incident)
        identity = self.records.identity(run)
        # A run id names the record's file: one that is not a run id (a record that lies) never does.
        run_id = identity.run_id if identity is not None else "unsound-run-record"
        job_dir = self.records.job_dir
        existing = existing_incident(job_dir, run_id)
        if existing is not None or not write:
            self.done["incident"] = existing
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
            "health": self.health.as_dict(),
            "log_path": log_path,
            "log_tail": tail(log_path, INCIDENT_LOG_LINES),
            "processes": processes,
            "py_spy": py_spy_dumps(members) if members else {"skipped": "no live process of the run"},
            "gpu": self.gpu_evidence(members) if self.gpu_evidence is not None else {"available": False},
        }
        try:
            path, _removed = write_incident(job_dir, run_id, record, now, self.options.keep_logs)
        except OSError as exc:
            raise ExecutionFailed(f"cannot write the incident record in {job_dir}/incidents: {exc.strerror or exc}; "
                                  "nothing was signalled") from None
        self.done["incident"] = path

    # --- stop ------------------------------------------------------------------------------

    def stop(self, run: dict, recorded: Backend, found: str | None = None) -> StopOutcome:
        """End the run's whole tree, and wait for its exit record; ExecutionFailed if some of it remains."""
        # What was found before the stop, for the next task: a run stopped while stalled is still
        # a stalled run to relaunch (with resume_args), one stopped while healthy is not.
        self.records.write(STOP_FILE, {"run_id": run.get("run_id"), "requested_at": utc_now(),
                                       "health": found or self.health.state.value})
        outcome = recorded.stop(run, self.options)
        record: dict | None = None

        def recorded_exit() -> bool:
            nonlocal record
            record = self.records.read_exit(run.get("run_id"))
            return record is not None

        Deadline(EXIT_RECORD_WAIT).poll(recorded_exit)
        self.stopped_exit = record
        self.done.update(exit_fields(record))
        self.done["stop"] = {
            "signalled": outcome.signalled,
            # systemd escalates by itself: its record of a SIGKILL end says it had to.
            "escalated": outcome.escalated or bool(record and record.get("exit_signal") == "SIGKILL"),
            "unreapable_zombies": outcome.unreapable_zombies,
            "ignored": outcome.ignored,
            "mark_conflicts": outcome.mark_conflicts,
        }
        if not outcome.gone:
            self.done["stop"]["remaining"] = outcome.remaining
            protected = [entry for entry in outcome.remaining if "protected" in entry]
            waited = [entry for entry in outcome.remaining if "waited_for_by_supervisor" in entry]
            why = (f"; {len(protected)} of them may never be signalled (see stop.remaining[].protected)"
                   if protected else "")
            if waited:
                why += (f"; the supervisor waits for pids {format_pids(entry['pid'] for entry in waited)}, which are "
                        "not this job's (see stop.remaining[].waited_for_by_supervisor)")
            pids = format_pids(entry["pid"] for entry in outcome.remaining) or "none found (the process table changed)"
            raise ExecutionFailed(
                f"the job's processes did not end after SIGTERM, {self.options.term_timeout:g}s and "
                f"SIGKILL: still there: pids {pids}: {outcome.remaining}{why}")
        return outcome

    # --- start -----------------------------------------------------------------------------

    def start(self, plan: Plan, judgement: Judgement) -> None:
        """Count the relaunch, stop what runs, set the old log aside, remove remove_paths, launch, prove."""
        status = judgement.status
        if plan.relaunch:
            # Counted before the stop and the start: a start that fails counts too.
            now = judgement.now
            # The entry says whether it counts (progress, cause) and why: see guard.py.
            entry = relaunch_entry(now, self.health.run_id, self.health.state.value, judgement.guard_report)
            self.records.write(HISTORY_FILE, with_relaunch(list(judgement.history), entry, now,
                                                           self.options.relaunch_window))
            # The lifetime count, and the failure it followed, outlive the window (the live file's counter).
            self.records.write(LIFETIME_FILE, lifetime_record(self.records.read(LIFETIME_FILE), entry,
                                                              self.health.as_dict()))
        replaced_exit = status.exit
        if judgement.active:
            self.stop(status.run, judgement.recorded)
            replaced_exit = self.stopped_exit
        elif status.exit is not None:
            self.done.update(exit_fields(status.exit))
        # The replaced run's fields (and how it ended) move under `previous`.
        replaced = {**run_fields(status.run), **self.done}
        previous = {key: replaced[key] for key in PREVIOUS_RUN_KEYS if key in replaced}
        for key in PREVIOUS_RUN_KEYS:
            self.done.pop(key, None)
        self.replaced = True
        if previous:
            self.done["previous"] = previous
        self.done["rotated_log"] = self._set_aside_log()
        self.done["removed_paths"] = [path for path in self.options.remove_paths if remove_path(path)]
        if self.options.checkpoint_dir is not None:
            plan = self._resume_from_checkpoint(plan)
        self.done["resumed"] = plan.resume
        self._launch(plan, {"run": status.run, "exit": replaced_exit})

    def _resume_from_checkpoint(self, plan: Plan) -> Plan:
        """The checkpoint judged again now that the job is stopped (a save under way before is judged as it was
        left), torn ones renamed aside where asked; the launch appends resume_args filled in from it."""
        # pylint: disable-next=import-outside-toplevel
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.checkpoints import CheckpointProblem
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.resume import choose  # pylint: disable=import-outside-toplevel
        try:
            choice = choose(self.options, plan.resume, rename=True)
        except CheckpointProblem as exc:
            raise ExecutionFailed(f"checkpoint_dir: {escape_controls(str(exc))}; the job was stopped and not started "
                                  "again") from None
        self.done["checkpoint"] = choice.as_result()
        if choice.refusal is not None:
            raise ExecutionFailed("checkpoint_dir: no complete checkpoint once the job was stopped "
                                  "(checkpoint_missing=refuse): the job was not started again")
        self.options = dataclasses.replace(self.options, resume_args=choice.resume_args)
        return dataclasses.replace(plan, resume=choice.resume)

    def _launch(self, plan: Plan, replaces: dict[str, Any]) -> None:
        """Launch and prove; `replaces`: the run this start replaces and how it ended (or None, None)."""
        options = self.options
        spec = options.spec
        done = self.done
        backend = make_backend(plan.backend, self.records, options.name, self.python)
        run_id = new_run_id()
        launch = {"run_id": run_id, **options.launch_fields(plan.resume)}
        self.create_log(spec.user, spec.group)
        done.update(backend=plan.backend, spec_hash=spec.spec_hash, run_id=run_id)
        # Until proven, this run's log is a failed start's: the next start sets it aside instead
        # of rotating it in, so failed starts never push out the log of the last run that worked.
        # And if it fails before the job runs, the job is judged as the run it replaced, never as
        # missing (see JobRecords.start_failure): that run's record, and how it ended, are kept here.
        self.records.write(FAILED_START_FILE, {"run_id": run_id, "log_path": options.log_path, "replaces": replaces})
        # pylint: disable-next=import-outside-toplevel
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.readiness import LogScanner, wait_ready
        # pylint: disable-next=import-outside-toplevel
        from ansible_collections.gpuops.relaunch.plugins.module_utils._metrics.textfile import LIVE_FILE_PREFIX, file_name
        kept = live_path(self.records.read(LAUNCH_FILE))
        if kept is not None and (options.metrics_dir is None
                                 or kept != os.path.join(options.metrics_dir, file_name(options.name, LIVE_FILE_PREFIX))):
            remove_live_file(kept)  # no run keeps it now
        deadline = Deadline(options.startup_timeout)
        try:
            backend.start(options, launch)
        except OSError as exc:
            raise ExecutionFailed(f"cannot start the job: {exc}") from None
        probe = RecordedRunProbe(self.records, backend, run_id)
        readiness = wait_ready(probe, LogScanner(options.log_path, options.ready_regex), options.min_uptime, deadline)
        run = probe.run or backend.run_record(run_id)
        done.update(run_fields(run))
        done["ready_line"] = readiness.ready_line
        if readiness.ready:
            self.records.remove(FAILED_START_FILE)
            done["running"] = True
            done["live_metrics"] = None
            if options.metrics_dir is not None:
                # The live file says so now, not at the node's next look: what the task did is true
                # there when the task ends (a write that fails is the node's to retry, not the start's).
                done["live_metrics"] = os.path.join(options.metrics_dir, file_name(options.name, LIVE_FILE_PREFIX))
                refresh_once(self.records.job_dir, run_id)
            done["msg"] = (f"{plan.operation.value}ed with backend {plan.backend}; proof of start holds"
                           + (plan.why_relaunch(self.health.state) if plan.relaunch else ""))
            done["log_tail"] = tail(options.log_path, options.log_tail_lines)
            return
        reason = readiness.reason
        if run is None and readiness.exit is None:
            reason = f"the backend did not report the job started within {options.startup_timeout:g}s"
        done.update(exit_fields(readiness.exit))
        if run is not None and backend.active(run):
            self.stop(run, backend, Health.CRASHED.value)
            done["stopped_after_failure"] = True
        done["running"] = False
        done["log_tail"] = tail(options.log_path, options.log_tail_lines)
        raise ExecutionFailed(f"the start of job {options.name!r} was not proven: {reason}")

    def _set_aside_log(self) -> str | None:
        """Rotate the previous log, or set a failed start's log aside as LOG.failed (one kept)."""
        failed_log = failed_start_log(self.records, self.options.log_path)
        if failed_log is None:
            return rotate(self.options.log_path, self.options.keep_logs)
        set_aside(self.options.log_path, failed_log)
        return failed_log

    def create_log(self, user: str | None, group: str | None) -> None:
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
            raise ExecutionFailed(f"log_path: cannot open {log_path} as a regular file of its own: "
                                  f"{exc.strerror or exc} (a symlink, FIFO, device or hard link there is refused)") from None
