# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The job's health: progressing, stalled, finished, crashed, missing (or stopped on request).

"Runs with this spec" is not health: a job whose collective hangs runs for days without a step.
Progress is a new log line matching ``progress_regex``; a job alive without one for ``stall_after``
seconds is stalled.

When was the last progress line written? The log does not say, so this takes the tightest *upper
bound* it can prove, never a guess, and a stall is judged on ``now - bound``, which is then a lower
bound of the real time without progress - the verdict ``stalled`` is never premature:

* the log's mtime, when nothing but blank space follows the progress line (then it is exact: the
  last write to the log was that line), and in any case (the line was written before the last write);
* when the progress record (``progress.json``, kept outside check mode) says that an earlier task
  already saw this very line (same run, same offset, same step), the time it first saw it;
* before the first progress line of the run (the whole log read), the run's start.

A run whose main process is stopped (state T: SIGSTOP, a job-control stop; t: a debugger; or asleep
in a cgroup freezer) is alive but runs nothing: the verdict's reason says so, with the wait channel
(:func:`stopped_state`), instead of a plain "running" or stall.

So a job that keeps printing other lines while its steps stand still is found stalled only once a
task outside check mode has seen the line (``state=health`` does that without changing anything of
the job). Wall-clock times (mtime, started_at) are compared with the wall clock; a clock set back
only delays a verdict.

The judgement (:func:`last_progress`, :func:`measure`, :func:`judge`) is the one the node keeps its
live textfile with (``_launch/live.py``): this file is standard library only, and imports only files
that are too (jobfiles, safepath, terminal, verdict), so that the supervisor's private copy in the
job's directory imports it from beside itself, as it does jobfiles.py. One implementation of the
rules, on the node and in the module alike.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
from dataclasses import dataclass, field
from typing import Any, Pattern

if not __package__:
    # The private copy next to the supervisor's (see install_supervisor): its neighbours are copies too.
    from jobfiles import open_regular  # pylint: disable=import-error
    from terminal import LINE_LIMIT, cap_line, escape_controls  # pylint: disable=import-error
    from verdict import Health  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import open_regular
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import LINE_LIMIT, cap_line, escape_controls
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Health

PROGRESS_FILE = "progress.json"
STOP_FILE = "stop.json"
# How far back from the end of the log to look for the last progress line: a job that writes
# more than this after its last step is judged by the log's mtime and the progress record.
SCAN_LIMIT = 8 * 1024 * 1024
CHUNK = 64 * 1024
# A line ends at \n or \r: a tqdm-style bar rewrites one line with \r, each state is a line.
_LINE_BREAK = re.compile(rb"[\r\n]")


@dataclass(frozen=True)
class LogProgress:
    """What the log says about progress: the last matching line and where it ends."""

    readable: bool
    why_not: str = ""
    size: int = 0
    mtime: float | None = None
    line: str | None = None
    step: str | None = None
    line_end: int | None = None   # byte offset just after the line
    trailing: bool = False        # something other than blank space follows the line
    whole: bool = False           # the search reached the start of the log
    file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the log read


def _step_of(match: re.Match) -> str:
    """The first group of the pattern if it has one (and it took part), else the whole match."""
    if match.re.groups and match.group(1) is not None:
        return match.group(1)
    return match.group(0)


def last_progress(log_path: str | None, pattern: Pattern[str], limit: int = SCAN_LIMIT,
                  chunk: int = CHUNK, since: LogProgress | None = None) -> LogProgress:
    """The last line of the log matching `pattern`, read backwards from the end (at most `limit` bytes).

    Only a regular file, never through a symlink (open_regular): the log path is the job's, and
    may be writable by the job's user.

    `since`: what an earlier call found in the same log (the node's live health looks every few
    seconds). A log only grows: when it is the same file, no shorter, only what was written since
    (and one chunk before it, for a line the earlier look saw unfinished) is read; if no line there
    matches, the earlier answer stands, as long as its line is still within the last `limit` bytes.
    So a job that prints no progress line costs the node one read of `limit` bytes, not one per look.
    """
    if not log_path:
        return LogProgress(False, "no log_path is recorded")
    try:
        fd = open_regular(log_path, os.O_RDONLY)
    except OSError as exc:
        return LogProgress(False, f"cannot read the log {log_path}: {exc.strerror or exc}")
    try:
        info = os.fstat(fd)
        file_id = (info.st_dev, info.st_ino)
        if since is not None and since.readable and since.file_id == file_id and since.size <= info.st_size:
            found = _scan(fd, info, pattern, min(info.st_size - since.size + chunk, limit), chunk)
            if found.line is not None:
                return found
            trailing = since.trailing or found.trailing
            whole = since.whole and info.st_size <= limit
            if since.line is not None and since.line_end is not None and info.st_size - since.line_end < limit - chunk:
                return LogProgress(True, "", info.st_size, info.st_mtime, since.line, since.step, since.line_end,
                                   trailing, whole, file_id)
            if since.line is None:
                return LogProgress(True, "", info.st_size, info.st_mtime, trailing=trailing, whole=whole, file_id=file_id)
        return _scan(fd, info, pattern, limit, chunk)
    except OSError as exc:
        return LogProgress(False, f"cannot read the log {log_path}: {exc.strerror or exc}")
    finally:
        os.close(fd)


def _scan(fd: int, info: os.stat_result, pattern: Pattern[str], limit: int, chunk: int) -> LogProgress:
    """last_progress's search of the open log, backwards from its end, over at most `limit` bytes.

    Memory stays bounded whatever the job prints: of a line longer than a chunk only its first
    LINE_LIMIT bytes are kept (the pattern sees those; the line is kept and shown cut, see cap_line).
    """
    size, mtime = info.st_size, info.st_mtime
    file_id = (info.st_dev, info.st_ino)
    # The line whose beginning lies in the next chunk to read: its first bytes so far (at most
    # LINE_LIMIT of them) and its whole length so far.
    carry, carry_length = b"", 0
    pos = size
    trailing = False
    while pos > 0 and size - pos < limit:
        length = min(chunk, pos)
        pos -= length
        pieces = _LINE_BREAK.split(os.pread(fd, length, pos))
        # The last piece continues into the carried line; each break is one byte.
        lengths = [len(piece) for piece in pieces]
        lengths[-1] += carry_length
        pieces[-1] = (pieces[-1] + carry)[:LINE_LIMIT]
        # Unless this chunk starts the file, its first piece continues into the earlier bytes.
        first = 0 if pos == 0 else 1
        cursor = pos + sum(lengths) + len(pieces) - 1  # just after the last piece
        for index in range(len(pieces) - 1, first - 1, -1):
            piece, whole = pieces[index], lengths[index]
            if piece.strip() or whole > len(piece):  # a cut line is not blank space
                head = piece[:LINE_LIMIT]
                text = head.decode("utf-8", "surrogateescape")
                match = pattern.search(text)
                if match is not None:
                    # Escaped for the result (see _base/terminal.py); the pattern saw the line as written.
                    shown = cap_line(head, whole).decode("utf-8", "surrogateescape")
                    return LogProgress(True, "", size, mtime, escape_controls(shown), escape_controls(_step_of(match)),
                                       cursor, trailing, pos == 0, file_id)
                trailing = True
            cursor -= whole + 1
        carry, carry_length = (pieces[0][:LINE_LIMIT], lengths[0]) if first else (b"", 0)
    return LogProgress(True, "", size, mtime, whole=pos == 0, trailing=trailing, file_id=file_id)


# Where a thread of a frozen control group sleeps: cgroup v2's freezer, cgroup v1's.
FREEZER_WCHANS = ("do_freezer_trap", "__refrigerator")


def stopped_state(state: str, wchan: str) -> str | None:
    """What a process's state and wait channel say about it being held still, or None if they do not."""
    where = f"state {state}, wchan {escape_controls(wchan) or '?'}"
    if state == "T":
        return (f"stopped by a signal ({where}: SIGSTOP or a job-control stop); it runs nothing, "
                "not even a SIGTERM handler, until continued")
    if state == "t":
        return f"stopped by a debugger ({where}: traced); it runs nothing until the tracer lets it go"
    if wchan in FREEZER_WCHANS:
        return f"frozen by a cgroup freezer ({where}); it runs nothing until thawed"
    return None


def leader_stopped_state(pid: int | None, starttime: int | None, proc_root: str = "/proc") -> str | None:
    """:func:`stopped_state` of the run's main process, read now (None when it is not that process any more)."""
    if not pid or starttime is None:
        return None
    # Imported here: the signal gate is the module's, and the node's private copy never asks this.
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import Identity, ProcessControl
    control = ProcessControl(proc_root)
    process = control.current(Identity(pid, starttime))
    if process is None:
        return None
    main = next((thread for thread in control.threads(pid) if thread.tid == pid), None)
    wchan = main.wchan if main is not None else ""
    # Read after the threads: they were the run's main process's only if the pid still has its start time.
    return stopped_state(process.state, wchan) if control.current(Identity(pid, starttime)) is not None else None


def epoch_of(timestamp: Any) -> float | None:
    """Seconds since the epoch of an ISO 8601 timestamp (as the records hold), or None."""
    if not isinstance(timestamp, str):
        return None
    try:
        moment = datetime.datetime.fromisoformat(timestamp)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat()


@dataclass(frozen=True)
class Progress:
    """The last progress of a run, and the latest moment it can have happened (`seen_at`)."""

    step: str | None
    line: str | None
    seen_at: float | None
    basis: str  # log_mtime | progress_record | run_start | unknown
    line_end: int | None = None
    why_unknown: str = ""

    def record(self, run_id: str) -> dict[str, Any]:
        """What progress.json keeps: enough to recognise this very line again."""
        return {"run_id": run_id, "step": self.step, "line": self.line, "line_end": self.line_end,
                "first_seen": self.seen_at, "first_seen_at": iso(self.seen_at)}


def _plausible_time(value: Any, started_at: float | None, now: float) -> bool:
    """Whether `value` can be when a line of this run was first seen: a number between the run's start
    and now. A record that says otherwise (0, a time before the run, one to come) would make a
    running job look stalled at once - and a stalled job is stopped."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (started_at is None or value >= started_at) and value <= now)


def measure(log: LogProgress, run_id: str, started_at: float | None, record: dict | None,
            now: float) -> Progress:
    """The progress of run `run_id` from its log, its start and the progress record (see the module doc)."""
    if not log.readable:
        return Progress(None, None, None, "unknown", why_unknown=log.why_not)
    bounds: list[tuple[float, str]] = []
    if log.mtime is not None and log.size > 0:
        bounds.append((log.mtime, "log_mtime"))
    if log.line is None:
        if log.whole and started_at is not None:
            bounds.append((started_at, "run_start"))  # no progress line yet: the start is the last progress
    elif (record is not None and record.get("run_id") == run_id and record.get("line_end") == log.line_end
          and record.get("step") == log.step and _plausible_time(record.get("first_seen"), started_at, now)):
        bounds.append((float(record["first_seen"]), "progress_record"))
    if log.line is None and not log.whole and not bounds:
        return Progress(None, None, None, "unknown", why_unknown="no progress line in the end of the log")
    if not bounds:
        if started_at is None:
            return Progress(log.step, log.line, None, "unknown", log.line_end, "neither the log nor the run says when")
        bounds.append((started_at, "run_start"))
    seen_at, basis = min(bounds)
    return Progress(log.step, log.line, min(seen_at, now), basis, log.line_end)


@dataclass
class HealthReport:
    """The verdict on one job, with what it rests on."""

    state: Health
    reason: str
    run_id: str | None = None
    progress: Progress | None = None
    since_progress: float | None = None
    exit: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False
    log_tail: list[str] = field(default_factory=list)

    @property
    def has_run(self) -> bool:
        return self.run_id is not None

    def as_dict(self) -> dict[str, Any]:
        progress = self.progress
        result: dict[str, Any] = {
            "state": self.state.value,
            "reason": self.reason,
            "run_id": self.run_id,
            "last_step": progress.step if progress else None,
            "last_progress_line": progress.line if progress else None,
            "last_progress_at": iso(progress.seen_at) if progress else None,
            "progress_basis": progress.basis if progress else None,
            "since_progress": None if self.since_progress is None else round(self.since_progress, 3),
            "exit_code": self.exit.get("exit_code"),
            "exit_signal": self.exit.get("exit_signal"),
            "ended_at": self.exit.get("ended_at"),
            "stopped": self.stopped,
        }
        if self.state.failed:
            result["log_tail"] = list(self.log_tail)
        return result


def describe_exit(record: dict | None) -> str:
    """'exit code 3', 'signal SIGKILL', the start error, or 'an unknown status'."""
    if not record:
        return "an unknown status (no exit record)"
    if record.get("error"):
        return str(record["error"])
    if record.get("exit_signal"):
        return f"signal {record['exit_signal']}"
    if record.get("exit_code") is not None:
        return f"exit code {record['exit_code']}"
    return "an unknown status"


# What a stop record may say the run was, and the verdict keeps after the stop ended it.
_FAILURES_KEPT_BY_A_STOP = tuple(state.value for state in Health if state.failed)


def _shell_signal_note(exit_record: dict) -> str:
    """' (128+9: how a shell reports a process ended by SIGKILL)' for an exit code above 128 that can be one.

    A command line (shell=true) ends with 128+N when its process, or with pipefail any process of its
    pipeline, was ended by signal N: the crash is then the signal's, not the code's.
    """
    code = exit_record.get("exit_code")
    if exit_record.get("exit_signal") is not None or not isinstance(code, int) or isinstance(code, bool):
        return ""
    try:
        name = signal.Signals(code - 128).name if code > 128 else None
    except ValueError:
        name = None
    return f" (128+{code - 128}: how a shell reports a process ended by {name})" if name else ""


def _ended(run_id: str, exit_record: dict, stop_record: dict | None) -> HealthReport:
    exit_fields = {key: exit_record.get(key) for key in ("exit_code", "exit_signal", "ended_at")}
    if stop_record is not None and stop_record.get("run_id") == run_id:
        # Ended because train_launch stopped it: the verdict is what that task found before stopping.
        # A failure stays one (the guard counts it, a relaunch resumes): a run stopped while missing
        # - its main process gone without an exit record, some of its tree left - is still missing.
        found = stop_record.get("health")
        state = Health(found) if found in _FAILURES_KEPT_BY_A_STOP else Health.STOPPED
        why = (f"stopped by train_launch at {stop_record.get('requested_at')} (it was {found}); "
               f"ended with {describe_exit(exit_record)}")
        return HealthReport(state, why, run_id, exit=exit_fields, stopped=True)
    if exit_record.get("error"):
        return HealthReport(Health.CRASHED, f"could not start: {exit_record['error']}", run_id, exit=exit_fields)
    if exit_record.get("exit_signal") is None and exit_record.get("exit_code") == 0:
        return HealthReport(Health.FINISHED, f"finished with exit code 0 at {exit_record.get('ended_at')}",
                            run_id, exit=exit_fields)
    return HealthReport(Health.CRASHED, f"ended with {describe_exit(exit_record)}{_shell_signal_note(exit_record)} "
                        f"at {exit_record.get('ended_at')}", run_id, exit=exit_fields)


def after_failed_start(failure: dict[str, Any]) -> str:
    """What a verdict's reason adds when the last start failed before the job ran (see records.start_failure).

    The error names the program and the paths of the task; it is escaped all the same (see
    _base/terminal.py), as anything shown to an operator's terminal.
    """
    return (f"; the start of run {escape_controls(str(failure.get('run_id')))} failed before the job ran "
            f"(the relaunch's own failure, not the job's): {escape_controls(str(failure.get('error')))}")


def judge(run: dict | None, exit_record: dict | None, stop_record: dict | None, alive: bool,
          progress: Progress | None, stall_after: float | None, now: float, held: str | None = None) -> HealthReport:
    """The verdict from what the records and the process table say (pure: no I/O, `now` given).

    `exit_record` and `stop_record` count only for the run in `run`; `alive` is whether its main
    process, proven a member of the run (its mark, or descent from its supervisor), runs; `progress` is None when no progress_regex was given.
    `held`: what holds the live main process still (:func:`stopped_state`), named first in the reason.
    """
    report = _judge_alive(run, exit_record, stop_record, alive, progress, stall_after, now)
    if held is not None and report.state in (Health.RUNNING, Health.STALLED):
        report.reason = f"alive, but {held}: {report.reason}"
    return report


def _judge_alive(run: dict | None, exit_record: dict | None, stop_record: dict | None, alive: bool,
                 progress: Progress | None, stall_after: float | None, now: float) -> HealthReport:
    if run is None:
        return HealthReport(Health.MISSING, "no record of a run of this job")
    run_id = str(run.get("run_id"))
    if exit_record is not None and exit_record.get("run_id") == run_id:
        return _ended(run_id, exit_record, stop_record)
    if not alive:
        return HealthReport(Health.MISSING, f"the recorded process (pid {run.get('pid')}) is gone without an "
                            "exit record (a reboot of the container or machine, or a kill of its supervisor)",
                            run_id)
    if progress is None:
        return HealthReport(Health.RUNNING, "running (no progress_regex: progress is not measured)", run_id)
    if progress.seen_at is None:
        return HealthReport(Health.RUNNING, f"running; progress cannot be measured: {progress.why_unknown}",
                            run_id, progress)
    since = max(now - progress.seen_at, 0.0)
    step = f"step {progress.step}" if progress.step is not None else "no progress line yet"
    if stall_after is not None and since >= stall_after:
        return HealthReport(Health.STALLED, f"alive, but no progress for {since:.1f}s (stall_after {stall_after:g}s); "
                            f"last: {step}", run_id, progress, since)
    return HealthReport(Health.RUNNING, f"running; last: {step}, {since:.1f}s ago", run_id, progress, since)
