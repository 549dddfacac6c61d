"""What playbooks/relaunch.yml must be told, for real: the job's name and command (no defaults), and
which hosts to force.

Two jobs on this machine, as two inventory hosts (local connection), each with its own copy of the
demo trainer, so that each host's clean-up selector (its script's path) matches its own job only.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.launch_targets import DEMO, end_recorded_runs
from tests.harness.playbook import REPO, PlaybookRun, run_playbook, summaries

pytestmark = pytest.mark.slow

PLAYBOOK = str(REPO / "playbooks" / "relaunch.yml")
REFUSE = "Fail this host when a step failed or the crash-loop guard refused"
DECIDE = "Look at the job, decide, and relaunch a job of one host"
VALIDATE = "Validating arguments against arg spec 'main'"
HOSTS = ("job-a", "job-b")


class Site:
    """Two jobs, one per inventory host; `vars[host]` is that host's inventory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.vars: dict[str, dict[str, Any]] = {}
        # The job's name and state directory as set up (a test may take them out of the inventory).
        self.names = {host: f"inputs-{host}" for host in HOSTS}
        self.state_dirs = {host: str(root / host / "state") for host in HOSTS}
        for host in HOSTS:
            home = root / host
            (home / "logs").mkdir(parents=True)
            script = home / "demo_train.py"
            shutil.copy(DEMO, script)
            self.vars[host] = {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "job_launch_name": self.names[host],
                "job_launch_command": [sys.executable, str(script), "--ready-after", "0.1"],
                "job_launch_log_path": str(home / "logs" / "train.log"),
                "job_launch_state_dir": self.state_dirs[host],
                "job_launch_ready_regex": "^step 1 ",
                "job_launch_min_uptime": 0.3,
                "job_launch_startup_timeout": 60,
                "job_launch_term_timeout": 5,
                "process_cleanup_match": [str(script).replace(".", "\\.") + "\\b"],
                "process_cleanup_term_timeout": 5,
                "gpu_drain_gpus_required": False,
                "gpu_drain_timeout": 20,
                "container_reset_allowed": False,
            }

    def inventory(self) -> str:
        path = self.root / "inventory.json"
        path.write_text(json.dumps({"all": {"hosts": self.vars}}), encoding="utf-8")
        return str(path)

    def relaunch(self, extra_vars: dict[str, Any] | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> PlaybookRun:
        return run_playbook(PLAYBOOK, inventory=self.inventory(), extra_vars=extra_vars, extra_args=extra_args, env=env)

    def run_record(self, host: str) -> dict | None:
        path = Path(self.state_dirs[host], self.names[host], "run.json")
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None

    def pids(self) -> dict[str, int | None]:
        return {host: (self.run_record(host) or {}).get("pid") for host in HOSTS}


@pytest.fixture(name="site")
def site_fixture(tmp_path):
    site = Site(tmp_path)
    yield site
    for host in HOSTS:
        stop = {"name": site.names[host], "state": "stopped", "state_dir": site.state_dirs[host]}
        run_playbook([{"hosts": host, "gather_facts": False, "tasks": [{"name": "stop", "gpuops.relaunch.train_launch": stop}]}],
                     inventory=site.inventory())
        end_recorded_runs(site.state_dirs[host])


def test_forcing_needs_the_hosts_named_and_inventory_force_works(site: Site) -> None:
    first = site.relaunch()
    assert first.rc == 0, first.stdout[-4000:]
    running = site.pids()
    assert all(running.values()), running

    # Force from the command line without naming hosts (or with a typo for relaunch_hosts): refused
    # on every host before anything is stopped (the probe, a question, has looked; the typo is refused
    # as a misspelt variable, before the probe).
    for extra in ({"relaunch_force": True}, {"relaunch_force": "true", "relaunch_host": "job-a"}):
        refused = site.relaunch(extra)
        assert refused.rc != 0
        for host in HOSTS:
            failure = refused.result(REFUSE, host)
            assert failure["failed"] is True, failure
            if "relaunch_host" in extra:
                assert "relaunch_host is not a variable of gpuops.relaunch (did you mean relaunch_hosts?)" in failure["msg"]
            else:
                assert "relaunch_hosts" in failure["msg"] and "--limit" in failure["msg"], failure["msg"]
        assert not refused.ran_step("stop")
        assert {summary["status"] for summary in summaries(refused).values()} == {"failed"}
        assert site.pids() == running

    # A NaN drain timeout with the force: refused at the decision, before the stop would end the job
    # (gpu_mem_wait refuses it too, but only once the job is gone). So is a drain environment whose name would run
    # as shell text on the drain's command line (Ansible writes NAME=value unquoted).
    marker = site.root / "injected"
    nan = site.relaunch({"relaunch_force": True, "gpu_drain_timeout": float("nan"),
                         "gpu_drain_environment": {f"X;touch {marker};Y": "1"}}, ["--limit", "job-a"])
    refused_msg = nan.result(REFUSE, "job-a")["msg"]
    assert "gpu_drain_timeout must be a finite number, got nan" in refused_msg
    assert f"gpu_drain_environment: 'X;touch {marker};Y' is not an environment variable name" in refused_msg
    assert not nan.ran_step("stop") and Path(f"/proc/{running['job-a']}").exists() and not marker.exists()

    # Named with --limit: that host only is forced.
    limited = site.relaunch({"relaunch_force": True}, ["--limit", "job-a"])
    assert limited.rc == 0, limited.stdout[-4000:]
    assert summaries(limited)["job-a"]["relaunched"] is True and "job-b" not in summaries(limited)
    after_limit = site.pids()
    assert after_limit["job-a"] != running["job-a"] and after_limit["job-b"] == running["job-b"]

    # Named with relaunch_hosts: the same.
    named = site.relaunch({"relaunch_force": True, "relaunch_hosts": "job-b"})
    assert named.rc == 0, named.stdout[-4000:]
    assert summaries(named)["job-b"]["relaunched"] is True and "job-a" not in summaries(named)
    after_named = site.pids()
    assert after_named["job-b"] != after_limit["job-b"] and after_named["job-a"] == after_limit["job-a"]

    # relaunch_force in the inventory of one host: the play no longer overrides it, and a force on
    # some hosts only needs no --limit.
    site.vars["job-b"]["relaunch_force"] = True
    inventory_forced = site.relaunch()
    assert inventory_forced.rc == 0, inventory_forced.stdout[-4000:]
    done = summaries(inventory_forced)
    assert done["job-b"]["relaunched"] is True and done["job-b"]["why"].startswith("forced (relaunch_force)")
    assert done["job-a"]["relaunched"] is False and done["job-a"]["action"] == "none"
    after_inventory = site.pids()
    assert after_inventory["job-b"] != after_named["job-b"] and after_inventory["job-a"] == after_named["job-a"]
    # ... and the inventory's false wins over nothing: a host_vars relaunch_force: false is honoured too.
    site.vars["job-b"]["relaunch_force"] = False
    quiet = site.relaunch()
    assert quiet.rc == 0 and not any(summary["relaunched"] for summary in summaries(quiet).values())
    # A host with nothing left ends its play after the decision: one task (a skipped one would cost the
    # controller a worker); the play's first host stays for the fleet summary, which has both.
    assert quiet.tasks_run("job-b") == 1 and quiet.tasks_run("job-a") > 1, quiet.stats
    assert sorted(quiet.result("Sum up the fleet")["fleet"]["hosts"]) == list(HOSTS)
    assert site.pids() == after_inventory


def test_a_host_unreachable_this_run_is_failed_in_the_fleet_whatever_a_fact_cache_kept(site: Site, tmp_path: Path) -> None:
    """With a fact cache that outlives the run (AWX's fact storage; here the jsonfile cache), the last run's
    relaunch_summary fact of a host is still there when that host is unreachable at this run's decision. The
    fleet summary reads this run's registered results instead: the host failed, unreachable."""
    cache = {"ANSIBLE_CACHE_PLUGIN": "ansible.builtin.jsonfile", "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "facts")}
    first = site.relaunch(env=cache)
    assert first.rc == 0 and all(summary["relaunched"] for summary in summaries(first).values()), first.stdout[-3000:]
    reachable = dict(site.vars["job-b"])
    site.vars["job-b"].update(ansible_connection="ssh", ansible_host="127.0.0.1", ansible_port=1)
    try:
        run = site.relaunch(env=cache)
    finally:
        site.vars["job-b"] = reachable
    assert run.rc != 0
    fleet = run.result("Sum up the fleet")["fleet"]
    assert fleet["hosts"]["job-b"]["status"] == "failed", fleet
    assert fleet["hosts"]["job-a"]["status"] == "unchanged", fleet


@pytest.mark.parametrize("missing", ["job_launch_name", "job_launch_command"])
def test_a_host_without_a_job_name_or_command_fails_naming_it(site: Site, missing: str) -> None:
    """No default name (a second job would replace the first) and no default command: the host fails
    with the variable named, nothing started; the other host relaunches all the same."""
    del site.vars["job-a"][missing]
    run = site.relaunch()
    assert run.rc != 0
    # The decision checks the role's variables against its argument spec before anything runs on that
    # host (the playbook imports the entry point without Ansible's own per-host check); the host is
    # summarized as failed and fails after the fleet summary, naming the variable.
    assert not any(VALIDATE in name for name in run.tasks)
    failure = run.result(REFUSE, "job-a")
    assert failure["failed"] is True and f"missing required arguments: {missing}" in failure["msg"], failure
    assert summaries(run)["job-a"]["status"] == "failed"
    assert run.result(DECIDE, "job-a").get("probe") is None
    assert not Path(site.state_dirs["job-a"]).exists()
    assert not Path(site.vars["job-a"]["job_launch_log_path"]).exists()
    assert summaries(run)["job-b"]["relaunched"] is True and site.pids()["job-b"]


def test_a_bad_master_port_and_ranks_set_in_the_play_are_refused_naming_the_variable(site: Site) -> None:
    """A user's play gives job_launch_ranks as a variable of the include: job-a's inventory says the
    same (so its ranks are fine) but its rank 0's port is no port; job-b's ranks exist only in the
    play, where the other ranks cannot read them. Both fail at the decision, naming the variable;
    nothing is started."""
    site.vars["job-a"].update(job_launch_ranks=["job-a"], job_launch_master_port="29500x\x1b[2J")
    play = [{"name": "Ours", "hosts": "all", "gather_facts": False, "tasks": [
        {"name": "Relaunch", "ansible.builtin.include_role": {"name": "gpuops.relaunch.relaunch"},
         "vars": {"job_launch_ranks": "{{ [inventory_hostname] }}"}}]}]
    run = run_playbook(play, inventory=site.inventory())
    assert run.rc != 0
    port = run.result(DECIDE, "job-a")
    assert port.get("failed") is True and "job_launch_master_port" in port["msg"], port
    assert "\\x1b[2J" in port["msg"] and "\x1b" not in port["msg"] and "int()" not in port["msg"]
    play_var = run.result(DECIDE, "job-b")
    assert play_var.get("failed") is True, play_var
    assert "job_launch_ranks must be set as a host or group variable (inventory)" in play_var["msg"]
    assert "list other ranks" not in play_var["msg"]
    for host in HOSTS:
        assert not Path(site.state_dirs[host]).exists()
        assert not Path(site.vars[host]["job_launch_log_path"]).exists()


def test_a_misspelt_variable_is_refused_naming_the_close_one(site: Site) -> None:
    """A typo in a host variable (job-a) and in a play variable (both hosts) would otherwise be ignored
    with rc 0: each host is refused before anything runs on it, the message naming the variable meant. So are
    values Ansible's own check would convert (a list for a string, a list or a null in a list of names), which
    raised "unhashable type" or launched with MASTER_ADDR="['x']"."""
    site.vars["job-a"]["job_launch_ready_regx"] = "^step 2 "
    site.vars["job-a"]["job_launch_master_addr"] = ["x"]
    site.vars["job-b"]["job_launch_ranks"] = [["job-b"], None]
    play = [{"name": "Ours", "hosts": "all", "gather_facts": False,
             "vars": {"process_cleanup_term_timout": 3}, "tasks": [
                 {"name": "Relaunch", "ansible.builtin.include_role": {"name": "gpuops.relaunch.relaunch"}}]}]
    run = run_playbook(play, inventory=site.inventory())
    assert run.rc != 0
    for host in HOSTS:
        refused = run.result(DECIDE, host)
        assert refused.get("failed") is True, refused
        assert "process_cleanup_term_timout is not a variable of gpuops.relaunch" in refused["msg"], refused["msg"]
        assert "did you mean process_cleanup_term_timeout?" in refused["msg"], refused["msg"]
        assert ("did you mean job_launch_ready_regex?" in refused["msg"]) is (host == "job-a"), refused["msg"]
        shape = ("job_launch_master_addr must be a string, not a list: ['x']" if host == "job-a" else
                 "job_launch_ranks must be a list of strings, and its item 0 is a list: [['job-b'], None]")
        assert shape in refused["msg"] and "Traceback" not in refused["msg"], refused["msg"]
        assert not Path(site.state_dirs[host]).exists()


def test_ranks_under_the_free_strategy_are_refused(site: Site) -> None:
    """Under strategy: free a rank would read its peers' barrier marks before they set them: refused at the
    decision, naming the strategy; the host without ranks relaunches all the same."""
    site.vars["job-a"]["job_launch_ranks"] = ["job-a"]
    play = [{"name": "Ours", "hosts": "all", "gather_facts": False, "strategy": "free", "tasks": [
        {"name": "Relaunch", "ansible.builtin.include_role": {"name": "gpuops.relaunch.relaunch"}}]}]
    run = run_playbook(play, inventory=site.inventory())
    assert run.rc != 0
    refused = run.result(DECIDE, "job-a")
    assert refused.get("failed") is True and "needs the linear strategy" in refused["msg"], refused
    assert "'free'" in refused["msg"]
    assert not Path(site.state_dirs["job-a"]).exists()
    assert summaries(run)["job-b"]["relaunched"] is True and site.pids()["job-b"]
