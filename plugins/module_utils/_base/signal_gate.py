# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Process identity, and the one gate every signal of this collection passes.

"Is (pid, starttime) still this process?" is answered here and nowhere else (:class:`Identity`,
:meth:`ProcessControl.current`): by reaping, the launch stop path and its records, and the GPU pid
watch. The supervisor script (``_launch/supervisor.py``) runs alone with the standard library and
keeps its own copy of the start-time reader.

A signal goes to one (pid, starttime) identity that a scan saw. With pidfds (Linux 5.3+, Python
3.9+) the process is pinned first and its start time checked after that, so a pid recycled at any
moment is never signalled; without them the start time is re-read right before ``kill()``.
Before that, :class:`SignalGate` refuses what must never be signalled whatever a plan or a record
says: PID 1 of the namespace, the process running the module and its ancestors, kernel threads,
processes matching a protected pattern and, where the caller asks, the members of the module's
own process group. No module signals a process group: a group is signalled member by member.
A signal that asks a process to end (SIGTERM, SIGINT, SIGHUP, SIGQUIT) is followed by SIGCONT to
the same pinned process, as systemd does: a stopped process (state T: SIGSTOP, a job control stop)
runs no handler until it is continued, so without it a frozen job would sit out the whole timeout
and be SIGKILLed without saving its checkpoint. SIGKILL needs none (it ends a stopped process); a
signal that asks anything else (SIGCHLD to a zombie's parent, SIGUSR1 to an idle supervisor) leaves
a stopped process stopped: whoever stopped it (a debugger, an operator) did so on purpose.
A caller may also give the gate a *proof* (:data:`Proof`), something the process must show now
(gpu_reclaim: that it holds a GPU device file); it is read once the process is pinned, and the
start time is checked again after it, so what was read belongs to the process the signal reaches.

The only signals that do not pass here: gpu_mem_wait's query child and nvidia-smi (nvml_query),
the module's own unreaped children, whose pid the kernel cannot hand to anyone else until it reaps
them; and the supervisor's forwarding of SIGTERM to the job (_launch/supervisor.py, which runs
alone with the standard library): member by member, each a descendant of the supervisor in the
job's group, by (pid, start time) pinned with a pidfd - the same rule, in a small copy.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    Process,
    ProcessTable,
    Thread,
    read_environ_value,
    read_process,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import NAMESPACE_INIT_PID, Protection


@dataclass(frozen=True)
class Identity:
    """A process as the snapshot saw it; (pid, starttime) tells it apart from a later one."""

    pid: int
    starttime: int
    comm: str = ""

    @classmethod
    def of(cls, process: Process) -> "Identity":
        return cls(process.pid, process.starttime, process.comm)

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.starttime)

    def matches(self, process: Process | None) -> bool:
        """Whether `process` (as read now) is this one and not a later one that reuses its pid."""
        return process is not None and process.pid == self.pid and process.starttime == self.starttime


def format_pids(pids: Iterable[int]) -> str:
    """Pids for a message: sorted, comma separated."""
    return ", ".join(str(pid) for pid in sorted(pids))


SENT = "sent"
GONE = "gone"
RECYCLED = "recycled"
REFUSED = "refused"
DENIED = "denied"
UNPROVEN = "unproven"

# What a process must show, as read now, to be signalled: called with the pid's process once it is
# pinned and its start time checked, True to let the signal go.
Proof = Callable[[Process], bool]

# Signals that ask a process to end: SIGCONT follows each (see the module doc).
CONTINUED_AFTER = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


class ProcessControl:
    """Looks at and signals processes of the PID namespace this code runs in, by identity."""

    def __init__(self, proc_root: str = "/proc", use_pidfd: bool | None = None) -> None:
        self.proc_root = proc_root
        has_pidfd = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
        self.use_pidfd = has_pidfd if use_pidfd is None else (use_pidfd and has_pidfd)

    # --- looking -----------------------------------------------------------------------------

    def look(self, pid: int) -> Process | None:
        """The process that has `pid` now, or None."""
        return read_process(self.proc_root, pid)

    def current(self, identity: Identity) -> Process | None:
        """`identity` as it is now (a zombie included), or None once it is gone or its pid reused."""
        process = self.look(identity.pid)
        return process if identity.matches(process) else None

    def environ_value(self, identity: Identity, name: str) -> str | None:
        """`name` in the environment `identity` was started with; None if absent or no longer it.

        The start time is checked after the read, so what was read belongs to `identity`, not to a
        later process that got its pid.
        """
        value = read_environ_value(self.proc_root, identity.pid, name)
        return value if value is not None and self.current(identity) is not None else None

    def threads(self, pid: int) -> list[Thread]:
        process = self.look(pid)
        if process is None:
            return []
        return ProcessTable({pid: process}, self.proc_root).load_threads(pid)

    # --- signalling --------------------------------------------------------------------------

    def send(self, target: Identity, sig: signal.Signals, proof: Proof | None = None) -> str:
        """Signal exactly `target`: SENT, or GONE / RECYCLED / DENIED / REFUSED / UNPROVEN and nothing sent.

        With a `proof`, the signal goes only where it holds for the process as it is after pinning.
        A signal in CONTINUED_AFTER is followed by SIGCONT to the same process (see the module doc).
        """
        if target.pid <= NAMESPACE_INIT_PID:
            return REFUSED
        if self.use_pidfd:
            try:
                return self._send_by_pidfd(target, sig, proof)
            except OSError as exc:
                if not _pidfd_unsupported(exc):
                    raise
                self.use_pidfd = False
        # Without a pidfd the SIGCONT goes by pid too: the signal may have ended the process and its pid
        # been reused since, so the start time is read again right before it, as before the signal.
        resume = None if sig not in CONTINUED_AFTER else (
            lambda: self._kill(target.pid, signal.SIGCONT) if target.matches(self.look(target.pid)) else None)
        return self._deliver_to_same(target, lambda: self._kill(target.pid, sig), proof, resume)

    def _send_by_pidfd(self, target: Identity, sig: signal.Signals, proof: Proof | None = None) -> str:
        try:
            handle = self._open(target.pid)
        except ProcessLookupError:
            return GONE
        try:
            # The handle pins one process; checking the start time after opening it proves it is
            # the one the plan saw (a reused pid shows another start time and is left alone).
            resume = None if sig not in CONTINUED_AFTER else (lambda: self._signal_handle(handle, signal.SIGCONT))
            return self._deliver_to_same(target, lambda: self._signal_handle(handle, sig), proof, resume)
        finally:
            self._close(handle)

    def _deliver_to_same(self, target: Identity, deliver: Callable[[], None], proof: Proof | None = None,
                         resume: Callable[[], None] | None = None) -> str:
        """`deliver()` the signal if `target.pid` still has the start time the plan saw (and `proof` holds),
        then `resume()` it (SIGCONT) unless the signal needs none."""
        now = self.look(target.pid)
        unlike = _unlike(target, now)
        if unlike is None and proof is not None:
            proven = proof(now)
            # The proof read files under /proc/PID: they were the target's only if the pid still
            # has its start time after the read (a pid is not reused while its process exists).
            unlike = _unlike(target, self.look(target.pid)) or (None if proven else UNPROVEN)
        if unlike is not None:
            return unlike
        try:
            deliver()
        except ProcessLookupError:
            return GONE
        except PermissionError:
            return DENIED
        if resume is not None:
            try:
                resume()
            except (ProcessLookupError, PermissionError):
                pass  # it ended on the signal itself: nothing to continue
        return SENT

    # The kernel primitives, one method each so that a simulated kernel can stand in for them.
    def _open(self, pid: int) -> Any:
        return os.pidfd_open(pid)  # pylint: disable=no-member

    def _signal_handle(self, handle: Any, sig: signal.Signals) -> None:
        signal.pidfd_send_signal(handle, sig)  # pylint: disable=no-member

    def _close(self, handle: Any) -> None:
        os.close(handle)

    def _kill(self, pid: int, sig: signal.Signals) -> None:
        os.kill(pid, sig)


def _pidfd_unsupported(exc: OSError) -> bool:
    """pidfd_open is missing from this kernel (or refused by a seccomp filter)."""
    return exc.errno in (errno.ENOSYS, errno.EPERM) and not isinstance(exc, ProcessLookupError)


def _unlike(target: Identity, now: Process | None) -> str | None:
    """GONE or RECYCLED when `now` (the pid as read now) is not `target`; None when it is."""
    if now is None:
        return GONE
    return None if target.matches(now) else RECYCLED


class SignalGate:
    """Protection first, then delivery to the exact identity: the only way this collection signals.

    `spare_group`: a process group whose members are never signalled either. The launch path passes
    the module's own group: the controller's other workers sit there, and a job's helper that runs
    Ansible carries the job's mark into them.
    `proof`: what every target must show once pinned (see :data:`Proof`); a target that does not
    is answered UNPROVEN and not signalled.
    """

    def __init__(self, protection: Protection, control: ProcessControl, spare_group: int | None = None,
                 proof: Proof | None = None) -> None:
        self.protection = protection
        self.control = control
        self.spare_group = spare_group
        self.proof = proof

    def refusal(self, pid: int) -> str | None:
        """Why `pid` must not be signalled, or None."""
        reason = self.protection.reason(pid)
        if reason is not None:
            return reason
        process = self.protection.table.processes.get(pid)
        if self.spare_group is not None and process is not None and process.pgid == self.spare_group:
            return "in the process group of the Ansible process running this module"
        return None

    def send(self, target: Identity, sig: signal.Signals) -> str:
        """SENT, or REFUSED / GONE / RECYCLED / DENIED / UNPROVEN and nothing sent."""
        if self.refusal(target.pid) is not None:
            return REFUSED
        return self.control.send(target, sig, self.proof)
