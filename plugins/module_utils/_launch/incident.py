# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Evidence before anything is signalled: the incident record of a stalled or crashed run.

A hang is gone once the job is killed, and with it the only chance to see where it hung. So the
first changing task that finds a run stalled or crashed writes, before it signals anything,
``STATE_DIR/NAME/incidents/incident-<UTC time>-<run id>.json`` (0600, in a 0700 directory,
written atomically): the health verdict, the last log lines, every thread of every proven member
of the run with its state and wchan (``/proc/PID/task/*``; a process held still by SIGSTOP, a
debugger or a cgroup freezer is named so in words, ``frozen``), Python stacks from ``py-spy dump``
where py-spy is installed (optional, bounded in time), and GPU memory per holder where a GPU query
works. One record per run: a later task that finds the same run names the record already there.
The newest ``keep_logs`` records are kept, like logs. The directory is walked from / and used by
its descriptor (``_base/safepath.py``); the log lines, command lines and names quoted in a record
are escaped (``_base/terminal.py``): an operator reads the record in a terminal.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import time
from typing import Any, Callable, Iterable

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import write_json_atomic
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import stopped_state
from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import cap_line, decode_line, escape_controls

INCIDENT_DIR = "incidents"
INCIDENT_DIR_MODE = 0o700
INCIDENT_LOG_LINES = 200
MAX_PROCESSES = 64
MAX_THREADS = 512
PY_SPY = "py-spy"
PY_SPY_TIMEOUT = 10.0
PY_SPY_BUDGET = 30.0
PY_SPY_MAX_PROCESSES = 8
PY_SPY_OUTPUT_LIMIT = 64 * 1024

Runner = Callable[..., subprocess.CompletedProcess]


def incident_dir(job_dir: str) -> str:
    return os.path.join(job_dir, INCIDENT_DIR)


def _names(dir_fd: int) -> list[str]:
    """The incident record names in the directory, oldest first (the time in the name sorts them)."""
    return sorted(name for name in os.listdir(dir_fd) if name.startswith("incident-") and name.endswith(".json"))


def _listing(job_dir: str) -> list[str]:
    """The incident record names, oldest first; [] without a directory reached safely (never a symlink)."""
    try:
        with safepath.walk(incident_dir(job_dir), listable=True) as directory:
            return _names(directory.fd)
    except OSError:
        return []


def existing_incident(job_dir: str, run_id: str) -> str | None:
    """The record already written for `run_id`, if any."""
    for name in _listing(job_dir):
        if name.endswith(f"-{run_id}.json"):
            return os.path.join(incident_dir(job_dir), name)
    return None


def ensure_incident_dir(job_dir: str) -> str:
    """The incidents directory, created 0700; one that cannot be reached safely (a symlink) is refused (OSError)."""
    directory = incident_dir(job_dir)
    with safepath.walk(directory, create_mode=INCIDENT_DIR_MODE, listable=True) as walked:
        os.fchmod(walked.fd, INCIDENT_DIR_MODE)
    return directory


def incident_name(run_id: str, now: float) -> str:
    moment = datetime.datetime.fromtimestamp(now, datetime.timezone.utc)
    return f"incident-{moment.strftime('%Y%m%dT%H%M%S.%fZ')}-{run_id}.json"


def write_incident(job_dir: str, run_id: str, record: dict[str, Any], now: float, keep: int) -> tuple[str, list[str]]:
    """Write the record atomically; return its path and the older records removed to keep `keep`."""
    directory = ensure_incident_dir(job_dir)
    name = incident_name(run_id, now)
    write_json_atomic(os.path.join(directory, name), record)
    removed = []
    with safepath.walk(directory, listable=True) as walked:
        names = _names(walked.fd)
        for old in names[:max(len(names) - keep, 0)]:
            try:
                os.unlink(old, dir_fd=walked.fd)
                removed.append(os.path.join(directory, old))
            except FileNotFoundError:
                pass
    return os.path.join(directory, name), removed


def thread_evidence(table: ProcessTable, pids: Iterable[int]) -> list[dict[str, Any]]:
    """Each process with every thread's state and wchan (read from /proc/PID/task/*)."""
    described = []
    for pid in sorted(pids)[:MAX_PROCESSES]:
        process = table.processes.get(pid)
        if process is None:
            continue
        threads = table.load_threads(pid)
        # A process names itself: its comm and command line are the job's to choose, escapes included,
        # and a command line can be megabytes (cut as a log line is, see cap_line).
        described.append({
            "pid": pid, "ppid": process.ppid, "state": process.state, "comm": escape_controls(process.comm),
            "cmdline": escape_controls(cap_line(process.cmdline)), "starttime": process.starttime,
            "threads": [_escaped(thread.as_dict()) for thread in threads[:MAX_THREADS]],
            "threads_truncated": len(threads) > MAX_THREADS,
        })
        # Held still (SIGSTOP, a debugger, a cgroup freezer): said in words, not left to a state letter.
        main = next((thread for thread in threads if thread.tid == pid), None)
        held = stopped_state(process.state, main.wchan if main is not None else "")
        if held is not None:
            described[-1]["frozen"] = held
    return described


def _escaped(fields: dict[str, Any]) -> dict[str, Any]:
    """A thread's fields with every text escaped (a thread names itself too)."""
    return {key: escape_controls(value) if isinstance(value, str) else value for key, value in fields.items()}


def py_spy_dumps(pids: Iterable[int], which: Callable[[str], str | None] = shutil.which,
                 run: Runner = subprocess.run, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """``py-spy dump --pid`` of each process, where py-spy is installed; never fails the task.

    Each dump is bounded by its own timeout and all of them by one budget: a process stuck in the
    kernel can make py-spy hang, and the evidence must not cost the relaunch.
    """
    executable = which(PY_SPY)
    if executable is None:
        return {"available": False, "reason": "py-spy is not installed on the target (optional)"}
    dumps = []
    started = clock()
    for pid in sorted(pids)[:PY_SPY_MAX_PROCESSES]:
        left = PY_SPY_BUDGET - (clock() - started)
        if left <= 0:
            dumps.append({"pid": pid, "error": f"skipped: the py-spy budget of {PY_SPY_BUDGET:g}s is spent"})
            continue
        try:
            done = run([executable, "dump", "--pid", str(pid)], capture_output=True,
                       timeout=min(PY_SPY_TIMEOUT, left), check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            dumps.append({"pid": pid, "error": f"py-spy did not answer within {min(PY_SPY_TIMEOUT, left):g}s"})
            continue
        except OSError as exc:
            dumps.append({"pid": pid, "error": f"cannot run py-spy: {exc}"})
            continue
        # Frames name the job's own files and functions: escaped like its log lines.
        output = "\n".join(decode_line(cap_line(line))
                           for line in (done.stdout or b"")[:PY_SPY_OUTPUT_LIMIT].split(b"\n"))
        entry: dict[str, Any] = {"pid": pid, "rc": done.returncode, "stacks": output}
        if done.returncode != 0:
            entry["error"] = decode_line(cap_line((done.stderr or b"").strip()))
        dumps.append(entry)
    return {"available": True, "executable": executable, "dumps": dumps}
