# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A directory that only this user (and root) controls, proven by walking its path from ``/``.

Checking the directory itself (``O_NOFOLLOW``, owner, mode) is not enough. ``O_NOFOLLOW`` guards
only the last component: a parent that is a symlink leads anywhere. And whoever may rename entries
in a directory above can move ours aside and put their own in its place, between our check and the
next use of the path (ssh opens its control socket by path, long after the check). So the path is
walked one component at a time from ``/``, each opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to
the one above, and every component must be:

- a real directory, not a symlink;
- owned by root or by this user (the effective uid);
- writable by no one else: no group or other write bit (a POSIX ACL that grants another user write
  shows in the group bits, which are its mask), unless the directory has the sticky bit. In a sticky
  directory (``/tmp``) only an entry's owner, the directory's owner and root may rename or remove
  it, and the entry below is itself owned by root or this user, so it cannot be swapped.

The directory itself must be owned by this user, without the mode bits the caller forbids. Missing
components are created ``0700`` and then checked like the others (someone who raced us to create
one owns it, and is refused).

A symlink on the path the user gave is followed only where only root can change it (safepath's
rule: ``/home -> /srv/home`` made by the administrator), and only by ``resolve_dir``, which gives
the path without it. That resolved path is what is checked and what the caller hands on (to ssh, say):
it has no symlink left, and no one but root and this user can change any of its components.
"""

from __future__ import annotations

import errno
import os
import stat

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption

# What the directory itself may not allow others: any access (a control socket directory), or writing.
NO_ACCESS_FOR_OTHERS = 0o077
NO_WRITE_FOR_OTHERS = 0o022
CREATE_MODE = 0o700
_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def resolve_dir(option: str, path: str) -> str:
    """`path` with ``~`` expanded, made absolute, and the symlinks on it that only root can change
    resolved (safepath.walk; its missing tail kept as given): the form that is checked and then used.
    BadOption naming `option` for any other symlink, or a component that is not a directory."""
    absolute = os.path.abspath(os.path.expanduser(path))
    try:
        with safepath.walk(absolute, stop_at_missing=True) as walked:
            return os.path.join(walked.reached, *walked.missing)
    except OSError as exc:
        raise BadOption(option, f"{absolute}: {exc if isinstance(exc, safepath.UnsafePath) else exc.strerror}") from None


def _why_not_a_directory(parent_fd: int, name: str, shown: str) -> str:
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError as exc:
        return f"{shown} cannot be looked at ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return f"{shown} is a symbolic link (every directory on the path must be a real directory)"
    return f"{shown} is not a directory"


def _open_component(option: str, parent_fd: int, name: str, shown: str, create: bool) -> int:
    """An fd on directory `name` in `parent_fd`, created 0700 first when missing and `create`."""
    for _attempt in range(2):
        try:
            return os.open(name, _OPEN_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise BadOption(option, f"{shown} does not exist") from None
            try:
                os.mkdir(name, CREATE_MODE, dir_fd=parent_fd)
            except FileExistsError:
                pass  # created meanwhile by someone else: opened and judged like any other
            except OSError as exc:
                raise BadOption(option, f"cannot create {shown} ({exc.strerror})") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise BadOption(option, _why_not_a_directory(parent_fd, name, shown)) from None
            raise BadOption(option, f"cannot open {shown} ({exc.strerror})") from None
    raise BadOption(option, f"{shown} vanished while it was being created")


def _check_above(option: str, info: os.stat_result, shown: str, uid: int) -> None:
    """A directory above the private one: root's or ours, and no one else may rename in it."""
    if info.st_uid not in (0, uid):
        raise BadOption(
            option,
            f"{shown} (on its path) belongs to uid {info.st_uid}: every directory on the path must belong"
            f" to root or to this user (uid {uid}), or its owner could replace what lies below it",
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise BadOption(
            option,
            f"{shown} (on its path) is writable by other users without the sticky bit (mode"
            f" {stat.S_IMODE(info.st_mode):04o}): they could rename the directory below it and put their own in its place",
        )


def open_private_dir(option: str, path: str, forbidden_mode: int = NO_ACCESS_FOR_OTHERS, create: bool = True) -> int:
    """An fd (O_DIRECTORY, close-on-exec) on `path` (absolute, without symlinks: see resolve_dir),
    walked from ``/`` and checked as the module docstring says; its missing components are created 0700
    when `create`. BadOption naming `option` and the component at fault otherwise. The caller closes the fd."""
    if not os.path.isabs(path):
        raise BadOption(option, f"{path} is not an absolute path")
    uid = os.geteuid()
    names = [name for name in path.split("/") if name and name != "."]
    if ".." in names:
        raise BadOption(option, f"{path} must not contain '..' (give it normalised)")
    fd = os.open("/", _OPEN_FLAGS)
    shown = "/"
    try:
        for name in names:
            _check_above(option, os.fstat(fd), shown, uid)
            shown = os.path.join(shown, name)
            below = _open_component(option, fd, name, shown, create)
            os.close(fd)
            fd = below
        info = os.fstat(fd)
        if info.st_uid != uid or info.st_mode & forbidden_mode:
            raise BadOption(
                option,
                f"{path} must belong to this user (uid {uid}) with mode {0o777 & ~forbidden_mode:04o}"
                f" or stricter (it has uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_private_dir(option: str, path: str, forbidden_mode: int = NO_ACCESS_FOR_OTHERS, create: bool = True) -> None:
    """open_private_dir for a caller that then uses the path (which the checks keep pointing here)."""
    os.close(open_private_dir(option, path, forbidden_mode, create))
