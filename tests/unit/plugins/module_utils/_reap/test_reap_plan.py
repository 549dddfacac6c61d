"""The reap planner on hand-made process tables: which identity gets which signal, and why."""

from __future__ import annotations

import re
import signal

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.plan import (
    END_PARENT,
    END_PARENT_KILL,
    KILL,
    KILL_LEADER,
    NOTIFY_PARENT,
    TERMINATE,
    ReapOptions,
    parse_term_signal,
    plan_reap,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_timeout
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    DEFAULT_PROTECTED,
    JobSelector,
    Protection,
)
from tests.harness.reap_sim import SimKernel, SimProcess

MODULE_PID = 900  # the process "running the module" in these tables
TRAIN = r"/w/run/train\.py\b"


def base() -> SimKernel:
    kernel = SimKernel()
    kernel.add(SimProcess(1, 1, 0, comm="systemd", cmdline="/sbin/init"))
    kernel.add(SimProcess(5, 5, 1, comm="sshd", cmdline="/usr/sbin/sshd -D"))
    kernel.add(SimProcess(800, 800, 5, comm="sshd", cmdline="sshd: root@notty"))
    kernel.add(SimProcess(850, 850, 800, comm="bash", cmdline="bash -c ansible"))
    kernel.add(SimProcess(MODULE_PID, 900, 850, comm="python3", cmdline="python3 /root/.ansible/tmp/AnsiballZ_zombie_reap.py"))
    return kernel


def plan_for(kernel: SimKernel, match=(TRAIN,), pids=(), descendants=True, protected=DEFAULT_PROTECTED, **options):
    table = kernel.table()
    selector = JobSelector.from_options(list(match), list(pids), descendants)
    protection = Protection(table, [re.compile(p) for p in protected], own_pid=MODULE_PID)
    return plan_reap(table, selector, protection, ReapOptions(**options))


def steps(plan, stage):
    return [(s.target.pid, s.target.starttime, s.signal) for s in plan.stage(stage)]


def test_job_tree_gets_term_then_kill_and_decoys_nothing():
    kernel = base()
    kernel.add(SimProcess(10, 110, 1, cmdline="python3 /w/run/train.py --lr 3e-4", pgid=10))
    kernel.add(SimProcess(11, 111, 10, cmdline="python3 -c worker", pgid=10))
    kernel.add(SimProcess(12, 112, 11, comm="pt_data_worker", cmdline="python3 -c loader", pgid=10))
    kernel.add(SimProcess(20, 120, 1, cmdline="python3 /w/run/train_eval.py", pgid=20))
    kernel.add(SimProcess(21, 121, 1, cmdline="python3 /w/other/train.py", pgid=21))
    kernel.add(SimProcess(22, 122, 1, cmdline="python3 /w/run/train.pyc", pgid=22))
    plan = plan_for(kernel, term_signal=signal.SIGINT)
    assert [i.pid for i in plan.job] == [10, 11, 12]
    assert steps(plan, TERMINATE) == [(10, 110, signal.SIGINT), (11, 111, signal.SIGINT), (12, 112, signal.SIGINT)]
    assert steps(plan, KILL) == [(10, 110, signal.SIGKILL), (11, 111, signal.SIGKILL), (12, 112, signal.SIGKILL)]
    assert "every member of process group 10 is the job" in plan.stage(TERMINATE)[0].reason
    assert {s.target.pid for s in plan.steps} == {10, 11, 12}  # PID 1 reaps the top one: no parent step
    assert any("orphaned to PID 1 (systemd)" in note for note in plan.notes)


def test_a_shared_process_group_is_never_signalled_as_a_group():
    kernel = base()
    kernel.add(SimProcess(30, 130, 1, comm="sh", cmdline="sh -c launcher", pgid=30))
    kernel.add(SimProcess(31, 131, 30, cmdline="python3 /w/run/train.py", pgid=30))
    kernel.add(SimProcess(32, 132, 30, cmdline="python3 /w/run/train_eval.py", pgid=30))
    plan = plan_for(kernel)
    (term,) = plan.stage(TERMINATE)
    assert term.target.pid == 31
    assert "shares with pids 30, 32 outside the job: signalled alone" in term.reason
    assert steps(plan, NOTIFY_PARENT) == [(30, 130, signal.SIGCHLD)]
    assert 32 not in {s.target.pid for s in plan.steps}


def test_parent_outside_the_job_is_only_asked_unless_reap_parents():
    kernel = base()
    kernel.add(SimProcess(40, 140, 1, comm="bash", cmdline="bash run.sh"))
    kernel.add(SimProcess(41, 141, 40, cmdline="python3 /w/run/train.py"))
    polite = plan_for(kernel)
    assert steps(polite, NOTIFY_PARENT) == [(40, 140, signal.SIGCHLD)]
    assert polite.stage(END_PARENT) == []
    assert any("reap_parents is false" in note for note in polite.notes)

    ending = plan_for(kernel, reap_parents=True, term_signal=signal.SIGHUP)
    assert steps(ending, END_PARENT) == [(40, 140, signal.SIGHUP)]
    assert steps(ending, END_PARENT_KILL) == [(40, 140, signal.SIGKILL)]


def test_protected_parents_and_the_module_chain_are_never_planned():
    kernel = base()
    # A job started from the ansible connection itself, and one under sshd.
    kernel.add(SimProcess(50, 150, MODULE_PID, cmdline="python3 /w/run/train.py"))
    kernel.add(SimProcess(51, 151, 800, cmdline="python3 /w/run/train.py"))
    plan = plan_for(kernel, reap_parents=True)
    targets = {s.target.pid for s in plan.steps}
    assert targets == {50, 51}
    reasons = {entry["pid"]: entry["reason"] for entry in plan.protected}
    assert "runs this module or is one of its ancestors" in reasons[MODULE_PID]
    assert "runs this module or is one of its ancestors" in reasons[800]  # sshd: ancestor *and* protected


def test_naming_pid_1_the_module_or_sshd_selects_nothing():
    kernel = base()
    plan = plan_for(kernel, match=(r"sshd", r"AnsiballZ"), pids=(1, MODULE_PID, 850, 4242))
    assert plan.job == [] and plan.steps == []
    assert {entry["pid"] for entry in plan.protected} == {1, 5, 800, 850, MODULE_PID}
    assert plan.missing_pids == [4242]


def test_zombie_leader_gets_sigkill_and_plain_zombies_no_signal():
    kernel = base()
    kernel.add(SimProcess(60, 160, 1, cmdline="python3 /w/run/train.py"))
    kernel.add(SimProcess(61, 161, 60, state="Z", threads=3, ignores_term=True))
    kernel.add(SimProcess(62, 162, 60, state="Z"))
    plan = plan_for(kernel)
    assert [i.pid for i in plan.job] == [60, 61, 62]
    assert steps(plan, KILL_LEADER) == [(61, 161, signal.SIGKILL)]
    assert "threads 10062, 10063" in plan.stage(KILL_LEADER)[0].reason
    assert 62 not in {s.target.pid for s in plan.steps}
    assert plan.exited == {(62, 162)}


def test_orphaned_job_zombie_under_pid_1_is_left_to_pid_1():
    kernel = base()
    kernel.add(SimProcess(70, 170, 1, state="Z"))
    plan = plan_for(kernel, match=(), pids=(70,))
    assert [i.pid for i in plan.job] == [70]
    assert plan.steps == []
    assert any("orphaned to PID 1" in note for note in plan.notes)


def test_parent_outside_the_namespace_is_noted():
    kernel = base()
    kernel.add(SimProcess(75, 175, 0, cmdline="python3 /w/run/train.py"))
    plan = plan_for(kernel)
    assert steps(plan, TERMINATE) == [(75, 175, signal.SIGTERM)]
    assert any("outside this PID namespace" in note for note in plan.notes)


def test_threads_in_d_state_are_noted_with_their_wchan():
    kernel = base()
    kernel.add(SimProcess(80, 180, 1, cmdline="python3 /w/run/train.py", stuck=True, wchan="uvm_va_space_destroy"))
    plan = plan_for(kernel)
    assert any("wchan uvm_va_space_destroy" in note for note in plan.notes)


def test_plan_is_printable_and_pure():
    kernel = base()
    kernel.add(SimProcess(10, 110, 1, cmdline="python3 /w/run/train.py"))
    table = kernel.table()
    protection = Protection(table, [], own_pid=MODULE_PID)
    first = plan_reap(table, JobSelector.from_options([TRAIN], [], True), protection, ReapOptions())
    second = plan_reap(table, JobSelector.from_options([TRAIN], [], True), protection, ReapOptions())
    assert first.as_list() == second.as_list()
    assert first.as_list()[0] == {
        "stage": "terminate", "pid": 10, "starttime": 110, "comm": "python3", "signal": "SIGTERM",
        "reason": "job process (every member of process group 10 is the job; each is signalled by identity)",
        "when": "at once",
    }


@pytest.mark.parametrize("name, expected", [
    ("SIGTERM", signal.SIGTERM), ("term", signal.SIGTERM), ("SigInt", signal.SIGINT), ("HUP", signal.SIGHUP),
    ("SIGKILL", signal.SIGKILL),
])
def test_signal_names(name, expected):
    assert parse_term_signal(name) == expected


@pytest.mark.parametrize("name, message", [
    ("SIGFOO", "term_signal: 'SIGFOO' is not a signal name"),
    ("15", "term_signal: '15' is not a signal name"),
    ("", "term_signal: '' is not a signal name"),
    ("SIGSTOP", "term_signal: SIGSTOP does not end a process"),
    ("CHLD", "term_signal: SIGCHLD does not end a process"),
])
def test_bad_signal_names(name, message):
    with pytest.raises(BadOption, match=re.escape(message)) as caught:
        parse_term_signal(name)
    assert caught.value.option == "term_signal"


@pytest.mark.parametrize("value, words", [
    (-1, "must be at least 0 and at most 86400 seconds, got -1"),
    (-0.001, "must be at least 0 and at most 86400 seconds"),
    (86401, "must be at least 0 and at most 86400 seconds, got 86401"),
    (1e12, "must be at least 0 and at most 86400 seconds, got 1e+12"),
    (float("inf"), "must be a finite number of seconds, got inf"),
    (float("nan"), "must be a finite number of seconds, got nan"),
])
def test_bad_timeouts(value, words):
    with pytest.raises(ValueError, match=re.escape(f"term_timeout: {words}")):
        check_timeout("term_timeout", value)


def test_good_timeouts():
    assert check_timeout("x", 0) == 0.0
    assert check_timeout("x", 2.5) == 2.5
    assert check_timeout("x", 86400) == 86400.0  # a day, the bound of every timeout
