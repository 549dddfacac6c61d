# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The job's live health on the node: its textfile kept current without Ansible.

With train_launch's ``metrics_dir`` the start stores, in launch.json, where the job's live file goes
(``METRICS_DIR/gpuops_job_JOB.prom``), the inventory hostnames for its ``gpuops_host`` and ``gpuops_rank0``
labels (``gpuops_run`` is the run's id), and the stall rule (``progress_regex``, ``stall_after``).
From then on the node rewrites the file itself:

* the supervisor backend: the supervisor, beside its wait (it still reaps the moment a child ends),
  every ``PERIOD`` seconds and at once when the job's main process ends;
* the systemd backend: ``live.py watch`` in a second transient unit bound to the job's unit
  (``BindsTo=``), every ``PERIOD`` seconds, and the job unit's ``ExecStopPost`` (record-exit) at once
  when the job ends.

The verdict is ``_launch/health.py``'s, the very code ``state: health`` judges with, on the same
records (run.json, exit.json, stop.json, progress.json); whether the main process is alive is, for
the supervisor, whether its child is still unreaped, and for the systemd unit, whether the recorded
pid still has the recorded start time. The file is written by ``_metrics/textfile.py``'s writer
(walked from /, a temporary file renamed over it, a symlink at its name replaced, never followed).

Only the run that the records name writes: a monitor of an earlier run (a stop and a start just
crossed) stops writing once run.json names another run, and every write happens under the job's
live lock, so the last writer has read the latest records. Standard library only: this file runs
from a private copy in the job's directory, next to the supervisor's (see install_supervisor).
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import sys
import time
from typing import Any, Callable

if not __package__:
    # The private copy: its neighbours in the job's directory (only root may write it) are copies too.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import health  # pylint: disable=import-error
    import jobfiles  # pylint: disable=import-error
    import polling  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import polling
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import health, jobfiles


def _live_gpus() -> Any:
    """The look at the job's GPUs, imported only for a job that names them (launch.json's live ``gpus``)."""
    # pylint: disable=import-outside-toplevel
    if not __package__:
        import live_gpus  # pylint: disable=import-error
    else:
        from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import live_gpus
    return live_gpus


def _textfile() -> Any:
    """The textfile writer, imported where a live file is named or written: train_launch imports this
    module on every run, and a job without metrics_dir never needs the writer."""
    # pylint: disable=import-outside-toplevel
    if not __package__:
        import textfile  # pylint: disable=import-error
    else:
        from ansible_collections.gpuops.relaunch.plugins.module_utils._metrics import textfile
    return textfile


def _checkpoints() -> Any:
    """The checkpoint resolver, imported where a launch names a checkpoint_dir."""
    # pylint: disable=import-outside-toplevel
    if not __package__:
        import checkpoints  # pylint: disable=import-error
    else:
        from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import checkpoints
    return checkpoints


# launch.json's keys: the live file's settings, and the stall rule (stored with every start).
LAUNCH_KEY = "live"
HEALTH_KEY = "health"
LIVE_FILE = "live.py"
LOCK_FILE = ".live.lock"
# How often the file is rewritten while the job runs: its age and step are at most this old, a stall
# is seen within this much of stall_after. An exit is written at once, not at the next period.
PERIOD = 5.0
# A main process that has just ended gets its exit record within moments (its supervisor writes it
# right after reaping, systemd's ExecStopPost right after the unit stops): wait that long before
# calling a run without one missing (train_launch's judgement waits the same).
EXIT_SETTLE_WAIT = 2.0


class LiveSettings:
    """What launch.json says about the live file: where, for which job, host and rank 0, and the stall rule."""

    def __init__(self, directory: str, job: str, host: str, progress_regex: str | None,
                 stall_after: float | None, rank0: str | None = None, gpus: dict[str, Any] | None = None) -> None:
        self.directory = directory
        # The job's GPUs (train_launch's metrics_gpus, live_gpus.gpu_settings): None for a job without any named.
        self.gpus = gpus
        self.job = job
        self.host = host
        # A start before the label existed stored none: the job is then taken as one host's.
        self.rank0 = rank0 or host
        self.progress_regex = progress_regex
        self.pattern = re.compile(progress_regex) if progress_regex else None
        self.stall_after = stall_after

    @property
    def file_name(self) -> str:
        textfile = _textfile()
        return textfile.file_name(self.job, textfile.LIVE_FILE_PREFIX)

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.file_name)


def _stored(launch: dict[str, Any] | None, key: str) -> dict[str, Any]:
    stored = (launch or {}).get(key)
    return stored if isinstance(stored, dict) else {}


def stall_rule(launch: dict[str, Any] | None) -> tuple[str | None, float | None]:
    """(progress_regex, stall_after) as the start stored them (launch.json's ``health``), where they are
    sound; else (None, None). A bare state=health judges by them, as the node does."""
    stored = _stored(launch, HEALTH_KEY)
    regex = stored.get("progress_regex")
    after = stored.get("stall_after")
    if not isinstance(regex, str) or not regex:
        return None, None
    try:
        re.compile(regex)
    except re.error:
        return None, None
    if isinstance(after, bool) or not isinstance(after, (int, float)) or not math.isfinite(after) or after <= 0:
        after = None
    return regex, None if after is None else float(after)


def settings_of(launch: dict[str, Any] | None) -> LiveSettings | None:
    """The live file's settings of a launch (launch.json's ``live``: ``dir``, ``job``, ``host``, ``rank0``),
    or None where it keeps none (or what it says is not sound)."""
    stored = _stored(launch, LAUNCH_KEY)
    directory, job, host, rank0 = stored.get("dir"), stored.get("job"), stored.get("host"), stored.get("rank0")
    if not all(isinstance(value, str) and value for value in (directory, job, host)):
        return None
    if not os.path.isabs(directory):
        return None
    regex, after = stall_rule(launch)
    gpus = stored.get("gpus")
    return LiveSettings(directory, job, host, regex, after, rank0 if isinstance(rank0, str) else None,
                        gpus if isinstance(gpus, dict) and gpus.get("devices") else None)


def live_path(launch: dict[str, Any] | None) -> str | None:
    """The path of the live file that a launch keeps, or None."""
    settings = settings_of(launch)
    return settings.path if settings is not None else None


def remove_live_file(path: str) -> bool:
    """Remove a live file that no run keeps any more (a start without metrics_dir, or with another):
    left behind, its health series would be written by two files once the relaunch's file has them.
    The directory is walked as the writer walks it; a link at the name is removed, never followed."""
    directory, name = os.path.split(path)
    try:
        with _textfile().safepath.walk(directory) as found:
            os.unlink(name, dir_fd=found.fd)
    except OSError:
        return False
    return True


def _identity_alive(run: dict[str, Any], proc_root: str = "/proc") -> bool:
    """Whether the recorded main process runs: its pid still has the recorded start time, and it is
    not a zombie (one that ended where nothing reaps it, as under a container init that never does)."""
    pid, starttime = run.get("pid"), run.get("starttime")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or not isinstance(starttime, int):
        return False
    try:
        with open("%s/%d/stat" % (proc_root, pid), "rb") as handle:
            raw = handle.read(4096)
        fields = raw[raw.rindex(b")") + 2:].split()
        return fields[0] not in (b"Z", b"X") and int(fields[19]) == starttime
    except (OSError, ValueError, IndexError):
        return False


def assess(job_dir: str, settings: LiveSettings, run: dict[str, Any], alive: bool | None,
           now: Callable[[], float] = time.time, note_progress: bool = True,
           seen: dict[str, Any] | None = None) -> health.HealthReport:
    """The health of `run` as state=health judges it (health.judge), from the job's records now.

    `alive`: whether its main process runs, where the caller knows (the supervisor: its child is not
    reaped yet); None: its recorded pid still has its start time. `seen`: the caller's memory of the
    log between looks (health.last_progress's `since`), kept under "log".
    """
    run_id = str(run.get("run_id"))

    def exit_record() -> dict | None:
        record = jobfiles.read_json(os.path.join(job_dir, jobfiles.EXIT_FILE))
        return record if record is not None and record.get("run_id") == run_id else None

    ended = exit_record()
    running = ended is None and (_identity_alive(run) if alive is None else alive)
    if ended is None and not running:
        # The exit record follows the end within moments (written right after the reaping, or by
        # ExecStopPost): wait that long, as the module does, before calling the run missing.
        ended = polling.Deadline(EXIT_SETTLE_WAIT).poll_for(exit_record, 0.05)
    moment = now()
    progress = None
    if ended is None and running and settings.pattern is not None:
        progress_path = os.path.join(job_dir, health.PROGRESS_FILE)
        memory = seen if seen is not None else {}
        since = memory.get("log") if memory.get("run_id") == run_id else None
        log = health.last_progress(run.get("log_path"), settings.pattern, since=since)
        memory.update(run_id=run_id, log=log)
        progress = health.measure(log, run_id, health.epoch_of(run.get("started_at")), jobfiles.read_json(progress_path),
                                  moment)
        if note_progress and progress.line is not None and progress.seen_at is not None and (
                progress.basis != "progress_record"):
            # As the module notes it: when this line was first seen, so that a stall is told even
            # while the job goes on printing other lines.
            jobfiles.write_json_atomic(progress_path, progress.record(run_id))
    stop_record = jobfiles.read_json(os.path.join(job_dir, health.STOP_FILE))
    return health.judge(run, ended, stop_record, running, progress, settings.stall_after, moment)


class Monitor:
    """Keeps one run's live file current; `refresh` never raises (a monitor must not end its job)."""

    def __init__(self, job_dir: str, run_id: str, settings: LiveSettings, clock: Callable[[], float] = time.time,
                 warn: Callable[[str], None] | None = None) -> None:
        self.job_dir = job_dir
        self.run_id = run_id
        self.settings = settings
        self.clock = clock
        self.warn = warn or (lambda text: sys.stderr.write(text + "\n"))
        self.next_at = 0.0
        self.last_problem = ""
        self.seen: dict[str, Any] = {}  # the log as the last look read it (see assess)
        self.gpu_watch: Any = None  # the look at the job's GPUs, made at the first refresh that has the run
        self.checkpoint: dict[str, Any] | None = None  # launch.json's checkpoint (dir, format, marker), if any

    @classmethod
    def of_launch(cls, job_dir: str, launch: dict[str, Any] | None, **kwargs: Any) -> Monitor | None:
        settings = settings_of(launch)
        if settings is None or not (launch or {}).get("run_id"):
            return None
        monitor = cls(job_dir, str(launch["run_id"]), settings, **kwargs)
        stored = (launch or {}).get("checkpoint")
        monitor.checkpoint = stored if isinstance(stored, dict) else None
        return monitor

    def seconds_to_next(self) -> float:
        return max(self.next_at - time.monotonic(), 0.0)

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def refresh(self, alive: bool | None = None) -> str | None:
        """Judge the run and rewrite its file, under the job's live lock; the state written, or None
        when nothing was (another run is recorded now, or the write failed: said once on stderr)."""
        self.next_at = time.monotonic() + PERIOD
        try:
            with _LiveLock(self.job_dir):
                run = jobfiles.read_json(os.path.join(self.job_dir, jobfiles.RUN_FILE))
                if run is None or run.get("run_id") != self.run_id:
                    return None  # not (or no longer) this run's file to write
                report = assess(self.job_dir, self.settings, run, alive, self.clock, seen=self.seen)
                textfile = _textfile()
                lifetime = jobfiles.read_json(os.path.join(self.job_dir, jobfiles.LIFETIME_FILE))
                text = textfile.render(textfile.live_metrics(self.settings.job, self.settings.host, report.as_dict(),
                                                             round(self.clock(), 3), rank0=self.settings.rank0,
                                                             run=self.run_id, checkpoint_step=self.checkpoint_step(),
                                                             gpus=self.look_at_gpus(run, ended=report.state.value != "running"),
                                                             lifetime=lifetime))
                textfile.write_textfile(self.settings.directory, self.settings.file_name, text)
        except Exception as exc:  # pylint: disable=broad-except
            problem = "gpuops live health: cannot write %s: %s" % (self.settings.path, exc)
            if problem != self.last_problem:
                self.warn(problem)
                self.last_problem = problem
            return None
        self.last_problem = ""
        return report.state.value

    def look_at_gpus(self, run: dict[str, Any], ended: bool) -> dict[str, Any] | None:
        """The job's GPUs as last seen (a new look when one is due, at most every live_gpus.GPU_PERIOD
        seconds, in a child under a deadline; at once when the job has `ended`: the failure's alert and
        the GPU's verdict reach Prometheus in one scrape); None for a job without GPUs named."""
        if self.settings.gpus is None:
            return None
        if self.gpu_watch is None:
            self.gpu_watch = _live_gpus().GpuWatch(self.job_dir, self.settings.gpus, health.epoch_of(run.get("started_at")))
        return self.gpu_watch.look(now=ended)

    def checkpoint_step(self) -> int | None:
        """The newest complete checkpoint's step, where the launch stored a checkpoint_dir (spec.stored_health);
        resolved by the rule train_launch resumes by (checkpoints.py), newest first and bounded."""
        stored = self.checkpoint
        if not stored or not isinstance(stored.get("dir"), str):
            return None
        try:
            return _checkpoints().resolve(stored["dir"], str(stored.get("format") or "auto"),
                                          str(stored.get("marker") or "COMPLETE"), enough=1).step
        except OSError:
            return None

    def finished(self) -> bool:
        """Whether this run's watch is over: it ended (exit record), or another run is recorded."""
        run = jobfiles.read_json(os.path.join(self.job_dir, jobfiles.RUN_FILE))
        if run is None or run.get("run_id") != self.run_id:
            return True
        ended = jobfiles.read_json(os.path.join(self.job_dir, jobfiles.EXIT_FILE))
        return ended is not None and ended.get("run_id") == self.run_id


class _LiveLock:
    """The job's live lock (an flock on LOCK_FILE in the job's directory, opened without following a link)."""

    def __init__(self, job_dir: str) -> None:
        self.path = os.path.join(job_dir, LOCK_FILE)
        self.fd = -1

    def __enter__(self) -> _LiveLock:
        self.fd = jobfiles.open_regular(self.path, os.O_RDWR | os.O_CREAT, jobfiles.STATE_FILE_MODE)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *_exc: object) -> None:
        os.close(self.fd)


def refresh_once(job_dir: str, run_id: str, alive: bool | None = None) -> str | None:
    """One refresh of run `run_id`'s live file, if its launch keeps one (record-exit, the module after a start)."""
    launch = jobfiles.read_json(os.path.join(job_dir, jobfiles.LAUNCH_FILE))
    if launch is None or launch.get("run_id") != run_id:
        return None
    monitor = Monitor.of_launch(job_dir, launch)
    return monitor.refresh(alive) if monitor is not None else None


def watch(job_dir: str, run_id: str) -> int:
    """The systemd backend's live unit: refresh every PERIOD seconds until the run is over."""
    launch = jobfiles.read_json(os.path.join(job_dir, jobfiles.LAUNCH_FILE))
    if launch is None or launch.get("run_id") != run_id:
        sys.stderr.write("gpuops live health: launch.json is not the launch of run %s\n" % run_id)
        return 1
    monitor = Monitor.of_launch(job_dir, launch)
    if monitor is None:
        return 0
    while True:
        monitor.refresh()
        if monitor.finished():
            monitor.refresh(alive=False)
            return 0
        time.sleep(monitor.seconds_to_next())


def main(argv: list) -> int:
    if len(argv) == 3 and argv[0] == "watch":
        return watch(argv[1], argv[2])
    sys.stderr.write("usage: live.py watch JOB_DIR RUN_ID\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
