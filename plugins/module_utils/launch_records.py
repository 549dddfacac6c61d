# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The job's state directory: what was launched, what runs, how the last run ended.

    STATE_DIR/NAME/          0700
        launch.json          what the module asked for (run id, argv, env, spec hash)   0600
        run.json             what runs: pids, start times, backend, started_at          0600
        exit.json            how the run with that run id ended, and when               0600
        supervisor.py        the supervisor's private copy                              0600
        .lock                held while a train_launch task works on this job

Every file is replaced atomically (write + rename); exit.json is kept until the next run ends,
so the record of the last exit survives restarts of the supervisor and of the machine.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from dataclasses import dataclass

from ansible_collections.gpuops.relaunch.plugins.module_utils.launch_supervisor import (
    EXIT_FILE,
    LAUNCH_FILE,
    RUN_FILE,
    read_json,
    write_json_atomic,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils.procfs import parse_stat, read_small

STATE_DIR_MODE = 0o700


def new_run_id() -> str:
    return uuid.uuid4().hex


def process_alive(pid: int | None, starttime: int | None, proc_root: str = "/proc") -> bool:
    """Whether (pid, starttime) still names a running (not zombie) process."""
    if not pid or starttime is None:
        return False
    raw = read_small(f"{proc_root}/{pid}/stat")
    fields = parse_stat(raw) if raw is not None else None
    return fields is not None and fields.starttime == starttime and fields.state not in ("Z", "X")


@dataclass
class JobStatus:
    """What the state directory and the process table say about the job now."""

    run: dict | None
    exit: dict | None
    running: bool

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

    def path(self, name: str) -> str:
        return os.path.join(self.job_dir, name)

    def ensure_dir(self) -> None:
        """Create the job's directory (and the state_dir above it, if missing) with mode 0700."""
        state_dir = os.path.dirname(self.job_dir)
        if not os.path.isdir(state_dir):
            os.makedirs(state_dir, mode=STATE_DIR_MODE)
            os.chmod(state_dir, STATE_DIR_MODE)
        os.makedirs(self.job_dir, mode=STATE_DIR_MODE, exist_ok=True)
        os.chmod(self.job_dir, STATE_DIR_MODE)

    def lock(self, timeout: float) -> None:
        """Serialise train_launch tasks on the same job (released when the module exits)."""
        self._lock_fd = os.open(self.path(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

        def acquired() -> bool:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        if not Deadline(timeout).poll(acquired, 0.2):
            raise OSError(f"another train_launch task still works on this job after {timeout:g}s "
                          f"(it holds {self.path('.lock')})")

    def read_run(self) -> dict | None:
        return read_json(self.path(RUN_FILE))

    def read_exit(self, run_id: str | None = None) -> dict | None:
        """exit.json; with `run_id`, only if it records the end of that run."""
        record = read_json(self.path(EXIT_FILE))
        if record is None or (run_id is not None and record.get("run_id") != run_id):
            return None
        return record

    def write_launch(self, launch: dict) -> None:
        write_json_atomic(self.path(LAUNCH_FILE), launch)

    def write_run(self, run: dict) -> None:
        write_json_atomic(self.path(RUN_FILE), run)

    def status(self) -> JobStatus:
        run = self.read_run()
        if run is None:
            return JobStatus(None, self.read_exit(), False)
        ended = self.read_exit(run.get("run_id"))
        running = ended is None and process_alive(run.get("pid"), run.get("starttime"), self.proc_root)
        return JobStatus(run, ended if ended is not None else None, running)
