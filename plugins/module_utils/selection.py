# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which processes are "the job", and which must never be touched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils.procfs import (
    ProcessTable,
    compile_patterns,
    self_and_ancestors,
)

NAMESPACE_INIT_PID = 1


@dataclass(frozen=True)
class JobSelector:
    """The job: processes whose command line matches, optional descendants, and listed pids."""

    patterns: tuple[Pattern[str], ...] = ()
    pids: tuple[int, ...] = ()
    include_descendants: bool = True

    @classmethod
    def from_options(cls, match: Iterable[str], pids: Iterable[int], include_descendants: bool) -> "JobSelector":
        return cls(tuple(compile_patterns(match, "match")), tuple(pids), include_descendants)

    @property
    def is_empty(self) -> bool:
        return not self.patterns and not self.pids

    def named(self, table: ProcessTable) -> set[int]:
        """Pids the selectors name directly: command line matches and listed pids that exist."""
        named = set(table.matching(self.patterns))
        named.update(pid for pid in self.pids if pid in table.processes)
        return named

    def select(self, table: ProcessTable, protection: "Protection | None" = None, named: set[int] | None = None) -> set[int]:
        """The job's pids: what is named, plus descendants, minus everything protected.

        Protected processes are never part of the job and are never walked through: naming PID 1
        must not pull in the whole system as its "descendants". Without `protection`, the
        always-protected set (PID 1, this process and its ancestors, kernel threads) applies.
        """
        guard = protection if protection is not None else Protection(table, ())
        job = {pid for pid in (self.named(table) if named is None else named) if pid not in guard}
        if self.include_descendants:
            pending = list(job)
            while pending:
                for child in table.children.get(pending.pop(), ()):
                    if child not in job and child not in guard:
                        job.add(child)
                        pending.append(child)
        return job


class Protection:
    """Decides which processes must never be signalled, and says why.

    Never: PID 1 of the namespace, this module's own process and its ancestors (the connection
    chain), kernel threads, and anything whose command line or comm matches a protected pattern.
    Evaluated lazily: only the pids a caller asks about are matched.
    """

    def __init__(self, table: ProcessTable, patterns: Iterable[Pattern[str]], own_pid: int | None = None) -> None:
        self.table = table
        self.patterns = list(patterns)
        self.own_chain = self_and_ancestors(table, own_pid)

    def reason(self, pid: int) -> str | None:
        """Why `pid` is protected, or None if it is not."""
        if pid == NAMESPACE_INIT_PID:
            return "PID 1 of this namespace"
        if pid in self.own_chain:
            return "runs this module or is one of its ancestors"
        process = self.table.processes.get(pid)
        if process is None:
            return None
        if process.is_kernel_thread:
            return "kernel thread"
        for rx in self.patterns:
            if rx.search(process.cmdline) or rx.search(process.comm):
                return f"matches protected pattern {rx.pattern!r}"
        return None

    def __contains__(self, pid: object) -> bool:
        return isinstance(pid, int) and self.reason(pid) is not None


# What a relaunch must never touch unless the user says otherwise: the way in (sshd), the
# service manager and init, and the container runtime and its monitors.
DEFAULT_PROTECTED: tuple[str, ...] = (
    r"\bsshd\b",
    r"\bsystemd\b",
    r"^(/usr)?/s?bin/init\b",
    r"\b(containerd|dockerd|runc|crun|lxcfs|lxc-start|lxc-monitor|lxc monitor|pve-lxc-syscalld)\b",
    r"\b(pvedaemon|pveproxy|pvestatd|pve-cluster|pmxcfs)\b",
)
