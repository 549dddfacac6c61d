"""_launch/decision.py and _launch/plan.py: the relaunch's policy, rule by rule, and the plan of a start."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.decision import (
    ACTION_WORDS,
    PLANNING_STATES,
    STATE_WORDS,
    Action,
    decide,
    resume_mode_for,
    would_resume,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import Failure, RelaunchDelay, RelaunchGuard
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import HealthReport
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.plan import Operation, plan_start
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobStatus
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Health

NOW = 1_800_000_000.0
GUARD = RelaunchGuard(1, 3600.0)
FINISHED_EXIT = {"exit_code": 0, "exit_signal": None, "ended_at": "2026-12-03T10:00:00+00:00"}


def report(state: Health, reason: str = "why", run_id: str | None = "r1") -> HealthReport:
    return HealthReport(state, reason, run_id, exit=FINISHED_EXIT if state is Health.FINISHED else {})


def guard_report(health: HealthReport, recent: int = 0) -> dict:
    history = [{"at": NOW - 10 - n, "run_id": f"r{n}", "health": "crashed"} for n in range(recent)]
    return GUARD.report(history, NOW, health.state.failed and health.has_run)


RULES = [
    # state, other spec, force, resume given -> action, why
    (Health.CRASHED, False, False, True, "relaunch", "the job is crashed: why"),
    (Health.STALLED, False, False, True, "relaunch", "the job is stalled: why"),
    (Health.MISSING, False, False, True, "relaunch", "the job is missing: why"),
    (Health.STOPPED, False, False, False, "relaunch", "the job is stopped: why"),
    (Health.CRASHED, True, True, True, "relaunch", "the job is crashed: why"),
    (Health.FINISHED, False, False, False, "none",
     "left alone: the job finished (exit code 0 at 2026-12-03T10:00:00+00:00); relaunch_force relaunches it"),
    (Health.FINISHED, False, True, False, "relaunch",
     "forced (relaunch_force), although the job finished (exit code 0 at 2026-12-03T10:00:00+00:00)"),
    (Health.RUNNING, True, False, False, "relaunch", "the job runs with another spec, log path or backend"),
    (Health.RUNNING, True, True, False, "relaunch", "the job runs with another spec, log path or backend"),
    (Health.RUNNING, False, False, False, "none", "left alone: it runs with this spec (why)"),
    (Health.RUNNING, False, True, False, "relaunch", "forced (relaunch_force): it runs with this spec (why)"),
]


@pytest.mark.parametrize("state, other_spec, force, resume, action, why", RULES)
def test_each_rule(state, other_spec, force, resume, action, why) -> None:
    health = report(state)
    decision = decide(health, other_spec, GUARD, guard_report(health), force, resume)
    resumes = resume and action == "relaunch"
    assert decision.as_dict() == {"action": action, "relaunch": action == "relaunch", "why": why,
                                  "resume": resumes, "resume_mode": "always" if resumes else "never", "resumable": False}


@pytest.mark.parametrize("state", [Health.RUNNING, Health.CRASHED, Health.FINISHED])
def test_resumable_says_whether_a_start_told_always_would_resume_whatever_is_decided(state) -> None:
    """The other ranks of a multi-rank job one of whose ranks failed are told to resume: whether each then
    appends its resume_args is would_resume's answer for always (it has some, and the job ran before)."""
    health = report(state)
    with_args = decide(health, False, GUARD, guard_report(health), False, False, ("--resume", "latest"))
    assert with_args.resumable is would_resume(("--resume", "latest"), "always", health) is health.has_run is True
    assert decide(health, False, GUARD, guard_report(health), False, False).resumable is False
    first = report(state, run_id=None)  # never ran: nothing to resume from
    assert decide(first, False, GUARD, guard_report(first), False, False, ("--resume", "latest")).resumable is False


@pytest.mark.parametrize("state", [Health.CRASHED, Health.STALLED, Health.MISSING])
def test_a_relaunch_past_the_guard_is_refused_with_the_guards_own_text(state) -> None:
    health = report(state)
    past = guard_report(health, recent=1)
    assert past["would_refuse"] is True
    decision = decide(health, False, GUARD, past, False, True)
    assert decision.action is Action.REFUSED and decision.relaunch is False and decision.resume is False
    assert decision.why == GUARD.refusal(past, state.value)
    assert "reset_guard=true / job_launch_reset_guard=true" in decision.why and "max_relaunches" in decision.why


def test_a_relaunch_before_its_due_time_is_left_for_later_and_a_start_refused() -> None:
    # The growing delay: the decision leaves the job (no worker waits), a start before due_at is refused.
    health = report(Health.CRASHED)
    guard = RelaunchGuard(5, 3600.0, RelaunchDelay(60.0, 600.0))
    history = [{"at": NOW - 10, "run_id": "r0", "health": "crashed", "step": "3", "counted": True}]
    early = guard.report(history, NOW, True, Failure("3"))
    decision = decide(health, False, guard, early, False, True)
    assert decision.action is Action.NONE and decision.due_at == early["due_at_iso"]
    assert decision.as_dict()["due_at"] == early["due_at_iso"] and "in 50s" in decision.why
    status = JobStatus({"run_id": "r1"}, {"exit_code": 3}, False)
    plan = plan_start(always_restart=False, status=status, active=False, health=health, same_spec=False, guard=guard,
                      guard_report=early, resume=False, backend="supervisor", spec_hash="h", rotated_log=None,
                      removed_paths=())
    assert plan.kind == "refuse" and plan.refusal == decision.why
    due = guard.report(history, NOW + 50, True, Failure("3"))
    assert decide(health, False, guard, due, False, True).action is Action.RELAUNCH
    assert "due_at" not in decide(health, False, guard, due, False, True).as_dict()
    progressed = guard.report(history, NOW, True, Failure("4"))
    assert decide(health, False, guard, progressed, False, True).action is Action.RELAUNCH


@pytest.mark.parametrize("state, force", [(Health.FINISHED, True), (Health.RUNNING, True), (Health.STOPPED, False)])
def test_the_guard_counts_only_relaunches_after_a_failure(state, force) -> None:
    # Forced, stopped or finished: not a relaunch after a failure, so never refused.
    health = report(state)
    decision = decide(health, False, GUARD, guard_report(health, recent=5), force, False)
    assert decision.action is Action.RELAUNCH


def test_a_first_launch_is_a_relaunch_the_guard_never_refuses() -> None:
    health = HealthReport(Health.MISSING, "no record of a run of this job")
    decision = decide(health, False, RelaunchGuard(0, 3600.0), RelaunchGuard(0, 3600.0).report([], NOW, False), False, False)
    assert decision.action is Action.RELAUNCH and decision.why == "the job is missing: no record of a run of this job"


def test_one_vocabulary() -> None:
    assert ACTION_WORDS == ("none", "relaunch", "refused")
    assert STATE_WORDS == ("started", "restarted", "stopped", "health", "probe")
    assert PLANNING_STATES == ("started", "restarted", "probe")


@pytest.mark.parametrize("resume_args, mode, state, run_id, expected", [
    ((), "always", Health.CRASHED, "r1", False),
    (("--resume",), "auto", Health.CRASHED, "r1", True),
    (("--resume",), "auto", Health.FINISHED, "r1", False),
    (("--resume",), "auto", Health.MISSING, None, False),       # a first launch
    (("--resume",), "always", Health.FINISHED, "r1", True),
    (("--resume",), "always", Health.MISSING, None, False),
    (("--resume",), "never", Health.CRASHED, "r1", False),
])
def test_would_resume(resume_args, mode, state, run_id, expected) -> None:
    assert would_resume(resume_args, mode, HealthReport(state, "why", run_id)) is expected


def plan(health: HealthReport, running: bool, same: bool, always: bool = False, recent: int = 0):
    status = JobStatus({"run_id": "r1", "spec_hash": "h", "backend": "supervisor", "log_path": "/l"} if health.has_run else None,
                       None, running)
    return plan_start(always_restart=always, status=status, active=running, health=health, same_spec=same,
                      guard=GUARD, guard_report=guard_report(health, recent), resume=False, backend="supervisor",
                      spec_hash="h", rotated_log="/l.1", removed_paths=("/tmp/x",))


@pytest.mark.parametrize("state, running, same, always, operation, other", [
    (Health.RUNNING, True, True, False, Operation.NONE, False),
    (Health.RUNNING, True, True, True, Operation.RESTART, False),
    (Health.RUNNING, True, False, False, Operation.RESTART, True),
    (Health.STALLED, True, True, False, Operation.RESTART, False),
    (Health.CRASHED, False, True, False, Operation.START, False),
    (Health.FINISHED, False, False, False, Operation.START, False),
])
def test_the_plan(state, running, same, always, operation, other) -> None:
    made = plan(report(state), running, same, always)
    assert made.operation is operation and made.other_spec is other and made.refusal is None
    assert made.kind == operation.value
    assert made.relaunch is (state.failed)
    if operation is not Operation.NONE:
        assert made.rotated_log == "/l.1" and made.removed_paths == ("/tmp/x",)


def test_the_plan_refuses_past_the_guard_with_its_text() -> None:
    made = plan(report(Health.CRASHED), False, True, recent=1)
    assert made.kind == "refuse" and made.operation is Operation.START
    assert made.refusal == GUARD.refusal(guard_report(report(Health.CRASHED), 1), "crashed")


@pytest.mark.parametrize("state", [Health.CRASHED, Health.STALLED, Health.MISSING])
def test_the_decision_and_the_plan_refuse_with_one_text(state) -> None:
    # One refusal: what the probe's decision reports is what the start fails with.
    health = report(state)
    made = plan(health, False, True, recent=1)
    decision = decide(health, False, GUARD, guard_report(health, 1), False, True)
    assert decision.action is Action.REFUSED and made.refusal == decision.why


def test_the_guard_refuses_only_what_its_report_refuses() -> None:
    health = report(Health.CRASHED)
    assert GUARD.refusal(guard_report(health, 0), "crashed") is None
    assert GUARD.refusal(GUARD.report([{"at": NOW - 1}], NOW, needed=False), "crashed") is None
    assert "relaunched after a failure 1 times" in GUARD.refusal(guard_report(health, 1), "crashed")


@pytest.mark.parametrize("resume_args, mode, state, run_id", [
    (resume_args, mode, state, run_id)
    for resume_args in ((), ("--resume",))
    for mode in ("auto", "always", "never")
    for state in (Health.CRASHED, Health.STALLED, Health.RUNNING, Health.FINISHED, Health.MISSING)
    for run_id in ("r1", None)
])
def test_the_start_told_the_probes_resume_mode_resumes_as_the_probe_said(resume_args, mode, state, run_id) -> None:
    # The relaunch stops the job first; the stop records the health it found, so the start judges a run
    # of the same health: told the decision's resume_mode, it appends resume_args exactly when the
    # probe's decision said it would.
    health = HealthReport(state, "why", run_id)
    said = decide(health, True, GUARD, guard_report(health), True, would_resume(resume_args, mode, health)).as_dict()
    assert said["action"] == "relaunch"
    assert would_resume(resume_args, said["resume_mode"], health) is said["resume"]
    assert said["resume_mode"] == resume_mode_for(said["resume"])
