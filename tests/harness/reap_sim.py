"""A small simulated kernel for the reap planner and executor unit tests.

Real processes are tested in tests/integration; here the point is to run the planner and the
executor's signal gate on thousands of generated process forests, including the rare orderings
(a pid reused between the snapshot and the signal, or between pinning and signalling) that cannot
be produced on demand with real processes.

The simulation follows the kernel where the code under test depends on it: a signal reaches the
process a handle pinned or, for ``kill()``, whoever holds the pid now; an exited process stays a
zombie until its parent reaps it; its children go to PID 1; a task in uninterruptible sleep keeps
a fatal signal pending; a pidfd to a process that has been reaped reports ESRCH.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import Process, ProcessTable, Thread
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import ProcessControl

FATAL_BY_DEFAULT = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}


@dataclass
class SimProcess:
    pid: int
    starttime: int
    ppid: int
    comm: str = "python3"
    cmdline: str = ""
    state: str = "S"
    threads: int = 1
    pgid: int = 0
    kernel: bool = False
    wchan: str = ""
    ignores_term: bool = False   # a handler that does not exit (or a Zl leader's threads)
    reaps: bool = True           # reaps its children when they exit / on SIGCHLD
    stuck: bool = False          # in uninterruptible sleep until woken: fatal signals stay pending
    pending_kill: bool = False
    exe: str = ""                # /proc/PID/exe: what the kernel executed ("" unknown)

    def as_process(self) -> Process:
        process = Process(
            pid=self.pid, starttime=self.starttime, ppid=self.ppid, pgid=self.pgid or self.pid,
            sid=self.pgid or self.pid, state=self.state, comm=self.comm, threads=self.threads,
            is_kernel_thread=self.kernel, cmdline="" if self.state == "Z" else self.cmdline,
            exe="" if self.state == "Z" and self.threads <= 1 else self.exe,
        )
        process.task_list = self.task_list()
        return process

    def task_list(self) -> list[Thread]:
        if self.state == "Z" and self.threads > 1:
            first = [Thread(self.pid, "Z", "", self.comm)]
            rest_state = "D" if self.stuck else "S"
            return first + [Thread(self.pid + 10_000 + i, rest_state, self.wchan, self.comm) for i in range(1, self.threads)]
        state = "D" if self.stuck else self.state
        return [Thread(self.pid, state, self.wchan if self.stuck else "", self.comm)]


@dataclass
class SimKernel:
    """A process table that changes when signalled and as (simulated) time passes."""

    processes: dict[int, SimProcess] = field(default_factory=dict)
    init_reaps: bool = True
    delivered: list[tuple[int, int, int]] = field(default_factory=list)
    now: float = 0.0

    def add(self, process: SimProcess) -> SimProcess:
        self.processes[process.pid] = process
        return process

    def table(self) -> ProcessTable:
        return ProcessTable({pid: p.as_process() for pid, p in self.processes.items()}, "/nonexistent-sim-proc")

    # --- the passage of time: PID 1 reaps its zombies (if it reaps at all) ---------------------

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.init_reaps:
            for pid in [p.pid for p in self.processes.values() if p.ppid == 1 and self._exited(p)]:
                del self.processes[pid]

    # --- what signals do -----------------------------------------------------------------------

    def deliver(self, pid: int, starttime: int, sig: int) -> None:
        process = self.processes.get(pid)
        assert process is not None and process.starttime == starttime, "delivered to a process that does not exist"
        self.delivered.append((pid, starttime, int(sig)))
        if sig == signal.SIGCHLD:
            if process.reaps:
                self._reap_children(process)
            return
        if self._exited(process):
            return
        fatal = sig == signal.SIGKILL or (sig in FATAL_BY_DEFAULT and not process.ignores_term)
        if not fatal:
            return
        if process.stuck:
            process.pending_kill = True
            return
        self.exit(process)

    def exit(self, process: SimProcess) -> None:
        process.state, process.threads = "Z", 1
        for child in self.processes.values():
            if child.ppid == process.pid:
                child.ppid = 1
        parent = self.processes.get(process.ppid)
        if process.ppid == 0 or (parent is not None and parent.reaps and parent.pid != 1):
            del self.processes[process.pid]

    def wake(self, pid: int) -> None:
        process = self.processes[pid]
        process.stuck = False
        if process.pending_kill:
            self.exit(process)

    def _reap_children(self, parent: SimProcess) -> None:
        for pid in [p.pid for p in self.processes.values() if p.ppid == parent.pid and self._exited(p)]:
            del self.processes[pid]

    @staticmethod
    def _exited(process: SimProcess) -> bool:
        return process.state == "Z" and process.threads <= 1


class SimControl(ProcessControl):
    """ProcessControl whose kernel primitives act on a SimKernel.

    `recycle_on_open` maps a pid to a replacement process: when the gate pins that pid, the
    original exits and is reaped and the replacement takes the pid (the worst possible moment).
    """

    def __init__(self, kernel: SimKernel, use_pidfd: bool = True, recycle_on_open: dict[int, SimProcess] | None = None) -> None:
        super().__init__("/nonexistent-sim-proc", use_pidfd=True)
        self.use_pidfd = use_pidfd
        self.kernel = kernel
        self.recycle_on_open = dict(recycle_on_open or {})

    def look(self, pid: int) -> Process | None:
        process = self.kernel.processes.get(pid)
        return process.as_process() if process is not None else None

    def threads(self, pid: int) -> list[Thread]:
        process = self.kernel.processes.get(pid)
        return process.task_list() if process is not None else []

    def _open(self, pid: int) -> tuple[int, int]:
        process = self.kernel.processes.get(pid)
        if process is None:
            raise ProcessLookupError(pid)
        handle = (pid, process.starttime)
        replacement = self.recycle_on_open.pop(pid, None)
        if replacement is not None:
            del self.kernel.processes[pid]
            self.kernel.add(replacement)
        return handle

    def _signal_handle(self, handle: tuple[int, int], sig: signal.Signals) -> None:
        pid, starttime = handle
        process = self.kernel.processes.get(pid)
        if process is None or process.starttime != starttime:
            raise ProcessLookupError(pid)
        self.kernel.deliver(pid, starttime, sig)

    def _close(self, handle: tuple[int, int]) -> None:
        pass

    def _kill(self, pid: int, sig: signal.Signals) -> None:
        process = self.kernel.processes.get(pid)
        if process is None:
            raise ProcessLookupError(pid)
        self.kernel.deliver(pid, process.starttime, sig)
