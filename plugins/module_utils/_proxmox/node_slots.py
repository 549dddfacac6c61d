# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""At most N container reboots at once per Proxmox node, across every task on this controller.

A fleet relaunch runs the reboot module for many hosts at once (up to ``forks``), and many of them
may live on one node: rebooting all of a node's training containers at the same moment piles up
their shutdowns, starts and GPU re-initialisation on one machine. Ansible's ``throttle`` counts
across the whole play, not per node, so each reboot takes one of the node's slots first: an
exclusive ``flock`` on one of N slot files named after the node, held while the reboot runs. The
kernel drops a lock with the process that held it, so a module that crashes or is killed never
leaves a slot taken.

A node is named by what it is, not by the address it was reached through: the API of a cluster
answers on every node's address (and on names and ports that lead there), so slots keyed by the API
URL let two reboots of one node through two URLs overlap. The slot files are keyed by the node's
SlotScope (its cluster's name, or for a node in no cluster its certificate's fingerprint) and its
name. Both come from the API, which may lie ("/", "..", empty, a megabyte): they are hashed, and
only a tame rendering of the node's name shows in the file name, so no answer leads out of the
slot directory.

The slot directory is the controller's (the module runs there, delegated to localhost). It is
created 0700 and, like every directory above it, must be a real directory that no other user can
write to or rename in (_base.private_dir): otherwise they could plant a symlink, swap the directory
or hold every slot.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.private_dir import (
    NO_WRITE_FOR_OTHERS,
    open_private_dir,
    resolve_dir,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import ProxmoxError

DEFAULT_SLOT_DIR = "~/.ansible/gpuops_relaunch/node_slots"
MAX_SLOTS = 64
SLOT_POLL_S = 0.2
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class SlotError(ProxmoxError):
    """No slot could be taken; nothing was changed."""


class NoFreeSlot(SlotError):
    """Every slot of the node stayed taken until the deadline."""


def check_slots(option: str, value: int) -> int:
    """0 (no throttle) up to MAX_SLOTS; BadOption otherwise."""
    if not 0 <= value <= MAX_SLOTS:
        raise BadOption(option, f"must be between 0 (no limit) and {MAX_SLOTS}, got {value}")
    return value


@dataclass(frozen=True)
class SlotScope:
    """What a node's slots are shared across: every API URL that leads to the same machine.

    ``cluster``: the node is in the PVE cluster named `name` (node names are unique in a cluster).
    ``standalone``: the node is in no cluster; `name` is its TLS certificate's fingerprint ("" if the
    API gave none), so that two separate machines both called ``pve`` keep their own slots.
    ``api``: the cluster could not be asked (no Sys.Audit on /); `name` is the API URL, and only reboots
    through that same URL share the slots.
    """

    kind: str
    name: str


def slot_prefix(scope: SlotScope, node: str) -> str:
    """A file-name prefix per (scope, node): the node's name made tame and short, for people reading
    the directory, and a hash of all of it, which is what tells nodes apart."""
    digest = hashlib.sha256(json.dumps([scope.kind, scope.name, node]).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{_UNSAFE.sub('_', node)[:40]}-{digest}"


def open_slot_dir(path: str) -> int:
    """An fd on the slot directory, made 0700 if missing; SlotError (naming slot_dir) if it or a directory
    above it is not safe (see _base.private_dir)."""
    try:
        return open_private_dir("slot_dir", resolve_dir("slot_dir", path), NO_WRITE_FOR_OTHERS)
    except BadOption as exc:
        raise SlotError(f"{exc}; nothing was changed") from None


@dataclass
class NodeSlot:
    """One slot held: released by release() or by the end of the process."""

    node: str
    index: int
    waited: float
    _fd: int

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only fd on the open file drops the flock
            self._fd = -1

    def as_dict(self) -> dict:
        return {"node": self.node, "slot": self.index, "waited": round(self.waited, 3)}


def _try_slot(dir_fd: int, name: str) -> int | None:
    """An fd holding the flock on slot file `name`, or None if another process holds it."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise SlotError(f"slot_dir: cannot open slot file {name} ({exc.strerror}); nothing was changed") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SlotError(f"slot_dir: slot file {name} is not a regular file; nothing was changed")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def take_slot(directory: str, scope: SlotScope, node: str, slots: int, deadline: Deadline) -> NodeSlot:
    """Hold one of the node's `slots` slots, polling until one is free; NoFreeSlot at the deadline."""
    dir_fd = open_slot_dir(directory)
    prefix = slot_prefix(scope, node)
    try:
        def free_slot() -> tuple[int, int] | None:
            for index in range(slots):
                fd = _try_slot(dir_fd, f"{prefix}.{index}.lock")
                if fd is not None:
                    return index, fd
            return None

        # Looked at once before the poll, so that a free slot is taken with waited == 0.
        taken = free_slot()
        waited = 0.0
        if taken is None:
            taken = deadline.poll_for(free_slot, SLOT_POLL_S)
            waited = deadline.elapsed()
    finally:
        os.close(dir_fd)
    if taken is None:
        raise NoFreeSlot(
            f"all {slots} reboot slot(s) of node {node} stayed taken by other reboots for"
            f" {deadline.elapsed():.0f} s (slot_timeout); nothing was changed"
        )
    index, fd = taken
    return NodeSlot(node, index, waited, fd)
