# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which processes are "the job", and which must never be touched."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    Process,
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
    allow_broad: bool = False

    @classmethod
    def from_options(
        cls, match: Iterable[str], pids: Iterable[int], include_descendants: bool, allow_broad: bool = False,
    ) -> "JobSelector":
        return cls(tuple(compile_patterns(match, "match")), tuple(pids), include_descendants, allow_broad)

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

    def too_broad(self, table: ProcessTable, protection: "Protection", own_pid: int | None = None) -> list[str]:
        """Why this selection is too broad to act on, one reason per offence; empty when it is not
        (or when `allow_broad` says to act anyway).

        `own_pid` is the module's process in `table` (default: this process); when it is not in
        `table` (a /proc of another namespace), the checks that need it are left out. See
        :func:`selection_floor`.
        """
        if self.allow_broad:
            return []
        return selection_floor(self, table, protection, own_pid)


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


# --- the floor under a selection ----------------------------------------------------------------
#
# A selection acts on every unprotected process it names, so a pattern that names everything, or
# names the way Ansible reached this host, ends the Ansible run itself: with a local connection the
# controller's workers for other hosts share their command line with the worker running this
# module, and ending them hangs the play. Such selections are refused unless `allow_broad` is set.

# ansible, ansible-playbook, ansible-pull, ansible-runner, ansible-connection, ... (comm is cut to
# 15 characters: "ansible-playboo").
_ANSIBLE_PROGRAM = re.compile(r"^ansible(-[a-z]+)?$")
_ANSIBLE_MODULE = re.compile(r"^AnsiballZ_\w+\.py$")
_INTERPRETER = re.compile(r"^(python[0-9.]*|pypy[0-9.]*|env)$")


def is_ansible_process(process: Process) -> bool:
    """Whether `process` runs an Ansible program (ansible-playbook and the workers it forks,
    ansible-pull, ansible-runner, ...) or an Ansible module (an ``AnsiballZ_*.py`` file)."""
    if _ANSIBLE_PROGRAM.match(process.comm):
        return True
    args = process.cmdline.split(" ")
    if any(_ANSIBLE_MODULE.match(os.path.basename(arg)) for arg in args):
        return True
    # The program is the first argument, or the script or -m module its interpreter runs.
    for position, arg in enumerate(args):
        name = os.path.basename(arg)
        if position > 0 and args[position - 1] == "-m":
            return name == "ansible" or name.startswith("ansible.")
        if _ANSIBLE_PROGRAM.match(name):
            return True
        if position == 0 and _INTERPRETER.match(name):
            continue
        if arg.startswith("-"):
            continue
        return False
    return False


def own_chain(table: ProcessTable, own_pid: int | None = None) -> list[int]:
    """The module's process and its ancestors in `table`, nearest first, without PID 1 (which has
    no siblings a pattern could reach through it). Empty when `own_pid` is not in `table`."""
    own = os.getpid() if own_pid is None else own_pid
    if own not in table.processes:
        return []
    return [pid for pid in (own, *table.ancestors(own)) if pid in table.processes and pid != NAMESPACE_INIT_PID]


def _describe(table: ProcessTable, pid: int) -> str:
    process = table.processes[pid]
    return f"pid {pid} ({process.comm})"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def selection_floor(
    selector: JobSelector, table: ProcessTable, protection: Protection, own_pid: int | None = None,
) -> list[str]:
    """What makes `selector` too broad in `table`, each reason naming the option (and the pattern):

    - a ``match`` pattern that matches the empty string selects every process with a command line;
    - a ``match`` pattern that matches the command line of the module's own process or one of its
      ancestors (the Ansible connection: ``sh -c``, the sshd session, a local connection's worker)
      also matches their siblings: every python process, every other connection, every other
      worker of the controller;
    - a selected process (named, or a descendant) that belongs to Ansible: one that runs an Ansible
      program or module, or one that the Ansible process running this module started (a descendant
      of it, or a member of the process group or session it leads).

    Ignores `selector.allow_broad`; :meth:`JobSelector.too_broad` honours it.
    """
    reasons: list[str] = []
    chain = own_chain(table, own_pid)
    for rx in selector.patterns:
        if rx.search("") is not None:
            reasons.append(f"match: {rx.pattern!r} matches the empty string, so it selects every process")
            continue
        hit = next((pid for pid in chain if rx.search(table.processes[pid].cmdline)), None)
        if hit is not None:
            whose = "the command line of this module's own process" if hit == chain[0] else (
                f"the command line of {_describe(table, hit)}, an ancestor of this module (the way Ansible reached this host)")
            reasons.append(
                f"match: {rx.pattern!r} matches {whose}, {_short(table.processes[hit].cmdline)!r}, "
                f"and so every process like it"
            )
    controller = [pid for pid in chain if is_ansible_process(table.processes[pid])]
    named = selector.named(table)
    for pid in sorted(selector.select(table, protection, named)):
        why = _ansible_relation(table, pid, controller)
        if why is None:
            continue
        reasons.append(f"{_selected_by(selector, table, pid, named)} {_describe(table, pid)}, {why}")
    return reasons


def _ansible_relation(table: ProcessTable, pid: int, controller: list[int]) -> str | None:
    """How `pid` belongs to Ansible, or None."""
    process = table.processes[pid]
    if is_ansible_process(process):
        return "which runs Ansible (a controller, one of its workers or a module)"
    for ancestor in table.ancestors(pid):
        if ancestor in controller:
            return f"which the Ansible process {_describe(table, ancestor)} that runs this module started"
    for leader, kind in ((process.pgid, "process group"), (process.sid, "session")):
        if leader in controller:
            return f"which is in the {kind} of the Ansible process {_describe(table, leader)} that runs this module"
    return None


def _selected_by(selector: JobSelector, table: ProcessTable, pid: int, named: set[int]) -> str:
    """Which option put `pid` into the job, as the start of a reason."""
    if pid in named:
        cmdline = table.processes[pid].cmdline
        for rx in selector.patterns:
            if cmdline and rx.search(cmdline):
                return f"match: {rx.pattern!r} selects"
        return "pids: lists"
    return "include_descendants: selects"


# --- the options of the modules that select a job (doc fragment job_selection) ---------------

JOB_SELECTION_SPEC: dict[str, dict[str, Any]] = {
    "match": {"type": "list", "elements": "str", "default": []},
    "pids": {"type": "list", "elements": "int", "default": []},
    "include_descendants": {"type": "bool", "default": True},
    "allow_broad": {"type": "bool", "default": False},
    "protected": {"type": "list", "elements": "str", "default": list(DEFAULT_PROTECTED)},
    "gpu_device_glob": {"type": "str", "default": "/dev/nvidia*"},
    "proc_root": {"type": "path", "default": "/proc"},
}


class BroadSelectionError(ValueError):
    """The selection names more than a job; `job` is what it would have selected."""

    SHOWN = 5

    def __init__(self, reasons: list[str], job: list[dict[str, Any]]) -> None:
        more = len(reasons) - self.SHOWN
        shown = "; ".join(reasons[: self.SHOWN]) + (f" (and {more} more)" if more > 0 else "")
        super().__init__(
            f"{shown}. Refused; nothing was touched: name the job itself (for example "
            "/workspace/run/train\\.py\\b or its pids), or set allow_broad: true if every unprotected process "
            "this selects may really be ended"
        )
        self.reasons = reasons
        self.job = job


def job_selection_from_params(
    params: Mapping[str, Any], checks: OptionChecks | None = None,
) -> tuple[JobSelector, tuple[Pattern[str], ...]]:
    """The selector and the protected patterns.

    Each wrong option is noted in `checks` and left out of what is returned, so act on the result
    only after ``checks.raise_if_any()``. Without `checks`, OptionsInvalid lists every problem.
    """
    own = checks is None
    checks = OptionChecks() if checks is None else checks
    pids = checks.check(_positive_pids, "pids", params["pids"])
    if not params["gpu_device_glob"]:
        checks.add("gpu_device_glob", "must not be empty")
    match = checks.check(compile_patterns, params["match"], "match")
    protected = checks.check(compile_patterns, params["protected"], "protected")
    if own:
        checks.raise_if_any()
    selector = JobSelector(tuple(match or ()), tuple(pids or ()), params["include_descendants"], params["allow_broad"])
    return selector, tuple(protected or ())


def _positive_pids(option: str, pids: Iterable[int]) -> tuple[int, ...]:
    bad = [pid for pid in pids if pid <= 0]
    if bad:
        raise BadOption(option, f"process IDs must be positive integers, got {bad}")
    return tuple(pids)


def own_pid_in(proc_root: str) -> int:
    """This process's pid in the PID namespace of `proc_root`; 0 when it has none there."""
    try:
        return int(os.readlink(os.path.join(proc_root, "self")))
    except (OSError, ValueError):
        return 0


def refuse_broad_selection(selector: JobSelector, protected: tuple[Pattern[str], ...], proc_root: str) -> None:
    """Raise BroadSelectionError when `selector` is too broad (see selection.selection_floor) on a
    fresh look at `proc_root`, unless it allows that. An empty selection is for the caller to judge."""
    if selector.allow_broad or selector.is_empty:
        return
    table = ProcessTable.scan(proc_root)
    protection = Protection(table, protected)
    reasons = selector.too_broad(table, protection, own_pid_in(proc_root))
    if reasons:
        processes = table.processes
        job = [
            {"pid": pid, "starttime": processes[pid].starttime, "comm": processes[pid].comm}
            for pid in sorted(selector.select(table, protection))
        ]
        raise BroadSelectionError(reasons, job)
