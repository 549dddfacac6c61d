# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Waiting on what PVE does: polls with deadlines, tasks by UPID, and POSTs that start tasks.

A PVE worker task ends with ``status: stopped`` and an ``exitstatus``; only ``OK`` and
``WARNINGS: N`` mean success, anything else is the error message, which is final. So a failed
task fails at once with PVE's words instead of being polled until some timeout.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import (
    AmbiguousPost,
    ProxmoxClient,
    ProxmoxError,
)

T = TypeVar("T")

WARNINGS_EXIT = re.compile(r"WARNINGS: \d+")
# The worker type PVE records for each container power action.
CT_TASK_TYPES = {"start": "vzstart", "stop": "vzstop", "shutdown": "vzshutdown", "reboot": "vzreboot"}
LOG_TAIL_LINES = 10


# PVE tasks take from a fraction of a second to minutes: look quickly at first, then back off so
# a long task does not keep the API busy.
API_POLL_GROWTH = 1.5


def poll(
    probe: Callable[[], T | None],
    deadline: Deadline,
    interval: float = 0.2,
    max_interval: float = 2.0,
) -> T | None:
    """Call probe until it returns something other than None, or the deadline passes (then None).

    The probe always runs at least once, and once more at the deadline, so a condition that became
    true during the last interval is seen.
    """
    return deadline.poll_for(probe, interval, growth=API_POLL_GROWTH, max_interval=max_interval)


@dataclass(frozen=True)
class Upid:
    """The parts of a PVE task id, UPID:node:pid:pstart:starttime:type:id:user: (numbers in hex)."""

    node: str
    pid: int
    pstart: int
    starttime: int
    type: str
    id: str
    user: str

    @classmethod
    def parse(cls, text: str) -> Upid:
        parts = str(text).split(":")
        if len(parts) < 9 or parts[0] != "UPID":
            raise ValueError(f"not a PVE task id (UPID): {text!r}")
        try:
            pid, pstart, starttime = (int(part, 16) for part in parts[2:5])
        except ValueError:
            raise ValueError(f"not a PVE task id (UPID): {text!r}") from None
        # The user may itself hold a colon-free "user@realm!token"; everything up to the last field.
        return cls(parts[1], pid, pstart, starttime, parts[5], parts[6], ":".join(parts[7:-1]))


def task_succeeded(exitstatus: str | None) -> bool:
    """PVE's rule: a finished task succeeded if its exit status is OK or WARNINGS: N."""
    return exitstatus == "OK" or bool(exitstatus and WARNINGS_EXIT.fullmatch(exitstatus))


@dataclass
class TaskOutcome:
    """A finished (or abandoned) task as the module reports it."""

    upid: str
    type: str
    exitstatus: str | None
    elapsed: float
    log_tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return task_succeeded(self.exitstatus)

    def as_dict(self) -> dict[str, Any]:
        return {"upid": self.upid, "type": self.type, "exitstatus": self.exitstatus, "elapsed": round(self.elapsed, 3)}


class TaskFailed(ProxmoxError):
    """A task ended with an exit status other than OK or WARNINGS: N."""

    def __init__(self, outcome: TaskOutcome) -> None:
        self.outcome = outcome
        log = f" (task log: {' | '.join(outcome.log_tail)})" if outcome.log_tail else ""
        super().__init__(f"task {outcome.type} {outcome.upid} failed: {escape_controls(str(outcome.exitstatus))}{log}")


class TaskTimeout(ProxmoxError):
    """A task still ran when the deadline came."""

    def __init__(self, outcome: TaskOutcome) -> None:
        self.outcome = outcome
        super().__init__(f"task {outcome.type} {outcome.upid} still running after {outcome.elapsed:.1f}s")


def _task_path(upid: str) -> str:
    node = Upid.parse(upid).node
    return f"nodes/{node}/tasks/{urllib.parse.quote(upid, safe='')}"


def wait_for_task(client: ProxmoxClient, upid: str, deadline: Deadline, posted_at: float | None = None) -> TaskOutcome:
    """Poll the task until it stops; return its outcome, or raise TaskFailed / TaskTimeout."""
    started = time.monotonic() if posted_at is None else posted_at
    task_type = Upid.parse(upid).type
    path = _task_path(upid)

    def finished() -> dict[str, Any] | None:
        status = client.get(path + "/status")
        return status if status.get("status") == "stopped" else None

    status = poll(finished, deadline, interval=0.1)
    outcome = TaskOutcome(upid, task_type, status.get("exitstatus") if status else None, time.monotonic() - started)
    if status is None:
        raise TaskTimeout(outcome)
    if not outcome.ok:
        outcome.log_tail = task_log_tail(client, upid)
        raise TaskFailed(outcome)
    return outcome


def task_log_tail(client: ProxmoxClient, upid: str, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of the task's log, or nothing when the log cannot be read."""
    try:
        entries = client.get(_task_path(upid) + "/log", start=0, limit=500) or []
    except ProxmoxError:
        return []
    # The log holds what ran in the container (a hook script, a stop that timed out): escaped
    # before it reaches a message.
    return [escape_controls(str(entry.get("t", ""))) for entry in entries[-lines:]]


def _our_tasks(client: ProxmoxClient, node: str, vmid: int, task_type: str) -> set[str]:
    """UPIDs of this guest's tasks of this type started by us (running ones included)."""
    listing = client.get(f"nodes/{node}/tasks", vmid=vmid, typefilter=task_type, source="all", limit=100) or []
    who = client.connection.identity
    return {
        task["upid"]
        for task in listing
        if task.get("type") == task_type and str(task.get("id")) == str(vmid) and task.get("user") == who
    }


def start_ct_task(client: ProxmoxClient, node: str, vmid: int, action: str, settle: float, **data: Any) -> str:
    """POST a container power action and return the UPID of the task it started.

    When the answer to the POST is lost, the task list says whether the server acted on it: a task
    of ours that was not there before is the one we asked for. Only when none appears within
    `settle` seconds is the POST sent again, so an action is never carried out twice.
    """
    task_type = CT_TASK_TYPES[action]
    path = f"nodes/{node}/lxc/{vmid}/status/{action}"
    before = _our_tasks(client, node, vmid, task_type)
    last: AmbiguousPost | None = None
    for _attempt in range(max(client.retry.attempts, 1)):
        try:
            return str(client.post(path, **data))
        except AmbiguousPost as exc:
            last = exc

            def new_task() -> str | None:
                fresh = _our_tasks(client, node, vmid, task_type) - before
                return sorted(fresh, key=lambda upid: Upid.parse(upid).starttime)[-1] if fresh else None

            found = poll(new_task, Deadline(settle), interval=0.25)
            if found:
                return found
    raise last or ProxmoxError(f"POST {path}: not sent")
