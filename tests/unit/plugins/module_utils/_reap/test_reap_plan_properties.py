"""Property tests: on any process forest, the plan targets only what the rules allow, and the
executor signals only identities the plan printed — never a pid that was reused meanwhile.

Forests hold protected processes (sshd, systemd, the module and its ancestors, kernel threads),
processes whose command line claims to be one of them while their executable is something else
(and the other way round), look-alike command lines (train_eval.py, the same script in another directory), process groups
shared between the job and others, zombies and zombie leaders at every depth, parents outside the
namespace, and pids recycled between the snapshot and the signal (or while the gate pins them).

The oracle below restates the rules from the module's documentation, written independently of
selection.py and reap_plan.py. Examples are derandomized and no example database is used, so CI
runs the same 1,000+ examples every time.
"""

from __future__ import annotations

import re
import signal
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import CONTINUED_AFTER
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.executor import Executor
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.plan import (
    END_PARENT,
    END_PARENT_KILL,
    KILL,
    KILL_LEADER,
    NOTIFY_PARENT,
    TERMINATE,
    ReapOptions,
    plan_reap,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    DEFAULT_PROTECTED,
    JobSelector,
    Protection,
    selection_floor,
)
from tests.harness.reap_sim import SimControl, SimKernel, SimProcess

EXAMPLES = 1000
CI = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

COMMAND_LINES = [
    "python3 /workspace/run/train.py --lr 3e-4",
    "python3 /workspace/run/train.py",
    "/usr/bin/python3 -m torch.distributed.run --nproc 8 /workspace/run/train.py",
    "python3 /workspace/run/train_eval.py",        # look-alike
    "python3 /workspace/other/train.py",           # the same script in another directory
    "python3 /workspace/run/train.pyc",            # one character more
    "python3 -c from multiprocessing.spawn import spawn_main",
    "sshd: root@pts/0",
    "/usr/sbin/sshd -D",
    "/lib/systemd/systemd --user",
    "/sbin/init",
    "lxc-start -F -n 200",
    "bash",
    "bash -c /workspace/run/train.py",
    "sleep 1000",
    "python3 /root/.ansible/tmp/AnsiballZ_zombie_reap.py",
    "",
]
COMMS = ["python3", "pt_data_worker", "sshd", "systemd", "bash", "sleep", "train.py", "kworker/0:1"]
MATCHES = [
    [r"/workspace/run/train\.py\b"],
    [r"train"],
    [r"python3"],
    [r"sshd", r"train\.py"],
    [r"^bash"],
    [r"torch\.distributed"],
    [],
]
PROTECTED = [list(DEFAULT_PROTECTED), [], [r"\bbash\b"], list(DEFAULT_PROTECTED) + [r"train_eval", r"^pt_"], [r"\bsshd\b"]]
# /proc/PID/exe, drawn independently of the command line: what the kernel executed, whatever the
# process says about itself. "" is unreadable (another user's process).
EXECUTABLES = ["/usr/bin/python3.11", "/usr/sbin/sshd", "/usr/lib/systemd/systemd-logind", "/usr/bin/bash",
               "/home/ops/bin/sshd", "/usr/bin/lxc-start (deleted)", "/opt/venv/bin/python3", ""]
# The protected programs and where they must lie (the documentation of the `protected` option).
PROTECTED_NAMES = {"sshd", "sshd-session", "sshd-auth", "init", "systemd", "containerd", "dockerd", "runc", "crun",
                   "conmon", "lxcfs", "lxc-start", "lxc-monitord", "pve-lxc-syscalld", "pmxcfs"}
SYSTEM_DIRS = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/")


def runs_protected_program(exe: str) -> bool:
    path = exe.removesuffix(" (deleted)")
    name = path.rsplit("/", 1)[-1]
    return path.startswith(SYSTEM_DIRS) and (name in PROTECTED_NAMES or name.startswith(("systemd-", "containerd-shim")))


def _field(bits: int, shift: int, size: int) -> int:
    return (bits >> shift) % size


@st.composite
def forests(draw):
    """A SimKernel with a random forest under PID 1, and the pid of the process running the module.

    Each process is decoded from one drawn integer (fast to generate; shrinks towards a plain,
    sleeping, unprotected process under PID 1).
    """
    kernel = SimKernel(init_reaps=draw(st.booleans()))
    init_comm = draw(st.sampled_from(["systemd", "sleep", "process_api", "init"]))
    kernel.add(SimProcess(1, 1, 0, comm=init_comm, cmdline="/sbin/init", reaps=False))
    pids = draw(st.lists(st.integers(3, 400), min_size=1, max_size=28, unique=True))
    placed = [1]
    for pid in pids:
        bits = draw(st.integers(0, 2**48 - 1))
        parent = (placed + [0])[_field(bits, 0, len(placed) + 1)]
        parent_process = kernel.processes.get(parent)
        zombie = _field(bits, 10, 4) == 3
        threads = 1 + _field(bits, 12, 4)
        state = "Z" if zombie else "SSRD"[_field(bits, 14, 4)]
        groups = [pid, (parent_process.pgid or parent) if parent_process is not None and parent else pid,
                  placed[_field(bits, 18, len(placed))]]
        kernel.add(SimProcess(
            pid=pid,
            starttime=_field(bits, 20, 4096),
            ppid=parent,
            comm=COMMS[_field(bits, 32, len(COMMS))],
            cmdline=COMMAND_LINES[_field(bits, 35, len(COMMAND_LINES))],
            state=state,
            threads=threads,
            pgid=groups[_field(bits, 16, 3)],
            kernel=_field(bits, 6, 16) == 15,
            wchan=["do_freezer_trap", "uvm_va_space_destroy", "nv_wait"][_field(bits, 40, 3)],
            ignores_term=bool(_field(bits, 42, 2)),
            reaps=not _field(bits, 43, 2),
            stuck=state == "D" or (zombie and threads > 1 and bool(_field(bits, 44, 2))),
            exe=EXECUTABLES[_field(bits, 45, len(EXECUTABLES))],
        ))
        placed.append(pid)
    candidates = [p for p in pids if not kernel.processes[p].kernel]
    module = draw(st.sampled_from(candidates)) if candidates else 0
    return kernel, module


@st.composite
def scenarios(draw):
    kernel, module = draw(forests())
    existing = sorted(kernel.processes)
    listed = draw(st.lists(st.sampled_from(existing + [401, 402, module or 1]), max_size=4))
    selector = JobSelector.from_options(draw(st.sampled_from(MATCHES)), listed, draw(st.booleans()))
    protected = [re.compile(p) for p in draw(st.sampled_from(PROTECTED))]
    options = ReapOptions(
        term_signal=draw(st.sampled_from([signal.SIGTERM, signal.SIGINT, signal.SIGHUP])),
        term_timeout=1.0, kill_timeout=0.5, reap_timeout=1.0, d_state_timeout=0.5,
        reap_parents=draw(st.booleans()),
    )
    return kernel, module, selector, protected, options


class Oracle:
    """The rules, restated from the documentation without using the code under test."""

    def __init__(self, kernel: SimKernel, module: int, selector: JobSelector, protected) -> None:
        self.procs = dict(kernel.processes)
        chain, current = set(), module
        while current in self.procs and current not in chain:
            chain.add(current)
            current = self.procs[current].ppid
        self.module_chain = chain if module else set()
        self.protected_patterns = protected
        named = {pid for pid, p in self.procs.items()
                 if p.state != "Z" and p.cmdline and any(rx.search(p.cmdline) for rx in selector.patterns)}
        named |= {pid for pid in selector.pids if pid in self.procs}
        job = {pid for pid in named if not self.protected(pid)}
        if selector.include_descendants:
            frontier = list(job)
            while frontier:
                parent = frontier.pop()
                for pid, p in self.procs.items():
                    if p.ppid == parent and pid not in job and not self.protected(pid):
                        job.add(pid)
                        frontier.append(pid)
        self.job = job

    def protected(self, pid: int) -> bool:
        p = self.procs.get(pid)
        if pid == 1 or pid in self.module_chain or (p is not None and p.kernel):
            return True
        if p is not None and runs_protected_program(self.exe(pid)):
            return True
        cmdline = "" if p is None or p.state == "Z" else p.cmdline
        return p is not None and any(rx.search(cmdline) or rx.search(p.comm) for rx in self.protected_patterns)

    def exe(self, pid: int) -> str:
        """What /proc/PID/exe names: nothing for a plain zombie (its memory is gone)."""
        p = self.procs[pid]
        return "" if p.kernel or (p.state == "Z" and p.threads <= 1) else p.exe

    def exited(self, pid: int) -> bool:
        p = self.procs[pid]
        return p.state == "Z" and p.threads <= 1


def make_plan(kernel, module, selector, protected, options):
    table = kernel.table()
    protection = Protection(table, protected, own_pid=module or 99999)
    return plan_reap(table, selector, protection, options), protection


@CI
@given(scenarios())
def test_plan_targets_only_what_the_rules_allow(scenario):
    kernel, module, selector, protected, options = scenario
    oracle = Oracle(kernel, module, selector, protected)
    before = {pid: replace(p) for pid, p in kernel.processes.items()}
    plan, _protection = make_plan(kernel, module, selector, protected, options)

    assert {i.pid for i in plan.job} == oracle.job
    event(f"job of {min(len(oracle.job), 5)}{'+' if len(oracle.job) >= 5 else ''} processes")
    for stage in sorted({step.stage for step in plan.steps}):
        event(f"plans {stage}")
    if plan.protected:
        event("protected processes refused")
    job_parents = {oracle.procs[pid].ppid for pid in oracle.job} - oracle.job
    for step in plan.steps:
        target = oracle.procs[step.target.pid]
        # Never: PID 1, the module and its ancestors, kernel threads, anything protected.
        assert not oracle.protected(step.target.pid), step
        # Always the identity the snapshot saw.
        assert (step.target.starttime, step.target.comm) == (target.starttime, target.comm)
        if step.stage in (TERMINATE, KILL):
            assert step.target.pid in oracle.job and not target.state == "Z"
            assert step.signal == (options.term_signal if step.stage == TERMINATE else signal.SIGKILL)
        elif step.stage == KILL_LEADER:
            assert step.target.pid in oracle.job and target.state == "Z" and target.threads > 1
            assert step.signal == signal.SIGKILL
        elif step.stage == NOTIFY_PARENT:
            assert step.target.pid in job_parents and step.signal == signal.SIGCHLD
        else:
            assert step.stage in (END_PARENT, END_PARENT_KILL)
            assert options.reap_parents and step.target.pid in job_parents
        # A plain zombie is never signalled: nothing is left in it to receive a signal.
        assert not oracle.exited(step.target.pid)

    # Complete: every live job process is asked, then killed; every zombie leader killed.
    live = {pid for pid in oracle.job if oracle.procs[pid].state != "Z"}
    leaders = {pid for pid in oracle.job if oracle.procs[pid].state == "Z" and oracle.procs[pid].threads > 1}
    assert sorted(s.target.pid for s in plan.stage(TERMINATE)) == sorted(live)
    assert sorted(s.target.pid for s in plan.stage(KILL)) == sorted(live)
    assert sorted(s.target.pid for s in plan.stage(KILL_LEADER)) == sorted(leaders)
    # Pure: the snapshot is untouched and planning again gives the same plan.
    assert kernel.processes == before
    again = make_plan(kernel, module, selector, protected, options)[0]
    assert again.as_list() == plan.as_list()


@st.composite
def executions(draw):
    kernel, module, selector, protected, options = draw(scenarios())
    pids = sorted(kernel.processes)
    recycled = draw(st.lists(st.sampled_from(pids), unique=True, max_size=3))
    at_open = draw(st.lists(st.sampled_from(pids), unique=True, max_size=2))
    vanished = draw(st.lists(st.sampled_from(pids), unique=True, max_size=2))
    use_pidfd = draw(st.booleans())
    lookalike = draw(st.sampled_from(COMMAND_LINES))
    return kernel, module, selector, protected, options, recycled, at_open, vanished, use_pidfd, lookalike


@CI
@given(executions())
def test_executor_signals_only_printed_identities_even_when_pids_are_reused(execution):
    kernel, module, selector, protected, options, recycled, at_open, vanished, use_pidfd, lookalike = execution
    oracle = Oracle(kernel, module, selector, protected)
    plan, protection = make_plan(kernel, module, selector, protected, options)

    # Between the snapshot and the ladder, some processes exit, are reaped, and their pids are
    # taken by new processes (which may look exactly like the job).
    newcomers = set()
    for pid in recycled:
        if pid == 1:
            continue
        old = kernel.processes.pop(pid)
        kernel.add(SimProcess(pid, old.starttime + 1, 1, cmdline=lookalike, comm=old.comm, reaps=False))
        newcomers.add((pid, old.starttime + 1))
    for pid in vanished:
        if pid != 1 and pid not in recycled:
            kernel.processes.pop(pid)
    # ...and some are reused at the worst moment: after the gate pinned the pid.
    swap = {}
    if use_pidfd:
        for pid in at_open:
            if pid != 1 and pid in kernel.processes:
                swap[pid] = SimProcess(pid, kernel.processes[pid].starttime + 2, 1, cmdline=lookalike)
                newcomers.add((pid, kernel.processes[pid].starttime + 2))

    control = SimControl(kernel, use_pidfd=use_pidfd, recycle_on_open=swap)
    outcome = Executor(plan, control, protection, options, kernel.clock, kernel.sleep).run()

    printed = plan.targets
    results = {action.result for action in outcome.actions}
    for result in sorted(results):
        event(f"gate result {result}")
    event(f"escalation {outcome.escalation}")
    for pid, starttime, _sig in kernel.delivered:
        assert (pid, starttime) in printed
        assert (pid, starttime) not in newcomers
        assert not oracle.protected(pid)
    # The gate follows each signal that asks for an end (SIGTERM) with SIGCONT to the same identity (a
    # stopped process runs its handler only when continued), and nothing else: never a SIGCONT of its
    # own, never after a SIGCHLD to a zombie's parent, never to anyone else (none where the SIGTERM ended it).
    asked = [entry for entry in kernel.delivered if entry[2] != signal.SIGCONT]
    for index, (pid, starttime, sig) in enumerate(kernel.delivered):
        if sig == signal.SIGCONT:
            assert index > 0 and kernel.delivered[index - 1][:2] == (pid, starttime)
            assert kernel.delivered[index - 1][2] in CONTINUED_AFTER
    assert outcome.signals_sent == len(asked)
    # Every wait has a deadline: the whole ladder ends within the sum of its timeouts.
    ladder = 2 * options.term_timeout + 2 * options.kill_timeout + options.d_state_timeout + 2 * options.reap_timeout
    assert kernel.now <= ladder + 0.5
    # Honest: a job process still running at the end is reported as remaining.
    reported = {(e["pid"], e["starttime"]) for e in outcome.remaining}
    for identity in plan.job:
        now = kernel.processes.get(identity.pid)
        if now is not None and now.starttime == identity.starttime and not (now.state == "Z" and now.threads <= 1):
            assert identity.key in reported


CONTROLLER = "/usr/bin/python3 /usr/bin/ansible-playbook -i hosts site.yml"
BROAD_MATCHES = MATCHES + [[".*"], [""], ["."], ["x?"], ["AnsiballZ"], [r"\.py\b"], ["sshd: root"], ["sleep", r"train\.py"]]


@st.composite
def selections(draw):
    kernel, module = draw(forests())
    if module and draw(st.booleans()):
        # The module (or one of its ancestors) is the Ansible controller, as with a local connection.
        chain, current = [], module
        while current in kernel.processes and current != 1 and current not in chain:
            chain.append(current)
            current = kernel.processes[current].ppid
        kernel.processes[draw(st.sampled_from(chain))].cmdline = CONTROLLER
    existing = sorted(kernel.processes)
    listed = draw(st.lists(st.sampled_from(existing + [401, module or 1]), max_size=3))
    selector = JobSelector.from_options(draw(st.sampled_from(BROAD_MATCHES)), listed, draw(st.booleans()))
    protected = [re.compile(p) for p in draw(st.sampled_from(PROTECTED))]
    return kernel, module, selector, protected


@CI
@given(selections())
def test_the_selection_floor_refuses_exactly_what_names_more_than_a_job(scenario):
    """Refused if and only if a pattern matches the empty string or a command line on the module's
    chain (PID 1 aside), or the job takes in an Ansible process, a process such a one on the chain
    started, or a member of a process group one leads (as an oracle, "Ansible" is AnsiballZ_ on the
    command line or the one controller command line the forests hold)."""
    kernel, module, selector, protected = scenario
    oracle = Oracle(kernel, module, selector, protected)
    table = kernel.table()
    reasons = selection_floor(selector, table, Protection(table, protected, own_pid=module or 99999), module or 99999)

    def cmdline(pid):
        p = oracle.procs[pid]
        return "" if p.state == "Z" else p.cmdline

    def ancestors(pid):
        found, current = [], oracle.procs[pid].ppid
        while current in oracle.procs and current not in found:
            found.append(current)
            current = oracle.procs[current].ppid
        return found

    def names_ansible(pid):
        # The module's own ancestors are judged by their words: nothing else can become one.
        return "AnsiballZ_" in cmdline(pid) or cmdline(pid) == CONTROLLER

    def runs_ansible(pid):
        # Anything else by its executable (a python) and the program it runs, never by argv[0].
        args = cmdline(pid).split(" ")
        program = args[1] if len(args) > 1 else ""
        return (oracle.exe(pid).rsplit("/", 1)[-1].startswith("python")
                and (program.rsplit("/", 1)[-1].startswith("AnsiballZ_") or cmdline(pid) == CONTROLLER))

    chain = sorted(pid for pid in oracle.module_chain if pid != 1)
    ansible_chain = {pid for pid in chain if names_ansible(pid)}
    broad = [rx.pattern for rx in selector.patterns
             if rx.search("") or any(rx.search(cmdline(pid)) for pid in chain)]
    ansible_job = [pid for pid in oracle.job
                   if runs_ansible(pid) or ansible_chain & set(ancestors(pid))
                   or oracle.procs[pid].pgid in ansible_chain]
    event(f"controller on the chain: {bool(ansible_chain)}")
    event(f"job takes in Ansible: {bool(ansible_job)}")
    event(f"refused: {bool(reasons)}")
    assert bool(reasons) == bool(broad or ansible_job), (broad, ansible_job, reasons)
    for pattern in broad:
        assert any(r.startswith(f"match: {pattern!r} matches ") for r in reasons), (pattern, reasons)
    for pid in ansible_job:
        assert any(f" pid {pid} (" in r.split(",")[0] for r in reasons), (pid, reasons)
    # Every reason names the option that is too broad.
    assert all(r.split(":")[0] in ("match", "pids", "include_descendants") for r in reasons)
