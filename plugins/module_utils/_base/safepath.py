# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Paths walked, not trusted: every file a task or the supervisor opens as root is reached this way.

``O_NOFOLLOW`` guards only the last component of a path. A parent that is a symlink planted by the
job's user (``/workspace/logs -> /root``) leads root anywhere: root's file renamed by the log
rotation, the job's output appended to it, its lines read back into a task result. So a path is
walked one component at a time from ``/``, each opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to
the one above, and what is done there is done relative to the directory's descriptor (``dir_fd``):
open with ``O_NOFOLLOW | O_NONBLOCK``, rename, unlink, list. Replacing a directory on the path after
the walk changes nothing for a descriptor that is already open.

A symlink on the way is followed only where nobody but root can change it: the link is root's and
sits in a directory that only root may write (or a sticky one, like ``/tmp``, where only the owner
of an entry may replace it). Such links are part of the system (``/var/run -> /run``, a workspace
linked by the administrator); any other is refused, and the error names it.

Standard library only: the supervisor's private copy (see ``_launch/supervisor.py``) runs with a
copy of this file next to it.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

# O_PATH: a directory on the way needs only search permission, not read permission.
_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# As many symlinks as the kernel follows in one path lookup (ELOOP after that).
MAX_LINKS = 40
_TMP_ATTEMPTS = 100


class UnsafePath(OSError):
    """A path that cannot be walked without trusting what another user can change; names the component.

    Raised as UnsafePath(errno, reason); str() is the reason alone.
    """

    def __str__(self) -> str:
        return str(self.strerror)


class NotRegularFile(OSError):
    """A path where a regular file should be holds something else (a FIFO, a device, a directory,
    a file with other hard links)."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.EINVAL, reason)

    def __str__(self) -> str:
        return str(self.strerror)


def components(path: str) -> list[str]:
    """The names on an absolute path, normalised ('.' and '..' resolved by name, as the user wrote it)."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise UnsafePath(errno.EINVAL, "%r is not an absolute path" % (path,))
    return [name for name in os.path.normpath(path).split("/") if name]


def _shown(names: list[str]) -> str:
    return "/" + "/".join(names)


def _root_only(link: os.stat_result, parent: os.stat_result) -> bool:
    """Whether only root can change the link `link` in the directory `parent`."""
    if link.st_uid != 0 or parent.st_uid != 0:
        return False
    # Group or other write lets others rename entries, unless the sticky bit restricts that to each
    # entry's owner (root, here).
    return not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or bool(parent.st_mode & stat.S_ISVTX)


class Walk:
    """The walk of one path: the descriptor of the deepest directory reached, and what was missing."""

    def __init__(self, fd: int, reached: str, missing: list[str]) -> None:
        self.fd = fd
        self.reached = reached
        self.missing = missing

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Walk:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def walk(path: str, create_mode: int | None = None, stop_at_missing: bool = False, listable: bool = False) -> Walk:
    """Walk the directory `path` from / without following a symlink anyone but root can change.

    `create_mode`: create missing directories with this mode (exactly, whatever the umask).
    `stop_at_missing`: return the deepest existing directory and the names still missing, instead
    of FileNotFoundError. `listable`: the final descriptor can be listed (os.listdir(fd)); otherwise
    it is an O_PATH descriptor, good for every *at call but not for reading.

    OSError otherwise; UnsafePath names the component that is a symlink refused or not a directory.
    """
    pending = components(path)
    fd = os.open("/", _O_PATH | _DIR_FLAGS)
    names: list[str] = []
    links = 0
    try:
        while pending:
            name = pending.pop(0)
            if name == "..":
                # Only from a link's target: the parent of the directory the walk is in.
                nxt = os.open("..", _O_PATH | _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
                names = names[:-1]
                continue
            last = not pending
            flags = (os.O_RDONLY if listable and last else _O_PATH) | _DIR_FLAGS
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                if stop_at_missing:
                    return Walk(fd, _shown(names), [name, *pending])
                if create_mode is None:
                    raise FileNotFoundError(errno.ENOENT, "%s does not exist" % _shown(names + [name])) from None
                nxt = _make_directory(fd, name, create_mode, _shown(names + [name]))
            except NotADirectoryError:
                # A symlink (O_NOFOLLOW with O_DIRECTORY says ENOTDIR for it) or something else.
                target = _trusted_link(fd, name, names)
                links += 1
                if links > MAX_LINKS:
                    raise UnsafePath(errno.ELOOP, "%s: more than %d symbolic links" % (path, MAX_LINKS)) from None
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _O_PATH | _DIR_FLAGS)
                    names = []
                pending = [part for part in target.split("/") if part and part != "."] + pending
                continue
            os.close(fd)
            fd = nxt
            names.append(name)
        return Walk(fd, _shown(names), [])
    except BaseException:
        os.close(fd)
        raise


def _make_directory(parent_fd: int, name: str, mode: int, shown: str) -> int:
    """mkdir `name` below `parent_fd` with exactly `mode`; a listable descriptor of it (never a link)."""
    try:
        os.mkdir(name, mode, dir_fd=parent_fd)
    except FileExistsError:
        pass  # created meanwhile by someone else: opened (or refused) like any existing one
    try:
        fd = os.open(name, os.O_RDONLY | _DIR_FLAGS, dir_fd=parent_fd)
    except NotADirectoryError:
        raise UnsafePath(errno.ENOTDIR, "%s is not a directory (a symlink is refused)" % shown) from None
    try:
        os.fchmod(fd, mode)  # the umask took bits away
    except OSError:
        os.close(fd)
        raise
    return fd


def _trusted_link(parent_fd: int, name: str, names: list[str]) -> str:
    """The target of the symlink `name` if only root can change it; UnsafePath otherwise."""
    shown = _shown(names + [name])
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError as exc:
        raise UnsafePath(errno.ENOTDIR, "%s cannot be looked at (%s)" % (shown, exc.strerror)) from None
    if not stat.S_ISLNK(info.st_mode):
        raise UnsafePath(errno.ENOTDIR, "%s is not a directory" % shown)
    if not _root_only(info, os.fstat(parent_fd)):
        raise UnsafePath(errno.ELOOP, "%s is a symbolic link that a user other than root can change "
                         "(owned by uid %d, or in a directory others may write); refusing to follow it"
                         % (shown, info.st_uid))
    return os.readlink(name, dir_fd=parent_fd)


def why_not_writable(dir_fd: int) -> str | None:
    """None if this process may create entries in the directory; else why not, to follow its name."""
    effective = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    if os.access(".", os.W_OK | os.X_OK, dir_fd=dir_fd, **effective):
        return None
    try:
        if os.statvfs(dir_fd).f_flag & os.ST_RDONLY:
            return "is on a read-only file system"
    except OSError:
        pass
    return "is not writable for uid %d" % os.geteuid()


def split(path: str) -> tuple[str, str]:
    """(directory, name) of an absolute path to a file; UnsafePath if it names no file (/ itself)."""
    names = components(path)
    if not names:
        raise UnsafePath(errno.EISDIR, "%s is not a file" % path)
    return _shown(names[:-1]), names[-1]


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """What `name` is in the directory, without following it; None if there is nothing."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_regular_at(dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """Open `name` in the directory only if it is a regular file with no other hard link, never a symlink.

    O_NONBLOCK keeps a FIFO planted there from blocking the open; fstat then proves what was
    opened, so a check and a use can never be about two different files. A second hard link could
    be another user's file linked in here (root would write to it, or read it back into a result).
    The descriptor returned is blocking again.
    """
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile("%s is not a regular file" % name)
        if info.st_nlink > 1:
            raise NotRegularFile("%s has other hard links" % name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """open_regular_at for a path, its directory walked from / (see walk)."""
    directory, name = split(path)
    with walk(directory) as parent:
        try:
            return open_regular_at(parent.fd, name, flags, mode)
        except NotRegularFile:
            raise NotRegularFile("%s is not a regular file or has other hard links" % path) from None


def lexists(path: str) -> bool:
    """Whether anything (a link too) is at `path`, its directory reached as walk does; False if it cannot be."""
    try:
        directory, name = split(path)
        with walk(directory) as parent:
            return lstat_at(parent.fd, name) is not None
    except OSError:
        return False


def regular_file_exists(path: str) -> bool:
    """Whether `path` is a regular file, reached without following a symlink anyone but root can change."""
    try:
        directory, name = split(path)
        with walk(directory) as parent:
            info = lstat_at(parent.fd, name)
    except OSError:
        return False
    return info is not None and stat.S_ISREG(info.st_mode)


def write_atomic_at(dir_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Replace `name` in the directory with `data`, so a reader sees the old file or the new one."""
    for _attempt in range(_TMP_ATTEMPTS):
        tmp = ".%s.%s" % (name, secrets.token_hex(6))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name for %s" % name)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """write_atomic_at for a path, its directory walked from /."""
    directory, name = split(path)
    with walk(directory) as parent:
        write_atomic_at(parent.fd, name, data, mode)


def remove_at(dir_fd: int, name: str) -> bool:
    """Remove `name` (a file, a link, or a directory tree) below the directory; False if it was not there.

    A tree is walked by descriptors, each directory opened with O_NOFOLLOW: a link inside it is
    removed, never followed, even if it was swapped in while the removal ran.
    """
    info = lstat_at(dir_fd, name)
    if info is None:
        return False
    if not stat.S_ISDIR(info.st_mode):
        _unlink_or_tree(dir_fd, name)
        return True
    # Depth first without recursion: a tree deeper than Python's stack must not stop the removal.
    stack: list[tuple[int, str, int]] = [(dir_fd, name, _open_subdir(dir_fd, name))]
    try:
        while stack:
            parent_fd, entry, fd = stack[-1]
            descended = False
            for child in os.listdir(fd):
                child_info = lstat_at(fd, child)
                if child_info is not None and stat.S_ISDIR(child_info.st_mode):
                    try:
                        stack.append((fd, child, _open_subdir(fd, child)))
                        descended = True
                        break
                    except NotADirectoryError:
                        pass  # swapped for a link or file meanwhile: unlinked below
                _unlink_or_tree(fd, child)
            if descended:
                continue
            stack.pop()
            os.close(fd)
            os.rmdir(entry, dir_fd=parent_fd)
    finally:
        for _parent, _entry, fd in stack:
            os.close(fd)
    return True


def _open_subdir(dir_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | _DIR_FLAGS, dir_fd=dir_fd)


def _unlink_or_tree(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        remove_at(dir_fd, name)  # became a directory meanwhile
