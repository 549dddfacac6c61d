# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The job log: never overwritten (numbered rotation), and its last lines for the result.

The log of a start that was never proven is set aside as ``LOG.failed`` (one kept) instead of
entering the rotation, so a series of failed starts cannot push out the last good run's log.
"""

from __future__ import annotations

import os

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import open_regular

TAIL_READ_LIMIT = 64 * 1024


def rotated_name(log_path: str, number: int) -> str:
    return f"{log_path}.{number}"


def failed_log_name(log_path: str) -> str:
    return f"{log_path}.failed"


def rotation_plan(log_path: str, keep: int, exists=os.path.lexists) -> list[tuple[str, str | None]]:
    """The renames (source, target) that rotate `log_path`; target None means delete.

    ``train.log`` becomes ``train.log.1``, ``.1`` becomes ``.2`` and so on; what would become
    ``.{keep+1}`` is deleted, so ``keep`` earlier logs survive. Oldest first, so no rename
    overwrites a file that has not been moved yet.
    """
    if not exists(log_path):
        return []
    plan: list[tuple[str, str | None]] = []
    highest = 1
    while exists(rotated_name(log_path, highest)):
        highest += 1
    # `highest` is the first free number: everything below it shifts up by one.
    for number in range(highest - 1, 0, -1):
        target = rotated_name(log_path, number + 1) if number + 1 <= keep else None
        plan.append((rotated_name(log_path, number), target))
    plan.append((log_path, rotated_name(log_path, 1)))
    return plan


def rotate(log_path: str, keep: int) -> str | None:
    """Rotate an existing log; return the name the previous log now has (or None if none)."""
    plan = rotation_plan(log_path, keep)
    for source, target in plan:
        if target is None:
            os.unlink(source)
        else:
            os.rename(source, target)
    return rotated_name(log_path, 1) if plan else None


def tail(log_path: str | None, lines: int) -> list[str]:
    """The last `lines` lines of the log (at most the last 64 KiB), decoded leniently.

    Only a regular file, never through a symlink: a link planted at log_path must not turn the
    task result into a reader of another file.
    """
    if not log_path or lines <= 0:
        return []
    try:
        with os.fdopen(open_regular(log_path, os.O_RDONLY), "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - TAIL_READ_LIMIT))
            data = handle.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace")
    if size > TAIL_READ_LIMIT:
        text = text.split("\n", 1)[-1]  # drop the partial first line
    return text.splitlines()[-lines:]
