# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which processes are "the job", and which must never be touched."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks, string_list
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    Process,
    ProcessTable,
    compile_patterns,
    program_path,
    self_and_ancestors,
)

NAMESPACE_INIT_PID = 1


# Why a process that a selection names is left to someone else (another job, say), or None: the
# selection neither takes it in nor walks through it to its descendants. Asked only about the
# processes a selection names and their descendants, so it may read their /proc files.
SpareTest = Callable[[int], Optional[str]]


@dataclass(frozen=True)
class JobSelector:
    """The job: processes whose command line matches, optional descendants, and listed pids.

    `job_dir` is the train_launch job this selection is for (its state directory); processes that
    are proven members of another job are left out (see ``_reap/other_jobs.py``). `expect_run_id`: the
    run of that job the selection is for ("" for none; None: any), so that a newer live run of the job
    is left out like another job's (the run-id fence, see ``_reap/other_jobs.py``).
    """

    patterns: tuple[Pattern[str], ...] = ()
    pids: tuple[int, ...] = ()
    include_descendants: bool = True
    allow_broad: bool = False
    job_dir: str | None = None
    expect_run_id: str | None = None

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

    def select(
        self, table: ProcessTable, protection: "Protection | None" = None, named: set[int] | None = None,
        spared: SpareTest | None = None,
    ) -> set[int]:
        """The job's pids: what is named, plus descendants, minus everything protected or `spared`.

        Protected and spared processes are never part of the job and are never walked through:
        naming PID 1 must not pull in the whole system as its "descendants", and the children of
        another job's process are that job's. Without `protection`, the always-protected set (PID 1,
        this process and its ancestors, kernel threads, the protected programs) applies.
        """
        guard = protection if protection is not None else Protection(table, ())

        def left_out(pid: int) -> bool:
            return pid in guard or (spared is not None and spared(pid) is not None)

        job = {pid for pid in (self.named(table) if named is None else named) if not left_out(pid)}
        if self.include_descendants:
            pending = list(job)
            while pending:
                for child in table.children.get(pending.pop(), ()):
                    if child not in job and not left_out(child):
                        job.add(child)
                        pending.append(child)
        return job

    def too_broad(self, table: ProcessTable, protection: "Protection", own_pid: int | None = None,
                  spared: SpareTest | None = None) -> list[str]:
        """Why this selection is too broad to act on, one reason per offence; empty when it is not
        (or when `allow_broad` says to act anyway).

        `own_pid` is the module's process in `table` (default: this process); when it is not in
        `table` (a /proc of another namespace), the checks that need it are left out. See
        :func:`selection_floor`.
        """
        if self.allow_broad:
            return []
        return selection_floor(self, table, protection, own_pid, spared)


# --- what is never touched, judged by what a process cannot claim ------------------------------
#
# A process chooses its own arguments, argv[0] included (`exec -a`), and its comm (PR_SET_NAME): a
# GPU job with "sshd" among its arguments must not be spared for it. What it cannot choose is the
# file the kernel executed (/proc/PID/exe), where that file lies (only root installs programs
# under /usr), its user, and where it sits in the process tree.

# Programs never signalled, whatever the options say: the way in (sshd), the service manager and
# init, the container runtime and its monitors, and the Proxmox cluster file system.
PROTECTED_PROGRAMS = frozenset({
    "sshd", "sshd-session", "sshd-auth", "init", "systemd",
    "containerd", "dockerd", "runc", "crun", "conmon", "lxcfs", "lxc-start", "lxc-monitord",
    "pve-lxc-syscalld", "pmxcfs",
})
# ... and their families: systemd-journald, systemd-logind, ...; containerd-shim-runc-v2, ...
PROTECTED_PROGRAM_PREFIXES = ("systemd-", "containerd-shim")
# Where a protected program must lie to count: places only root can write. A copy of python
# named sshd in a home directory, /tmp or a virtualenv is not sshd.
SYSTEM_PROGRAM_DIRS = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/", "/lib32/", "/libx32/")
# The Proxmox VE daemons are Perl programs, so their executable is perl like any Perl script's:
# they count only when they run as root (their real uid, which a process cannot claim) under
# their own name.
PROXMOX_PERL_DAEMONS = (
    "pvedaemon", "pveproxy", "pvestatd", "pvescheduler", "pve-firewall", "pve-ha-crm", "pve-ha-lrm", "spiceproxy",
)
_PERL = re.compile(r"^perl[0-9.]*$")
ROOT_UID = 0


def is_system_program(exe: str) -> bool:
    """Whether `exe` (a /proc/PID/exe target) is a file in one of the system program directories."""
    path = program_path(exe)
    return path.startswith(SYSTEM_PROGRAM_DIRS) and "/../" not in path


def protected_program(table: ProcessTable, pid: int) -> str | None:
    """Why `pid` runs a program that is never signalled (see PROTECTED_PROGRAMS), or None."""
    exe = table.executable(pid)
    if not exe or not is_system_program(exe):
        return None
    path = program_path(exe)
    name = os.path.basename(path)
    if name in PROTECTED_PROGRAMS or name.startswith(PROTECTED_PROGRAM_PREFIXES):
        return f"runs {path}, a protected program"
    if _PERL.match(name) and table.processes[pid].comm.split(" ")[0] in PROXMOX_PERL_DAEMONS and table.load_uid(pid) == ROOT_UID:
        return f"runs the Proxmox daemon {table.processes[pid].comm.split(' ')[0]} (perl, as root)"
    return None


class Protection:
    """Decides which processes must never be signalled, and says why.

    Never: PID 1 of the namespace, this module's own process and its ancestors (the connection
    chain), kernel threads, the protected programs (judged by their executable, see
    :func:`protected_program`), and anything whose command line or comm matches one of the user's
    protected patterns (which a process can claim: a convenience, not a guarantee). Evaluated
    lazily: only the pids a caller asks about are looked at.
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
        program = protected_program(self.table, pid)
        if program is not None:
            return program
        for rx in self.patterns:
            if rx.search(process.cmdline) or rx.search(process.comm):
                return f"matches protected pattern {rx.pattern!r}"
        return None

    def __contains__(self, pid: object) -> bool:
        return isinstance(pid, int) and self.reason(pid) is not None


# The default of the `protected` option: no patterns. What is always protected is judged by the
# executable (PROTECTED_PROGRAMS), not by a command line a process can write itself.
DEFAULT_PROTECTED: tuple[str, ...] = ()


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
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*$")
# Python's options that take the next argument as their value.
_PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def is_ansible_process(process: Process, executable: str) -> bool:
    """Whether `process` runs an Ansible program (ansible-playbook and the workers it forks,
    ansible-pull, ansible-runner, ...) or an Ansible module (an ``AnsiballZ_*.py`` file).

    `executable` is its ``/proc/PID/exe`` (:meth:`.procfs.ProcessTable.executable`): it must be a
    Python interpreter, and the program that interpreter runs (the script after its options, or its
    ``-m`` module) must be Ansible's. argv[0] is whatever the process's starter wrote there
    (``exec -a ansible-playbook``) and is never looked at. A process that runs Python with a script
    it named ansible-playbook itself still passes: this tells Ansible apart from a job, it does not
    defend against one (built-in protection never rests on it).
    """
    if not _PYTHON.match(os.path.basename(program_path(executable))):
        return False
    args = process.cmdline.split(" ")[1:]
    position = 0
    while position < len(args):
        arg = args[position]
        if arg == "-m":
            module = args[position + 1] if position + 1 < len(args) else ""
            return module == "ansible" or module.startswith("ansible.")
        if arg == "-c":
            return False  # code on the command line, no script
        if arg.startswith("-"):
            position += 2 if arg in _PYTHON_OPTIONS_WITH_VALUE else 1
            continue
        name = os.path.basename(arg)
        return bool(_ANSIBLE_PROGRAM.match(name) or _ANSIBLE_MODULE.match(name))
    return False


def _names_ansible(args: list[str]) -> bool:
    """Whether an argument list runs Ansible as far as its words say: a program or module of
    Ansible anywhere in it (``sh -c '... AnsiballZ_x.py'`` included).

    Only ever asked about the module's own ancestors, which are what ran this module: a process
    cannot become one by choosing its words.
    """
    for position, arg in enumerate(args):
        name = os.path.basename(arg)
        if _ANSIBLE_PROGRAM.match(name) or any(_ANSIBLE_MODULE.match(os.path.basename(word)) for word in arg.split(" ")):
            return True
        if position > 0 and args[position - 1] == "-m" and (name == "ansible" or name.startswith("ansible.")):
            return True
    return False


# The options of the Ansible programs that carry a task's arguments and variables onto the command
# line of the controller and of every worker it forks (`ansible -a '{"match": ["train"]}'`,
# `ansible-playbook -e process_cleanup_match=train`): a pattern found only there was typed there.
_TYPED_ARGUMENT_OPTIONS = ("-a", "--args", "-e", "--extra-vars")


def without_typed_arguments(args: list[str]) -> list[str]:
    """`args` of an Ansible program without the values of the options that carry module arguments
    and extra variables (see _TYPED_ARGUMENT_OPTIONS): ``-a VALUE``, ``-aVALUE``, ``--args=VALUE``."""
    kept: list[str] = []
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        if arg in _TYPED_ARGUMENT_OPTIONS:
            kept.append(arg)
            skip_next = True
            continue
        long_option = next((o for o in _TYPED_ARGUMENT_OPTIONS if o.startswith("--") and arg.startswith(o + "=")), None)
        short_option = next((o for o in _TYPED_ARGUMENT_OPTIONS if len(o) == 2 and arg.startswith(o) and len(arg) > 2
                             and not arg.startswith("--")), None)
        kept.append(long_option or short_option or arg)
    return kept


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


@dataclass
class FloorReview:
    """What makes a selection too broad (see :func:`review_selection`).

    `patterns`: reasons that are about a ``match`` pattern itself; `ansible`: the selected processes
    that belong to Ansible, each with the reason that names the option that selected it, and
    `relation` how each belongs to Ansible (:meth:`AnsibleRun.relation`).
    """

    patterns: list[str] = field(default_factory=list)
    ansible: dict[int, str] = field(default_factory=dict)
    relation: dict[int, str] = field(default_factory=dict)

    @property
    def reasons(self) -> list[str]:
        return self.patterns + [self.ansible[pid] for pid in sorted(self.ansible)]


class AnsibleRun:
    """The Ansible run of this module as the process table shows it: the module's chain and, among
    its ancestors, the ones that run Ansible (the controller, its worker, the module itself)."""

    def __init__(self, table: ProcessTable, own_pid: int | None = None) -> None:
        self.table = table
        self.chain = own_chain(table, own_pid)
        self.controller = [pid for pid in self.chain if _names_ansible(table.argv(pid))]

    def judged_command_line(self, pid: int) -> str:
        """The command line of `pid` (one of the chain) as a pattern is judged against: an Ansible
        program's without the arguments and variables typed on it."""
        args = self.table.argv(pid)
        return " ".join(without_typed_arguments(args) if pid in self.controller else args)

    def relation(self, pid: int) -> str | None:
        """How `pid` belongs to Ansible, as the rest of a sentence about it ("runs Ansible ...",
        "was started by the Ansible process ..."), or None."""
        table = self.table
        process = table.processes[pid]
        if is_ansible_process(process, table.executable(pid)):
            return "runs Ansible (a controller, one of its workers or a module)"
        for ancestor in table.ancestors(pid):
            if ancestor in self.controller:
                return f"was started by the Ansible process {_describe(table, ancestor)} that runs this module"
        for leader, kind in ((process.pgid, "process group"), (process.sid, "session")):
            if leader in self.controller:
                return f"is in the {kind} of the Ansible process {_describe(table, leader)} that runs this module"
        return None


def review_selection(
    selector: JobSelector, table: ProcessTable, protection: Protection, own_pid: int | None = None,
    spared: SpareTest | None = None, named: set[int] | None = None,
) -> FloorReview:
    """What makes `selector` too broad in `table`, each reason naming the option (and the pattern):

    - a ``match`` pattern that matches the empty string selects every process with a command line;
    - a ``match`` pattern that matches the command line of the module's own process or one of its
      ancestors (the Ansible connection: ``sh -c``, the sshd session, a local connection's worker)
      also matches their siblings: every python process, every other connection, every other
      worker of the controller. An Ansible program's command line is judged without the module
      arguments and extra variables typed on it (``ansible -a``, ``-e``): a pattern typed there is
      not one that names Ansible, and the workers it would reach are caught by the next rule;
    - a selected process (named, or a descendant) that belongs to Ansible: one that runs an Ansible
      program or module (judged by its executable, see :func:`is_ansible_process`), or one that
      the Ansible run of this module started (a descendant of one of its Ansible processes, or a
      member of the process group or session one of them leads).

    Ignores `selector.allow_broad`; :meth:`JobSelector.too_broad` honours it.
    """
    review = FloorReview()
    run = AnsibleRun(table, own_pid)
    for rx in selector.patterns:
        if rx.search("") is not None:
            review.patterns.append(f"match: {rx.pattern!r} matches the empty string, so it selects every process")
            continue
        hit = next((pid for pid in run.chain if rx.search(run.judged_command_line(pid))), None)
        if hit is not None:
            whose = "the command line of this module's own process" if hit == run.chain[0] else (
                f"the command line of {_describe(table, hit)}, an ancestor of this module (the way Ansible reached this host)")
            review.patterns.append(
                f"match: {rx.pattern!r} matches {whose}, {_short(run.judged_command_line(hit))!r}, "
                f"and so every process like it"
            )
    named = selector.named(table) if named is None else named
    for pid in sorted(selector.select(table, protection, named, spared)):
        why = run.relation(pid)
        if why is None:
            continue
        review.relation[pid] = why
        review.ansible[pid] = f"{_selected_by(selector, table, pid, named)} {_describe(table, pid)}, which {why}"
    return review


def selection_floor(
    selector: JobSelector, table: ProcessTable, protection: Protection, own_pid: int | None = None,
    spared: SpareTest | None = None,
) -> list[str]:
    """The reasons of :func:`review_selection`, pattern reasons first."""
    return review_selection(selector, table, protection, own_pid, spared).reasons


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

# train_launch's default state_dir: a job named without a state directory is looked for there.
DEFAULT_JOB_STATE_DIR = "/var/lib/gpuops"

# `match` and `protected` are `raw`: Ansible's list type splits a string on commas, and a regular
# expression is full of them (train_\d{1,3}\.py). A string is one pattern (see options.string_list).
JOB_SELECTION_SPEC: dict[str, dict[str, Any]] = {
    "match": {"type": "raw", "default": []},
    "pids": {"type": "list", "elements": "int", "default": []},
    "include_descendants": {"type": "bool", "default": True},
    "allow_broad": {"type": "bool", "default": False},
    "protected": {"type": "raw", "default": list(DEFAULT_PROTECTED)},
    "job_name": {"type": "str"},
    "job_state_dir": {"type": "path", "default": DEFAULT_JOB_STATE_DIR},
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
    The job the selection is for (``job_name``) is checked where jobs are known (``_reap/other_jobs.py``).
    """
    own = checks is None
    checks = OptionChecks() if checks is None else checks
    pids = checks.check(_positive_pids, "pids", params["pids"])
    if not params["gpu_device_glob"]:
        checks.add("gpu_device_glob", "must not be empty")
    match = checks.check(_patterns, "match", params["match"])
    protected = checks.check(_patterns, "protected", params["protected"])
    if own:
        checks.raise_if_any()
    selector = JobSelector(tuple(match or ()), tuple(pids or ()), params["include_descendants"], params["allow_broad"])
    return selector, tuple(protected or ())


def _patterns(option: str, value: Any) -> list[Pattern[str]]:
    return compile_patterns(string_list(option, value), option)


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


def refuse_broad_selection(
    selector: JobSelector, table: ProcessTable, protection: Protection, own_pid: int,
    spared: SpareTest | None = None,
) -> None:
    """Raise BroadSelectionError when `selector` is too broad in `table` (see
    :func:`review_selection`), unless it allows that. The caller's one snapshot is judged, the same
    the plan is made from. An empty selection is for the caller to judge."""
    if selector.allow_broad or selector.is_empty:
        return
    reasons = selector.too_broad(table, protection, own_pid, spared)
    if reasons:
        processes = table.processes
        job = [
            {"pid": pid, "starttime": processes[pid].starttime, "comm": processes[pid].comm}
            for pid in sorted(selector.select(table, protection, spared=spared))
        ]
        raise BroadSelectionError(reasons, job)
