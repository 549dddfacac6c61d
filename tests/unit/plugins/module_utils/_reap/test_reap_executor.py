"""The executor's ladder and signal gate on a simulated kernel (real processes: tests/integration)."""

from __future__ import annotations

import re
import signal

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.executor import Executor, options_from_params
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.plan import ReapOptions, plan_reap
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import GONE, RECYCLED, SENT
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    DEFAULT_PROTECTED,
    JOB_SELECTION_SPEC,
    JobSelector,
    Protection,
)
from tests.harness.reap_sim import SimControl, SimKernel, SimProcess

MODULE_PID = 900
OPTIONS = {"term_timeout": 3.0, "kill_timeout": 2.0, "reap_timeout": 4.0, "d_state_timeout": 5.0}


def world(init_reaps: bool = True) -> SimKernel:
    kernel = SimKernel(init_reaps=init_reaps)
    kernel.add(SimProcess(1, 1, 0, comm="sleep", cmdline="sleep infinity", reaps=False))
    kernel.add(SimProcess(MODULE_PID, 900, 1, cmdline="python3 AnsiballZ_zombie_reap.py"))
    return kernel


def reap(kernel: SimKernel, match=(r"train\.py",), pids=(), use_pidfd=True, recycle_on_open=None, **overrides):
    table = kernel.table()
    protection = Protection(table, [re.compile(p) for p in DEFAULT_PROTECTED], own_pid=MODULE_PID)
    options = ReapOptions(**dict(OPTIONS, **overrides))
    plan = plan_reap(table, JobSelector.from_options(list(match), list(pids), True), protection, options)
    control = SimControl(kernel, use_pidfd=use_pidfd, recycle_on_open=recycle_on_open)
    outcome = Executor(plan, control, protection, options, kernel.clock, kernel.sleep).run()
    return plan, outcome


def sent(outcome):
    return [(a.step.stage, a.step.target.pid, a.step.signal.name)
            for a in outcome.actions if a.result == SENT]


def test_a_job_that_exits_on_term_gets_nothing_more():
    kernel = world()
    kernel.add(SimProcess(10, 110, 1, cmdline="python3 train.py"))
    kernel.add(SimProcess(11, 111, 10, cmdline="python3 train.py worker"))
    _plan, outcome = reap(kernel)
    assert sent(outcome) == [("terminate", 10, "SIGTERM"), ("terminate", 11, "SIGTERM")]
    assert outcome.escalation == Escalation.NONE and outcome.remaining == []
    assert {(e["pid"], e["now"]) for e in outcome.ended} == {(10, "gone"), (11, "gone")}
    assert outcome.changed
    assert kernel.now < 1.0  # polled: no waiting out the term_timeout


def test_term_ignored_means_sigkill_after_term_timeout():
    kernel = world()
    kernel.add(SimProcess(10, 110, 1, cmdline="python3 train.py", ignores_term=True))
    _plan, outcome = reap(kernel)
    assert sent(outcome) == [("terminate", 10, "SIGTERM"), ("kill", 10, "SIGKILL")]
    kill = [a for a in outcome.actions if a.step.stage == "kill"][0]
    assert kill.elapsed >= OPTIONS["term_timeout"]
    assert outcome.escalation == Escalation.NONE


def test_zombie_leader_is_killed_at_once():
    kernel = world()
    kernel.add(SimProcess(20, 120, 1, cmdline="python3 train.py"))
    kernel.add(SimProcess(21, 121, 20, state="Z", threads=2, ignores_term=True))
    _plan, outcome = reap(kernel)
    assert ("kill_leader", 21, "SIGKILL") in sent(outcome)
    assert 21 not in kernel.processes


def test_stuck_in_d_is_host_action_naming_the_wchan():
    kernel = world()
    stuck = kernel.add(SimProcess(30, 130, 1, cmdline="python3 train.py", stuck=True, wchan="uvm_va_space_destroy"))
    _plan, outcome = reap(kernel)
    assert outcome.escalation == Escalation.HOST_ACTION
    assert "wchan uvm_va_space_destroy" in outcome.reasons[0] and "pid 30 thread 30" in outcome.reasons[0]
    assert outcome.remaining[0]["state"] == "D"
    assert kernel.now >= OPTIONS["term_timeout"] + OPTIONS["d_state_timeout"]
    assert stuck.pending_kill  # the SIGKILL was sent and waits for the task to wake
    kernel.wake(30)
    assert kernel.processes[30].state == "Z"


def test_orphans_under_an_init_that_never_reaps_need_a_container_reboot():
    kernel = world(init_reaps=False)
    kernel.add(SimProcess(40, 140, 1, cmdline="python3 train.py"))
    kernel.add(SimProcess(41, 141, 40, cmdline="python3 train.py worker", reaps=False))
    kernel.add(SimProcess(42, 142, 41, state="Z"))
    _plan, outcome = reap(kernel)
    assert outcome.escalation == Escalation.CONTAINER_REBOOT
    assert "zombies 40, 41, 42 are orphaned to PID 1 (sleep)" in outcome.reasons[0]
    assert {e["pid"] for e in outcome.remaining} == {40, 41, 42}


def test_zombie_of_a_parent_that_never_reaps():
    def make() -> SimKernel:
        kernel = world()
        kernel.add(SimProcess(50, 150, 1, comm="bash", cmdline="bash run.sh", reaps=False))
        kernel.add(SimProcess(51, 151, 50, state="Z"))
        return kernel

    kernel = make()
    _plan, outcome = reap(kernel, match=(), pids=(51,))
    assert sent(outcome) == [("notify_parent", 50, "SIGCHLD")]
    assert outcome.escalation == Escalation.NONE
    assert "reap_parents: true would end that parent" in outcome.remaining[0]["reason"]
    assert not outcome.changed  # a signal was sent, but nothing went away

    kernel = make()
    _plan, outcome = reap(kernel, match=(), pids=(51,), reap_parents=True)
    assert sent(outcome) == [("notify_parent", 50, "SIGCHLD"), ("end_parent", 50, "SIGTERM")]
    assert 50 not in kernel.processes and 51 not in kernel.processes
    assert outcome.changed and outcome.remaining == []


def test_a_pid_recycled_before_the_signal_is_never_signalled():
    for use_pidfd in (True, False):
        kernel = world()
        kernel.add(SimProcess(60, 160, 1, cmdline="python3 train.py"))
        table = kernel.table()
        protection = Protection(table, [], own_pid=MODULE_PID)
        options = ReapOptions(**OPTIONS)
        plan = plan_reap(table, JobSelector.from_options([r"train\.py"], [], True), protection, options)
        # The job exits and is reaped; an unrelated process gets its pid before the ladder runs.
        del kernel.processes[60]
        kernel.add(SimProcess(60, 999, 1, comm="bash", cmdline="bash"))
        outcome = Executor(plan, SimControl(kernel, use_pidfd=use_pidfd), protection, options, kernel.clock, kernel.sleep).run()
        assert kernel.delivered == []
        assert outcome.signals_sent == 0 and not outcome.changed
        assert kernel.processes[60].state == "S"


def test_a_pid_recycled_while_being_pinned_is_never_signalled():
    kernel = world()
    kernel.add(SimProcess(61, 161, 1, cmdline="python3 train.py"))
    replacement = SimProcess(61, 777, 1, comm="bash", cmdline="bash")
    _plan, outcome = reap(kernel, recycle_on_open={61: replacement})
    assert [a.result for a in outcome.actions] == [RECYCLED]
    assert kernel.delivered == []
    assert kernel.processes[61] is replacement and replacement.state == "S"


def test_gone_before_the_signal():
    kernel = world()
    kernel.add(SimProcess(62, 162, 1, cmdline="python3 train.py"))
    table = kernel.table()
    protection = Protection(table, [], own_pid=MODULE_PID)
    plan = plan_reap(table, JobSelector.from_options([r"train\.py"], [], True), protection, ReapOptions(**OPTIONS))
    control = SimControl(kernel)
    del kernel.processes[62]
    assert control.send(plan.steps[0].target, signal.SIGTERM) == GONE


# --- zombie_reap's options ---------------------------------------------------------------------

def reap_params(**overrides):
    values = {name: spec.get("default") for name, spec in JOB_SELECTION_SPEC.items()}
    values.update(term_signal="SIGTERM", term_timeout=10.0, kill_timeout=10.0, reap_timeout=5.0,
                  d_state_timeout=30.0, reap_parents=False, orphan_grace=2.0, match=[r"train\.py"])
    values.update(overrides)
    return values


def test_every_bad_option_is_reported_at_once():
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(reap_params(
            match=["train(.py"], protected=["[sshd"], pids=[0], term_signal="STOP", term_timeout=-1,
            kill_timeout=float("nan"), reap_timeout=float("inf"), d_state_timeout=1e12, orphan_grace=601,
            proc_root="/nonexistent",
        ))
    error = caught.value
    assert error.options == ["pids", "match", "protected", "term_signal", "term_timeout", "kill_timeout",
                             "reap_timeout", "d_state_timeout", "orphan_grace", "proc_root"]
    result = error.as_result()
    assert set(result) == {"msg", "option_problems"} and all(set(p) == {"option", "reason"} for p in result["option_problems"])
    assert "term_signal: SIGSTOP does not end a process" in result["msg"]
    assert "proc_root: /nonexistent is not the process table" in result["msg"]


def test_an_empty_selection_is_refused_unless_it_is_empty_because_of_a_bad_pid():
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(reap_params(match=[]), check_mode=True)
    assert caught.value.options == ["match"] and "is empty, and so is pids" in str(caught.value)
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(reap_params(match=[], pids=[-1]), check_mode=True)
    assert caught.value.options == ["pids"]


def test_good_options_and_check_mode_on_a_foreign_proc_root():
    selector, protected, options = options_from_params(
        reap_params(term_signal="int", term_timeout=2, proc_root="/nonexistent"), check_mode=True)
    assert options.term_signal == signal.SIGINT and options.term_timeout == 2.0 and selector.patterns
    assert len(protected) == len(DEFAULT_PROTECTED)


def test_an_internal_error_is_not_reported_as_a_bad_option(monkeypatch):
    from ansible_collections.gpuops.relaunch.plugins.module_utils._reap import executor

    def broken(*_args):
        raise ValueError("a bug, not the user's signal")

    monkeypatch.setattr(executor, "parse_term_signal", broken)
    with pytest.raises(ValueError, match="a bug") as caught:
        options_from_params(reap_params(), check_mode=True)
    assert not isinstance(caught.value, (BadOption, OptionsInvalid))


def test_expect_run_id_needs_the_job_and_is_a_run_id():
    selector, _protected, _options = options_from_params(
        reap_params(job_name="llm", job_state_dir="/var/lib/gpuops", expect_run_id="3f2a9c0e"), check_mode=True)
    assert selector.job_dir == "/var/lib/gpuops/llm" and selector.expect_run_id == "3f2a9c0e"
    assert options_from_params(reap_params(), check_mode=True)[0].expect_run_id is None
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(reap_params(expect_run_id="3f2a9c0e"), check_mode=True)
    assert caught.value.options == ["expect_run_id"] and "needs job_name" in str(caught.value)
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(reap_params(job_name="llm", expect_run_id="a b"), check_mode=True)
    assert caught.value.options == ["expect_run_id"] and "'a b' is not a run id" in str(caught.value)
