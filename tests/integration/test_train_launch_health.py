"""train_launch's health verdict, incident records, crash-loop guard and resume, for real.

Each job is the demo trainer (playbooks/files/demo_train.py) told to stall, crash or finish at a
step, launched through the real module inside a PID namespace whose init never reaps (so every
signal stays inside it). Nothing here waits a fixed time: the tests ask the module (state=health)
until it gives the verdict, against a deadline.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.harness.gpu_holder import host_proc_view, sim_gpu
from tests.harness.launch_targets import Target, in_pid_namespace
from tests.harness.pidns import process_starttime
from tests.harness.procstates import wait_until

pytestmark = pytest.mark.slow

PROGRESS = r"^step (\d+) "
RESUME = ["--resume", "latest", "--stall-at-step", "0"]  # the resumed run no longer stalls


@pytest.fixture(name="ns")
def ns_fixture(tmp_path):
    with in_pid_namespace(tmp_path) as where:
        yield where


def task(target: Target, state: str = "started", task_name: str = "t", **options: Any) -> dict[str, Any]:
    base = target.launch_task(task_name=task_name, state=state, progress_regex=PROGRESS, stall_after=1,
                              resume_args=RESUME, min_uptime=0.2)
    base["gpuops.relaunch.train_launch"].update(options)
    if state in ("health", "stopped"):
        for key in ("command", "ready_regex", "min_uptime", "startup_timeout", "resume_args"):
            base["gpuops.relaunch.train_launch"].pop(key, None)
    return base


def once(target: Target, state: str = "started", check: bool = False, **options: Any) -> dict[str, Any]:
    run = target.play([task(target, state, **options)], check=check)
    return run.result("t")


def health_until(target: Target, wanted: str, **options: Any) -> dict[str, Any]:
    """Ask (state=health) until the verdict is `wanted`; the last answer."""
    seen: list[str] = []

    def ask() -> dict[str, Any] | None:
        result = once(target, "health", **options)
        assert result.get("failed") is not True, result
        seen.append(result["health"]["state"])
        return result if result["health"]["state"] == wanted else None

    return wait_until(ask, timeout=90, what=f"health {wanted}")


def job_dir(target: Target) -> Path:
    return Path(target.state_dir) / "job"


def nothing_written(target: Target) -> None:
    assert not (job_dir(target) / "incidents").exists()
    assert not (job_dir(target) / "relaunches.json").exists()


def test_a_stalled_job_is_found_kept_as_evidence_and_resumed(ns: Target) -> None:
    first = once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--stall-at-step", "3"))
    assert first["running"] is True and first["health"]["state"] == "missing"  # no run before: a first launch
    assert first["resumed"] is False and first["relaunch_guard"]["needed"] is False

    stalled = health_until(ns, "stalled")
    assert stalled["changed"] is False and stalled["operation"] == "none" and stalled["running"] is True
    assert stalled["health"]["last_step"] == "3" and stalled["health"]["last_progress_line"].startswith("step 3 ")
    assert stalled["health"]["since_progress"] >= 1 and stalled["health"]["last_progress_at"]
    assert "stalling after step 3" in stalled["health"]["log_tail"]
    assert stalled["relaunch_guard"]["needed"] is True and stalled["relaunch_guard"]["would_refuse"] is False

    # Check mode: says it would restart and resume, writes nothing, signals nothing.
    would = once(ns, check=True, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2",
                                                 "--stall-at-step", "3"))
    assert would["operation"] == "restart" and would["resumed"] is True and would["health"]["state"] == "stalled"
    assert would["pid"] == first["pid"] and first["pid"] in ns.processes()
    nothing_written(ns)

    again = once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--stall-at-step", "3"))
    assert again["changed"] is True and again["operation"] == "restart" and again["health"]["state"] == "stalled"
    assert again["resumed"] is True and again["pid"] != first["pid"]
    assert again["spec_hash"] == first["spec_hash"]  # resume_args are not part of the spec
    assert "resuming from latest" in Path(ns.log()).read_text()
    incident = json.loads(Path(again["incident"]).read_text())
    assert oct(Path(again["incident"]).stat().st_mode & 0o777) == "0o600"
    assert incident["run_id"] == first["run_id"] and incident["health"]["state"] == "stalled"
    assert "stalling after step 3" in incident["log_tail"]
    leader = [entry for entry in incident["processes"] if entry["pid"] == first["pid"]]
    assert leader, incident["processes"]
    # The main thread and the thread blocked on the lock, each with its state and wchan.
    assert len(leader[0]["threads"]) >= 2
    assert all(set(thread) >= {"tid", "state", "wchan"} for thread in leader[0]["threads"])
    assert "available" in incident["py_spy"] or "dumps" in incident["py_spy"]
    history = json.loads((job_dir(ns) / "relaunches.json").read_text())["relaunches"]
    assert [entry["health"] for entry in history] == ["stalled"] and history[0]["run_id"] == first["run_id"]

    # The resumed run progresses, and a new start with the same spec changes nothing.
    health = once(ns, "health")
    assert health["health"]["state"] == "running" and health["run_id"] == again["run_id"]
    same = once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--stall-at-step", "3"))
    assert same["changed"] is False and same["pid"] == again["pid"]


def test_a_stall_behind_other_output_is_found_once_a_task_has_seen_the_step(ns: Target) -> None:
    """The job goes on printing (not steps): the log's mtime keeps moving, the progress record does not."""
    once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--stall-at-step", "2",
                             "--stall-chatter", "0.1"))
    stalled = health_until(ns, "stalled")  # each ask outside check mode notes the step it sees
    assert stalled["health"]["progress_basis"] == "progress_record" and stalled["health"]["last_step"] == "2"
    assert stalled["health"]["log_tail"][-1] == "still waiting for allreduce after step 2"
    record = (job_dir(ns) / "progress.json").read_bytes()
    # Check mode reads the record too, and writes nothing.
    checked = ns.play([task(ns, "health")], check=True).result("t")
    assert checked["health"]["state"] == "stalled" and (job_dir(ns) / "progress.json").read_bytes() == record


def test_a_crashing_job_is_relaunched_until_the_guard_stops_it(ns: Target) -> None:
    crashing = ns.demo("--ready-after", "0.1", "--step-interval", "1", "--crash-at-step", "2", "--exit-code", "7")
    options = {"command": crashing, "max_relaunches": 2, "relaunch_window": 3600, "resume_args": ["--resume", "x"]}
    first = once(ns, **options)
    assert first["running"] is True
    pids = [first["pid"]]
    for attempt in range(2):
        crashed = health_until(ns, "crashed", max_relaunches=2)
        assert crashed["health"]["exit_code"] == 7 and crashed["health"]["exit_signal"] is None
        assert "crashing after step 2 with code 7" in crashed["health"]["log_tail"]
        assert crashed["relaunch_guard"]["recent"] == attempt and crashed["relaunch_guard"]["would_refuse"] is False
        if attempt == 1:
            # The growing delay: the second counted relaunch is due relaunch_delay after the first. Before that
            # the probe leaves the job (decision none, due_at: no worker waits) and a start is refused, to be
            # retried; nothing is stopped or counted. (Told no delay, the same relaunch goes ahead below.)
            delayed = {**options, "relaunch_delay": 3000, "relaunch_max_delay": 3000}
            later = once(ns, "probe", **delayed)
            assert later["decision"]["action"] == "none"
            assert later["decision"]["due_at"] == later["relaunch_guard"]["due_at_iso"]
            assert later["relaunch_guard"]["delay"] == 3000 and 0 < later["relaunch_guard"]["wait"] <= 3000
            not_yet = once(ns, **delayed)
            assert not_yet["failed"] is True and not_yet["changed"] is False and not_yet["msg"].startswith("not relaunching yet")
            assert later["decision"]["due_at"] in not_yet["msg"] and "relaunch_delay=3000" in not_yet["msg"]
            assert len(json.loads((job_dir(ns) / "relaunches.json").read_text())["relaunches"]) == 1
        again = once(ns, **options)
        assert again["running"] is True and again["resumed"] is True and again["health"]["state"] == "crashed"
        assert Path(again["incident"]).is_file()
        pids.append(again["pid"])
    last = health_until(ns, "crashed", max_relaunches=2)
    assert last["relaunch_guard"]["recent"] == 2 and last["relaunch_guard"]["would_refuse"] is True
    # Check mode says it would refuse, and does not fail.
    would = once(ns, check=True, **options)
    assert would.get("failed") is not True and would["relaunch_guard"]["would_refuse"] is True
    assert would["msg"].startswith("would refuse: ")
    refused = once(ns, **options)
    assert refused["failed"] is True and refused["changed"] is False
    assert "max_relaunches=2" in refused["msg"] and "relaunch_window=3600s" in refused["msg"]
    assert refused["run_id"] == last["run_id"] and Path(refused["incident"]).is_file()  # the evidence is kept
    assert json.loads(Path(refused["incident"]).read_text())["health"]["exit_code"] == 7
    assert len(list((job_dir(ns) / "incidents").iterdir())) == 3  # one per crashed run
    history = json.loads((job_dir(ns) / "relaunches.json").read_text())["relaunches"]
    assert [(entry["step"], entry["counted"]) for entry in history] == [("2", True), ("2", True)]  # the same step
    # The budget knows why. A failure the hardware caused (the GPU health gate's word) is relaunched and not
    # counted; its run gets past step 2 (to 4), so the relaunch after it is not counted either; dying at step 4
    # again is counted, and refused as before.
    onward = {**options, "command": ns.demo("--ready-after", "0.1", "--step-interval", "0.3", "--crash-at-step", "4",
                                            "--exit-code", "7")}
    hardware = once(ns, failure_cause="hardware", **onward)
    assert hardware["running"] is True and hardware["relaunch_guard"]["counts"] is False
    progressed = health_until(ns, "crashed", max_relaunches=2)
    guard = progressed["relaunch_guard"]
    assert guard["recent"] == 2 and guard["step"] == "4" and guard["counts"] is False and guard["would_refuse"] is False
    assert "got past step 2" in guard["why"]
    assert once(ns, **onward)["running"] is True
    same_step = health_until(ns, "crashed", max_relaunches=2)["relaunch_guard"]
    assert same_step["counts"] is True and same_step["would_refuse"] is True and same_step["recent"] == 2
    history = json.loads((job_dir(ns) / "relaunches.json").read_text())["relaunches"]
    assert [(entry["step"], entry["cause"], entry["counted"]) for entry in history[2:]] == [
        ("2", "hardware", False), ("4", "unknown", False)]


def test_a_finished_job_is_finished(ns: Target) -> None:
    done = ns.demo("--ready-after", "0.1", "--step-interval", "0.3", "--finish-at-step", "3")
    once(ns, command=done)
    finished = health_until(ns, "finished")
    assert finished["health"]["exit_code"] == 0 and finished["health"]["last_step"] is None
    assert finished["relaunch_guard"]["needed"] is False
    stopped = once(ns, "stopped")
    assert stopped["changed"] is False and stopped["incident"] is None


def test_a_trainer_killed_inside_a_shell_pipeline_is_crashed_not_finished(ns: Target, tmp_path: Path) -> None:
    """`python train.py | tee`: the OOM killer's SIGKILL of the trainer must not become tee's exit 0."""
    trainer = " ".join(shlex.quote(arg) for arg in ns.demo("--ready-after", "0.1", "--step-interval", "0.2"))
    first = once(ns, command=f"{trainer} | tee {shlex.quote(str(tmp_path / 'tee.out'))}", shell=True)
    assert first["running"] is True
    table = ns.processes()
    [python] = [proc.pid for proc in table.values() if proc.ppid == first["pid"] and ns.mine(proc)]
    host = ns.host_pid(python)
    assert host is not None
    os.kill(host, signal.SIGKILL)  # inside the namespace: the trainer this test started, just looked up

    def run_ended() -> dict[str, Any] | None:
        result = once(ns, "health")
        return result if result["health"]["state"] in ("finished", "crashed") else None

    ended = wait_until(run_ended, timeout=90, what="the run's end")
    assert ended["health"]["state"] == "crashed", ended["health"]
    assert ended["health"]["exit_code"] == 128 + signal.SIGKILL and "SIGKILL" in ended["health"]["reason"]
    assert ended["decision"]["action"] == "relaunch"


def test_a_run_gone_without_an_exit_record_is_missing_and_relaunched(ns: Target) -> None:
    """A container reboot, simulated: the supervisor and the job killed by their recorded pids."""
    textfiles = ns.work / "textfiles"
    textfiles.mkdir()
    first = once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2"), metrics_dir=str(textfiles),
                 metrics_host="ct")
    supervisor, job = ns.host_pid(first["supervisor_pid"]), ns.host_pid(first["pid"])
    assert supervisor and job
    starts = {pid: process_starttime(pid) for pid in (supervisor, job)}
    for pid in (supervisor, job):  # the supervisor first, so that nothing records the job's end
        if process_starttime(pid) == starts[pid]:
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: all(ns.processes().get(pid) is None or ns.processes()[pid].zombie
                           for pid in (first["supervisor_pid"], first["pid"])), what="the run gone")
    missing = once(ns, "health")
    assert missing["health"]["state"] == "missing" and missing["running"] is False
    # Nothing on the node keeps the live file now: the task that found the run missing wrote it.
    assert (f'gpuops_job_health{{gpuops_job="job",gpuops_host="ct",gpuops_rank0="ct",gpuops_run="{first["run_id"]}",'
            'state="missing"} 1') in (textfiles / "gpuops_job_job.prom").read_text(encoding="utf-8")
    assert missing["health"]["run_id"] == first["run_id"] and missing["relaunch_guard"]["needed"] is True
    would = once(ns, check=True, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2"))
    assert would["operation"] == "start" and would["resumed"] is True
    nothing_written(ns)
    again = once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2"))
    assert again["running"] is True and again["resumed"] is True and again["health"]["state"] == "missing"
    assert again["incident"] is None  # nothing alive to look at: the health and the log say it all
    assert "resuming from latest" in Path(ns.log()).read_text()


def test_the_incident_holds_gpu_memory_per_holder(tmp_path: Path) -> None:
    """Simulated NVML (PYTHONPATH in the task's environment) answers for the stalled job's host pid."""
    with host_proc_view() as host_proc, sim_gpu(devices=1, host_proc=host_proc) as gpu, \
            in_pid_namespace(tmp_path) as ns:
        command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--stall-at-step", "2")
        first = once(ns, command=command)
        job = ns.host_pid(first["pid"])
        assert job is not None
        gpu.register(job, 2048)
        health_until(ns, "stalled")
        stop = task(ns, "stopped")
        stop["environment"] = gpu.env()
        stopped = ns.play([stop]).result("t")
        assert stopped["changed"] is True and stopped["health"]["state"] == "stalled"
        evidence = json.loads(Path(stopped["incident"]).read_text())["gpu"]
        assert evidence["available"] is True and evidence["backend"] == "pynvml"
        [device] = evidence["devices"]
        # NVML reports host pids: inside the container the job's own pid differs (job_member says so).
        assert {"pid": job, "used_mib": 2048.0, "job_member": False} in device["processes"]
        after = once(ns, "health")
        assert after["health"]["state"] == "stalled" and after["health"]["stopped"] is True


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed (it is optional on targets)")
def test_the_incident_holds_python_stacks_where_py_spy_is_installed(ns: Target) -> None:
    first = once(ns, command=ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--stall-at-step", "2"))
    health_until(ns, "stalled")
    stop = task(ns, "stopped")
    stop["environment"] = {"PATH": os.environ["PATH"]}
    stopped = ns.play([stop]).result("t")
    dumps = json.loads(Path(stopped["incident"]).read_text())["py_spy"]["dumps"]
    [leader] = [dump for dump in dumps if dump["pid"] == first["pid"]]
    assert leader["rc"] == 0 and "main" in leader["stacks"] and "demo_train.py" in leader["stacks"]


BAD_HEALTH_OPTIONS = [
    ({"stall_after": "{{ 'nan' | float }}"}, ["stall_after"]),
    ({"stall_after": 0}, ["stall_after"]),
    ({"stall_after": 86401}, ["stall_after"]),
    ({"progress_regex": "(", "stall_after": 5}, ["progress_regex"]),
    ({"progress_regex": None, "stall_after": 5}, ["stall_after"]),
    ({"max_relaunches": -1, "relaunch_window": 0}, ["max_relaunches", "relaunch_window"]),
]


def test_bad_health_options_are_refused_naming_them(ns: Target) -> None:
    # One play, a task per case (ignore_errors): one namespace and one ansible-playbook start for all.
    tasks = []
    for index, (options, _named) in enumerate(BAD_HEALTH_OPTIONS):
        tasks.append(dict(task(ns, task_name=f"bad {index}", **options), ignore_errors=True))
    run = ns.play(tasks)
    for index, (options, named) in enumerate(BAD_HEALTH_OPTIONS):
        result = run.result(f"bad {index}")
        assert result["failed"] is True and result.get("changed") is False, options
        assert [problem["option"] for problem in result["option_problems"]] == named, options
        assert "Traceback" not in json.dumps(result)
    assert not Path(ns.state_dir).exists()


# A trainer that saves a checkpoint when asked to stop (SIGTERM), as most do.
CHECKPOINTING_TRAINER = """
import os, signal, sys, time
checkpoint = sys.argv[1]
def save(signum, frame):
    with open(checkpoint, "w") as out:
        out.write("saved at step %d" % step)
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
step = 0
while True:
    step += 1
    print("step %d loss 0.1" % step, flush=True)
    time.sleep(0.2)
"""


def test_a_frozen_job_is_named_stopped_by_a_signal_and_saves_its_checkpoint_when_relaunched(ns: Target, tmp_path: Path) -> None:
    """Frozen with SIGSTOP (a debugger, a cgroup freezer): the health and the incident say so, and the
    relaunch's SIGTERM is followed by SIGCONT, so the trainer's handler runs and saves its checkpoint
    well within term_timeout instead of being SIGKILLed at its end."""
    script = ns.work / "checkpointing.py"
    script.write_text(CHECKPOINTING_TRAINER, encoding="utf-8")
    checkpoint = ns.work / "checkpoint"
    command = ["/usr/bin/python3", str(script), str(checkpoint)]
    first = once(ns, command=command)
    assert first["running"] is True, first
    leader = ns.host_pid(first["pid"])
    os.kill(leader, signal.SIGSTOP)
    wait_until(lambda: Path(f"/proc/{leader}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", what="the job frozen")
    stalled = health_until(ns, "stalled")
    assert "stopped by a signal" in stalled["health"]["reason"], stalled["health"]
    assert "do_signal_stop" in stalled["health"]["reason"] or "wchan" in stalled["health"]["reason"]

    relaunched = once(ns, command=command, term_timeout=30)
    assert relaunched["running"] is True and relaunched["changed"] is True and relaunched["resumed"] is True, relaunched
    assert relaunched["stop"]["escalated"] is False, relaunched["stop"]
    assert checkpoint.read_text(encoding="utf-8").startswith("saved at step ")
    assert relaunched["previous"]["exit_code"] == 0
    assert relaunched["elapsed"] < 25
    incident = json.loads(Path(relaunched["incident"]).read_text(encoding="utf-8"))
    assert "stopped by a signal" in incident["health"]["reason"]
    (process,) = [entry for entry in incident["processes"] if entry["pid"] == first["pid"]]
    assert process["state"] == "T" and "stopped by a signal" in process["frozen"]
