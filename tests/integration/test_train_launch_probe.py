"""train_launch state=probe, force and reset_guard, for real.

The demo trainer (playbooks/files/demo_train.py) under the real module, inside a PID namespace whose
init never reaps. A probe judges and plans as state=started would and decides; it never stops,
starts, rotates or removes anything. reset_guard is the documented way past the crash-loop guard.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.launch_targets import Target, in_pid_namespace
from tests.harness.playbook import REPO, run_playbook
from tests.harness.procstates import wait_until

pytestmark = pytest.mark.slow

PROGRESS = r"^step (\d+) "
RESUME = ["--resume", "latest"]


@pytest.fixture(name="ns")
def ns_fixture(tmp_path):
    with in_pid_namespace(tmp_path) as where:
        yield where


def once(target: Target, state: str = "started", check: bool = False, **options: Any) -> dict[str, Any]:
    task = target.launch_task(task_name="t", state=state, progress_regex=PROGRESS, resume_args=RESUME, min_uptime=0.2)
    task["gpuops.relaunch.train_launch"].update(options)
    if state == "health":
        for key in ("command", "ready_regex", "min_uptime", "startup_timeout", "resume_args"):
            task["gpuops.relaunch.train_launch"].pop(key, None)
    return target.play([task], check=check).result("t")


def health_until(target: Target, wanted: str, **options: Any) -> dict[str, Any]:
    def ask() -> dict[str, Any] | None:
        result = once(target, "health", **options)
        assert result.get("failed") is not True, result
        return result if result["health"]["state"] == wanted else None

    return wait_until(ask, timeout=90, what=f"health {wanted}")


def job_dir(target: Target) -> Path:
    return Path(target.state_dir) / "job"


# The start path's modules: a probe of a job that runs with this spec needs none of them, and every
# module run on a target compiles what it imports afresh (AnsiballZ imports from a zip).
START_PATH_MODULES = ("_launch.supervisor", "_launch.systemd", "_launch.executor", "_launch.incident",
                      "_launch.readiness", "_launch.sharing", "_metrics.textfile", "_gpu.query")

# The module run as AnsiballZ runs it, in a fresh interpreter; what it imported goes to argv[2].
PROBE_IN_FRESH_INTERPRETER = """
import atexit, json, sys
imported = sys.argv[2]
sys.path.insert(0, sys.argv[3])
atexit.register(lambda: open(imported, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = sys.argv[:2]
from ansible_collections.gpuops.relaunch.plugins.modules import train_launch
train_launch.main()
"""


def test_a_probe_of_a_running_job_imports_nothing_of_the_start_path(ns: Target, tmp_path) -> None:
    task = ns.launch_task(task_name="t", min_uptime=0.2, backend="supervisor")
    assert ns.play([task]).result("t")["running"] is True
    args, imported = tmp_path / "args.json", tmp_path / "imported.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": dict(task["gpuops.relaunch.train_launch"], state="probe")}))
    # This interpreter: it has Ansible's module_utils, as the AnsiballZ payload has.
    ran = ns.namespace.run_inside([sys.executable, "-c", PROBE_IN_FRESH_INTERPRETER, str(args), str(imported),
                                   str(REPO / ".build" / "collections")])
    assert ran.returncode == 0, ran.stderr
    probe = json.loads(ran.stdout)
    assert probe["operation"] == "none" and probe["decision"]["action"] == "none", probe
    prefix = "ansible_collections.gpuops.relaunch.plugins.module_utils."
    modules = json.loads(imported.read_text())
    assert prefix + "_launch.judge" in modules
    assert [name for name in START_PATH_MODULES if prefix + name in modules] == []


def test_a_running_job_is_left_alone_and_its_progress_noted(ns: Target) -> None:
    command = ns.demo("--ready-after", "0.1", "--step-interval", "0.2")
    first = once(ns, command=command)
    assert first["running"] is True
    wait_until(lambda: "step 2 " in Path(ns.log()).read_text(), what="step 2")
    probe = once(ns, "probe", command=command)
    assert probe["changed"] is False and probe["operation"] == "none" and probe["pid"] == first["pid"]
    assert probe["decision"]["action"] == "none" and probe["decision"]["relaunch"] is False
    assert probe["decision"]["why"].startswith("left alone: it runs with this spec (running; last: step ")
    assert (job_dir(ns) / "progress.json").is_file()  # noted, as state=health notes it
    assert ns.processes().get(first["pid"]) is not None and not Path(ns.log() + ".1").exists()
    # force: the decision relaunches, the probe still changes nothing.
    forced = once(ns, "probe", command=command, force=True)
    assert forced["changed"] is False and forced["operation"] == "none" and forced["pid"] == first["pid"]
    assert forced["decision"]["action"] == "relaunch" and forced["decision"]["why"].startswith("forced (relaunch_force)")
    # Another spec: the plan restarts, the decision relaunches; the job keeps running.
    other = once(ns, "probe", command=command + ["--lines", "4"])
    assert other["operation"] == "restart" and other["msg"] == "would restart the job with backend supervisor"
    assert other["decision"] == {"action": "relaunch", "relaunch": True, "resume": False, "resume_mode": "never",
                                 "resumable": True, "why": "the job runs with another spec, log path or backend"}
    started = once(ns, command=command)  # and state=started agrees there is nothing to do
    assert started["changed"] is False and started["pid"] == first["pid"]
    assert started["decision"]["action"] == "none"
    # --check --diff of a start with another spec: what the restart is for, before it happens (escaped,
    # the secret masked); the job keeps running.
    task = ns.launch_task(task_name="t", progress_regex=PROGRESS, resume_args=RESUME, min_uptime=0.2,
                          command=[*command, "--lines", "4"], env={"HF_TOKEN": "hf-secret", "RUN_NOTE": "a\x1b[2Jb"})
    diffed = run_playbook([{"hosts": "all", "gather_facts": False, "tasks": [task]}], inventory=ns.inventory,
                          check=True, extra_args=["--diff"]).result("t")
    assert diffed["changed"] is True and diffed["operation"] == "restart" and diffed["pid"] == first["pid"]
    assert diffed["diff"]["before"] == f"command: {shlex.join(command)}\n"
    assert diffed["diff"]["after"] == (f"command: {shlex.join([*command, '--lines', '4'])}\n"
                                       "env.HF_TOKEN: ********\nenv.RUN_NOTE: a\\x1b[2Jb\n")
    assert diffed["diff"]["before_header"] == f"recorded run {first['run_id']}"
    assert "hf-secret" not in json.dumps(diffed["diff"]) and ns.processes().get(first["pid"]) is not None


def test_a_crashed_job_is_relaunched_resumed_and_the_guard_reset(ns: Target) -> None:
    crashing = ns.demo("--ready-after", "0.1", "--step-interval", "0.5", "--crash-at-step", "2", "--exit-code", "7")
    options = {"command": crashing, "max_relaunches": 1, "relaunch_window": 3600}
    once(ns, **options)
    crashed = health_until(ns, "crashed", max_relaunches=1)
    probe = once(ns, "probe", **options)
    assert probe["changed"] is False and probe["operation"] == "start" and probe["resumed"] is True
    assert probe["decision"] == {"action": "relaunch", "relaunch": True, "resume": True, "resume_mode": "always",
                                 "resumable": True, "why": f"the job is crashed: {crashed['health']['reason']}"}
    assert probe["incident"] is None and not (job_dir(ns) / "incidents").exists()
    assert not (job_dir(ns) / "relaunches.json").exists() and not Path(ns.log() + ".1").exists()
    again = once(ns, **options)
    assert again["running"] is True and again["resumed"] is True and again["decision"]["action"] == "relaunch"
    health_until(ns, "crashed", max_relaunches=1)
    # The guard: the probe decides refused (with the refusal text), the start fails with it.
    refused_probe = once(ns, "probe", **options)
    assert refused_probe.get("failed") is not True and refused_probe["decision"]["action"] == "refused"
    refused = once(ns, **options)
    assert refused["failed"] is True and refused["msg"] == refused_probe["decision"]["why"]
    assert "reset the guard with reset_guard=true / job_launch_reset_guard=true" in refused["msg"]
    # reset_guard: the history is cleared first, and the job is relaunched.
    reset = once(ns, reset_guard=True, **options)
    assert reset.get("failed") is not True, reset
    assert reset["guard_cleared"] == 1 and reset["running"] is True and reset["resumed"] is True
    assert reset["decision"]["action"] == "relaunch" and reset["relaunch_guard"]["recent"] == 0
    history = json.loads((job_dir(ns) / "relaunches.json").read_text())["relaunches"]
    assert len(history) == 1 and history[0]["run_id"] == refused["run_id"]  # this relaunch, counted anew


def test_a_finished_job_is_left_alone_unless_forced(ns: Target) -> None:
    done = ns.demo("--ready-after", "0.1", "--step-interval", "0.2", "--finish-at-step", "2")
    once(ns, command=done)
    finished = health_until(ns, "finished")
    probe = once(ns, "probe", command=done)
    ended = finished["health"]["ended_at"]
    assert probe["decision"] == {"action": "none", "relaunch": False, "resume": False, "resume_mode": "never",
                                 "resumable": True, "why": f"left alone: the job finished (exit code 0 at {ended}); relaunch_force relaunches it"}
    forced = once(ns, "probe", command=done, force=True, resume="always")
    assert forced["decision"] == {"action": "relaunch", "relaunch": True, "resume": True, "resume_mode": "always",
                                  "resumable": True, "why": f"forced (relaunch_force), although the job finished (exit code 0 at {ended})"}
    assert forced["changed"] is False and forced["operation"] == "start"
