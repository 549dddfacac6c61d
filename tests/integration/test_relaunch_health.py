"""playbooks/relaunch.yml acts on the job's health, for real, inside a PID namespace.

The host is a PID namespace whose init never reaps (a light container) reached over
community.docker.nsenter, so everything the relaunch signals is inside it and ends with it. The job
is the demo trainer (a copy in this test's directory, so process_cleanup's selector matches this
test's processes only), told to stall, crash or finish at a step. Verdicts are waited for by asking
the module (state=health) against a deadline, never by sleeping.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.pidns import PidNamespace, nsenter_vars, pid_namespace, process_starttime
from tests.harness.playbook import DECIDE_TASK, REPO, PlaybookRun, run_playbook
from tests.harness.procstates import host_pid, wait_until
from tests.harness.prometheus import parse_exposition, sample

pytestmark = pytest.mark.slow

PLAYBOOK = str(REPO / "playbooks" / "relaunch.yml")
SUMMARY = "Summarize"
REFUSED = "Fail this host when a step failed or the crash-loop guard refused"
PYTHON = "/usr/bin/python3"
# An init that reaps, as a container's usually does: after the simulated reboot nothing is left,
# not even zombies (under the never-reaping sleep they would stay, and only a real reboot clears them).
REAPING_INIT = [PYTHON, "-c", "import os, time\nwhile True:\n    try:\n        os.wait()\n"
                "    except ChildProcessError:\n        time.sleep(0.2)\n"]


class Site:
    """One host (a PID namespace), one job of this test's own, and how to ask about it."""

    def __init__(self, work: Path, namespace: PidNamespace) -> None:
        self.work = work
        self.namespace = namespace
        self.script = work / "demo_train.py"
        shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", self.script)
        (work / "logs").mkdir()
        self.vars: dict[str, Any] = dict(
            nsenter_vars(namespace.init_pid),
            job_launch_name="health",
            job_launch_command=[PYTHON, str(self.script), "--ready-after", "0.1"],
            job_launch_log_path=str(work / "logs" / "train.log"),
            job_launch_state_dir=str(work / "state"),
            job_launch_ready_regex="^step 1 ",
            job_launch_min_uptime=0.5,
            job_launch_startup_timeout=60,
            job_launch_term_timeout=5,
            job_launch_progress_regex=r"^step (\d+) ",
            job_launch_stall_after=1,
            job_launch_resume_args=["--resume", "latest", "--stall-at-step", "0"],
            job_launch_max_relaunches=1,
            process_cleanup_match=[f"{self.script}\\b".replace(".", "\\.")],
            process_cleanup_term_timeout=5,
            gpu_drain_gpus_required=False,
            gpu_drain_timeout=20,
            container_reset_allowed=False,
        )

    @property
    def job_dir(self) -> Path:
        return self.work / "state" / "health"

    @property
    def log(self) -> Path:
        return Path(self.vars["job_launch_log_path"])

    def inventory(self, **overrides: Any) -> str:
        path = self.work / "inventory.json"
        path.write_text(json.dumps({"all": {"hosts": {"ct": dict(self.vars, **overrides)}}}), encoding="utf-8")
        return str(path)

    def relaunch(self, check: bool = False, **extra_vars: Any) -> PlaybookRun:
        return run_playbook(PLAYBOOK, inventory=self.inventory(), check=check, extra_vars=extra_vars or None,
                            env={"ANSIBLE_SHOW_CUSTOM_STATS": "1"})

    def health(self) -> dict[str, Any]:
        run = run_playbook([{"hosts": "all", "gather_facts": False, "tasks": [{
            "name": "health", "gpuops.relaunch.train_launch": {
                "name": "health", "state": "health", "state_dir": self.vars["job_launch_state_dir"],
                "progress_regex": self.vars["job_launch_progress_regex"], "stall_after": 1,
                "max_relaunches": self.vars["job_launch_max_relaunches"]}}]}], inventory=self.inventory())
        result = run.result("health")
        assert result.get("failed") is not True, result
        return result

    def health_until(self, wanted: str) -> dict[str, Any]:
        def ask() -> dict[str, Any] | None:
            found = self.health()
            return found if found["health"]["state"] == wanted else None

        return wait_until(ask, timeout=90, what=f"health {wanted}")


@pytest.fixture(name="site")
def site_fixture(tmp_path) -> Iterator[Site]:
    with pid_namespace() as namespace:
        yield Site(tmp_path, namespace)


@pytest.fixture(name="reaping_site")
def reaping_site_fixture(tmp_path) -> Iterator[Site]:
    with pid_namespace(REAPING_INIT) as namespace:
        yield Site(tmp_path, namespace)


def textfile(site: Site, name: str) -> dict:
    """A metrics file of the site's job in its textfile directory, as Prometheus reads it."""
    return parse_exposition((site.work / "textfiles" / name).read_text(encoding="utf-8"))


def with_textfiles(site: Site, live: bool) -> None:
    """relaunch_metrics_dir (the relaunch's file), and with `live` job_launch_metrics_dir (the node's)."""
    (site.work / "textfiles").mkdir(mode=0o755)
    site.vars["relaunch_metrics_dir"] = str(site.work / "textfiles")
    if live:
        site.vars["job_launch_metrics_dir"] = str(site.work / "textfiles")


def summary(run: PlaybookRun, ok: bool = True) -> dict[str, Any]:
    if ok:
        assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.summary()


def changed_tasks(run: PlaybookRun) -> list[str]:
    return [name for name, hosts in run.tasks.items() if any(h.get("changed") for h in hosts)]


def test_a_stalled_job_is_relaunched_with_evidence_and_resumed(site: Site) -> None:
    site.vars["job_launch_command"] += ["--step-interval", "0.2", "--stall-at-step", "3"]
    with_textfiles(site, live=True)
    first = summary(site.relaunch())
    assert first["action"] == "relaunch" and first["health"]["state"] == "missing" and first["resumed"] is False
    stalled = site.health_until("stalled")
    assert stalled["health"]["last_step"] == "3"

    # Check mode: says what it would do, changes nothing (no incident, no history, same process).
    would = summary(site.relaunch(check=True))
    assert would["would_relaunch"] is True and would["relaunched"] is False and would["incident"] is None
    assert would["health"]["state"] == "stalled" and would["resumed"] is True
    assert not (site.job_dir / "incidents").exists() and not (site.job_dir / "relaunches.json").exists()
    assert site.health()["pid"] == stalled["pid"]

    run = site.relaunch()
    done = summary(run)
    assert done["relaunched"] is True and done["action"] == "relaunch" and done["resumed"] is True
    assert done["health"]["state"] == "stalled" and done["health"]["last_step"] == "3"
    assert done["why"].startswith("the job is stalled: ")
    assert int(done["job"]["pid"]) != stalled["pid"]
    stop = run.step("stop")
    assert stop["incident"] == done["incident"] and stop["health"]["state"] == "stalled"
    # One task relaunched it (the decision's), and it says it changed the host.
    assert changed_tasks(run) == [f"gpuops.relaunch.relaunch : {DECIDE_TASK}"], run.stats
    incident = json.loads(Path(done["incident"]).read_text())
    assert "stalling after step 3" in incident["log_tail"]
    leader = next(entry for entry in incident["processes"] if entry["pid"] == stalled["pid"])
    assert len(leader["threads"]) >= 2 and all("wchan" in thread for thread in leader["threads"])
    assert "resuming from latest" in site.log.read_text()
    stats = json.loads(run.stdout)["global_custom_stats"]["relaunch_summary"]["ct"]
    assert stats["incident"] == done["incident"] and stats["health"]["state"] == "stalled"
    # The metrics after the run: the node's live file says the resumed run runs, the relaunch's file
    # counts this relaunch and keeps what the probe saw; the health series are in the live file only.
    labels = {"gpuops_job": "health", "gpuops_host": "ct"}
    live_file = textfile(site, "gpuops_job_health.prom")
    # One run's file (the resumed run's), and the job's life across runs (no gpuops_run): one relaunch after a stall.
    [run] = {dict(series)["gpuops_run"] for _name, series in live_file if "gpuops_run" in dict(series)}
    assert sample(live_file, "gpuops_job_health", **labels, gpuops_rank0="ct", gpuops_run=run, state="running") == 1
    assert sample(live_file, "gpuops_job_relaunches_total", **labels, gpuops_rank0="ct") == 1
    assert sample(live_file, "gpuops_job_last_failure", **labels, gpuops_rank0="ct", health="stalled", signal="",
                  cause="unknown") == 1
    relaunch_file = textfile(site, "gpuops_relaunch_health.prom")
    assert sample(relaunch_file, "gpuops_job_recent_relaunches", **labels) == 1
    assert sample(relaunch_file, "gpuops_relaunch_probe_health", **labels, state="stalled") == 1
    assert not {"gpuops_job_health", "gpuops_job_last_step"} & {name for name, _labels in relaunch_file}
    # The resumed run progresses: the next relaunch leaves it alone.
    again = site.relaunch()
    assert summary(again)["action"] == "none" and changed_tasks(again) == []


def test_a_finished_job_is_left_alone_unless_forced(site: Site) -> None:
    site.vars["job_launch_command"] += ["--step-interval", "0.3", "--finish-at-step", "3"]
    summary(site.relaunch())
    site.health_until("finished")
    run = site.relaunch()
    left = summary(run)
    assert left["action"] == "none" and left["relaunched"] is False and left["health"]["state"] == "finished"
    assert left["health"]["exit_code"] == 0 and "relaunch_force relaunches it" in left["why"]
    assert changed_tasks(run) == [] and not run.ran_step("stop")
    forced = summary(site.relaunch(relaunch_force=True, relaunch_hosts="all"))
    assert forced["relaunched"] is True and forced["resumed"] is False  # never resumed after a finished run
    assert "resuming from" not in site.log.read_text()


def test_a_crashing_job_is_relaunched_until_the_guard_stops_it(site: Site) -> None:
    site.vars["job_launch_command"] += ["--step-interval", "1.5", "--crash-at-step", "2", "--exit-code", "7"]
    with_textfiles(site, live=False)
    first = summary(site.relaunch())
    site.health_until("crashed")
    again = summary(site.relaunch())
    # Without a live file the relaunch's file tells the job after the run: its new run runs, this
    # relaunch counted; what the probe saw (crashed) is its own series.
    relaunch_file = textfile(site, "gpuops_relaunch_health.prom")
    labels = {"gpuops_job": "health", "gpuops_host": "ct"}
    assert sample(relaunch_file, "gpuops_job_health", **labels, state="running") == 1
    assert sample(relaunch_file, "gpuops_job_health", **labels, state="crashed") == 0
    assert sample(relaunch_file, "gpuops_relaunch_probe_health", **labels, state="crashed") == 1
    assert sample(relaunch_file, "gpuops_job_recent_relaunches", **labels) == 1
    assert again["relaunched"] is True and again["health"]["state"] == "crashed" and again["health"]["exit_code"] == 7
    assert again["resumed"] is True and Path(again["incident"]).is_file() and int(again["job"]["pid"]) != int(
        first["job"]["pid"])
    crashed = site.health_until("crashed")
    assert crashed["relaunch_guard"]["would_refuse"] is True

    would = site.relaunch(check=True)
    assert summary(would, ok=False)["action"] == "refused" and would.rc != 0

    run = site.relaunch()
    refused = summary(run, ok=False)
    assert run.rc != 0 and refused["action"] == "refused" and refused["relaunched"] is False
    assert refused["health"]["state"] == "crashed" and refused["health"]["exit_code"] == 7
    assert refused["relaunch_guard"]["recent"] == 1 and refused["relaunch_guard"]["would_refuse"] is True
    assert "crashing after step 2 with code 7" in refused["health"]["log_tail"]
    failure = run.result(REFUSED)
    assert failure["failed"] is True and "max_relaunches=1" in failure["msg"]
    assert "Nothing was stopped" in failure["msg"] and "crashing after step 2" in failure["msg"]
    assert not run.ran_step("stop")  # nothing was stopped or started
    assert site.health()["run_id"] == crashed["run_id"]
    assert json.loads((site.job_dir / "relaunches.json").read_text())["relaunches"][0]["health"] == "crashed"


def test_a_run_gone_after_a_reboot_is_missing_and_relaunched(reaping_site: Site) -> None:
    site = reaping_site
    site.vars["job_launch_command"] += ["--step-interval", "0.2"]
    first = summary(site.relaunch())
    run = site.health()
    assert run["health"]["state"] == "running"
    # A container reboot, simulated: the supervisor, then the job, killed by their recorded pids.
    for ns_pid in (run["supervisor_pid"], run["pid"]):
        pid = host_pid(site.namespace.init_pid, ns_pid)
        starttime = process_starttime(pid)
        assert starttime is not None
        if process_starttime(pid) == starttime:
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not {run["supervisor_pid"], run["pid"]} & set(
        int(pid) for pid in site.namespace.run_inside(["ps", "-eo", "pid="]).stdout.split()), what="nothing left")
    missing = site.health_until("missing")
    assert missing["health"]["run_id"] == run["run_id"]
    would = summary(site.relaunch(check=True))
    assert would["would_relaunch"] is True and would["resumed"] is True
    assert not (site.job_dir / "relaunches.json").exists()
    done = summary(site.relaunch())
    assert done["relaunched"] is True and done["health"]["state"] == "missing" and done["resumed"] is True
    assert done["incident"] is None and "resuming from latest" in site.log.read_text()
    assert int(done["job"]["pid"]) != int(first["job"]["pid"])
