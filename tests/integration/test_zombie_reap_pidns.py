"""zombie_reap inside a PID-namespace container whose init (``sleep infinity``) never reaps,
reached by ansible-playbook over community.docker.nsenter, as a task would reach a container.

Ending a job there leaves its orphans as zombies of that init for ever: the module must end
everything it can, wait ``reap_timeout``, and then say that only a container reboot clears the
rest — naming those zombies by the pids they have inside the container.
"""

from __future__ import annotations

import uuid

import pytest

from tests.harness.pidns import pid_namespace
from tests.harness.playbook import run_playbook
from tests.harness.procstates import SLEEPER, STALE_JOB, Reaper, host_pid, state_of

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
