"""The process_cleanup role (one zombie_reap call, its found and left) through ansible-playbook:
its facts are what a playbook decides a container reset on."""

from __future__ import annotations

import uuid

from tests.harness.pidns import pid_namespace, process_starttime
from tests.harness.playbook import run_playbook
from tests.harness.procstates import PYTHON, SLEEPER, STALE_JOB, Reaper, state_of, wait_until
from tests.integration.test_zombie_reap import identities, supervised, tree

REAP_TASK = "gpuops.relaunch.process_cleanup : End the job and clear its zombies with the least force that works"
FACTS = [
    "process_cleanup_found_escalation", "process_cleanup_found_reasons", "process_cleanup_escalation",
    "process_cleanup_needs_reboot", "process_cleanup_needs_host_action", "process_cleanup_reasons",
    "process_cleanup_ended", "process_cleanup_remaining", "process_cleanup_other_jobs",
]
# What the role runs: the argument check, the one module call, relaunch_clearance's judgement (on the
# controller), the facts, the fail task (skipped unless asked for). Only the reap reaches the target.
ROLE_TASKS = 5
LOCAL_TASKS = ("Validating arguments against arg spec", "Decide whether only", "Record what was found", "Stop when only")


def role_play(match: str, hosts: str = "all") -> list[dict]:
    return [{
        "name": "process cleanup", "hosts": hosts, "gather_facts": False,
        "tasks": [
            {"name": "Clean up", "ansible.builtin.include_role": {"name": "gpuops.relaunch.process_cleanup"},
             "vars": {"process_cleanup_match": [match], "process_cleanup_term_timeout": 3,
                      "process_cleanup_reap_timeout": 3, "process_cleanup_orphan_grace": 2}},
            {"name": "Show", "ansible.builtin.debug": {"msg": dict(
                {fact: "{{ %s }}" % fact for fact in FACTS},
                after="{{ process_cleanup_result.left }}",
            )}},
        ],
    }]


def facts(run) -> dict:
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.result("Show")["msg"]


def module_calls(run) -> list[str]:
    """The role's tasks that run a module on the target, by name: the argument check, set_fact and
    fail run on the controller. Every task of the role is counted, so a look added before or after
    the reap shows."""
    role_tasks = [name for name in run.tasks if name.startswith("gpuops.relaunch.process_cleanup : ")]
    assert len(role_tasks) == ROLE_TASKS, role_tasks
    return [name for name in role_tasks if not any(local in name for local in LOCAL_TASKS)]


def test_role_on_localhost_check_mode_then_for_real(tmp_path):
    inventory = tmp_path / "inventory"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={PYTHON}\n", encoding="utf-8")
    reaper = Reaper()
    try:
        tag = f"/tmp/gpuops-role-{uuid.uuid4().hex[:8]}/run/train.py"
        job = reaper.start(STALE_JOB, runner=supervised(tag))
        parent, orphan = int(job["parent"]), int(job["orphan"])
        before = identities(tree(parent) + tree(orphan))
        match = tag.replace(".", r"\.") + r"\b"

        checked = run_playbook(role_play(match), inventory=str(inventory), check=True)
        seen = facts(checked)
        assert seen["process_cleanup_found_escalation"] == "signals"
        # In check mode what is left is what was found: signals would clear it, no reboot.
        assert seen["process_cleanup_escalation"] == "signals"
        assert seen["after"]["escalation"] == "signals"
        assert seen["process_cleanup_needs_reboot"] is False and seen["process_cleanup_needs_host_action"] is False
        assert module_calls(checked) == [REAP_TASK]
        plan = checked.result(REAP_TASK)
        assert plan["actions"] == [] and {s["pid"] for s in plan["plan"]} >= set(before) - {int(job["zombie"])}
        assert plan["left"] == plan["found"]
        assert all(process_starttime(pid) == st for pid, st in before.items())

        run = run_playbook(role_play(match), inventory=str(inventory))
        done = facts(run)
        assert module_calls(run) == [REAP_TASK]
        assert done["process_cleanup_found_escalation"] == "signals"
        assert any(str(parent) in reason for reason in done["process_cleanup_found_reasons"])
        # Orphans other tests on this machine hand to PID 1 meanwhile are watched, and PID 1 reaps
        # them within the grace: nothing of this test's job, and nothing else, may be left.
        after = done["after"]
        assert after["escalation"] == "none", after
        assert done["process_cleanup_escalation"] == "none", done["process_cleanup_reasons"]
        assert done["process_cleanup_needs_reboot"] is False and done["process_cleanup_needs_host_action"] is False
        assert {e["pid"] for e in done["process_cleanup_ended"]} == set(before)
        assert all(process_starttime(pid) != st for pid, st in before.items())

        again = run_playbook(role_play(match), inventory=str(inventory))
        reap = again.result(REAP_TASK)
        # Nothing to signal is cheap: one look (left is found), no signal, no change.
        assert module_calls(again) == [REAP_TASK]
        assert reap["changed"] is False and reap["signals_sent"] == 0 and reap["job"] == [] and reap["plan"] == []
        assert reap["left"] == reap["found"] and facts(again)["process_cleanup_escalation"] == "none"
    finally:
        reaper.cleanup()


def test_role_inside_a_non_reaping_container_asks_for_a_reboot(tmp_path):
    reaper = Reaper()
    with pid_namespace() as namespace:
        try:
            tag = f"/tmp/gpuops-role-{uuid.uuid4().hex[:8]}/run/train.py"
            runner = ["nsenter", f"--target={namespace.init_pid}", "--pid", "--mount", "--"]
            job = reaper.start(STALE_JOB, tag, runner=runner)
            inventory = namespace.write_inventory(tmp_path / "inventory")
            run = run_playbook(role_play(tag.replace(".", r"\.") + r"\b"), inventory=inventory)
            done = facts(run)
            assert module_calls(run) == [REAP_TASK]
            assert done["process_cleanup_escalation"] == "container_reboot"
            assert done["process_cleanup_needs_reboot"] is True
            assert done["after"]["escalation"] == "container_reboot"
            assert {e["state"] for e in done["process_cleanup_remaining"]} == {"Z"}
            assert int(job["orphan"]) in {e["pid"] for e in done["process_cleanup_remaining"]}
            assert state_of(namespace.init_pid) == "S"
        finally:
            reaper.cleanup()


def test_only_the_host_can_help_a_frozen_task_and_fail_on_escalation_fails_after_the_facts(tmp_path):
    """A task frozen in D: relaunch_clearance's rule says the host must act (not a reboot), the facts say so, and
    process_cleanup_fail_on_escalation fails the role after publishing them."""
    inventory = tmp_path / "inventory"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={PYTHON}\n", encoding="utf-8")
    reaper = Reaper()
    try:
        tag = f"/tmp/gpuops-role-{uuid.uuid4().hex[:8]}/frozen/train.py"
        pid = int(reaper.start(SLEEPER, runner=supervised(tag))["pid"])
        group = reaper.frozen(pid)
        wait_until(lambda: state_of(pid) == "D", what="the frozen task to be in D")
        play = role_play(tag.replace(".", r"\.") + r"\b")
        clean_up = play[0]["tasks"][0]
        clean_up["vars"].update(process_cleanup_term_timeout=1, process_cleanup_kill_timeout=1,
                                process_cleanup_d_state_timeout=2, process_cleanup_fail_on_escalation=True)
        play[0]["tasks"][0] = {"name": "Clean up, failing on escalation", "block": [clean_up],
                               "rescue": [{"name": "Why it failed", "ansible.builtin.debug": {"msg": "{{ ansible_failed_result.msg }}"}}]}
        run = run_playbook(play, inventory=str(inventory))
        done = facts(run)
        assert done["process_cleanup_escalation"] == "host_action", done
        failed = run.result("gpuops.relaunch.process_cleanup : Stop when only a container reboot or the host can clear what is left")
        assert failed["failed"] is True and run.result("Why it failed")["msg"] == failed["msg"]
        assert failed["msg"].startswith("host_action: ") and f"pid {pid}" in failed["msg"], failed["msg"]
        assert done["process_cleanup_needs_host_action"] is True and done["process_cleanup_needs_reboot"] is False
        assert [e["pid"] for e in done["process_cleanup_remaining"]] == [pid]
        reaper.thaw(group)
    finally:
        reaper.cleanup()
