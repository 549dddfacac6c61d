"""_launch/control.py on a state directory with no live process: verdicts, check mode, the guard's refusal."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import control
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.control import LaunchController, LaunchError
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import options_from_params
from tests.harness.launch_targets import end_recorded_runs

GONE_PID = 4194000  # above any pid this machine hands out


def params(tmp_path, **overrides):
    base = {
        "name": "job", "state": "started", "command": ["python3", "train.py"], "shell": False,
        "chdir": None, "env": {}, "user": None, "group": None, "log_path": str(tmp_path / "train.log"),
        "keep_logs": 5, "state_dir": str(tmp_path / "state"), "backend": "supervisor", "startup_timeout": 60,
        "min_uptime": 5, "ready_regex": None, "term_timeout": 30, "remove_paths": [], "log_tail_lines": 20,
        "progress_regex": r"^step (\d+)", "stall_after": 10, "resume_args": ["--resume"],
        "max_relaunches": 1, "relaunch_window": 3600,
    }
    base.update(overrides)
    return base


@pytest.fixture(name="job")
def job_fixture(tmp_path):
    job = tmp_path / "state" / "job"
    job.mkdir(parents=True)
    (tmp_path / "train.log").write_text("step 1 x\nTraceback: boom\n")
    (job / "run.json").write_text(json.dumps({
        "run_id": "r1", "pid": GONE_PID, "starttime": 5, "backend": "supervisor", "spec_hash": "x",
        "log_path": str(tmp_path / "train.log"), "started_at": "2026-12-03T10:00:00+00:00"}))
    yield job
    # A failed start leaves its supervisor waiting idle for the next one (idle.json): end it.
    end_recorded_runs(tmp_path / "state")


def listing(path) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(root, name), path): Path(root, name).read_bytes()
            for root, _dirs, names in os.walk(path) for name in names}


def apply(tmp_path, check_mode=False, **overrides):
    return LaunchController(options_from_params(params(tmp_path, **overrides)), check_mode).apply()


def test_crashed_and_asking_changes_nothing(tmp_path, job) -> None:
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 3, "exit_signal": None, "ended_at": "t"}))
    before = listing(job)
    result = apply(tmp_path, state="health", command=None)
    assert result["health"]["state"] == "crashed" and result["health"]["exit_code"] == 3
    assert result["health"]["log_tail"] == ["step 1 x", "Traceback: boom"]
    assert result["operation"] == "none" and result["changed"] is False
    assert result["relaunch_guard"]["needed"] is True and result["relaunch_guard"]["would_refuse"] is False
    assert listing(job) == before


def test_missing_without_an_exit_record(tmp_path, job, monkeypatch) -> None:
    monkeypatch.setattr(control, "EXIT_SETTLE_WAIT", 0.0)
    result = apply(tmp_path, state="health", command=None)
    assert result["health"]["state"] == "missing" and result["health"]["run_id"] == "r1"
    assert "without an exit record" in result["health"]["reason"]


def test_past_the_guard_check_mode_says_so_and_a_real_run_refuses_with_the_evidence(tmp_path, job) -> None:
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 3, "exit_signal": None, "ended_at": "t"}))
    history = {"relaunches": [{"at": control.time.time() - 10, "run_id": "r0", "health": "crashed"}]}
    (job / "relaunches.json").write_text(json.dumps(history))
    before = listing(job)
    would = apply(tmp_path, check_mode=True)
    assert would["msg"].startswith("would refuse: ") and would["relaunch_guard"]["would_refuse"] is True
    assert would["changed"] is False and listing(job) == before
    with pytest.raises(LaunchError) as caught:
        apply(tmp_path)
    assert "max_relaunches=1" in str(caught.value) and "relaunch_window=3600s" in str(caught.value)
    assert caught.value.result["changed"] is False
    incident = json.loads(Path(caught.value.result["incident"]).read_text(encoding="utf-8"))
    assert incident["health"]["state"] == "crashed" and incident["log_tail"][-1] == "Traceback: boom"
    assert incident["processes"] == [] and incident["py_spy"] == {"skipped": "no live process of the run"}
    assert json.loads((job / "relaunches.json").read_text()) == history  # not counted: nothing was relaunched
    assert not (job / "stop.json").exists() and not (job / "launch.json").exists()


def test_a_finished_run_is_not_a_failure(tmp_path, job) -> None:
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 0, "exit_signal": None, "ended_at": "t"}))
    would = apply(tmp_path, check_mode=True)
    assert would["health"]["state"] == "finished" and would["operation"] == "start"
    assert would["resumed"] is False and would["relaunch_guard"]["needed"] is False


@pytest.mark.parametrize("resume, expected", [("auto", False), ("always", True), ("never", False)])
def test_resume_always_resumes_a_finished_run_and_never_keeps_a_crashed_one_from_the_start(
        tmp_path, job, resume, expected) -> None:
    # A finished run: auto does not resume it; always does (the job ran before: the other ranks of a
    # multi-rank job one of whose ranks failed resume from the same checkpoint).
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 0, "exit_signal": None, "ended_at": "t"}))
    assert apply(tmp_path, check_mode=True, resume=resume)["resumed"] is expected
    # A crashed run: auto and always resume it, never does not.
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 3, "exit_signal": None, "ended_at": "t"}))
    assert apply(tmp_path, check_mode=True, resume=resume, max_relaunches=None)["resumed"] is (resume != "never")


def test_resume_always_never_resumes_a_first_launch(tmp_path) -> None:
    assert apply(tmp_path, check_mode=True, resume="always")["resumed"] is False


def test_a_run_record_whose_run_id_is_a_path_never_names_a_file(tmp_path, job) -> None:
    # A record that lies: its run id climbs out of the incidents directory.
    run = json.loads((job / "run.json").read_text())
    (job / "run.json").write_text(json.dumps({**run, "run_id": "../../../escaped"}))
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 3, "exit_signal": None, "ended_at": "t"}))
    result = apply(tmp_path, state="stopped", command=None)
    assert any("run_id is missing or not a run id" in problem for problem in result["record_problems"])
    assert result["incident"] is None  # the record is ignored as a whole: no run, nothing to record
    assert not list(tmp_path.rglob("escaped*"))
    for path in tmp_path.rglob("incident-*"):
        assert path.parent == job / "incidents"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_relaunch_history_holding_nan_or_infinity_is_refused_and_reported(tmp_path, job, constant) -> None:
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 3, "exit_signal": None, "ended_at": "t"}))
    (job / "relaunches.json").write_text('{"relaunches": [{"at": %s, "run_id": "r0", "health": "crashed"}]}' % constant)
    result = apply(tmp_path, state="health", command=None)
    assert any(f"holds {constant}" in problem for problem in result["record_problems"])
    assert result["relaunch_guard"]["recent"] == 0


# --- state=probe, force, reset_guard ----------------------------------------------------------

def crashed(job) -> None:
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 3, "exit_signal": None, "ended_at": "t"}))


@pytest.mark.parametrize("check_mode", [False, True])
def test_a_probe_renders_the_plan_as_check_mode_does_and_changes_nothing(tmp_path, job, check_mode) -> None:
    crashed(job)
    (tmp_path / "cache").mkdir()
    before = listing(job)
    probe = apply(tmp_path, check_mode=check_mode, state="probe", max_relaunches=None,
                  remove_paths=[str(tmp_path / "cache")])
    would = apply(tmp_path, check_mode=True, max_relaunches=None, remove_paths=[str(tmp_path / "cache")])
    assert probe["changed"] is False and would["changed"] is True
    for key in ("operation", "resumed", "rotated_log", "removed_paths", "relaunch_guard", "health", "backend",
                "spec_hash", "msg", "running", "incident", "decision"):
        assert probe[key] == would[key], key
    assert probe["operation"] == "start" and probe["msg"].startswith("would start the job")
    assert probe["rotated_log"] == str(tmp_path / "train.log.1") and probe["removed_paths"] == [str(tmp_path / "cache")]
    assert probe["decision"] == {"action": "relaunch", "relaunch": True, "resume": True, "resume_mode": "always",
                                 "resumable": True, "why": f"the job is crashed: {probe['health']['reason']}"}
    assert listing(job) == before and (tmp_path / "cache").is_dir() and not (tmp_path / "train.log.1").exists()
    assert not (job / ".lock").exists()  # a probe that writes nothing never waits for the lock


def test_a_probe_past_the_guard_decides_refused_and_does_not_fail(tmp_path, job) -> None:
    crashed(job)
    (job / "relaunches.json").write_text(json.dumps({"relaunches": [{"at": control.time.time() - 10, "run_id": "r0"}]}))
    before = listing(job)
    probe = apply(tmp_path, state="probe")
    assert probe["changed"] is False and probe["msg"].startswith("would refuse: ")
    assert probe["decision"]["action"] == "refused" and probe["decision"]["relaunch"] is False
    assert probe["decision"]["why"] == probe["msg"][len("would refuse: "):]
    assert "reset_guard=true / job_launch_reset_guard=true" in probe["decision"]["why"]
    assert probe["incident"] is None and listing(job) == before  # no incident, no history: it only asks


def test_a_finished_job_is_left_alone_unless_forced(tmp_path, job) -> None:
    (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 0, "exit_signal": None, "ended_at": "t"}))
    alone = apply(tmp_path, state="probe")
    assert alone["decision"] == {"action": "none", "relaunch": False, "resume": False, "resume_mode": "never",
                                 "resumable": True, "why": "left alone: the job finished (exit code 0 at t); relaunch_force relaunches it"}
    assert alone["operation"] == "start"  # what state=started would do: force changes the decision only
    forced = apply(tmp_path, state="probe", force=True, resume="always")
    assert forced["decision"] == {"action": "relaunch", "relaunch": True, "resume": True, "resume_mode": "always",
                                  "resumable": True, "why": "forced (relaunch_force), although the job finished (exit code 0 at t)"}
    assert {key: value for key, value in forced.items() if key not in ("decision", "elapsed", "resumed")} == \
        {key: value for key, value in alone.items() if key not in ("decision", "elapsed", "resumed")}


def test_a_probe_that_could_not_start_fails_as_the_check_mode_probe_does(tmp_path, job) -> None:
    crashed(job)
    with pytest.raises(LaunchError, match="chdir") as caught:
        apply(tmp_path, state="probe", max_relaunches=None, chdir=str(tmp_path / "nowhere"))
    assert caught.value.result["changed"] is False
    assert caught.value.result["option_problems"][0]["option"] == "chdir"


@pytest.mark.parametrize("state", ["health", "stopped"])
def test_health_decides_stopped_does_not(tmp_path, job, state) -> None:
    crashed(job)
    result = apply(tmp_path, check_mode=True, state=state, command=None)
    assert ("decision" in result) is (state == "health")
    if state == "health":
        assert result["decision"]["action"] == "relaunch" and result["decision"]["resume"] is True


def test_reset_guard_clears_the_history_and_the_refusal_with_it(tmp_path, job) -> None:
    crashed(job)
    history = {"relaunches": [{"at": control.time.time() - 10 - n, "run_id": f"r0{n}"} for n in range(3)]}
    (job / "relaunches.json").write_text(json.dumps(history))
    # Check mode: says it would clear 3 and would then start; clears nothing.
    would = apply(tmp_path, check_mode=True, state="probe", reset_guard=True)
    assert would["guard_cleared"] == 3 and would["changed"] is True
    assert would["relaunch_guard"]["recent"] == 0 and would["decision"]["action"] == "relaunch"
    assert json.loads((job / "relaunches.json").read_text()) == history
    # For real: cleared through the records (0600, replaced atomically), under the job's lock.
    done = apply(tmp_path, state="probe", reset_guard=True)
    assert done["guard_cleared"] == 3 and done["changed"] is True and done["decision"]["action"] == "relaunch"
    assert json.loads((job / "relaunches.json").read_text()) == {"relaunches": []}
    assert (job / "relaunches.json").stat().st_mode & 0o777 == 0o600 and (job / ".lock").exists()
    # Nothing left to clear: no change.
    again = apply(tmp_path, check_mode=True, state="health", command=None, reset_guard=True)
    assert again["guard_cleared"] == 0 and again["changed"] is False


def test_reset_guard_never_writes_through_a_symlink(tmp_path, job) -> None:
    crashed(job)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"relaunches": [{"at": control.time.time() - 10, "run_id": "r0"}]}))
    (job / "relaunches.json").symlink_to(target)
    result = apply(tmp_path, state="probe", reset_guard=True)
    assert result["guard_cleared"] == 0 and any("relaunches.json" in p for p in result["record_problems"])
    assert json.loads(target.read_text())["relaunches"][0]["run_id"] == "r0"


@pytest.mark.parametrize("before, found, counted", [
    # r1 ran healthy and train_launch stopped it (as a restart does before its start).
    ({"exit_code": None, "exit_signal": "SIGTERM"}, {"health": "running"}, False),
    # r1 crashed by itself: that stays its own failure, and a relaunch of it is still one.
    ({"exit_code": 3, "exit_signal": None}, None, True),
], ids=["stopped-healthy", "crashed"])
def test_a_start_that_fails_is_the_relaunchs_own_failure_never_missing(
        tmp_path, job, monkeypatch, before, found, counted) -> None:
    """A start whose program cannot be executed (its interpreter is gone): nothing of the job ran, so
    the job is what it was before the start - never missing (counted by the guard, resumed)."""
    monkeypatch.setattr(control, "EXIT_SETTLE_WAIT", 0.0)
    (job / "exit.json").write_text(json.dumps(dict(before, run_id="r1", ended_at="2026-12-03T11:00:00+00:00")))
    if found is not None:
        (job / "stop.json").write_text(json.dumps(dict(found, run_id="r1", requested_at="2026-12-03T11:00:00+00:00")))
    broken = tmp_path / "train.sh"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    with pytest.raises(LaunchError, match="was not proven: .*cannot start") as caught:
        apply(tmp_path, command=[str(broken)], max_relaunches=5, startup_timeout=30)
    assert "No such file or directory" in caught.value.result["start_error"]
    # Later tasks: the probe with a guard that refuses any relaunch after a failure, and the health.
    probe = apply(tmp_path, state="probe", max_relaunches=0)
    health = apply(tmp_path, state="health", command=None, max_relaunches=0)
    for looked in (probe, health):
        assert looked["health"]["state"] == ("crashed" if counted else "stopped"), looked["health"]
        assert looked["health"]["run_id"] == "r1"
        assert f"the start of run {caught.value.result['run_id']} failed before the job ran" in looked["health"]["reason"]
        assert looked["relaunch_guard"]["needed"] is counted and looked["relaunch_guard"]["would_refuse"] is counted
        assert looked["decision"]["action"] == ("refused" if counted else "relaunch")
    if not counted:
        # A plain start, without resume_args: the job did not fail, its relaunch did.
        assert probe["operation"] == "start" and probe["resumed"] is False and probe["decision"]["resume"] is False


def test_health_waits_in_the_module_for_the_verdict_asked_for(tmp_path, job, monkeypatch) -> None:
    """wait_for: judged again until the verdict comes (here the exit record appears after the first look)."""
    judge = control.JobJudge.judge
    looks = []

    def judge_and_then_exit(self, *args, **kwargs):
        looks.append(1)
        if len(looks) == 2:  # the run ends between the first and the second look
            (job / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 3, "exit_signal": None,
                                                       "ended_at": "t"}))
        return judge(self, *args, **kwargs)

    monkeypatch.setattr(control.JobJudge, "judge", judge_and_then_exit)
    monkeypatch.setattr(control, "HEALTH_WAIT_INTERVAL", 0.0)
    result = apply(tmp_path, state="health", command=None, wait_for=["crashed"], wait_timeout=60)
    assert result["health"]["state"] == "crashed" and result["msg"].startswith("crashed: ")
    assert len(looks) == 2 and result["changed"] is False


def test_health_that_does_not_come_fails_naming_the_last_verdict(tmp_path, job) -> None:
    with pytest.raises(LaunchError) as caught:
        apply(tmp_path, state="health", command=None, wait_for=["stalled"], wait_timeout=0)
    assert str(caught.value).startswith("job job was not stalled within wait_timeout 0s: missing: ")
    assert caught.value.result["health"]["state"] == "missing"


@pytest.mark.parametrize("overrides, message", [
    ({"state": "started", "wait_for": ["stalled"]}, "wait_for: only with state=health"),
    ({"state": "health", "command": None, "wait_for": ["hung"]}, "wait_for: 'hung': not a health verdict"),
    ({"state": "health", "command": None, "end_supervisor": True}, "end_supervisor: only with state=stopped"),
])
def test_wait_for_and_end_supervisor_are_refused_where_they_mean_nothing(tmp_path, overrides, message) -> None:
    with pytest.raises(control.OptionsInvalid) as caught:
        options_from_params(params(tmp_path, **overrides))
    assert message in str(caught.value)
