# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The job log: never overwritten (numbered rotation), and its last lines for the result.

The log of a start that was never proven is set aside as ``LOG.failed`` (one kept) instead of
entering the rotation, so a series of failed starts cannot push out the last good run's log.

The log's directory may belong to the job's user, who can swap anything in it at any moment. So it
is walked from / once (``_base/safepath.py``: no symlink another user can change), and the rotation,
the set-aside, the creation and the reading all happen relative to that directory's descriptor:
renames and unlinks never follow a link, the log is opened ``O_NOFOLLOW | O_NONBLOCK`` as a regular
file of one link, and only what was just opened is given to the job's user.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import cap_line, decode_line

TAIL_READ_LIMIT = 64 * 1024
# The mode of a log directory train_launch creates (as ansible.builtin.file in the job_launch role).
LOG_DIR_MODE = 0o755
# A line ends at \n or \r (a progress bar rewrites its line with \r): each state is a line.
_LINE_BREAK = re.compile(rb"\r\n|[\r\n]")


def rotated_name(log_path: str, number: int) -> str:
    return f"{log_path}.{number}"


def failed_log_name(log_path: str) -> str:
    return f"{log_path}.failed"


def _exists_in(dir_fd: int) -> Callable[[str], bool]:
    """lexists for names in one directory (rotation names differ only in their last component)."""
    return lambda path: safepath.lstat_at(dir_fd, os.path.basename(path)) is not None


def rotation_plan(log_path: str, keep: int, exists: Callable[[str], bool] = safepath.lexists) -> list[tuple[str, str | None]]:
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
    """Rotate an existing log; return the name the previous log now has (or None if none).

    Renames and unlinks happen in the walked directory and never follow a link: a symlink the job's
    user put at ``train.log.3`` is moved or removed itself, whatever it points to.
    """
    directory, _name = safepath.split(log_path)
    try:
        parent = safepath.walk(directory)
    except FileNotFoundError:
        return None  # no directory yet, so no earlier log
    with parent:
        plan = rotation_plan(log_path, keep, _exists_in(parent.fd))
        for source, target in plan:
            if target is None:
                os.unlink(os.path.basename(source), dir_fd=parent.fd)
            else:
                os.rename(os.path.basename(source), os.path.basename(target),
                          src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
    return rotated_name(log_path, 1) if plan else None


def set_aside(log_path: str, target: str) -> None:
    """Rename the log to `target` (a name in the same directory), in the walked directory."""
    directory, name = safepath.split(log_path)
    with safepath.walk(directory) as parent:
        os.rename(name, os.path.basename(target), src_dir_fd=parent.fd, dst_dir_fd=parent.fd)


def create_log(log_path: str, mode: int, uid: int = -1, gid: int = -1) -> None:
    """Create (or append to) the log, its directory too if missing, and give it to uid/gid.

    What is chowned is exactly what was just opened: a regular file with no other hard link, reached
    without following a link (see safepath.open_regular_at). OSError says why not.
    """
    directory, name = safepath.split(log_path)
    with safepath.walk(directory, create_mode=LOG_DIR_MODE) as parent:
        fd = safepath.open_regular_at(parent.fd, name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    try:
        if uid != -1 or gid != -1:
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)


def _file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of what is at `path`, its directory walked (no link another user can change followed),
    the name itself not followed; None where nothing is or it cannot be reached."""
    try:
        directory, name = safepath.split(path)
        with safepath.walk(directory) as parent:
            info = safepath.lstat_at(parent.fd, name)
    except OSError:
        return None
    return None if info is None else (info.st_dev, info.st_ino)


def same_log(recorded: object, given: str | None) -> bool:
    """Whether a recorded log path and this task's are one log, as the kernel resolves them, not as spelt:
    the same path once normalised as every walk here reads it (``/a//b``, ``/a/./b``), or, where the file
    exists, the same file (device, inode: a root's symlinked directory, a bind mount)."""
    if not isinstance(recorded, str) or given is None:
        return recorded == given
    try:
        if safepath.split(recorded) == safepath.split(given):
            return True
    except OSError:
        return False
    ours = _file_identity(given)
    return ours is not None and ours == _file_identity(recorded)


def split_lines(text: bytes) -> list[bytes]:
    """The lines of `text`, each ended by \\n, \\r\\n or \\r (the last one perhaps unfinished)."""
    return _LINE_BREAK.split(text)


def tail(log_path: str | None, lines: int) -> list[str]:
    """The last `lines` lines of the log (at most the last 64 KiB), each cut (cap_line), then escaped.

    Only a regular file reached without following a symlink another user can change: a link planted
    at log_path, or at a directory above it, must not turn the task result into a reader of another
    file. Every line is escaped (see _base/terminal.py): it is shown to an operator's terminal.
    """
    if not log_path or lines <= 0:
        return []
    try:
        with os.fdopen(safepath.open_regular(log_path, os.O_RDONLY), "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - TAIL_READ_LIMIT))
            data = handle.read()
    except OSError:
        return []
    pieces = split_lines(data)
    if size > TAIL_READ_LIMIT:
        pieces = pieces[1:]  # drop the partial first line
    if pieces and not pieces[-1]:
        pieces.pop()  # the log ends with a line break
    return [decode_line(cap_line(piece)) for piece in pieces[-lines:]]
