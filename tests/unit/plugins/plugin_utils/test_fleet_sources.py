"""relaunch_fleet reads each host's summary from this run's registered results (action relaunch_fleet's
this_runs_summary), never from the fact, which a fact cache can carry over from an earlier run."""

from __future__ import annotations

from ansible_collections.gpuops.relaunch.plugins.action.relaunch_fleet import this_runs_summary

SUMMARY = {"host": "gpu1", "status": "unchanged"}
RELAUNCHED = {"host": "gpu1", "status": "relaunched"}


def test_a_host_the_decision_finished_has_the_decisions_summary():
    decided = {"done": True, "ansible_facts": {"relaunch_summary": SUMMARY}}
    assert this_runs_summary(decided, {"ansible_facts": {"relaunch_summary": RELAUNCHED}}, "relaunch_summary") == SUMMARY


def test_a_host_that_went_on_has_the_summary_tasks_and_none_without_one():
    decided = {"done": False, "ansible_facts": {"relaunch_decision": {}}}
    assert this_runs_summary(decided, {"ansible_facts": {"relaunch_summary": RELAUNCHED}}, "relaunch_summary") == RELAUNCHED
    # Unreachable during the steps: the summary task did not run (the role forgets an earlier include's result).
    assert this_runs_summary(decided, None, "relaunch_summary") is None
    assert this_runs_summary(decided, {"ansible_facts": {"relaunch_summary": "not a summary"}}, "relaunch_summary") is None


def test_an_unreachable_decision_has_what_it_registered_and_nothing_else():
    assert this_runs_summary({"unreachable": True}, None, "relaunch_summary") is None
    failed = {"done": True, "unreachable": True, "ansible_facts": {"relaunch_summary": {"status": "failed"}}}
    assert this_runs_summary(failed, None, "relaunch_summary") == {"status": "failed"}
