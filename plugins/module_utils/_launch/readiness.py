# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Proof of start: the job lives past min_uptime, its log exists, and the ready line appears.

Everything here polls the real condition against a deadline; nothing sleeps a fixed guess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Pattern, Protocol

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import LINE_LIMIT, cap_line, escape_controls
# describe_exit is the health judgement's (health.py, which the node's private copy imports too).
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import describe_exit

# How much of the log one read takes: the log is read by chunks of this, never whole.
READ_CHUNK = 64 * 1024


class LogScanner:
    """Reads a growing log from the start and finds the first line matching a pattern.

    The pattern sees the line as the job wrote it (its first LINE_LIMIT bytes); `matched_line` is the
    line cut (see cap_line) and escaped for showing (see _base/terminal.py), as it goes into the result.
    The log is read by bounded chunks and of each line only its head is kept: a job that prints a line
    of gigabytes costs this wait time, never memory.
    """

    def __init__(self, path: str, pattern: Pattern[str] | None) -> None:
        self.path = path
        self.pattern = pattern
        self.offset = 0
        self.partial = b""  # the first bytes (at most LINE_LIMIT) of the unfinished last line
        self.partial_length = 0  # its whole length so far
        self.matched_line: str | None = None

    def exists(self) -> bool:
        return safepath.regular_file_exists(self.path)

    def scan(self) -> str | None:
        """Read what was appended since the last call; return the first matching line, if any."""
        if self.matched_line is not None or self.pattern is None:
            return self.matched_line
        try:
            # A regular file only: a FIFO here must not block the wait, a symlink not be followed.
            with os.fdopen(safepath.open_regular(self.path, os.O_RDONLY), "rb") as handle:
                handle.seek(self.offset)
                while self.matched_line is None:
                    data = handle.read(READ_CHUNK)
                    if not data:
                        break
                    self.offset += len(data)
                    self._take(data)
        except OSError:
            return None
        return self.matched_line

    def _take(self, data: bytes) -> None:
        """Judge each line that `data` ends; keep the head of the one it leaves unfinished."""
        pieces = data.split(b"\n")
        self._extend(pieces[0])
        for piece in pieces[1:]:
            if self._match_partial(finished=True):
                return
            self.partial, self.partial_length = b"", 0
            self._extend(piece)

    def _extend(self, piece: bytes) -> None:
        if len(self.partial) < LINE_LIMIT:
            self.partial += piece[:LINE_LIMIT - len(self.partial)]
        self.partial_length += len(piece)

    def _match_partial(self, finished: bool) -> bool:
        """Whether the (head of the) line in `partial` matches; if so it becomes `matched_line`."""
        raw = self.partial
        if finished and self.partial_length == len(raw):
            raw = raw.rstrip(b"\r")  # a line ended by \r\n
        if self.pattern is None or not self.pattern.search(raw.decode("utf-8", "surrogateescape")):
            return False
        length = self.partial_length - (len(self.partial) - len(raw))
        self.matched_line = escape_controls(cap_line(raw, length).decode("utf-8", "surrogateescape"))
        return True

    def scan_including_partial(self) -> str | None:
        """At the very end, also try the unfinished last line (a job may not end it with \\n)."""
        found = self.scan()
        if found is None and self.pattern is not None and self.partial_length:
            self._match_partial(finished=False)
        return self.matched_line


class JobProbe(Protocol):
    """What the readiness check needs to know about a started job, whatever the backend."""

    def exit_record(self) -> dict | None:
        """The recorded end of this run (exit_code / exit_signal / error), or None while it runs."""

    def alive(self) -> bool:
        """Whether the job's main process is still running."""


@dataclass
class Readiness:
    """The outcome of waiting for the proof of start."""

    ready: bool
    reason: str
    waited: float
    ready_line: str | None = None
    exit: dict | None = None


def wait_ready(
    probe: JobProbe,
    scanner: LogScanner,
    min_uptime: float,
    deadline: Deadline,
) -> Readiness:
    """Poll until the proof holds, the job ends, or the deadline passes.

    `deadline` started when the job was started, so min_uptime counts from the start of the job.
    """
    while True:
        record = probe.exit_record()
        if record is not None or not probe.alive():
            record = record or _settled_exit(probe, deadline)
            return Readiness(False, _ended_reason(record), deadline.elapsed(), scanner.scan(), record)
        line = scanner.scan()
        up_long_enough = deadline.elapsed() >= min_uptime
        if up_long_enough and scanner.exists() and (scanner.pattern is None or line is not None):
            return Readiness(True, "ready", deadline.elapsed(), line)
        if deadline.expired():
            line = scanner.scan_including_partial()
            if line is not None and up_long_enough and scanner.exists():
                return Readiness(True, "ready", deadline.elapsed(), line)
            return Readiness(False, _timeout_reason(scanner, min_uptime, deadline), deadline.elapsed(), line)
        deadline.pause()


def _settled_exit(probe: JobProbe, deadline: Deadline) -> dict | None:
    # The main process is gone: its exit record follows within moments (the supervisor writes it
    # right after reaping). Wait a little for it, but never past the startup deadline.
    grace = Deadline(min(2.0, max(deadline.remaining(), 0.5)), deadline.clock, deadline.sleep)
    record: dict | None = None

    def recorded() -> bool:
        nonlocal record
        record = probe.exit_record()
        return record is not None

    grace.poll(recorded, 0.05)
    return record


def _ended_reason(record: dict | None) -> str:
    return f"the job ended during startup with {describe_exit(record)}"


def _timeout_reason(scanner: LogScanner, min_uptime: float, deadline: Deadline) -> str:
    waited = f"{deadline.elapsed():.1f}s"
    if not scanner.exists():
        return f"the log {scanner.path} did not appear within {waited}"
    if deadline.elapsed() < min_uptime:
        return f"the job was not up for min_uptime {min_uptime:g}s within {waited}"
    return f"no line matching ready_regex {scanner.pattern.pattern!r} appeared in the log within {waited}"
