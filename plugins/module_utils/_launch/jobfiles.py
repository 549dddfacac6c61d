# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A job's files, as the module and the supervisor program both read and write them.

Standard library only (and ``_base/safepath.py``): the supervisor runs from a private copy in the
job's state directory, with this file and safepath.py copied next to it (``install_supervisor``), so
nothing here may import from the collection except safepath, which it finds beside it there. The
module imports it from the collection like any module_utils (AnsiballZ ships it with the module, as
it ships supervisor.py). One implementation, so both sides agree on the records' names, format and
how they are opened: never through a symlink, never a FIFO, replaced atomically.
"""

from __future__ import annotations

import datetime
import json
import os

if not __package__:
    # The private copy, imported by the supervisor program: the copy of safepath.py lies next to it,
    # in the job's directory that only root may write (the program put that directory on sys.path).
    import safepath  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath

LAUNCH_FILE = "launch.json"
RUN_FILE = "run.json"
EXIT_FILE = "exit.json"
SUPERVISOR_FILE = "supervisor.py"
SAFEPATH_FILE = "safepath.py"
JOBFILES_FILE = "jobfiles.py"
IDLE_FILE = "idle.json"
FAILED_START_FILE = "failed_start.json"
# Relaunches after a failure over the job's whole life (relaunches.json keeps only the guard's window)
# and the last failure's exit and cause: the live file's counter reads it (see guard.lifetime_record).
LIFETIME_FILE = "lifetime.json"
STATE_FILE_MODE = 0o600
RUN_MARK = "GPUOPS_RELAUNCH_RUN"
SUPERVISOR_MARK = "GPUOPS_RELAUNCH_SUPERVISOR"
RECORD_READ_LIMIT = 1024 * 1024
# The job's umask unless train_launch's umask option says otherwise: systemd's default for a service,
# so the job's checkpoints and outputs are readable by the group and others as a login shell's would be
# (the supervisor itself runs with 0077: its records are root's).
JOB_UMASK = 0o022


def job_umask(launch: dict) -> int:
    """The umask a run of `launch` (launch.json) starts with; JOB_UMASK for a launch written before the option."""
    value = launch.get("umask")
    return value if isinstance(value, int) and 0 <= value <= 0o777 else JOB_UMASK


def run_mark(job_dir: str, run_id: str) -> str:
    """The value of RUN_MARK that the processes of one run carry."""
    return "%s:%s" % (job_dir, run_id)


# One implementation for the module and the supervisor program alike (see _base/safepath.py).
NotRegularFile = safepath.NotRegularFile
open_regular = safepath.open_regular


def utc_now() -> str:
    """Now, as an ISO 8601 UTC timestamp with microseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def write_json_atomic(path: str, data: dict) -> None:
    """Write `data` as JSON to `path` so a reader sees the old file or the new one, never a part."""
    safepath.write_atomic(path, json.dumps(data, sort_keys=True).encode("utf-8"), STATE_FILE_MODE)


def _refuse_constant(name: str) -> None:
    # Python's json reads NaN and Infinity, which no record of ours holds: every comparison with NaN
    # is false and an infinite time never passes (a guard that never reopens, a stall never seen).
    raise ValueError("holds %s, which is not a number a record can hold" % name)


def load_json(path: str) -> dict | None:
    """The JSON object in `path`; None if there is no such file; ValueError if it is anything else
    (not a regular file, a symlink, too large, not JSON, not an object)."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError("cannot be read safely: %s" % (exc.strerror or exc)) from None
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(RECORD_READ_LIMIT + 1)
    if len(raw) > RECORD_READ_LIMIT:
        raise ValueError("is larger than %d bytes" % RECORD_READ_LIMIT)
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except ValueError as exc:
        raise ValueError("is not valid JSON (%s)" % exc) from None
    if not isinstance(data, dict):
        raise ValueError("does not hold a JSON object")
    return data


def read_json(path: str) -> dict | None:
    """The JSON object in `path`, or None if it is missing or not a sound record."""
    try:
        return load_json(path)
    except ValueError:
        return None


# Its own copy of the (pid, starttime) identity check of _base/signal_gate: the supervisor must stay
# standard-library only and run alone.
def process_stat(pid: int, proc_root: str = "/proc") -> tuple[int, int, int] | None:
    """(ppid, pgid, starttime) from /proc/PID/stat, parsed after the last ')' (comm may hold any byte)."""
    try:
        fd = os.open("%s/%d/stat" % (proc_root, pid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        fields = raw[raw.rindex(b")") + 2:].split()
        return int(fields[1]), int(fields[2]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def process_starttime(pid: int, proc_root: str = "/proc") -> int | None:
    """Field 22 of /proc/PID/stat."""
    fields = process_stat(pid, proc_root)
    return fields[2] if fields is not None else None
