"""zombie_reap inside a PID-namespace container whose init (``sleep infinity``) never reaps,
reached by ansible-playbook over community.docker.nsenter, as a task would reach a container.

Ending a job there leaves its orphans as zombies of that init for ever: the module must end
everything it can, wait ``reap_timeout``, and then say that only a container reboot clears the
rest — naming those zombies by the pids they have inside the container.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest

from tests.harness.pidns import pid_namespace, process_starttime
from tests.harness.playbook import run_playbook
from tests.harness.procstates import PYTHON, SLEEPER, STALE_JOB, Reaper, host_pid, state_of

TASK = "Reap the job inside the container"


@pytest.fixture(name="namespace")
def namespace_fixture():
    with pid_namespace() as namespace:
        yield namespace


def test_orphans_under_a_non_reaping_init_escalate_to_container_reboot(namespace, tmp_path):
    reaper = Reaper()
    try:
        runner = ["nsenter", f"--target={namespace.init_pid}", "--pid", "--mount", "--"]
        tag = f"/tmp/gpuops-ns-{uuid.uuid4().hex[:8]}/run/train.py"
        job = reaper.start(STALE_JOB, tag, runner=runner)
        decoy = reaper.start(SLEEPER, tag.replace("/run/", "/other/"), runner=runner)
        parent, zombie, orphan = int(job["parent"]), int(job["zombie"]), int(job["orphan"])
        workers = [int(w) for w in job["workers"].split(",")]
        decoy_host = host_pid(namespace.init_pid, int(decoy["pid"]))

        inventory = namespace.write_inventory(tmp_path / "inventory")
        run = run_playbook([{
            "name": "reap in the container", "hosts": "ct", "gather_facts": False,
            "tasks": [{"name": TASK, "gpuops.relaunch.zombie_reap": {
                "match": [tag.replace(".", r"\.") + r"\b"], "term_timeout": 3, "kill_timeout": 3,
                "reap_timeout": 2, "d_state_timeout": 2,
            }}],
        }], inventory=inventory)
        assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]
        res = run.result(TASK)

        assert res["escalation"] == "container_reboot", res["reasons"]
        assert res["changed"] is True
        job_pids = {j["pid"] for j in res["job"]}
        assert {parent, zombie, orphan, *workers} <= job_pids  # pids inside the container
        # Everything that could be ended was: what is left is only zombies of the init.
        assert {e["state"] for e in res["remaining"]} == {"Z"}
        left = {e["pid"] for e in res["remaining"]}
        assert {zombie, orphan, *workers} <= left
        assert parent not in left  # its parent (nsenter, outside the container) reaped it
        assert all("orphaned to PID 1" in e["reason"] for e in res["remaining"])
        reason = next(r for r in res["reasons"] if "only a restart of the container clears them" in r)
        assert "(sleep)" in reason and all(str(pid) in reason for pid in left)
        # PID 1 of the container was never signalled, and the look-alike outside the job survived.
        assert 1 not in {a["pid"] for a in res["actions"]}
        assert state_of(decoy_host) == "S"
        assert namespace.alive()
        for pid in left:
            assert state_of(host_pid(namespace.init_pid, pid)) == "Z"
    finally:
        reaper.cleanup()


# --- selections that name more than a job ---------------------------------------------------------
#
# A broad selection must be refused before anything is signalled, and the refusal must hold where it
# matters most: with ansible_connection=local, where the controller's workers for other hosts share
# the command line of the worker running the module. The whole controller runs in a PID namespace of
# its own here (the shell below is its PID 1; its children die with it), so that if the floor ever
# gives way, what ends is only what this test started.

SLEEP_FOREVER = "import time; time.sleep(3600)"
REAPING_INIT = [PYTHON, "-c", "import os, time\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(0.05)\n"]


def private_controller(*tags: str) -> list[str]:
    """An ansible-playbook wrapper: a fresh PID namespace whose PID 1 is a shell that starts one
    sleeper per tag, then runs the controller (not as its last command, so it is not exec'd)."""
    sleepers = "".join(f"{PYTHON} -c '{SLEEP_FOREVER}' {tag} </dev/null >/dev/null 2>&1 & " for tag in tags)
    return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
            "/bin/sh", "-c", sleepers + '"$@"; exit $?', "sh"]


def refused_task(name: str, match: list[str], **extra) -> dict:
    return {"name": name, "gpuops.relaunch.zombie_reap": {"match": match, "term_timeout": 2, "kill_timeout": 2},
            "when": "inventory_hostname == 'h1'", "ignore_errors": True, **extra}


def test_broad_selections_are_refused_and_the_controller_serving_another_host_survives(tmp_path):
    base = f"/tmp/gpuops-broad-{uuid.uuid4().hex[:8]}"
    job_tag, other_tag = f"{base}/run/train.py", f"{base}/other/train.py"
    job_rx = job_tag.replace(".", r"\.") + r"\b"
    released = tmp_path / "h1-done"
    inventory = tmp_path / "inventory"
    inventory.write_text("".join(
        f"{host} ansible_connection=local ansible_python_interpreter={PYTHON}\n" for host in ("h1", "h2")
    ), encoding="utf-8")
    when_h1 = "inventory_hostname == 'h1'"
    run = run_playbook([{
        "name": "broad selections", "hosts": "h1,h2", "gather_facts": False, "strategy": "free",
        "tasks": [
            # h2's worker and its module stay busy until h1 is through: the processes that a broad
            # selection on h1 used to end.
            {"name": "Serve the other host", "ansible.builtin.wait_for": {"path": str(released), "timeout": 240},
             "when": "inventory_hostname == 'h2'"},
            refused_task("Everything, in check mode", [".*"], check_mode=True),
            refused_task("The empty pattern", [""]),
            refused_task("Every python", ["python"]),
            refused_task("The controller's command line", ["gpuops-play-"]),
            refused_task("The job and the empty pattern", [job_rx, ""], check_mode=True),
            {"name": "The job, in check mode", "gpuops.relaunch.zombie_reap": {"match": [job_rx]},
             "check_mode": True, "when": when_h1},
            {"name": "The role with everything", "when": when_h1, "block": [
                {"name": "Clean up everything", "ansible.builtin.include_role": {"name": "gpuops.relaunch.process_cleanup"},
                 "vars": {"process_cleanup_match": [".*"]}},
            ], "rescue": [
                {"name": "Record the role's refusal", "ansible.builtin.set_fact": {"role_refusal": "{{ ansible_failed_result.msg }}"}},
            ]},
            {"name": "Show the role's refusal", "ansible.builtin.debug": {"msg": "{{ role_refusal | default('') }}"}, "when": when_h1},
            {"name": "What is left", "gpuops.relaunch.zombie_facts": {"match": [re.escape(base) + "/"]}, "when": when_h1},
            {"name": "Release the other host", "ansible.builtin.file": {"path": str(released), "state": "touch", "mode": "0600"},
             "when": when_h1},
        ],
    }], inventory=str(inventory), timeout=180, wrapper=private_controller(job_tag, other_tag))
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]

    # The other host's task ran to its end: its worker was never touched.
    served = run.result("Serve the other host", "h2")
    assert served.get("failed") is not True and served.get("skipped") is not True, served

    left = run.result("What is left", "h1")["ansible_facts"]["zombie_facts"]["job_processes"]
    sleepers = {entry["pid"] for entry in left}
    assert len(sleepers) == 2 and {entry["state"] for entry in left} == {"S"}, left

    expected = {
        "Everything, in check mode": "match: '.*' matches the empty string, so it selects every process",
        "The empty pattern": "match: '' matches the empty string, so it selects every process",
        "Every python": "match: 'python' matches the command line of this module's own process",
        "The controller's command line": "match: 'gpuops-play-' matches the command line of pid ",
        "The job and the empty pattern": "match: '' matches the empty string",
    }
    for name, message in expected.items():
        res = run.result(name, "h1")
        assert res.get("failed") is True, (name, res)
        assert res["msg"].startswith(message), (name, res["msg"])
        assert "allow_broad: true" in res["msg"] and "Traceback" not in json.dumps(res), name
        assert res["refused"] and res["actions"] == [] and res["plan"] == [] and res["signals_sent"] == 0, name
        assert res.get("changed") is False, name
        # What the selection would have taken is shown: the sleepers among it, for the broad ones.
        if name != "The controller's command line":
            assert sleepers <= {entry["pid"] for entry in res["job"]}, name
    # The controller's own worker for the other host is what that pattern would have ended.
    controller = run.result("The controller's command line", "h1")
    assert "an ancestor of this module" in controller["msg"]
    workers = [int(m) for r in controller["refused"] for m in re.findall(r"selects pid (\d+) \(ansible-playboo\), which runs Ansible", r)]
    assert workers and set(workers) <= {entry["pid"] for entry in controller["job"]}, controller["refused"]
    assert not sleepers & {entry["pid"] for entry in controller["job"]}

    # A selection that names the job passes, and check mode shows what it selects.
    planned = run.result("The job, in check mode", "h1")
    assert planned.get("failed") is not True and planned["changed"] is True, planned
    (job_entry,) = planned["job"]
    assert job_entry["pid"] in sleepers and planned["actions"] == []
    assert [(s["stage"], s["pid"]) for s in planned["plan"]][:1] == [("terminate", job_entry["pid"])]

    assert run.result("Show the role's refusal", "h1")["msg"].startswith(
        "match: '.*' matches the empty string, so it selects every process")


def test_allow_broad_ends_everything_a_container_runs_but_its_init_and_the_connection(tmp_path):
    with pid_namespace(REAPING_INIT) as namespace:
        reaper = Reaper()
        try:
            runner = ["nsenter", f"--target={namespace.init_pid}", "--pid", "--mount", "--"]
            base = f"/tmp/gpuops-broad-{uuid.uuid4().hex[:8]}"
            started = [reaper.start(SLEEPER, f"{base}/{name}", runner=runner) for name in ("train.py", "tensorboard", "notebook")]
            inside = {int(fields["pid"]) for fields in started}
            hosts = {host_pid(namespace.init_pid, pid): process_starttime(host_pid(namespace.init_pid, pid)) for pid in inside}

            broad = {"match": [".*"], "term_timeout": 3, "kill_timeout": 3, "reap_timeout": 2, "d_state_timeout": 2}
            run = run_playbook([{
                "name": "everything in the container", "hosts": "ct", "gather_facts": False,
                "tasks": [
                    {"name": "Refused without allow_broad", "gpuops.relaunch.zombie_reap": broad, "ignore_errors": True},
                    {"name": "Everything, in check mode", "gpuops.relaunch.zombie_reap": dict(broad, allow_broad=True),
                     "check_mode": True},
                    {"name": "Everything", "gpuops.relaunch.zombie_reap": dict(broad, allow_broad=True)},
                ],
            }], inventory=namespace.write_inventory(tmp_path / "inventory"), timeout=300)
            assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]

            refused = run.result("Refused without allow_broad")
            assert refused.get("failed") is True and refused["msg"].startswith("match: '.*' matches the empty string")
            assert refused["actions"] == [] and inside <= {entry["pid"] for entry in refused["job"]}

            planned = run.result("Everything, in check mode")
            assert planned.get("failed") is not True and planned["actions"] == []
            selected = {entry["pid"] for entry in planned["job"]}
            assert inside <= selected and 1 not in selected  # PID 1 stays protected
            assert {s["pid"] for s in planned["plan"] if s["stage"] == "terminate"} >= inside

            ended = run.result("Everything")
            assert ended["changed"] is True and ended["escalation"] == "none", ended["reasons"]
            assert inside <= {entry["pid"] for entry in ended["ended"]}
            assert 1 not in {action["pid"] for action in ended["actions"]}
            for pid, starttime in hosts.items():
                assert process_starttime(pid) != starttime or state_of(pid) == "Z", pid
            assert namespace.alive()
        finally:
            reaper.cleanup()
