"""A light "container": a PID namespace whose init never reaps.

``unshare --pid --fork --mount-proc sleep infinity`` in a session of its own makes a new PID namespace whose PID 1
is ``sleep``: it never calls ``wait()``, so every process orphaned inside stays a zombie for ever,
exactly like a container whose init does not reap. ``nsenter`` runs commands inside, and Ansible
reaches in with the ``community.docker.nsenter`` connection (see :meth:`PidNamespace.inventory`).

Clean-up is a SIGKILL to the recorded init (host) pid, checked against its recorded start time so
a reused pid is never signalled: the kernel then ends everything inside the namespace.

    with pid_namespace() as ns:
        ns.run_inside(["ps", "-e"])
        run_playbook(plays, inventory=ns.inventory())
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline

NSENTER = "nsenter"


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first), or None if the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def process_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), or None if the pid is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def parent_pid(pid: int) -> int | None:
    """The ppid of `pid` as this /proc sees it, or None if the pid is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text(encoding="utf-8")
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()
    except OSError:
        return None


def run_inside(init_pid: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run `argv` inside the PID and mount namespaces of `init_pid` (subprocess.run keywords apply)."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 60)
    kwargs.setdefault("check", False)
    cmd = [NSENTER, f"--target={init_pid}", "--pid", "--mount", "--", *argv]
    return subprocess.run(cmd, **kwargs)  # pylint: disable=subprocess-run-check


def nsenter_vars(init_pid: int | str) -> dict[str, str]:
    """Host vars that make Ansible run a host's tasks inside the namespaces of `init_pid` (a host pid,
    or a template that gives one) with the community.docker.nsenter connection."""
    return {
        "ansible_connection": "community.docker.nsenter",
        "ansible_host": str(init_pid),
        "ansible_nsenter_pid": str(init_pid),
        "ansible_python_interpreter": "/usr/bin/python3",
    }


def nsenter_inventory(init_pid: int, host: str = "ct") -> str:
    """:func:`nsenter_vars` as an INI inventory line for `host`."""
    return host + "".join(f" {name}={value}" for name, value in nsenter_vars(init_pid).items()) + "\n"


class NsenterTarget:
    """Something Ansible reaches through the host pid of its init: a PID namespace, a container."""

    init_pid: int

    def inventory(self, host: str = "ct") -> str:
        """An INI inventory line that makes Ansible run tasks inside; good while this init runs."""
        return nsenter_inventory(self.init_pid, host)

    def write_inventory(self, path: str | os.PathLike, host: str = "ct") -> str:
        """Write :meth:`inventory` to `path` and return the path as a string (for -i)."""
        Path(path).write_text(self.inventory(host), encoding="utf-8")
        return str(path)


@dataclass
class PidNamespace(NsenterTarget):
    """A running PID namespace, known by its init's host pid and start time."""

    init_pid: int
    init_starttime: int
    unshare: subprocess.Popen

    def run_inside(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside this namespace; see the module-level run_inside."""
        return run_inside(self.init_pid, argv, **kwargs)

    def host_pids(self) -> list[int]:
        """Host pids of every process inside the namespace, the init included."""
        found: list[int] = []
        pending = [self.init_pid]
        while pending:
            pid = pending.pop()
            found.append(pid)
            pending.extend(_children(pid))
        return found

    def alive(self) -> bool:
        return process_starttime(self.init_pid) == self.init_starttime

    def kill(self) -> None:
        """SIGKILL the recorded init (if it is still the same process) and wait for unshare."""
        if self.alive():
            os.kill(self.init_pid, signal.SIGKILL)
        try:
            self.unshare.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.unshare.kill()
            self.unshare.wait(timeout=30)


def start_pid_namespace(init_argv: list[str] | None = None, timeout: float = 30) -> PidNamespace:
    """Start a PID namespace (init = `init_argv`, default a never-reaping sleep) and return it."""
    argv = ["unshare", "--pid", "--fork", "--mount-proc", *(init_argv or ["sleep", "infinity"])]
    # start_new_session is setsid(1) without its extra fork: the Popen pid is unshare itself (in a
    # session of its own, away from the test's terminal and process group) and the init its child.
    unshare = subprocess.Popen(  # pylint: disable=consider-using-with
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def started() -> PidNamespace | None:
        children = _children(unshare.pid)
        if children:
            init_pid = children[0]
            starttime = process_starttime(init_pid)
            # Until exec, the child still runs unshare's image (and /proc may not be mounted yet).
            if starttime is not None and _comm(init_pid) not in (None, "unshare"):
                return PidNamespace(init_pid=init_pid, init_starttime=starttime, unshare=unshare)
        if unshare.poll() is not None:
            raise RuntimeError(f"unshare exited with {unshare.returncode} before its init appeared")
        return None

    namespace = Deadline(timeout).poll_for(started, 0.02)
    if namespace is not None:
        return namespace
    unshare.kill()
    unshare.wait(timeout=30)
    raise RuntimeError("the PID namespace init did not appear within the deadline")


@contextmanager
def pid_namespace(init_argv: list[str] | None = None) -> Iterator[PidNamespace]:
    """A PID namespace for the duration of the block; everything inside ends with it."""
    namespace = start_pid_namespace(init_argv)
    try:
        yield namespace
    finally:
        namespace.kill()
