# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Two jobs never share a log: a start refuses the live log of another job, and a log among records.

A second job started on the first one's log rotates that log away while it runs: the first job then
writes into ``LOG.1``, its stall detection reads the second one's progress, and its next start moves
the second job's log in turn. So, before anything is stopped or rotated, a start looks at the other
jobs of its state_dir (``state_dir/NAME`` each):

* those proven live - their records sound and their main process alive by the same proof as the stop
  path's (its run's mark, descent from its supervisor, its unit) - with the log their run.json names;
  a record of a run that ended, or one naming a process that is not the run's, blocks nothing;
* those another task works on right now (their lock held), with the log their launch.json names: a
  start of theirs may be under way.

A log is the other's when it is the same file (device and inode, whatever the spelling: ``//``,
``/./``, a root's symlinked directory, a hard link), or when it shares a rotation with it: the same
directory (device and inode) and a name of the other's rotation (``LOG.1``, ``LOG.2`` ..., ``LOG.failed``)
or the other way round - each job's rotation would move the other's live log.

A log among a job's records (in ``state_dir/NAME``, this job's too) is refused as well: its rotation
would rename the records. So is a ``state_dir/NAME`` that a link (root's: walks follow no other) makes
the same directory as another job's: one job's records would be the other's.

Only jobs under the same state_dir are seen: a job kept under another state_dir is not.

Two starts at the same instant must not both pass: a start that is about to stop, rotate or create
anything checks and claims its log in one step (:func:`claim_log`), under an exclusive lock on the
state_dir's descriptor, and its claim (``claim.json`` in its job directory, naming the log) counts while
its task holds the job's lock: the other start, checking after it, sees the claim and is refused.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass
from typing import Tuple

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import LAUNCH_FILE, write_json_atomic
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import NAME_PATTERN, LaunchOptions

# A start's claim on its log (see claim_log), in its job directory: it counts while the job's lock is held.
CLAIM_FILE = "claim.json"
# At most this many entries of state_dir are looked at (a bound on the work of one start).
MAX_JOBS = 4096
# What the rotation appends to a log's name (logs.rotated_name, logs.failed_log_name).
_ROTATION_SUFFIX = re.compile(r"\.(?:[0-9]+|failed)")

# (device, inode): what a file is, whatever the path that spells it.
Identity = Tuple[int, int]


@dataclass(frozen=True)
class LogSpot:
    """Where a log lies: its directory as walked (device, inode), its name, and the file there, if any."""

    directory: Identity
    name: str
    file: Identity | None


def _identity(info: os.stat_result) -> Identity:
    return (info.st_dev, info.st_ino)


def locate(path: str) -> LogSpot | None:
    """Where `path` lies, its directory walked as the start walks it; None if it cannot be reached."""
    try:
        directory, name = safepath.split(path)
        with safepath.walk(directory) as parent:
            info = safepath.lstat_at(parent.fd, name)
            return LogSpot(_identity(os.fstat(parent.fd)), name, _identity(info) if info is not None else None)
    except OSError:
        return None


def _in_rotation_of(name: str, log_name: str) -> bool:
    """Whether `name` is `log_name` or one of the names its rotation gives (LOG.N, LOG.failed)."""
    return name == log_name or (name.startswith(log_name)
                                and _ROTATION_SUFFIX.fullmatch(name[len(log_name):]) is not None)


def shares(ours: LogSpot, theirs: LogSpot) -> bool:
    """Whether two logs are one file, or one's rotation would move the other."""
    if ours.file is not None and ours.file == theirs.file:
        return True
    return ours.directory == theirs.directory and (
        _in_rotation_of(ours.name, theirs.name) or _in_rotation_of(theirs.name, ours.name))


def _job_names(state_dir: str) -> list[str]:
    """The job directories' names in state_dir (as many as MAX_JOBS); none if it cannot be listed."""
    try:
        with safepath.walk(state_dir, listable=True) as found:
            names = os.listdir(found.fd)
    except OSError:
        return []
    return sorted(name for name in names if NAME_PATTERN.match(name))[:MAX_JOBS]


def _worked_on(job_dir: str) -> bool:
    """Whether another train_launch task holds the job's lock now (a shared lock is refused at once)."""
    try:
        fd = safepath.open_regular(os.path.join(job_dir, ".lock"), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _claims(records: JobRecords) -> list[tuple[str, str]]:
    """The logs another job holds now: (log_path, what it does with it)."""
    claims: list[tuple[str, str]] = []
    status = records.status()
    if status.running and status.run is not None and isinstance(status.run.get("log_path"), str):
        claims.append((status.run["log_path"], f"runs (pid {status.run.get('pid')})"))
    if _worked_on(records.job_dir):
        # What it started, and what it is starting now (its claim: a start under way has no launch.json yet).
        for name in (LAUNCH_FILE, CLAIM_FILE):
            record = records.read(name)
            if record is not None and isinstance(record.get("log_path"), str):
                claims.append((record["log_path"], "is being worked on by another task now (its lock is held)"))
    return claims


def _directory_identity(path: str) -> Identity | None:
    try:
        with safepath.walk(path) as found:
            return _identity(os.fstat(found.fd))
    except OSError:
        return None


def sharing_problems(options: LaunchOptions, proc_root: str = "/proc") -> list[BadOption]:
    """Why options.log_path (or options.state_dir) cannot be this job's (see the module doc); empty when they can."""
    log_path = options.log_path
    ours = locate(log_path) if log_path is not None else None
    own_dir = _directory_identity(options.job_dir)
    problems: list[BadOption] = []
    if log_path is not None and ours is None and os.path.dirname(log_path) == os.path.normpath(options.job_dir):
        problems.append(BadOption("log_path", f"{log_path!r} lies in the state directory of job {options.name!r} "
                                  f"({options.job_dir!r}), among its records (the log's rotation renames files in "
                                  "its directory); put the log elsewhere"))
    for name in _job_names(options.state_dir):
        job_dir = os.path.join(options.state_dir, name)
        identity = _directory_identity(job_dir)
        if name != options.name and identity is not None and identity == own_dir:
            # A link (root's) that makes two names one directory: one job's records would be the other's.
            problems.append(BadOption("state_dir", f"{options.job_dir!r} is the same directory as {job_dir!r}, "
                                      f"the state directory of job {name!r}: each job needs its own"))
            continue
        if ours is None:
            continue  # no log directory yet: no file of another job is there
        if identity == ours.directory:
            problems.append(BadOption("log_path", f"{log_path!r} lies in the state directory of job {name!r} "
                                      f"({job_dir!r}), among its records (the log's rotation renames files in its "
                                      "directory); put the log elsewhere"))
            continue
        if name == options.name:
            continue
        for theirs_path, how in _claims(JobRecords(job_dir, proc_root)):
            theirs = locate(theirs_path)
            if theirs is None or not shares(ours, theirs):
                continue
            same = ours.file is not None and ours.file == theirs.file or ours.name == theirs.name
            what = "is the log" if same else "is in the log rotation (LOG.N, LOG.failed)"
            problems.append(BadOption("log_path", (
                f"{log_path!r} {what} of job {name!r}, which {how}; its log is {theirs_path!r} (its records are "
                f"in {job_dir!r}). Two jobs cannot share a log: the start would rotate the other job's live log "
                "away and each would read the other's progress. Give each job a log_path of its own "
                "(nothing was stopped or rotated)")))
            break
    return problems


def check_not_shared(options: LaunchOptions, proc_root: str = "/proc") -> None:
    """OptionsInvalid naming log_path (or state_dir) when it is another job's (see sharing_problems)."""
    problems = sharing_problems(options, proc_root)
    if problems:
        raise OptionsInvalid(problems)


def claim_log(options: LaunchOptions, proc_root: str = "/proc") -> None:
    """check_not_shared and the claim of options.log_path as one step: under an exclusive lock on the
    state_dir's descriptor (held for the check and one small write), so that of two starts on one log at
    the same instant the second sees the first's claim. The caller holds the job's lock (the claim counts
    only while it does). OptionsInvalid as check_not_shared, and nothing claimed."""
    # Opened for reading (listable): flock takes no O_PATH descriptor.
    with safepath.walk(options.state_dir, listable=True) as state_dir:
        fcntl.flock(state_dir.fd, fcntl.LOCK_EX)
        check_not_shared(options, proc_root)
        write_json_atomic(os.path.join(options.job_dir, CLAIM_FILE), {"log_path": options.log_path})
