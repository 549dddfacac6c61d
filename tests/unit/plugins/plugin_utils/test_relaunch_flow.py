"""The relaunch role's decisions and summaries (plugin_utils/relaunch_flow): plain functions of results."""

from __future__ import annotations

import json
import os
from urllib.parse import unquote

import pytest

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import (
    FAILED_EARLY, FLEET_STATUSES, NOT_LOOKED, Rank, RelaunchInputError, alerted_job_hosts, check_fleet_wide, check_ranks, check_ranks_in_inventory,
    check_strategy, clearance, decide, failure_message, fleet_line, fleet_summary, host_summary, outcome_line, rank_of,
    seen_run, superseded,
)
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import (
    CHECK_DIR, FLEET_FILE, ReportError, file_name_part, report_dir, summary_file_name, write_report,
)
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import awx_job, check_ranks_in_slice
from tests.harness.awx_slices import awx_meta_vars, slice_inventory, sliced_hosts


def probe(action: str = "none", state: str = "running", why: str = "w", resume: bool = False) -> dict:
    return {"health": {"state": state, "reason": "r"}, "decision": {
        "action": action, "relaunch": action == "relaunch", "why": why, "resume": resume}}


RANKS = Rank(0, ("a", "b", "c"), "a", 29500)


def test_a_single_host_takes_the_probes_decision_as_it_is():
    decision = decide(probe("relaunch", "crashed", "the job is crashed: exit 1", True))
    assert decision == {"action": "relaunch", "relaunch": True, "why": "the job is crashed: exit 1", "resume": True,
                        "resume_mode": None, "stop": True, "wanted_by": [], "expect_run_id": ""}


def test_the_stop_runs_only_when_something_of_the_job_runs():
    assert decide(dict(probe("relaunch", "crashed"), running=False))["stop"] is False
    assert decide(dict(probe("relaunch", "running"), running=True))["stop"] is True


def test_an_alert_for_this_hosts_job_leaves_the_decision_to_the_probe():
    crashed = probe("relaunch", "crashed", "the job is crashed: exit 1", True)
    assert decide(crashed, alerted_job="llm", job_name="llm") == decide(crashed)
    # No alert (a watchdog run): "" is how ansible-core before 2.19 renders an unset one.
    assert decide(crashed, alerted_job="", job_name="llm") == decide(crashed)
    # A late or duplicate alert: the probe finds the job running, so nothing happens either way.
    assert decide(probe(), alerted_job="llm", job_name="llm")["action"] == "none"


@pytest.mark.parametrize("action", ["relaunch", "refused"])
def test_an_alert_for_another_job_does_nothing_and_says_so(action):
    """The host's inventory job is not the one the alert named (renamed, or a stale textfile): nothing is
    stopped or launched, and the crash-loop guard is not asked either."""
    decision = decide(probe(action, "crashed", resume=True), alerted_job="old-llm", job_name="llm")
    assert decision == {"action": "none", "relaunch": False, "resume": False, "resume_mode": None, "stop": False,
                        "wanted_by": [], "why": decision["why"], "expect_run_id": ""}
    assert decision["why"] == ("the alert names the job 'old-llm', but this host's job (job_launch_name) is 'llm': "
                               "nothing is done")
    # A rank of a multi-rank job: the other ranks' wishes do not make it relaunch for another job's alert.
    probes = {"a": probe(), "b": probe("relaunch", "stalled"), "c": probe()}
    assert decide(probes["a"], RANKS, probes, alerted_job="old-llm", job_name="llm")["relaunch"] is False


def test_an_alert_for_another_host_does_nothing_on_this_one():
    """The limit reached this host although the alert named another (a group or a pattern such as 'all' in the
    alert's gpuops_host): only the named host may act on its alert."""
    crashed = probe("relaunch", "crashed")
    assert decide(crashed, alerted_host="gpu1", host="gpu1", alerted_job="llm", job_name="llm") == decide(crashed)
    other = decide(crashed, alerted_host="all", host="gpu1", alerted_job="llm", job_name="llm")
    assert other["action"] == "none" and other["relaunch"] is False and other["stop"] is False
    assert other["why"] == "the alert names the host 'all', not this one ('gpu1'): nothing is done"


def test_an_alert_that_names_a_rank_of_the_job_reaches_every_rank_and_no_other_job():
    """The event path names a multi-rank job by its rank 0 (gpuops_rank0): every rank acts on it; a host
    of another job does nothing, whatever its probe found."""
    probes = {"a": probe(), "b": probe("relaunch", "crashed"), "c": probe()}
    for host in RANKS.ranks:
        rank = Rank(RANKS.ranks.index(host), RANKS.ranks, "a", 29500)
        assert decide(probes[host], rank, probes, alerted_host="a", host=host, alerted_job="llm", job_name="llm") == (
            decide(probes[host], rank, probes))
    other = decide(probe("relaunch", "crashed"), Rank(0, ("x", "y"), "x", 29500), {}, alerted_host="a", host="x")
    assert other["relaunch"] is False and other["why"] == (
        "the alert names the host 'a', not this one ('x') nor a rank of its job: nothing is done")


@pytest.mark.parametrize(("alerted", "host", "ranks", "expect"), [
    ("a", "a", ["a", "b", "c"], ["a", "b", "c"]),      # rank 0 names its job's ranks, in rank order
    ("b", "b", ("a", "b"), ["a", "b"]),                # any rank does
    ("gpu1", "gpu1", None, ["gpu1"]),                  # a job of one host
    ("gpu1", "gpu1", "", ["gpu1"]),                    # unset, as ansible-core before 2.19 renders it
    ("gpus", "gpu1", None, []),                        # a group name in the label reached this host
    ("a", "a", ["a", "z"], ["a"]),                     # a rank the inventory lacks is never added
    ("a", "a", ["b", "c"], ["a"]),                     # ranks that leave the host out: the host, which refuses
    ("a", "a", "a,b", ["a"]),                          # not a list
    ("a", "a", {"a": 1}, ["a"]),
])
def test_the_alerted_jobs_hosts_are_its_ranks_in_the_inventory(alerted, host, ranks, expect):
    assert alerted_job_hosts(alerted, host, ranks, ["a", "b", "c", "gpu1"]) == expect


def test_the_alerted_job_is_quoted_with_its_control_characters_escaped():
    why = decide(probe("relaunch", "crashed"), alerted_job="x\x1b]0;owned\x07\n", job_name="llm")["why"]
    assert "\x1b" not in why and "\n" not in why and "\\x1b" in why


def test_one_rank_that_must_relaunch_relaunches_every_rank_and_all_resume_after_a_failure():
    probes = {"a": probe(), "b": probe("relaunch", "stalled"), "c": probe()}
    decision = decide(probes["a"], RANKS, probes)
    assert decision["relaunch"] and decision["action"] == "relaunch"
    assert decision["why"] == "relaunched with its job, because rank(s) b must be"
    assert decision["resume_mode"] == "always" and decision["wanted_by"] == ["b"]


def test_every_rank_resumes_the_newest_step_complete_on_all_of_them():
    def with_steps(answer: dict, steps: list | None) -> dict:
        return dict(answer, checkpoint={"complete_steps": steps, "step": (steps or [None])[0]})

    probes = {"a": with_steps(probe(), [300, 200, 100]), "b": with_steps(probe("relaunch", "crashed"), [200, 100]),
              "c": with_steps(probe(), [300, 200])}
    assert {decide(probes[host], RANKS, probes)["checkpoint_step"] for host in RANKS.ranks} == {200}
    probes["c"] = with_steps(probe(), [300])  # c's 200 is torn: no step is complete on every rank
    assert decide(probes["a"], RANKS, probes)["checkpoint_step"] == -1
    probes["c"] = probe()  # a rank that judges none rules every step out
    assert decide(probes["a"], RANKS, probes)["checkpoint_step"] == -1
    plain = {"a": probe(), "b": probe("relaunch", "crashed"), "c": probe()}  # no checkpoint_dir: nothing to agree on
    assert "checkpoint_step" not in decide(plain["a"], RANKS, plain)
    healthy = {host: with_steps(probe(), [100]) for host in RANKS.ranks}  # no relaunch: no step
    assert "checkpoint_step" not in decide(healthy["a"], RANKS, healthy)


def test_a_rank_the_guard_refuses_still_takes_its_job_with_it_and_keeps_its_own_refusal():
    probes = {"a": probe(), "b": probe("refused", "crashed", "guard"), "c": probe()}
    assert decide(probes["a"], RANKS, probes)["action"] == "relaunch"
    assert decide(probes["b"], RANKS, probes)["action"] == "refused"


def test_a_rank_that_did_not_answer_does_not_relaunch_a_healthy_job():
    probes = {"a": probe(), "b": None, "c": {"failed": True, "msg": "unreachable"}}
    decision = decide(probes["a"], RANKS, probes)
    assert decision["action"] == "none" and not decision["relaunch"] and decision["resume_mode"] is None


def test_a_rank_relaunched_with_its_failed_job_says_it_resumes_only_where_its_start_can():
    """Every rank is told to resume (resume_mode always); one without resume_args, or that never ran, cannot,
    and its decision says so (the probe's resumable)."""
    probes = {"a": dict(probe(), decision=dict(probe()["decision"], resumable=False)),
              "b": probe("relaunch", "crashed", resume=True),
              "c": dict(probe(), decision=dict(probe()["decision"], resumable=True))}
    assert decide(probes["a"], RANKS, probes)["resume"] is False
    assert decide(probes["c"], RANKS, probes)["resume"] is True
    assert {decide(probes[name], RANKS, probes)["resume_mode"] for name in "ac"} == {"always"}


def test_a_forced_relaunch_of_healthy_ranks_does_not_resume():
    probes = {name: probe("relaunch", "running", "forced") for name in "abc"}
    assert decide(probes["a"], RANKS, probes)["resume_mode"] is None


@pytest.mark.parametrize("variable, does", [("relaunch_force", "to force"),
                                            ("job_launch_reset_guard", "to reset the crash-loop guard of")])
@pytest.mark.parametrize("forced, hosts, named, refused", [
    (4, 4, False, True), (4, 4, True, False), (3, 4, False, False), (0, 0, False, False)])
def test_a_force_or_a_guard_reset_on_every_host_needs_the_hosts_named(variable, does, forced, hosts, named, refused):
    play = [f"h{index}" for index in range(hosts)]
    asked: list[str] = []

    def is_forced(host):
        asked.append(host)
        return play.index(host) < forced
    if refused:
        with pytest.raises(RelaunchInputError) as raised:
            check_fleet_wide(variable, True, is_forced, play, named)
        assert str(raised.value).startswith(f"{variable} is true on every host of the play (4), and neither "
                                            f"relaunch_hosts nor --limit says which hosts {does}: nothing was changed")
    else:
        check_fleet_wide(variable, True, is_forced, play, named)
    # The others are asked only until the first that is not forced (3 of 4: up to h3).
    assert len(asked) <= (0 if named else min(forced + 1, hosts))
    asked.clear()
    check_fleet_wide(variable, False, is_forced, play, named)
    assert not asked, "a run without it reads no other host's variables"


def test_rank_layout_problems_are_each_named():
    layouts = {"a": ["a", "b", "c"], "b": ["a", "b", "c"], "c": ["c", "b", "a"]}
    with pytest.raises(RelaunchInputError) as raised:
        check_ranks("a", ["a", "b", "c"], layouts, ["a", "b", "c"], ["a", "b"])
    assert "c are not in this batch" in str(raised.value) and "rank(s) c list other ranks" in str(raised.value)
    with pytest.raises(RelaunchInputError, match="does not list this host"):
        check_ranks("x", ["a"], {"a": ["a"]}, ["a", "x"], ["a", "x"])
    with pytest.raises(RelaunchInputError, match="must be a list"):
        check_ranks("a", "a,b", {}, ["a"], ["a"])
    check_ranks("b", ["a", "b"], {"a": ["a", "b"], "b": ["a", "b"]}, ["a", "b"], ["a", "b"])


def test_rank_zero_gives_the_address_and_port():
    rank = rank_of("b", ["a", "b"], {"ansible_host": "10.0.0.1"})
    assert rank.env() == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1", "NNODES": "2"}
    assert rank_of("a", ["a"], {"job_launch_master_addr": "m", "job_launch_master_port": 1234}).env()["MASTER_PORT"] == "1234"


# --- a sliced AWX job (issue 27, item 2) -------------------------------------------------------------

SLICED = {"a-solo": {}, "r0": {"job_launch_ranks": ["r0", "r1"]}, "r1": {"job_launch_ranks": ["r0", "r1"]},
          "r2": {"job_launch_ranks": ["r2", "r3"]}, "r3": {"job_launch_ranks": ["r2", "r3"]}, "z-off": {"enabled": False}}


def test_awx_slices_follow_awx_rule_every_nth_enabled_host_by_name():
    assert [sliced_hosts(SLICED, k, 2) for k in (1, 2)] == [["a-solo", "r1", "r3"], ["r0", "r2"]]
    assert sliced_hosts(SLICED, 1, 1) == ["a-solo", "r0", "r1", "r2", "r3"]
    inventory = slice_inventory(SLICED, {"gpus": ["r0", "r1"], "idle": ["z-off"]}, 2, 2)
    assert inventory["gpus"] == {"hosts": ["r0"]} and "idle" not in inventory and set(inventory["_meta"]["hostvars"]) == {
        "r0", "r2"}


def test_a_job_whose_ranks_fall_into_different_slices_is_refused_in_every_slice_that_holds_one():
    messages = {}
    for number in (1, 2):
        inventory = sliced_hosts(SLICED, number, 2)
        awx = awx_job(awx_meta_vars(100 + number, 100, "relaunch"))
        for host in inventory:
            ranks = SLICED[host].get("job_launch_ranks")
            if not ranks:
                continue
            with pytest.raises(RelaunchInputError) as raised:
                check_ranks_in_slice(host, ranks, inventory, awx)
            messages[host] = str(raised.value)
    assert set(messages) == {"r0", "r1", "r2", "r3"}
    assert messages["r1"].startswith("r1: job_launch_ranks (r0, r1): rank(s) r0 are not in this run's inventory at "
                                     "all, only rank(s) r1 are (AWX job 101, a node of workflow job 100 (relaunch)).")
    assert "r1 are not in this run's inventory at all, only rank(s) r0 are (AWX job 102" in messages["r0"]
    for message in messages.values():
        assert "other slice jobs of workflow job 100" in message and "Inventory.get_sliced_hosts" in message
        assert "No rank of this job is relaunched" in message and "job_slice_count 1" in message
        assert "event path" in message


def test_ranks_in_one_slice_and_ranks_only_left_out_by_the_limit_pass_to_check_ranks():
    awx = awx_job(awx_meta_vars(7, 6, "t"))
    check_ranks_in_slice("r0", ["r0", "r1"], ["a-solo", "r0", "r1"], awx)
    check_ranks_in_slice("r0", ["r0", "r1"], ["r0", "r1"], {})
    # Not a list, or not listing this host: check_ranks says so.
    check_ranks_in_slice("r0", "r0,r1", ["r0"], awx)
    check_ranks_in_slice("x", ["r0", "r1"], ["x"], awx)


def test_a_rank_missing_from_the_inventory_outside_awx_or_outside_a_workflow_is_named_as_such():
    with pytest.raises(RelaunchInputError) as raised:
        check_ranks_in_slice("r0", ["r0", "r\x1b[2J1"], ["r0"], {})
    assert "not in this run's inventory at all" in str(raised.value) and "misspelt hostname" in str(raised.value)
    with pytest.raises(RelaunchInputError) as raised:
        check_ranks_in_slice("r0", ["r0", "r\x1b[2J1"], ["r0"], awx_job(awx_meta_vars(7, None, "t")))
    assert "(AWX job 7, which is no slice: it belongs to no workflow job)" in str(raised.value)
    assert "\x1b" not in str(raised.value) and "r\\x1b[2J1" in str(raised.value)


def test_awx_job_reads_either_prefix_and_nothing_outside_awx():
    assert awx_job({}) == {} and awx_job({"awx_job_id": ""}) == {}
    assert awx_job({"tower_job_id": 5}) == {"job": 5, "workflow_job": None, "workflow_job_name": None}
    assert awx_job(awx_meta_vars(9, 8, "n")) == {"job": 9, "workflow_job": 8, "workflow_job_name": "n"}


def reaped(escalation: str, reasons=()) -> dict:
    return {"escalation": escalation, "reasons": list(reasons)}


@pytest.mark.parametrize("cleanup, drain, allowed, done, check, expect", [
    ("none", {"escalation": "none", "released": True}, False, False, False, ("clear", None)),
    ("container_reboot", {"escalation": "none", "released": True}, True, False, False, ("reset", None)),
    ("container_reboot", {"escalation": "none", "released": True}, False, False, False, ("blocked", "Only a container reboot helps")),
    ("container_reboot", {"escalation": "none", "released": True}, True, True, False, ("blocked", "A container reboot did not clear it")),
    ("container_reboot", {"escalation": "none", "released": True}, True, True, True, ("announced", None)),
    ("host_action", {"escalation": "container_reboot", "released": False, "msg": "held"}, True, False, False,
     ("blocked", "The host must act")),
    ("none", {"escalation": "signals", "released": False, "msg": "held"}, True, False, False,
     ("blocked", "The GPUs were not released: why; held")),
    ("none", {"escalation": "container_reboot", "released": False, "msg": "held"}, True, False, False, ("reset", None)),
    ("bogus", {}, True, False, False, ("blocked", "The host must act")),
    ("signals", {"escalation": "none", "released": True}, False, False, True, ("clear", None)),
])
def test_clearance_takes_the_worst_of_the_cleanup_and_the_drain(cleanup, drain, allowed, done, check, expect):
    answer = clearance(reaped(cleanup, ["why"]), drain, allowed, done, check, "h1")
    outcome, text = expect
    assert answer["clear"] is (outcome == "clear")
    assert answer["reset"] is (outcome == "reset")
    if text:
        assert answer["blocked"].startswith(f"h1: not relaunching. {text}")
    else:
        assert answer["blocked"] is None


def full_results() -> dict:
    return {
        "probe": {"health": {"state": "crashed", "reason": "exit 3", "exit_code": 3, "log_tail": ["boom"]},
                  "relaunch_guard": {"max_relaunches": 3, "recent": 1, "would_refuse": False, "history": []}},
        "decision": {"action": "relaunch", "why": "the job is crashed: exit 3"},
        "stop": {"elapsed": 0.5, "incident": "/var/lib/gpuops/x/incidents/1.json"},
        "cleanup": {"elapsed": 1.25, "escalation": "none", "reasons": ["ended 2"], "ended": [{"pid": 7}, {"pid": 9}],
                    "found": {"escalation": "signals", "reasons": ["zombie 7"]}},
        "drain": {"elapsed": 2.0, "released": True, "released_mib": 1024, "escalation": "none"},
        "reset": {"skipped": True, "changed": False},
        "launch": {"elapsed": 3.0, "operation": "start", "pid": 4242, "log_path": "/l", "ready_line": "step 1",
                   "resumed": True, "changed": True, "running": True},
    }


def test_the_host_summary_has_native_types_and_every_key():
    summary = host_summary("h1", False, full_results(), None, None)
    assert summary["relaunched"] is True and summary["status"] == "relaunched"
    assert summary["job"] == {"operation": "start", "pid": 4242, "log_path": "/l", "ready_line": "step 1"}
    assert summary["found"] == "signals" and summary["reasons"] == ["zombie 7", "ended 2"] and summary["ended"] == [7, 9]
    assert summary["seconds"] == {"stop": 0.5, "cleanup": 1.25, "drain": 2.0, "launch": 3.0}
    assert summary["container_reset"] is False and summary["resumed"] is True and summary["failed"] is None
    assert summary["health"]["exit_code"] == 3 and summary["health"]["last_step"] is None
    assert summary["relaunch_guard"]["relaunch_window"] is None and summary["rank"] is None
    json.dumps(summary)  # nothing that is not JSON


def test_the_summary_says_which_checkpoint_was_resumed_and_the_work_lost():
    results = full_results()
    assert host_summary("h1", False, results, None, None)["checkpoint"] is None  # no checkpoint_dir
    results["probe"]["health"]["last_step"] = "1234"
    results["launch"]["checkpoint"] = {"resumed": True, "path": "/c/step_1200", "step": 1200, "format": "dcp",
                                       "torn_skipped": 1, "torn": [{"path": "/c/step_1300", "step": 1300, "why": "w"}]}
    assert host_summary("h1", False, results, None, None)["checkpoint"] == {
        "resumed": True, "path": "/c/step_1200", "step": 1200, "format": "dcp", "torn_skipped": 1,
        "torn": ["/c/step_1300"], "work_lost_steps": 34}
    results["launch"]["checkpoint"].update(resumed=False)  # none complete: a fresh start
    assert host_summary("h1", False, results, None, None)["checkpoint"]["work_lost_steps"] is None


def test_the_summary_says_the_job_after_the_action_and_keeps_what_the_probe_saw():
    """Issue 25 item 2: the metrics tell the state after the run acted, and count its relaunch."""
    results = full_results()
    results["launch"].update(changed=True, relaunch_guard={"recent": 1, "needed": True}, live_metrics="/m/gpuops_job_x.prom")
    summary = host_summary("h1", False, results, None, None)
    assert summary["health"]["state"] == "crashed"  # what the probe saw
    assert summary["after"] == {"state": "running", "recent_relaunches": 2}
    assert summary["live_metrics"] == "/m/gpuops_job_x.prom"
    # A start after a failure counts even when it then fails; the job after it is not known.
    failed = host_summary("h1", False, results, "Launch the job and prove it started: not proven", None)
    assert failed["after"] == {"state": "unknown", "recent_relaunches": 2}
    # A forced relaunch of a job that had not failed is not counted; check mode changes nothing.
    results["launch"]["relaunch_guard"] = {"recent": 1, "needed": False}
    assert host_summary("h1", False, results, None, None)["after"]["recent_relaunches"] == 1
    assert host_summary("h1", True, full_results(), None, None)["after"] == {"state": "crashed", "recent_relaunches": 1}
    # A relaunch the budget does not count (the hardware's failure, or progress) leaves the count as it was;
    # the summary says why, and the growing delay's due time when there is one.
    results["launch"]["relaunch_guard"] = {"recent": 1, "needed": True, "counts": False}
    assert host_summary("h1", False, results, None, None)["after"]["recent_relaunches"] == 1
    results["probe"]["relaunch_guard"].update(counts=False, why="not counted: the hardware caused the failure",
                                              cause="hardware", due_at_iso=None)
    told = host_summary("h1", False, results, None, None)["relaunch_guard"]
    assert told["why"].startswith("not counted") and told["cause"] == "hardware" and "wait" not in told
    # Nothing decided: the job is as the probe found it; the probe's live file is the job's.
    noop = {"probe": {"health": {"state": "running"}, "relaunch_guard": {"recent": 0}, "live_metrics": None},
            "decision": {"action": "none"}, "launch": {"changed": True, "relaunch_guard": {"recent": 5, "needed": True}}}
    assert host_summary("h1", False, noop, None, None)["after"] == {"state": "running", "recent_relaunches": 0}


def test_a_launch_that_found_the_job_started_by_another_run_is_no_relaunch_of_this_run():
    """A watchdog run and an alert's run at once: both saw the job crashed, one started it, the other's launch
    found it running with this spec and started nothing. That run says so, and the job runs."""
    results = full_results()
    results["stop"] = {}
    results["launch"] = {"changed": False, "operation": "none", "pid": 4243, "running": True, "elapsed": 0.4,
                         "relaunch_guard": {"recent": 2, "needed": False}}
    summary = host_summary("h1", False, results, None, None)
    assert summary["relaunched"] is False and summary["status"] == "unchanged"
    assert summary["why"] == ("the job is crashed: exit 3; but when this run launched, the job already ran with this "
                              "spec (pid 4243), started meanwhile by another run: this run started nothing")
    assert summary["after"] == {"state": "running", "recent_relaunches": 1}
    assert outcome_line(summary, "llm").startswith("h1 [llm]: crashed, nothing done: the job is crashed")
    # In check mode a launch starts nothing either: that is what would_relaunch says, not this.
    assert host_summary("h1", True, results, None, None)["status"] == "would_relaunch"


# --- the run-id fence: the stop and the clean-up are for the run the probe saw ------------------------------------

def test_the_decision_names_the_run_its_probe_saw_for_the_stop_and_the_clean_up():
    crashed = dict(probe("relaunch", "crashed"), health={"state": "crashed", "reason": "exit 1", "run_id": "x1"})
    assert decide(crashed)["expect_run_id"] == "x1"
    # Never ran (or records not sound): "", so that any run found later is newer.
    assert seen_run(probe("relaunch", "missing")) == "" and seen_run({}) == "" and seen_run({"health": None}) == ""
    # Every rank of a multi-rank job names its own probe's run.
    others = {"a": crashed, "b": probe(), "c": probe()}
    assert decide(probe(), RANKS, others)["expect_run_id"] == ""
    assert decide(crashed, RANKS, others)["expect_run_id"] == "x1"


def test_a_step_that_left_a_newer_run_alone_is_superseded():
    assert superseded({"superseded": True}) and superseded({}, {"superseded": True, "changed": False})
    assert not superseded(None, {}, {"superseded": False}, {"skipped": True, "superseded": True}, "x")


def test_a_clean_up_superseded_by_a_newer_run_clears_the_launch_without_a_drain():
    """The drain was skipped (its registered result says so): the GPUs are the newer run's, nothing to wait for."""
    cleanup = dict(reaped("none"), superseded=True, newer_run={"run_id": "y2", "pid": 4388})
    answer = clearance(cleanup, {"skipped": True, "changed": False}, False, False, False, "h1")
    assert answer["clear"] is True and answer["reset"] is False and answer["blocked"] is None
    # Without the fence a skipped drain is no answer of a drain either: the clean-up alone decides.
    assert clearance(reaped("none"), {"skipped": True}, False, False, False, "h1")["clear"] is True


def test_a_relaunch_whose_stop_and_clean_up_left_a_newer_run_alone_says_another_run_started_it():
    """Two relaunch runs at once: this one's stop and clean-up found a newer run (another run's relaunch) and left it
    alone, its drain was skipped, its launch found that run running with this spec: it started nothing, and says so."""
    results = full_results()
    newer = {"run_id": "y2", "pid": 4388, "starttime": 1, "started_at": "t"}
    results["stop"] = {"changed": False, "superseded": True, "newer_run": newer, "incident": None, "elapsed": 0.1}
    results["cleanup"] = dict(results["cleanup"], superseded=True, newer_run=newer, ended=[])
    results["drain"] = {"skipped": True, "changed": False}
    results["launch"] = {"changed": False, "operation": "none", "pid": 4388, "running": True, "elapsed": 0.3,
                         "relaunch_guard": {"recent": 2, "needed": False}}
    summary = host_summary("h1", False, results, None, None)
    assert summary["relaunched"] is False and summary["status"] == "unchanged" and summary["incident"] is None
    assert summary["why"].endswith("the job already ran with this spec (pid 4388), started meanwhile by another run: "
                                   "this run started nothing")
    assert summary["after"] == {"state": "running", "recent_relaunches": 1} and summary["ended"] == []
    assert summary["gpu_released"] is None and "drain" not in summary["seconds"]


def test_the_summary_names_processes_whose_marks_contradicted_their_ancestry():
    """A worker of this job carrying another job's marks (issue 24, item 4b) was ended as this job's:
    the summary names it, once, whether the stop or the clean-up's look saw it."""
    assert host_summary("h1", False, full_results(), None, None)["mark_conflicts"] == []
    results = full_results()
    results["stop"]["stop"] = {"signalled": [40, 41], "mark_conflicts": [
        {"pid": 41, "comm": "python3", "marked_job_dir": "/var/lib/gpuops/b", "reason": "..."}]}
    results["cleanup"]["found"]["findings"] = [
        {"kind": "mark_conflict", "escalation": "signals", "pids": [41], "why": "..."},
        {"kind": "mark_conflict", "escalation": "signals", "pids": [43], "why": "..."},
        {"kind": "zombie", "escalation": "signals", "pids": [7], "why": "zombie 7"}]
    summary = host_summary("h1", False, results, None, None)
    assert summary["mark_conflicts"] == [{"pid": 41, "marked_job_dir": "/var/lib/gpuops/b", "seen_by": "stop"},
                                         {"pid": 43, "marked_job_dir": None, "seen_by": "cleanup"}]
    json.dumps(summary)


def test_the_summary_keeps_the_last_drains_gpus():
    results = full_results()
    gpu = {"index": 0, "uuid": "GPU-a", "name": "H100", "total_mib": 81559.0, "reserved_mib": 527.0,
           "used_mib_before": 40960.0, "used_mib_after": 12.0, "processes": []}
    results["drain"]["gpus"] = [gpu]
    summary = host_summary("h1", False, results, None, None)
    assert summary["gpu_released"] is True
    assert summary["gpus"] == [{"index": 0, "uuid": "GPU-a", "name": "H100", "total_mib": 81559.0, "used_mib": 12.0}]
    # After a container reset, the drain after it is the last look.
    results["drain"]["released"] = False
    results["drain_again"] = {"released": True, "gpus": [dict(gpu, used_mib_after=0.0)]}
    summary = host_summary("h1", False, results, None, None)
    assert summary["gpu_released"] is True and summary["gpus"][0]["used_mib"] == 0.0
    # A drain that failed still says what it saw.
    results["drain_again"] = {"failed": True, "released": False, "gpus": [dict(gpu, used_mib_after=40000.0)]}
    summary = host_summary("h1", False, results, "Wait for the GPUs: held", None)
    assert summary["gpu_released"] is False and summary["gpus"][0]["used_mib"] == 40000.0
    json.dumps(summary)


def test_without_a_drain_the_gpus_are_not_known():
    results = full_results()
    results["drain"] = {"skipped": True}
    summary = host_summary("h1", False, results, None, None)
    assert summary["gpu_released"] is None and summary["gpus"] == []
    results["drain"] = {"released": "yes", "gpus": "GPU-a"}  # not gpu_mem_wait's answer: not guessed at
    summary = host_summary("h1", False, results, None, None)
    assert summary["gpu_released"] is None and summary["gpus"] == []


def test_a_noop_summary_says_nothing_was_looked_at():
    results = {"probe": {"health": {"state": "running", "reason": "ok"}, "operation": "none", "pid": 88, "elapsed": 0.2},
               "decision": {"action": "none", "why": "left alone"}}
    summary = host_summary("h1", False, results, None, None)
    assert summary["status"] == "unchanged" and summary["found"] == NOT_LOOKED and summary["seconds"] == {}
    # The job as the probe found it: still running under its pid.
    assert summary["job"] == {"operation": "none", "pid": 88, "log_path": None, "ready_line": None}
    assert failure_message(summary, "j") is None


def test_a_noop_after_an_earlier_relaunch_in_the_same_play_ignores_its_steps():
    # The role included twice in one play: the first include relaunched, the second found its job
    # running. The registered variables of the first include's steps are still set.
    results = dict(full_results(), probe={"health": {"state": "running"}, "operation": "none", "pid": 88},
                   decision={"action": "none", "why": "left alone"})
    summary = host_summary("h1", False, results, None, None)
    assert summary["status"] == "unchanged" and summary["found"] == NOT_LOOKED and summary["ended"] == []
    assert summary["job"]["pid"] == 88 and summary["seconds"] == {} and summary["incident"] is None


def test_a_host_whose_probe_failed_is_failed_with_an_unknown_health():
    summary = host_summary("h1", False, {"probe": {"failed": True, "msg": "x", "skipped": False}}, "probe: x", None)
    assert summary["status"] == "failed" and failure_message(summary, "j") == "h1: probe: x"
    summary = host_summary("h1", False, {}, "Ask: unreachable", None)
    assert summary["health"]["state"] == "unknown"


def test_check_mode_would_relaunch_and_a_refusal_fails_with_the_evidence():
    assert host_summary("h1", True, full_results(), None, None)["status"] == "would_relaunch"
    results = dict(full_results(), decision={"action": "refused", "why": "relaunched 3 times"})
    summary = host_summary("h1", False, results, None, None)
    assert summary["status"] == "refused" and not summary["relaunched"]
    message = failure_message(summary, "train")
    assert message.startswith("h1: not relaunching train: relaunched 3 times. Nothing was stopped") and "boom" in message


def test_the_fleet_sums_hosts_jobs_and_counts():
    ranks = {"index": 0, "of": 2, "ranks": ["a", "b"]}
    a = host_summary("a", False, full_results(), None, ranks)
    b = host_summary("b", False, full_results(), "Launch: died", dict(ranks, index=1))
    c = host_summary("c", False, {"probe": {"health": {"state": "running"}}, "decision": {"action": "none"}}, None, None)
    fleet = fleet_summary({"a": a, "b": b, "c": c, "d": None})
    assert fleet["hosts"]["a"] == {"status": "relaunched", "health": "crashed", "found": "signals", "ended": 2,
                                   "container_reset": False, "pid": 4242, "seconds": 6.75, "rank": 0,
                                   "failed": None}
    assert fleet["hosts"]["d"]["status"] == "failed" and fleet["hosts"]["c"]["rank"] is None
    assert fleet["jobs"] == {"a": {"ranks": ["a", "b"], "relaunched": ["a"], "failed": ["b"]}}
    assert fleet["counts"] == {"relaunched": 1, "unchanged": 1, "refused": 0, "failed": 2, "would_relaunch": 0}
    assert tuple(fleet["counts"]) == FLEET_STATUSES


def test_a_report_is_written_whole_and_replaces_a_planted_symlink(tmp_path):
    target = tmp_path / "secret"
    target.write_text("keep", encoding="utf-8")
    (tmp_path / "h1.json").symlink_to(target)
    path = write_report(str(tmp_path), "h1.json", {"pid": 1})
    assert json.loads((tmp_path / "h1.json").read_text(encoding="utf-8")) == {"pid": 1}
    assert target.read_text(encoding="utf-8") == "keep" and path == str(tmp_path / "h1.json")
    assert oct((tmp_path / "h1.json").stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    (tmp_path / "file").write_text("", encoding="utf-8")
    with pytest.raises(ReportError, match="cannot write"):
        write_report(str(tmp_path / "file"), "x.json", {})


# --- bad input names the variable (issue 24, item 9) ---------------------------------------------


@pytest.mark.parametrize("port", [-5, 0, 65536, "29500x", "", " 29500", 1.5, True, [29500], "29500\x1b[2J"])
def test_a_master_port_outside_1_to_65535_is_refused_naming_the_variable_and_the_value(port):
    if port == "":
        # An empty value is no value (ansible-core before 2.19 renders a null template as ""): the default port.
        assert rank_of("a", ["a"], {"job_launch_master_port": port}).master_port == 29500
        return
    with pytest.raises(RelaunchInputError) as raised:
        rank_of("b", ["a", "b"], {"job_launch_master_port": port})
    message = str(raised.value)
    assert "job_launch_master_port" in message and "1 to 65535" in message and "No rank of this job" in message
    assert "\x1b" not in message
    if port == "29500\x1b[2J":
        assert "\\x1b[2J" in message


@pytest.mark.parametrize("port, expect", [(1, 1), (65535, 65535), ("1234", 1234), (None, 29500)])
def test_a_master_port_from_1_to_65535_is_taken(port, expect):
    assert rank_of("a", ["a"], {"job_launch_master_port": port}).env()["MASTER_PORT"] == str(expect)


def test_ranks_that_are_not_this_hosts_inventory_variable_are_refused_as_such():
    # Set as a play, role or task variable, job_launch_ranks is not in hostvars: the other ranks cannot read it.
    with pytest.raises(RelaunchInputError) as raised:
        check_ranks_in_inventory("a", ["a", "b"], None)
    assert "job_launch_ranks must be set as a host or group variable (inventory)" in str(raised.value)
    assert "play" in str(raised.value) and "list other ranks" not in str(raised.value)
    # A play variable that overrides the inventory's: the same.
    with pytest.raises(RelaunchInputError, match="host or group variable"):
        check_ranks_in_inventory("a", ["a", "b"], ["a", "c"])
    check_ranks_in_inventory("a", ["a", "b"], ["a", "b"])
    check_ranks_in_inventory("a", ("a", "b"), ["a", "b"])


# --- controller files stay where they belong (issue 24, item 8) -------------------------------------


TRICKY_NAMES = ["gpu1", "GPU1", "Gpu1", "/../../x", "../x", "..", ".", ".hidden", "fleet", "fleet.json", "check",
                "a@b", "a%40b", "a%2540b", "%2E.", "a b", "a/b", "a\\b", "n\u00e9", "ne\u0301", "x\x1b[2Jy", "a.b", "a~b",
                "a-b", "a_b", "A", "a"]


def test_a_file_name_part_is_injective_even_on_a_case_insensitive_file_system_and_reversible():
    parts = [file_name_part(name) for name in TRICKY_NAMES]
    # Injective, and still after case-folding (macOS' default file system folds case).
    assert len({part.casefold() for part in parts}) == len(TRICKY_NAMES)
    for name, part in zip(TRICKY_NAMES, parts):
        assert "/" not in part and "\\" not in part and not part.startswith(".") and "@" not in part
        assert part.isascii() and part.isprintable() and part
        assert unquote(part) == name
    assert file_name_part("gpu-node_01.lab~1") == "gpu-node_01.lab~1"  # a usual hostname stays readable


def test_summary_files_are_one_per_host_and_job_and_never_the_fleets():
    names = {summary_file_name(host, job) for host in TRICKY_NAMES for job in ("train", "eval", "fleet", "x@y")}
    assert len(names) == len(TRICKY_NAMES) * 4
    assert FLEET_FILE not in names and all(name.endswith(".json") and name.count("@") == 1 for name in names)
    assert all(os.path.basename(name) == name and not name.startswith(".") for name in names)
    assert summary_file_name("gpu1", "train") == "gpu1@train.json"
    assert summary_file_name("/../../x", "j") == "%2F..%2F..%2Fx@j.json"
    with pytest.raises(ValueError, match="job_name"):
        summary_file_name("gpu1", "")


def test_check_mode_reports_go_to_their_own_directory(tmp_path):
    assert report_dir("/r", False) == "/r" and report_dir("/r", True) == os.path.join("/r", CHECK_DIR)
    # No summary or fleet file name can be the check directory's.
    assert CHECK_DIR not in {summary_file_name(host, "j") for host in TRICKY_NAMES} | {FLEET_FILE}


def test_the_rank_env_filter_leaves_a_bad_port_to_the_decision():
    # The probe's spec is templated before the decision: a bad port must not fail it with a bare int() error.
    from ansible_collections.gpuops.relaunch.plugins.filter.relaunch import rank_env
    assert rank_env({"A": "1"}, ["a", "b"], "b", {"a": {"job_launch_master_port": "29500x"}}) == {"A": "1"}
    assert rank_env({}, ["a", "b"], "b", {"a": {"job_launch_master_port": "1234"}})["MASTER_PORT"] == "1234"


@pytest.mark.parametrize("strategy, refused", [("linear", False), ("ansible.builtin.linear", False), (None, False),
                                               ("free", True), ("host_pinned", True)])
def test_ranks_need_a_strategy_that_holds_their_barriers(strategy, refused):
    if refused:
        with pytest.raises(RelaunchInputError, match="needs the linear strategy"):
            check_strategy("gpu1", strategy)
    else:
        check_strategy("gpu1", strategy)


def test_one_line_per_host_says_what_it_saw_did_and_why_escaped():
    crashed = host_summary("gpu1", False, {
        "probe": {"health": {"state": "crashed"}},
        "decision": {"action": "relaunch", "why": "crashed \x1b[2J (exit 1)"},
        "launch": {"pid": 42, "resumed": True, "operation": "start", "changed": True}}, None, None)
    line = outcome_line(crashed, "llm")
    assert line == "gpu1 [llm]: crashed, relaunched (pid 42, resumed): crashed \\x1b[2J (exit 1)"
    healthy = host_summary("gpu2", False, {"probe": {"health": {"state": "running"}},
                                           "decision": {"action": "none", "why": "runs with its spec"}}, None, None)
    assert outcome_line(healthy, "llm") == "gpu2 [llm]: running, nothing done: runs with its spec"
    failed = host_summary("gpu3", False, {"probe": None, "decision": None}, "Look: unreachable", None)
    assert outcome_line(failed, "llm") == "gpu3 [llm]: unknown, FAILED: Look: unreachable"


def test_the_fleet_lists_hosts_that_failed_before_the_decision():
    healthy = host_summary("a", False, {"probe": {"health": {"state": "running"}},
                                        "decision": {"action": "none", "why": "fine"}}, None, None)
    fleet = fleet_summary({"a": healthy, "b": None, "c": None}, failed_early=["b"])
    assert fleet["hosts"]["b"]["status"] == "failed" and fleet["hosts"]["b"]["failed"] == FAILED_EARLY
    assert fleet["hosts"]["c"]["failed"] == "failed before its summary"
    assert fleet["hosts"]["a"]["failed"] is None
    assert fleet["counts"]["failed"] == 2 and fleet["counts"]["unchanged"] == 1
    assert fleet_line(fleet) == "3 host(s): 1 unchanged, 2 failed (failed: b, c)"


@pytest.mark.parametrize("variable, value", [
    ("job_launch_master_addr", ["x"]), ("job_launch_master_addr", {"a": 1}), ("job_launch_master_addr", "a b"),
    ("job_launch_master_addr", "m\x1b[2J"), ("job_launch_master_addr", 10), ("ansible_host", ["10.0.0.1"]),
])
def test_a_master_addr_that_is_no_address_is_refused_naming_the_variable(variable, value):
    """["x"] would launch every rank with MASTER_ADDR="['x']"."""
    with pytest.raises(RelaunchInputError) as raised:
        rank_of("b", ["a", "b"], {variable: value})
    message = str(raised.value)
    assert f"b: {variable} (of rank 0, a) must be a host name or address for MASTER_ADDR" in message
    assert "\x1b" not in message and "No rank of this job" in message
    assert rank_of("b", ["a", "b"], {"job_launch_master_addr": "", "ansible_host": "h"}).master_addr == "h"


@pytest.mark.parametrize("ranks", [[["node1"], "node2"], [None, "node1"], ["node1", {"a": 1}], ["", "node1"], "node1"])
def test_ranks_that_are_no_list_of_names_are_refused_naming_the_variable(ranks):
    with pytest.raises(RelaunchInputError) as raised:
        check_ranks("node1", ranks, {}, ["node1", "node2"], ["node1", "node2"])
    assert "node1: job_launch_ranks must be a list of inventory hostnames, not " in str(raised.value)
    # A number is a name (YAML reads the host 7 as one): taken as its text, as before.
    check_ranks("node1", ["node1", 7], {}, ["node1", "7"], ["node1", "7"])


# --- the GPU gate -------------------------------------------------------------------------------

from ansible_collections.gpuops.relaunch.plugins.plugin_utils import relaunch_flow as flow  # noqa: E402


@pytest.mark.parametrize("word, lead", [
    ("gpu_reset", "Only a GPU reset clears it (the GPU gate resets"),
    ("host_reboot", "Only a reboot of the machine that owns the GPUs clears it"),
])
def test_the_clearance_names_the_gpu_words_not_a_release(word, lead):
    answer = flow.clearance({"escalation": word, "reasons": ["GPU 1: XID 79"]}, {}, True, False, False, "h1")
    assert answer["reset"] is False and answer["blocked"].startswith(f"h1: not relaunching. {lead}")
    assert answer["blocked"].endswith(": GPU 1: XID 79") and "not released" not in answer["blocked"]


GATE_REFUSED = {"changed": True, "outcome": "refuse", "escalation": "host_reboot", "why": "GPU 1: XID 79", "elapsed": 0.4,
                "bad": [{"index": 1, "uuid": "GPU-1", "pci_bus_id": "00000000:3C:00.0", "escalation": "host_reboot",
                         "quarantined": False, "recovery_action": None, "remapped_rows": None, "reasons": ["XID 79"],
                         "xids": [{"xid": 79, "first": 5.0, "text": "NVRM: Xid (PCI:0000:3c:00): 79, \\x1b[2J"}]}],
                "visible": [], "reset": [], "quarantined": ["GPU-1"], "quarantine_cleared": []}


def test_a_gate_refusal_is_the_runs_refusal_and_the_host_fails_with_the_evidence():
    results = {"probe": {"health": {"state": "crashed"}}, "decision": {"action": "relaunch", "why": "crashed"},
               "stop": None, "cleanup": {"escalation": "none"}, "drain": {"released": True}, "gate": GATE_REFUSED}
    summary = flow.host_summary("h1", False, results, None, None)
    assert summary["action"] == "refused" and summary["relaunched"] is False and flow.fleet_status(summary) == "refused"
    assert summary["gpu_gate"]["quarantined"] == ["GPU-1"] and summary["seconds"]["gpu_gate"] == 0.4
    message = flow.failure_message(summary, "job")
    assert message.startswith("h1: not relaunching. The GPUs need host_reboot: GPU 1: XID 79.")
    assert "GPU 1 GPU-1 00000000:3C:00.0: host_reboot" in message and "XID 79 at 5.0" in message
    assert "Nothing was stopped" not in message and "\x1b" not in message


def test_a_ranks_gate_refusal_that_failed_its_task_is_still_the_refusal():
    results = {"probe": {"health": {"state": "crashed"}}, "decision": {"action": "relaunch", "why": "crashed"},
               "cleanup": {"escalation": "none"}, "drain": {"released": True}, "gate": GATE_REFUSED}
    summary = flow.host_summary("h1", False, results, "Check the GPUs' hardware before the launch: h1: ...", {"index": 1})
    assert flow.fleet_status(summary) == "refused" and summary["failed"] is None
