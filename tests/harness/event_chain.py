"""The event chain, started once for a test file or a benchmark: node -> node_exporter -> Prometheus ->
Alertmanager -> ansible-rulebook -> playbooks/relaunch.yml, every part real and on loopback.

:func:`event_chain` starts, in a work directory: a PID namespace whose init never reaps (two inventory
hosts reach it over nsenter, so every signal stays inside), node_exporter on the textfile directory the
jobs' live files and the relaunch's files go to, ansible-rulebook with the collection's rulebook
(extensions/eda/rulebooks/relaunch_on_alert.yml), Alertmanager with the shipped route
(extensions/eda/alertmanager.yml as shipped, timings included; only its URL and token file replaced) and
Prometheus with the shipped rules, scrape and evaluation every second (Prometheus' intervals are the user's:
shortened here so that detection takes a second). It launches gpu1's job (a plain relaunch run, not
through the chain) and waits until Prometheus sees it running. gpu1 runs a healthy demo job, gpu2 one
that crashes four steps (about 3 s) after each start (launched by the test that wants it). rank-a and
rank-b are the two ranks of one job, "ddp", whose processes meet on loopback and exchange a byte at
every step (demo_train.py --rendezvous; launched by the test that wants them): rank-b is another node,
with a node_exporter of its own (its live file has the job's name too). Everything ends with the block,
each part by the pid it recorded, the rulebook first.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from tests.harness.pidns import PidNamespace, nsenter_vars, pid_namespace, process_starttime
from tests.harness.playbook import REPO, run_playbook
from tests.harness.procstates import host_pid, wait_until
from tests.harness.prometheus import ALERTMANAGER, NODE_EXPORTER, PROMETHEUS, Service, alertmanager, free_port
from tests.harness.prometheus import node_exporter, prometheus_server, require
from tests.harness.rulebook import Rulebook, received_at, rulebook

PLAYBOOK = str(REPO / "playbooks" / "relaunch.yml")
RULES = [REPO / "extensions" / "prometheus" / "rules" / name for name in ("gpuops.rules.yml", "gpuops_events.rules.yml")]
ROUTE = REPO / "extensions" / "eda" / "alertmanager.yml"
PYTHON = "/usr/bin/python3"
RANKS = ("rank-a", "rank-b")


class Chain:
    """The namespace, the two hosts' jobs and the running services of one scenario."""

    def __init__(self, work: Path, namespace: PidNamespace, max_relaunches: int = 5) -> None:
        self.work = work
        self.namespace = namespace
        self.textfiles = work / "textfile"
        self.textfiles.mkdir(mode=0o755)
        self.summaries = work / "summaries"
        self.rank_b_textfiles = work / "textfile-rank-b"
        self.rank_b_textfiles.mkdir(mode=0o755)
        self.hosts: dict[str, dict[str, Any]] = {
            "gpu1": self._job_vars("gpu1", "train", ["--step-interval", "0.2"], max_relaunches=max_relaunches),
            # Running for about 3 s after each start, then crashing: each crash is another run's, so an alert and
            # a notification of its own, at once (the route groups by gpuops_run).
            "gpu2": self._job_vars("gpu2", "crashy", ["--step-interval", "1", "--crash-at-step", "4", "--exit-code", "3"],
                                   max_relaunches=1),
        }
        for host, textfiles in (("rank-a", self.textfiles), ("rank-b", self.rank_b_textfiles)):
            self.hosts[host] = self._job_vars(host, "ddp", ["--step-interval", "0.2", "--rendezvous"],
                                              max_relaunches=max_relaunches, textfiles=textfiles)
            self.hosts[host]["job_launch_ranks"] = list(RANKS)
        self.hosts["rank-a"].update(job_launch_master_addr="127.0.0.1", job_launch_master_port=free_port())
        self.inventory = work / "inventory.json"
        self.inventory.write_text(json.dumps({"all": {"hosts": self.hosts}}), encoding="utf-8")
        self.prometheus: Service
        self.alertmanager: Service
        self.rulebook: Rulebook

    def _job_vars(self, host: str, job: str, args: list[str], max_relaunches: int,
                  textfiles: Path | None = None) -> dict[str, Any]:
        # A copy of the demo per host: each host's clean-up selector matches its own job only.
        own = self.work / host
        own.mkdir()
        script = own / "demo_train.py"
        shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", script)
        return dict(
            nsenter_vars(self.namespace.init_pid),
            job_launch_name=job,
            job_launch_command=[PYTHON, str(script), "--ready-after", "0.1", *args],
            job_launch_log_path=str(own / "train.log"),
            job_launch_state_dir=str(own / "state"),
            job_launch_ready_regex="^step 1 ",
            job_launch_min_uptime=0.5,
            job_launch_startup_timeout=30,
            job_launch_term_timeout=5,
            job_launch_progress_regex=r"^step (\d+) ",
            job_launch_stall_after=2,
            job_launch_max_relaunches=max_relaunches,
            job_launch_metrics_dir=str(textfiles or self.textfiles),
            process_cleanup_match=[f"{script}\\b".replace(".", "\\.")],
            process_cleanup_term_timeout=5,
            gpu_drain_gpus_required=False,
            gpu_drain_timeout=20,
            container_reset_allowed=False,
            relaunch_metrics_dir=str(textfiles or self.textfiles),
            relaunch_summary_dir=str(self.summaries),
        )

    # --- the job, as its records say -----------------------------------------------------------------

    def run_record(self, host: str) -> dict[str, Any]:
        job = self.hosts[host]["job_launch_name"]
        return json.loads((Path(self.hosts[host]["job_launch_state_dir"]) / job / "run.json").read_text(encoding="utf-8"))

    def exit_time(self, host: str) -> float | None:
        """When the current run ended (its supervisor's exit record), in seconds since the epoch; None while it runs."""
        job = self.hosts[host]["job_launch_name"]
        try:
            record = json.loads((Path(self.hosts[host]["job_launch_state_dir"]) / job / "exit.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        if record.get("run_id") != self.run_record(host)["run_id"]:
            return None
        return datetime.fromisoformat(record["ended_at"]).timestamp()

    def job_host_pid(self, host: str) -> int:
        """The host pid of the job's main process (the run record's pid is the namespace's)."""
        return host_pid(self.namespace.init_pid, int(self.run_record(host)["pid"]))

    def summary_path(self, host: str) -> Path:
        return self.summaries / f"{host}@{self.hosts[host]['job_launch_name']}.json"

    def summary_stamp(self, host: str) -> tuple[int, int] | None:
        try:
            stat = self.summary_path(host).stat()
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    def next_summary(self, host: str, after: tuple[int, int] | None, timeout: float = 90) -> tuple[dict[str, Any], float]:
        """The host's next relaunch summary (written by a run that ended after `after`), and when it was seen."""
        def written() -> dict[str, Any] | None:
            stamp = self.summary_stamp(host)
            if stamp is None or stamp == after:
                return None
            return json.loads(self.summary_path(host).read_text(encoding="utf-8"))
        found = wait_until(written, timeout=timeout, what=f"a relaunch run's summary for {host}", interval=0.05)
        return found, time.time()

    # --- what the chain saw ------------------------------------------------------------------------

    def events_for(self, rank0: str, since: float) -> list[dict[str, Any]]:
        """The notifications the rulebook received since `since` for the job whose rank 0 (or one host) is `rank0`."""
        return [event for event in self.rulebook.events()
                if (event.get("payload") or {}).get("groupLabels", {}).get("gpuops_rank0") == rank0
                and received_at(event) >= since]

    def firing(self, alertname: str, host: str) -> bool:
        alerts = self.prometheus.get("/api/v1/alerts")["data"]["alerts"]
        return any(alert["labels"].get("alertname") == alertname and alert["labels"].get("gpuops_host") == host
                   and alert["state"] == "firing" for alert in alerts)

    def active_in_alertmanager(self, alertname: str, host: str) -> bool:
        alerts = self.alertmanager.get("/api/v2/alerts?active=true")
        return any(alert["labels"].get("alertname") == alertname and alert["labels"].get("gpuops_host") == host
                   for alert in alerts)

    def health_in_prometheus(self, host: str) -> str | None:
        query = f'gpuops_job_health{{gpuops_host="{host}"}} == 1'
        result = self.prometheus.get("/api/v1/query?query=" + quote(query, safe=""))["data"]["result"]
        return result[0]["metric"]["state"] if result else None

    def recaps_after(self, runs: int, count: int = 1) -> list[dict[str, dict[str, int]]]:
        """The PLAY RECAPs of the rulebook's runs after its first `runs`, once there are `count` of them."""
        def enough() -> list[dict[str, dict[str, int]]] | None:
            recaps = self.rulebook.recaps()[runs:]
            return recaps if len(recaps) >= count else None
        return wait_until(enough, timeout=60, what=f"{count} more playbook run(s) of the rulebook", interval=0.1)

    def launch(self, *hosts: str) -> dict[str, Any]:
        """The job's first launch, by a plain relaunch run (not through the chain); the first host's summary."""
        run = run_playbook(PLAYBOOK, inventory=str(self.inventory), extra_vars={"relaunch_hosts": ":".join(hosts)})
        assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
        return run.summary(hosts[0])


def alertmanager_config(webhook: str, token_file: Path) -> dict[str, Any]:
    """The shipped route (extensions/eda/alertmanager.yml) as shipped, timings included: only what a user must
    replace is replaced (the rulebook's URL, the token file)."""
    config = yaml.safe_load(ROUTE.read_text(encoding="utf-8"))
    [route] = config["route"]["routes"]
    [receiver] = [r for r in config["receivers"] if r["name"] == route["receiver"]]
    [hook] = receiver["webhook_configs"]
    hook["url"] = webhook
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    return config


@contextmanager
def event_chain(work: Path, max_relaunches: int = 5) -> Iterator[Chain]:
    """The whole chain in `work`, gpu1's job running (`max_relaunches`: gpu1's crash-loop guard)."""
    require(NODE_EXPORTER, PROMETHEUS, ALERTMANAGER)
    with ExitStack() as stack:
        namespace = stack.enter_context(pid_namespace())
        chain = Chain(work, namespace, max_relaunches)
        exporter = stack.enter_context(node_exporter(chain.textfiles, work))
        rank_b_logs = work / "rank-b-node"
        rank_b_logs.mkdir()
        rank_b_exporter = stack.enter_context(node_exporter(chain.rank_b_textfiles, rank_b_logs))
        port = free_port()
        token = f"chain-{os.getpid()}"
        chain.rulebook = stack.enter_context(rulebook("relaunch_on_alert", chain.inventory, work, port=port, token=token))
        token_file = work / "eda_token"
        token_file.write_text(token, encoding="utf-8")
        chain.alertmanager = stack.enter_context(alertmanager(alertmanager_config(chain.rulebook.webhook, token_file), work))
        chain.prometheus = stack.enter_context(prometheus_server({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in RULES],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [chain.alertmanager.url.split("//", 1)[1]]}]}]},
            "scrape_configs": [{"job_name": "node",
                                "static_configs": [{"targets": [node.url.split("//", 1)[1].split("/", 1)[0]
                                                                for node in (exporter, rank_b_exporter)]}]}],
        }, work))
        first = chain.launch("gpu1")
        assert first["relaunched"] is True, first
        wait_until(lambda: chain.health_in_prometheus("gpu1") == "running", timeout=30, what="gpu1 running in Prometheus")
        # The rulebook ends first (ExitStack: last in, first out), so no run starts while the rest ends.
        yield chain


def relaunched_through_the_chain(chain: Chain, host: str, failed_at: float, before: tuple[int, int] | None,
                                 old: dict[str, Any], runs: int) -> tuple[dict[str, Any], float, float]:
    """Wait for the chain's relaunch of `host` after a failure at `failed_at` (the rulebook had made `runs`
    runs before); check the new run is proven started and the run was limited to `host`. The relaunch's
    summary, the detection (failure -> the rulebook received the alert) and the relaunch (received -> the
    launch proved the new run started) in seconds."""
    summary, seen = chain.next_summary(host, before)
    assert summary["status"] == "relaunched" and summary["relaunched"] is True, summary
    events = chain.events_for(host, failed_at)
    assert events, chain.rulebook.text()[-3000:]
    detected = received_at(events[0])
    # One notification per failed run: the run that failed names its group.
    assert events[0]["payload"]["groupLabels"] == {"gpuops_rank0": host, "gpuops_job": chain.hosts[host]["job_launch_name"],
                                                   "gpuops_run": old["run_id"]}
    # Proven started: the launch came back (ready line, min_uptime), a new run with a live main process.
    record = chain.run_record(host)
    assert record["run_id"] != old["run_id"] and record["pid"] != old["pid"]
    assert process_starttime(chain.job_host_pid(host)) is not None
    [recap] = chain.recaps_after(runs)
    assert set(recap) == {host} and recap[host]["failed"] == 0 and recap[host]["changed"] > 0, recap
    return summary, detected - failed_at, seen - detected
