# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The backends that run a job: a detached per-job supervisor, or a transient systemd unit.

Each starts a run, finds its record, says whether anything of it still runs and stops its whole
tree; which one a recorded run used is in its run.json (``backend``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Callable, Protocol

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.live import LIVE_FILE, settings_of
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import DEFAULT_PATH, LaunchOptions
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import (
    IDLE_FILE,
    RUN_MARK,
    SUPERVISOR_MARK,
    process_starttime,
    run_mark,
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
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import SENT

# The job's log: the job's user writes it, its group may read it.
LOG_MODE = 0o640
# How long a stopped run's supervisor may take to record the exit and exit or go idle (milliseconds, normally).
SETTLE_WAIT = 5.0


# The start path's modules (supervisor.py, systemd.py) are imported where a start or a systemd run needs
# them: a module run compiles everything it imports afresh, and a probe of a healthy job needs neither.
def _supervisor() -> Any:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import supervisor  # pylint: disable=import-outside-toplevel
    return supervisor


def _systemd() -> Any:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import systemd  # pylint: disable=import-outside-toplevel
    return systemd


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
        supervisor = _supervisor()
        script = supervisor.install_supervisor(self.records.job_dir)
        self.records.write_launch(launch)
        idle = self.idle_supervisor()
        # The supervisor stayed because nothing could reap it: it takes the new run, if the gate
        # lets the wake-up through; otherwise a new supervisor does.
        if idle is not None and wake_idle_supervisor(idle, self.records.job_dir, self.records.proc_root) == SENT:
            return
        # -I and a minimal environment: nothing of the Ansible connection's Python set-up carries
        # over. SUPERVISOR_MARK is how a later task proves this process is the job's supervisor.
        supervisor.spawn_detached([self.python, "-I", script, "run", self.records.job_dir], launch["log_path"], LOG_MODE,
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
        outcome = stop_tree(identity, options.term_timeout, self.records.proc_root, supervisor_idle=self.is_idle(run))
        if outcome.gone:
            self._wait_until_settled(run)
        return outcome

    def _wait_until_settled(self, run: dict) -> None:
        """Wait until the run's supervisor has exited or gone idle (idle.json written).

        The stop counts the run as gone once the supervisor has reaped its last child; the supervisor
        then records the exit and only afterwards exits or writes idle.json. A caller that looked for
        the idle supervisor in between (state=absent before removing the records, a start reusing it)
        would miss it, and the supervisor would go idle in records already gone.
        """
        pid, starttime = run.get("supervisor_pid"), run.get("supervisor_starttime")
        idle = self.is_idle(run)
        Deadline(SETTLE_WAIT).poll(lambda: idle() or not supervisor_alive(pid, starttime, self.records.job_dir,
                                                                          self.records.proc_root))


class SystemdBackend:
    """The job as a transient systemd unit (see _launch/systemd.py)."""

    name = "systemd"

    def __init__(self, records: JobRecords, python: str, job_name: str) -> None:
        self.records = records
        self.python = python
        self.unit = _systemd().unit_name(job_name)

    def start(self, options: LaunchOptions, launch: dict[str, Any]) -> None:
        systemd = _systemd()
        script = _supervisor().install_supervisor(self.records.job_dir)
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
        if settings_of(launch) is not None:
            # The node keeps the live file: a second unit, bound to the job's, looks every live.PERIOD
            # seconds (the job unit's ExecStopPost writes its end at once). An earlier run's goes first.
            live_unit = systemd.live_unit_name(options.name)
            try:
                systemd.stop_if_loaded(live_unit)
                systemd.start_unit(systemd.live_unit_argv(
                    self.unit, live_unit,
                    [self.python, "-I", os.path.join(self.records.job_dir, LIVE_FILE), "watch", self.records.job_dir,
                     launch["run_id"]],
                    f"gpuops.relaunch live health of job {options.name}"))
            except (OSError, subprocess.SubprocessError) as exc:
                # The job runs: its monitoring is not worth stopping it for. The start and the unit's
                # ExecStopPost still write the file; the result says what is missing.
                self.records.problems.append(f"metrics_dir: the live unit {live_unit} did not start ({exc}); the live "
                                             "file is written at the start and at the job's end only")

    def run_record(self, run_id: str) -> dict | None:
        run = self.records.read_run()
        return run if run is not None and run.get("run_id") == run_id else None

    # The unit is always the one named after this job, never the record's "unit": a record that
    # names ssh.service must not make a stop stop it.
    def active(self, run: dict) -> bool:
        systemd = _systemd()
        shown = systemd.show(self.unit)
        if systemd.unit_active(shown) and shown.get("InvocationID") == run.get("invocation_id"):
            return True
        identity = self.records.identity(run)
        return identity is not None and leader_alive(identity, self.records.proc_root)

    def stop(self, run: dict, options: LaunchOptions) -> StopOutcome:
        _systemd().stop_unit(self.unit, options.term_timeout + KILL_WAIT + 30)
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
    systemd = _systemd()
    if systemd.systemd_is_init() and shutil.which(systemd.SYSTEMD_RUN):
        return "systemd"
    return "supervisor"


def make_backend(name: str, records: JobRecords, job_name: str, python: str) -> Backend:
    if name == "systemd":
        return SystemdBackend(records, python, job_name)
    return SupervisorBackend(records, python)
