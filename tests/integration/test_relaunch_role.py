"""The role gpuops.relaunch.relaunch included in a user's own play, for real, on two local hosts.

A cluster playbook of one's own: its own tasks before and after, `serial`, tags, `become`, and the
relaunch included as a role. The first run launches each host's job; the second changes nothing and
leaves the same pids, in few tasks per host. Each host's job is a script copied into this test's own
directory, so the clean-up's selector matches this test's processes only.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests.harness.launch_targets import end_recorded_runs
from tests.harness.playbook import DECIDE_TASK, REPO, run_playbook
from tests.harness.playbook import summaries as all_summaries

HOSTS = ("gpu-a", "gpu-b")
# Goals of the relaunch-as-code issue, per host: a no-op relaunch and a first relaunch.
NOOP_TASKS = 3
FIRST_TASKS = 25


def host_vars(tmp_path, host: str) -> dict:
    home = tmp_path / host
    (home / "logs").mkdir(parents=True)
    script = home / "demo_train.py"
    shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", script)
    return {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "job_launch_name": f"role-test-{host}-{os.getpid()}",
        "job_launch_command": [sys.executable, str(script), "--workers", "1"],
        "job_launch_log_path": str(home / "logs" / "train.log"),
        "job_launch_state_dir": str(home / "state"),
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 1,
        "job_launch_startup_timeout": 60,
        "job_launch_term_timeout": 10,
        "process_cleanup_match": [f"{script}\\b".replace(".", "\\.")],
        "process_cleanup_term_timeout": 5,
        "gpu_drain_gpus_required": False,
        "gpu_drain_timeout": 20,
    }


@pytest.fixture(name="cluster")
def cluster_fixture(tmp_path):
    hosts = {host: host_vars(tmp_path, host) for host in HOSTS}
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": hosts}}), encoding="utf-8")
    yield {"inventory": str(inventory), "hosts": hosts, "dir": tmp_path}
    run_playbook([{
        "name": "stop", "hosts": "all", "gather_facts": False,
        "tasks": [{"name": "Stop", "gpuops.relaunch.train_launch": {
            "name": "{{ job_launch_name }}", "state": "stopped", "state_dir": "{{ job_launch_state_dir }}"}}],
    }], inventory=str(inventory))
    for host_vars_ in hosts.values():
        end_recorded_runs(host_vars_["job_launch_state_dir"])


def users_play(summary_dir: str) -> list[dict]:
    """A play as a user writes one: own tasks around the relaunch, serial, become, tags."""
    return [{
        "name": "Our cluster", "hosts": "all", "gather_facts": False, "serial": 1,
        "become": True, "become_method": "ansible.builtin.su",
        "tasks": [
            {"name": "Our own check before", "ansible.builtin.set_fact": {"ours_before": True}, "tags": ["always"]},
            {"name": "Relaunch our training", "ansible.builtin.include_role": {
                "name": "gpuops.relaunch.relaunch", "apply": {"tags": ["relaunch"]}},
             "vars": {"relaunch_summary_dir": summary_dir}, "tags": ["relaunch"]},
            {"name": "Our own step after", "ansible.builtin.set_fact": {
                "ours_status": "{{ relaunch_summary.status }}"}, "tags": ["relaunch"]},
            {"name": "Not part of a relaunch", "ansible.builtin.fail": {"msg": "tags left this out"}, "tags": ["other"]},
        ],
    }]


def summaries(run) -> dict:
    assert run.rc == 0, run.stdout[-5000:] + run.stderr[-2000:]
    return all_summaries(run)


def test_the_role_in_a_users_play_relaunches_once_and_then_changes_nothing(cluster):
    summary_dir = str(cluster["dir"] / "summaries")
    first = run_playbook(users_play(summary_dir), inventory=cluster["inventory"], extra_args=["--tags", "relaunch"])
    done = summaries(first)
    for host in HOSTS:
        assert done[host]["status"] == "relaunched", done[host]
        assert done[host]["health"]["state"] == "missing" and done[host]["job"]["operation"] == "start"
        assert isinstance(done[host]["job"]["pid"], int)
        job = cluster["hosts"][host]["job_launch_name"]
        assert json.loads((cluster["dir"] / "summaries" / f"{host}@{job}.json").read_text(encoding="utf-8")) == done[host]
        assert first.tasks_run(host) <= FIRST_TASKS + 3  # the user's own three tasks
    assert "Not part of a relaunch" not in first.tasks

    again = run_playbook(users_play(summary_dir), inventory=cluster["inventory"], extra_args=["--tags", "relaunch"])
    same = summaries(again)
    for host in HOSTS:
        assert same[host]["status"] == "unchanged" and same[host]["why"].startswith("left alone: it runs with this spec")
        assert same[host]["job"]["pid"] == done[host]["job"]["pid"] and same[host]["found"].startswith("not looked")
        assert again.stats[host]["changed"] == 0, again.stats
        assert again.tasks_run(host) <= NOOP_TASKS + 3, again.stats
    # The user's own task after the role reads the role's summary; the job runs on, under the pid the first run proved.
    assert again.result("Our own step after", HOSTS[0])["ansible_facts"]["ours_status"] == "unchanged"
    probe = again.result("Look at the job, decide, and relaunch a job of one host", HOSTS[0])["probe"]
    assert probe["pid"] == done[HOSTS[0]]["job"]["pid"] and probe["changed"] is False


def test_a_forced_relaunch_through_the_role_restarts_the_named_host_only(cluster):
    first = run_playbook(users_play(""), inventory=cluster["inventory"], extra_args=["--skip-tags", "other"])
    pids = {host: summary["job"]["pid"] for host, summary in summaries(first).items()}
    forced = run_playbook(users_play(""), inventory=cluster["inventory"], extra_vars={"relaunch_force": True},
                          extra_args=["--limit", HOSTS[1], "--skip-tags", "other"])
    done = summaries(forced)
    assert list(done) == [HOSTS[1]]
    assert done[HOSTS[1]]["status"] == "relaunched" and done[HOSTS[1]]["job"]["pid"] != pids[HOSTS[1]]
    assert done[HOSTS[1]]["why"].startswith("forced (relaunch_force)")
    everywhere = run_playbook(users_play(""), inventory=cluster["inventory"], extra_vars={"relaunch_force": True},
                              extra_args=["--skip-tags", "other"])
    assert everywhere.rc != 0
    refusal = everywhere.result("Look at the job, decide, and relaunch a job of one host", HOSTS[0])
    assert "neither relaunch_hosts nor --limit" in refusal["msg"]
    assert refusal.get("failed") is True
    # The crash-loop guard's reset alike (an AWX survey answered without choosing hosts): refused, fleet-wide.
    reset = run_playbook(users_play(""), inventory=cluster["inventory"], extra_vars={"job_launch_reset_guard": True},
                         extra_args=["--skip-tags", "other"])
    assert reset.rc != 0
    refusal = reset.result("Look at the job, decide, and relaunch a job of one host", HOSTS[0])
    assert refusal["msg"].startswith("job_launch_reset_guard is true on every host of the play"), refusal["msg"]


def test_each_include_is_its_own_relaunch_and_writes_its_own_file(tmp_path):
    """The role included twice on one host (two jobs): a job of one rank whose launch fails, then a
    healthy job of one host. The second include reads nothing the first left (its failure, its rank,
    its barrier marks), and each job's summary goes to a file of its own inside relaunch_summary_dir,
    although the host's name reaches out of it and collides with the fleet's."""
    host = "../fleet"
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    scripts = {}
    for job in ("first", "second"):
        scripts[job] = home / f"{job}_train.py"
        shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", scripts[job])
    state_dir = str(home / "state")
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": {host: {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        # The first job is a job of ranks (of one), set where ranks belong: the inventory.
        "job_launch_ranks": [host],
        "job_launch_state_dir": state_dir, "job_launch_ready_regex": "^step 1 ", "job_launch_min_uptime": 0.3,
        "job_launch_startup_timeout": 30, "job_launch_term_timeout": 5, "process_cleanup_term_timeout": 5,
        "gpu_drain_gpus_required": False, "gpu_drain_timeout": 20,
    }}}}), encoding="utf-8")
    summary_dir = tmp_path / "summaries"

    def job_vars(job: str, *args: str) -> dict:
        return {"job_launch_name": f"{job}-{os.getpid()}", "job_launch_command": [sys.executable, str(scripts[job]), *args],
                "job_launch_log_path": str(home / "logs" / f"{job}.log"),
                "process_cleanup_match": [f"{scripts[job]}\\b".replace(".", "\\.")],
                "relaunch_summary_dir": str(summary_dir), "relaunch_fail_host": False}

    play = [{"name": "Two jobs on one host", "hosts": "all", "gather_facts": False, "tasks": [
        # Its program ends before it is ready: the launch fails, after the rank's barrier.
        {"name": "The first job", "ansible.builtin.include_role": {"name": "gpuops.relaunch.relaunch"},
         "vars": job_vars("first", "--ready-after", "5", "--exit-after", "0.2", "--exit-code", "3")},
        {"name": "The second job", "ansible.builtin.include_role": {"name": "gpuops.relaunch.relaunch"},
         "vars": dict(job_vars("second", "--ready-after", "0.1"), job_launch_ranks=None)},
        {"name": "Sum up", "gpuops.relaunch.relaunch_fleet": {"summary_dir": str(summary_dir)}},
    ]}]
    try:
        run = run_playbook(play, inventory=str(inventory))
        assert run.rc == 0, run.stdout[-5000:] + run.stderr[-2000:]
        # The first job's ranks summarize in the role's task; the second, a job of one host, in its decision's.
        [first] = (entry["ansible_facts"]["relaunch_summary"] for entry in run.tasks["Summarize"])
        second = run.tasks[DECIDE_TASK][-1]["ansible_facts"]["relaunch_summary"]
        assert first["status"] == "failed" and first["rank"]["ranks"] == [host], first
        assert "Launch the job and prove it started" in first["failed"]
        # Nothing of the first include's: no failure, no rank (so no barrier and no stop again).
        assert second["status"] == "relaunched" and second["failed"] is None and second["rank"] is None, second
        assert len(run.tasks["Mark this rank ready to launch"]) == 1  # the first include's barrier only
        assert run.result("Sum up")["fleet"]["hosts"][host]["status"] == "relaunched"
        # One file per host and job, the host's name encoded; the fleet's apart; nothing outside the directory.
        encoded = "%2E.%2Ffleet"
        assert sorted(p.name for p in summary_dir.iterdir()) == sorted(
            [f"{encoded}@first-{os.getpid()}.json", f"{encoded}@second-{os.getpid()}.json", "fleet.json"])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "inventory.json", "summaries"]
        assert json.loads((summary_dir / f"{encoded}@first-{os.getpid()}.json").read_text(encoding="utf-8")) == first
        assert json.loads((summary_dir / f"{encoded}@second-{os.getpid()}.json").read_text(encoding="utf-8")) == second
        assert set(json.loads((summary_dir / "fleet.json").read_text(encoding="utf-8"))["hosts"]) == {host}
    finally:
        stops = [{"name": "Stop", "gpuops.relaunch.train_launch": {
            "name": f"{job}-{os.getpid()}", "state": "stopped", "state_dir": state_dir}} for job in ("first", "second")]
        run_playbook([{"name": "stop", "hosts": "all", "gather_facts": False, "tasks": stops}], inventory=str(inventory))
        end_recorded_runs(state_dir)
