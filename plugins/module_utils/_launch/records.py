# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The job's state directory: what was launched, what runs, how the last run ended.

    STATE_DIR/NAME/          0700
        launch.json          what the module asked for (run id, argv, env, spec hash)   0600
        run.json             what runs: pids, start times, backend, started_at          0600
        exit.json            how the run with that run id ended, and when               0600
        failed_start.json    the last run whose start was not proven, its log, the run   0600
                             it was to replace (and how that one ended)
        idle.json            a supervisor that waits for the next run (see supervisor)  0600
        start_error.txt      systemd: why the unit's main process could not become the  0600
                             job after taking its user (ExecStopPost moves it to exit.json)
        supervisor.py        the supervisor's private copy                              0600
        live.py, health.py,  the live health's private copies, and the standard-library  0600
        textfile.py, ...     files they import (see supervisor.private_copies)
        .live.lock           held while the node rewrites the job's live file (live.py)
        stop.json            the last run train_launch stopped, and its health then      0600
        progress.json        the run's last progress line and when a task first saw it  0600
        relaunches.json      relaunches after a failure, for the crash-loop guard        0600
        incidents/           one incident record per stalled or crashed run             0700
        .lock                held while a train_launch task works on this job

Every file is replaced atomically (write + rename); exit.json is kept until the next run ends,
so the record of the last exit survives restarts of the supervisor and of the machine. Records are
read only as regular files (never through a symlink, never a FIFO), their directory walked from /
without following a symlink another user can change (``_base/safepath.py``); a record that is not
sound is reported in `problems` and ignored, and no record is ever taken as proof of what to signal.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from dataclasses import dataclass
from typing import Any

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import HISTORY_FILE, history_entries
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import (
    EXIT_FILE,
    FAILED_START_FILE,
    LAUNCH_FILE,
    RUN_FILE,
    load_json,
    open_regular,
    write_json_atomic,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.logs import failed_log_name, same_log
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import JobIdentity, RecordError, leader_alive
from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline

STATE_DIR_MODE = 0o700


def new_run_id() -> str:
    return uuid.uuid4().hex


class StateDirProblem(OSError):
    """The job's records cannot be kept in state_dir (the option to change); `cause` is the error met."""

    def __init__(self, cause: OSError, what: str) -> None:
        super().__init__(cause.errno, f"{what}: {cause.strerror or cause}")
        self.cause = cause

    def __str__(self) -> str:
        return f"state_dir: {self.strerror}"


@dataclass
class JobStatus:
    """What the state directory and the process table say about the job now."""

    run: dict | None
    exit: dict | None
    running: bool
    # The last start failed before anything of the job ran (see JobRecords.start_failure): `run` and
    # `exit` are then the run that start was to replace, as they were.
    start_failure: dict | None = None

    @property
    def backend(self) -> str | None:
        return self.run.get("backend") if self.run else None

    @property
    def spec_hash(self) -> str | None:
        return self.run.get("spec_hash") if self.run else None


class JobRecords:
    """Reads and writes one job's state directory."""

    def __init__(self, job_dir: str, proc_root: str = "/proc") -> None:
        self.job_dir = job_dir
        self.proc_root = proc_root
        self._lock_fd: int | None = None
        self.problems: list[str] = []

    def path(self, name: str) -> str:
        return os.path.join(self.job_dir, name)

    def is_real_dir(self) -> bool:
        """Whether the job's directory exists, reached without a symlink another user can change."""
        try:
            safepath.walk(self.job_dir).close()
        except OSError:
            return False
        return True

    def ensure_dir(self) -> None:
        """Create the job's directory (and the state_dir above it, if missing) with mode 0700.

        Walked from / (a symlink another user can change is refused, and named). OSError names
        state_dir: a file or a read-only file system there is the user's to fix.
        """
        try:
            with safepath.walk(self.job_dir, create_mode=STATE_DIR_MODE, listable=True) as job_dir:
                os.fchmod(job_dir.fd, STATE_DIR_MODE)
        except OSError as exc:
            raise StateDirProblem(exc, f"cannot keep the job's records in {self.job_dir}") from None

    def lock(self, timeout: float) -> None:
        """Serialise train_launch tasks on the same job (released when the module exits)."""
        try:
            self._lock_fd = open_regular(self.path(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateDirProblem(exc, f"cannot open the lock {self.path('.lock')}") from None

        def acquired() -> bool:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        if not Deadline(timeout).poll(acquired, 0.2):
            raise OSError(f"another train_launch task still works on this job after {timeout:g}s "
                          f"(it holds {self.path('.lock')})")

    def read(self, name: str) -> dict | None:
        """The record `name`, or None if it is missing or not sound (then noted in `problems`)."""
        try:
            return load_json(self.path(name))
        except ValueError as exc:
            problem = f"{self.path(name)} {exc}; ignored"
            if problem not in self.problems:
                self.problems.append(problem)
            return None

    def read_run(self) -> dict | None:
        return self.read(RUN_FILE)

    def read_exit(self, run_id: str | None = None) -> dict | None:
        """exit.json; with `run_id`, only if it records the end of that run."""
        record = self.read(EXIT_FILE)
        if record is None or (run_id is not None and record.get("run_id") != run_id):
            return None
        return record

    def write(self, name: str, record: dict) -> None:
        write_json_atomic(self.path(name), record)

    def remove(self, name: str) -> None:
        try:
            with safepath.walk(self.job_dir) as job_dir:
                os.unlink(name, dir_fd=job_dir.fd)
        except FileNotFoundError:
            pass

    def write_launch(self, launch: dict) -> None:
        write_json_atomic(self.path(LAUNCH_FILE), launch)

    def write_run(self, run: dict) -> None:
        write_json_atomic(self.path(RUN_FILE), run)

    def identity(self, run: dict) -> JobIdentity | None:
        """The run's identity, or None (noted in `problems`) when its record cannot describe a run."""
        try:
            return JobIdentity.from_run(run, self.job_dir, self.path(RUN_FILE))
        except RecordError as exc:
            if str(exc) not in self.problems:
                self.problems.append(f"{exc}; ignored")
            return None

    def start_failure(self) -> dict | None:
        """The last start, if it failed before anything of the job ran; None otherwise.

        failed_start.json names the start (written before it) and the run it was to replace, with
        that run's exit record as it was after the stop (the start's own error takes exit.json's
        place). The start failed before the job ran when exit.json holds an error for it: its
        supervisor or unit could not enter chdir, open the log, become the user or exec the program.
        Such a failure is the relaunch's own, not the job's: the job is judged as the run it replaced
        (a healthy run the relaunch stopped is stopped, not missing), so the crash-loop guard does not
        count it and no resume_args are added for it.
        """
        failed = self.read(FAILED_START_FILE)
        if not failed or not isinstance(failed.get("replaces"), dict):
            return None
        ended = self.read_exit(failed.get("run_id"))
        if not ended or not ended.get("error"):
            return None
        replaced = failed["replaces"]
        replaced_run = replaced.get("run") if isinstance(replaced.get("run"), dict) else None
        recorded = self.read_run()
        if recorded is not None and recorded.get("run_id") not in (
                failed.get("run_id"), replaced_run.get("run_id") if replaced_run else None):
            return None  # a later run is recorded: this record is not about the last start
        replaced_exit = replaced.get("exit") if isinstance(replaced.get("exit"), dict) else None
        return {"run_id": failed.get("run_id"), "error": ended["error"], "ended_at": ended.get("ended_at"),
                "run": replaced_run, "exit": replaced_exit}

    def status(self) -> JobStatus:
        failure = self.start_failure()
        if failure is not None:
            replaced = failure["run"]
            identity = self.identity(replaced) if replaced is not None else None
            if replaced is None or identity is None:
                return JobStatus(None, None, False, failure)
            ended = failure["exit"] if (failure["exit"] or {}).get("run_id") == identity.run_id else None
            return JobStatus(replaced, ended, ended is None and leader_alive(identity, self.proc_root), failure)
        run = self.read_run()
        identity = self.identity(run) if run is not None else None
        if run is None or identity is None:
            return JobStatus(None, self.read_exit(), False)
        ended = self.read_exit(identity.run_id)
        running = ended is None and leader_alive(identity, self.proc_root)
        return JobStatus(run, ended, running)


# What a task's result says about the records (the controller and the executor both build results from them).
# What the result says about the run that a (re)start replaced.
PREVIOUS_RUN_KEYS = ("run_id", "pid", "pgid", "starttime", "started_at", "supervisor_pid", "unit",
                     "exit_code", "exit_signal", "ended_at", "start_error")


def run_fields(run: dict | None) -> dict[str, Any]:
    """What the result says about a recorded run."""
    if not run:
        return {}
    keys = ("run_id", "pid", "pgid", "starttime", "started_at", "spec_hash", "supervisor_pid", "unit")
    return {key: run.get(key) for key in keys if key in run}


def exit_fields(record: dict | None) -> dict[str, Any]:
    """What the result says about how a run ended."""
    if not record:
        return {}
    fields = {key: record.get(key) for key in ("exit_code", "exit_signal", "ended_at")}
    if record.get("error"):
        fields["start_error"] = record["error"]
    return fields


def failed_start_log(records: JobRecords, log_path: str | None) -> str | None:
    """Where the log at log_path goes if it is the log of a start that was never proven."""
    failed = records.read(FAILED_START_FILE)
    launched = records.read(LAUNCH_FILE)
    if (failed and launched and failed.get("run_id") == launched.get("run_id")
            and same_log(failed.get("log_path"), log_path) and safepath.lexists(log_path)):
        return failed_log_name(log_path)
    return None


def reset_history(records: JobRecords, write: bool) -> int:
    """reset_guard: how many relaunches the history holds; cleared (if `write`) through the records."""
    entries = history_entries(records.read(HISTORY_FILE))
    if entries and write:
        records.write(HISTORY_FILE, {"relaunches": []})
    return len(entries)
