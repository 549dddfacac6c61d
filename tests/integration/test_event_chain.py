"""The event-driven relaunch as one real chain: the failure itself is the trigger, no Ansible poll.

node (the job's live textfile) -> node_exporter (textfile collector) -> Prometheus (the shipped rules,
GpuopsJobFailed) -> Alertmanager (the shipped route, extensions/eda/alertmanager.yml) -> ansible-rulebook
(the shipped rulebook, extensions/eda/rulebooks/relaunch_on_alert.yml) -> playbooks/relaunch.yml on the
alerted job's hosts. Every part is real (Debian's binaries unpacked by `make prometheus-tools`,
ansible-rulebook from requirements/test.txt, Java 17 from APT_PKGS) and on loopback. The route is the
shipped file with only its URL and token file replaced (its timings as shipped: group_interval 1m,
repeat_interval 10m); Prometheus scrapes and evaluates every second (its intervals are the user's: shortened
here, so that detection takes a second). They start once for the whole file (module fixture, tests/harness/event_chain.py), and the
cases run in this order.

The hosts are four inventory names for one PID namespace whose init never reaps (nsenter connection):
every signal stays inside it. gpu1 runs a healthy job, gpu2 a job that crashes about 3 s after each
start, rank-a and rank-b the two ranks of one job that meet on loopback. Each relaunch case prints its
failure-to-running latency, split into detection (the failure -> the rulebook received the alert) and
relaunch (received -> the relaunch proved the new run started).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.event_chain import RANKS, Chain, event_chain, relaunched_through_the_chain
from tests.harness.pidns import process_starttime
from tests.harness.playbook import REPO
from tests.harness.procstates import wait_until
from tests.harness.prometheus import free_port
from tests.harness.rulebook import RULEBOOK, received_at
from tests.harness.rulebook import require as require_rulebook

pytestmark = pytest.mark.slow

# The rulebook's throttle window (rulebooks/relaunch_on_alert.yml: once_within).
THROTTLE_S = 10
# The chain's speed (failure -> running, the goal 30 s) is measured by bench/event_chain_latency.py;
# a test never asserts a wall-clock time: it waits for each step with a deadline and prints the latency.


@pytest.fixture(name="chain", scope="module")
def chain_fixture(tmp_path_factory) -> Iterator[Chain]:
    with event_chain(tmp_path_factory.mktemp("chain")) as chain:
        yield chain


def relaunched(chain: Chain, host: str, failed_at: float, before: tuple[int, int] | None, old: dict[str, Any],
               runs: int, what: str) -> dict[str, Any]:
    """The chain's relaunch after a failure: proven started (each step waited for with a deadline), its latency printed."""
    summary, detection, relaunch = relaunched_through_the_chain(chain, host, failed_at, before, old, runs)
    total = detection + relaunch
    print(f"\n{what}: failure -> running {total:.1f}s (detection {detection:.1f}s, relaunch {relaunch:.1f}s)")
    return summary


def test_a_killed_job_is_relaunched_by_the_chain_and_again_when_killed_again(chain: Chain) -> None:
    """The second kill, right after the relaunch, is the same failure of the same job with the same labels but
    another run's: with the shipped route (group_interval 1m, repeat_interval 10m) it is sent at once too, as
    the first notification of a group of its own (in the job's group, Alertmanager held it for group_interval,
    or counted it as notified until repeat_interval)."""
    groups = []
    for what in ("kill -9", "kill -9 again, right after its relaunch"):
        old, before, runs = chain.run_record("gpu1"), chain.summary_stamp("gpu1"), len(chain.rulebook.recaps())
        target = chain.job_host_pid("gpu1")
        failed_at = time.time()
        os.kill(target, signal.SIGKILL)  # the job's main process, inside the namespace, just looked up
        summary = relaunched(chain, "gpu1", failed_at, before, old, runs, what)
        assert summary["health"]["state"] == "crashed" and summary["health"]["exit_signal"] == "SIGKILL"
        groups.append(chain.events_for("gpu1", failed_at)[0]["payload"]["groupKey"])
        wait_until(lambda: chain.health_in_prometheus("gpu1") == "running", timeout=20, what="gpu1 running again")
    assert groups[0] != groups[1], groups


def test_a_stopped_job_is_stalled_and_relaunched_by_the_chain(chain: Chain) -> None:
    old, before, runs = chain.run_record("gpu1"), chain.summary_stamp("gpu1"), len(chain.rulebook.recaps())
    target = chain.job_host_pid("gpu1")
    failed_at = time.time()
    os.kill(target, signal.SIGSTOP)  # held still: alive, no progress
    summary = relaunched(chain, "gpu1", failed_at, before, old, runs, "SIGSTOP (stalled)")
    assert summary["health"]["state"] == "stalled", summary["health"]
    assert "stopped by a signal" in summary["health"]["reason"]
    wait_until(lambda: chain.health_in_prometheus("gpu1") == "running", timeout=20, what="gpu1 running again")


def test_a_duplicate_alert_relaunches_nothing_and_an_alert_for_another_job_does_nothing(chain: Chain) -> None:
    """Also: labels that are no job or host name (any scrape target can export gpuops_job_health) never reach
    Ansible, whose templating would run what they say on the controller."""
    last = chain.events_for("gpu1", 0)[-1]
    old = chain.run_record("gpu1")
    runs = len(chain.rulebook.recaps())
    # Past the throttle window of the last alert, so that the rulebook runs the relaunch for the duplicate.
    wait_until(lambda: time.time() - received_at(last) > THROTTLE_S + 0.5, timeout=THROTTLE_S + 5,
               what="the throttle window to pass", interval=0.2)
    before = chain.summary_stamp("gpu1")
    # Labels that are no names (the rule engine's `$` matches before a final line terminator: each of these
    # passed the old check), and four copies of a payload without startsAt (each ran: the throttle could not
    # group them). Then the same Alertmanager payload twice at once (a burst), then one that names another
    # job. One run per host at a time, in order: a run for a bad label would come before the other job's.
    pwned = chain.work / "pwned"
    bad_labels = [("gpuops_job", "{{ lookup('ansible.builtin.pipe', 'touch %s') }}" % pwned), ("gpuops_rank0", "all"),
                  ("gpuops_rank0", "all\n"), ("gpuops_rank0", "gpu1\r\n"), ("gpuops_rank0", "gpu1\u2028"),
                  ("gpuops_job", "train\n"), ("gpuops_job", "train\u0085")]
    for label, value in bad_labels:
        bad = json.loads(json.dumps(last["payload"]))
        bad["groupLabels"][label] = bad["commonLabels"][label] = value
        assert chain.rulebook.post(bad) == 200
    unstarted = json.loads(json.dumps(last["payload"]))
    for alert in unstarted["alerts"]:
        del alert["startsAt"]
    for _copy in range(4):
        assert chain.rulebook.post(unstarted) == 200
    assert chain.rulebook.post(last["payload"]) == 200
    assert chain.rulebook.post(last["payload"]) == 200
    other = json.loads(json.dumps(last["payload"]))
    other["groupLabels"]["gpuops_job"] = other["commonLabels"]["gpuops_job"] = "renamed-away"
    assert chain.rulebook.post(other) == 200

    duplicate, _seen = chain.next_summary("gpu1", before)
    assert duplicate["status"] == "unchanged" and duplicate["action"] == "none", duplicate
    assert chain.run_record("gpu1")["run_id"] == old["run_id"]
    # The burst made one run; the host's lock ran the other job's alert after it: two runs, in order.
    recaps = chain.recaps_after(runs, 2)
    assert [recap["gpu1"]["changed"] for recap in recaps] == [0, 0], recaps
    # The last run's summary: the other job's alert.
    elsewhere = json.loads(chain.summary_path("gpu1").read_text(encoding="utf-8"))
    assert elsewhere["action"] == "none" and elsewhere["status"] == "unchanged"
    assert elsewhere["why"] == ("the alert names the job 'renamed-away', but this host's job (job_launch_name) is "
                                "'train': nothing is done")
    assert chain.run_record("gpu1")["run_id"] == old["run_id"]
    # All the posts arrived; the bad ones matched no rule: no run, nothing templated.
    posts = len(bad_labels) + 4 + 3
    assert len([event for event in chain.rulebook.events() if received_at(event) > received_at(last) + 1]) == posts
    assert len(chain.rulebook.recaps()) == runs + 2 and not pwned.exists()


def test_an_alert_on_one_rank_relaunches_every_rank_of_its_job_once(chain: Chain) -> None:
    """rank-b's process is killed; rank-a's then ends too (its peer is gone). Both alerts carry the job's
    rank 0 (gpuops_rank0=rank-a): one relaunch of both ranks, which meet again and train together."""
    started = chain.launch(*RANKS)
    assert started["relaunched"] is True, started
    for host in RANKS:
        wait_until(lambda h=host: chain.health_in_prometheus(h) == "running", timeout=30, what=f"{host} running")
    old = {host: chain.run_record(host) for host in RANKS}
    before = {host: chain.summary_stamp(host) for host in RANKS}
    runs = len(chain.rulebook.recaps())
    failed_at = time.time()
    os.kill(chain.job_host_pid("rank-b"), signal.SIGKILL)
    summaries = {host: chain.next_summary(host, before[host]) for host in RANKS}
    for host, (summary, _seen) in summaries.items():
        assert summary["status"] == "relaunched" and summary["relaunched"] is True, summary
    assert summaries["rank-b"][0]["health"]["exit_signal"] == "SIGKILL"
    events = chain.events_for("rank-a", failed_at)
    # Each rank's failed run is a notification of its own, all under the job's rank 0.
    assert events and {event["payload"]["groupLabels"]["gpuops_run"] for event in events} <= {
        old[host]["run_id"] for host in RANKS}
    assert all(event["payload"]["groupLabels"]["gpuops_rank0"] == "rank-a" for event in events)
    detected = received_at(events[0])
    print(f"\none rank killed: failure -> both ranks running {max(seen for _s, seen in summaries.values()) - failed_at:.1f}s "
          f"(detection {detected - failed_at:.1f}s)")
    # Proven started, together: a new run on each rank, whose log says it met the other rank, and steps after.
    new = {host: chain.run_record(host) for host in RANKS}
    for index, host in enumerate(RANKS):
        assert new[host]["run_id"] != old[host]["run_id"]
        assert process_starttime(chain.job_host_pid(host)) is not None
        log = Path(new[host]["log_path"])
        wait_until(lambda path=log, i=index: f"rendezvous: rank {i} of 2" in path.read_text(encoding="utf-8")
                   and "step 3 " in path.read_text(encoding="utf-8"), timeout=20, what=f"{host} training with its peer")
    # Once, however many ranks alerted (the later notifications wait for the first run, under the rank 0's
    # lock, and find the job running): when the chain has settled (both running in Prometheus, no alert
    # left in Alertmanager), the one run that changed the ranks is the one that relaunched them.
    for host in RANKS:
        wait_until(lambda h=host: chain.health_in_prometheus(h) == "running", timeout=20, what=f"{host} running again")
        wait_until(lambda h=host: not chain.active_in_alertmanager("GpuopsJobFailed", h), timeout=20,
                   what=f"Alertmanager to drop GpuopsJobFailed for {host}")
    recaps = chain.recaps_after(runs)
    assert all(set(recap) == set(RANKS) for recap in recaps), recaps
    assert [recap["rank-a"]["changed"] > 0 for recap in recaps].count(True) == 1, recaps
    assert {host: chain.run_record(host)["run_id"] for host in RANKS} == {host: new[host]["run_id"] for host in RANKS}


def test_a_crash_loop_is_refused_alerts_and_is_not_retried(chain: Chain) -> None:
    started = chain.launch("gpu2")
    assert started["relaunched"] is True
    old, before, runs = chain.run_record("gpu2"), chain.summary_stamp("gpu2"), len(chain.rulebook.recaps())
    # The job crashes about 3 s after its start (exit 3): the chain relaunches it once (max_relaunches=1)...
    crashed_at = wait_until(lambda: chain.exit_time("gpu2"), timeout=30, what="gpu2's crash")
    relaunched(chain, "gpu2", crashed_at, before, old, runs, "crash (exit 3)")
    # ... it crashes again, and the crash-loop guard refuses: nothing is stopped or started.
    refused, _seen = chain.next_summary("gpu2", chain.summary_stamp("gpu2"))
    assert refused["status"] == "refused" and refused["relaunched"] is False, refused
    [recap] = chain.recaps_after(runs + 1)
    assert recap["gpu2"]["failed"] == 1 and recap["gpu2"]["changed"] == 0, recap
    wait_until(lambda: chain.firing("GpuopsCrashLoopRefused", "gpu2"), timeout=20, what="GpuopsCrashLoopRefused")
    wait_until(lambda: not chain.firing("GpuopsJobFailed", "gpu2"), timeout=20, what="GpuopsJobFailed to end")
    wait_until(lambda: not chain.active_in_alertmanager("GpuopsJobFailed", "gpu2"), timeout=20,
               what="Alertmanager to drop GpuopsJobFailed for gpu2")
    runs = len(chain.rulebook.recaps())
    refused_at = time.time()
    record = chain.run_record("gpu2")
    # No more relaunches: over a few evaluation intervals, no alert reaches the rulebook and nothing runs.
    time.sleep(3)
    assert chain.events_for("gpu2", refused_at) == [] and len(chain.rulebook.recaps()) == runs
    assert chain.run_record("gpu2") == record


def test_the_rulebook_will_not_listen_without_a_token(tmp_path) -> None:
    """Whoever can post to the webhook can ask for relaunches: an unset gpuops_eda_webhook_token stops the
    rulebook before it listens (a wrong token is answered 401: the harness waits for that answer)."""
    home = require_rulebook()
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("gpu1 ansible_connection=local\n", encoding="utf-8")
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps({"gpuops_eda_webhook_port": free_port()}), encoding="utf-8")
    env = dict(os.environ, JAVA_HOME=str(home), ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
               PATH=f"{RULEBOOK.parent}:{os.environ.get('PATH', '')}")
    ended = subprocess.run([str(RULEBOOK), "-r", "gpuops.relaunch.relaunch_on_alert", "-i", str(inventory),
                            "--vars", str(variables)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                           timeout=120, check=False)
    assert ended.returncode != 0, ended.stdout[-2000:]
    assert "gpuops_eda_webhook_token' is undefined" in ended.stdout + ended.stderr


def test_the_rulebook_will_not_start_where_its_playbook_runs_would_not_find_the_collection(tmp_path) -> None:
    """Started in a checkout without ANSIBLE_CONFIG, the rulebook finds itself (the checkout's ansible.cfg) but
    its playbook runs (ansible-runner, in a private directory) would not find the collection: every relaunch
    would fail while Alertmanager gets a 200. It stops at once and says what is missing."""
    home = require_rulebook()
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("gpu1 ansible_connection=local\n", encoding="utf-8")
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps({"gpuops_eda_webhook_port": free_port(), "gpuops_eda_webhook_token": "t"}),
                         encoding="utf-8")
    env = {name: value for name, value in os.environ.items()
           if name not in ("ANSIBLE_CONFIG", "ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS")}
    env.update(JAVA_HOME=str(home), PATH=f"{RULEBOOK.parent}:{os.environ.get('PATH', '')}")
    ended = subprocess.run([str(RULEBOOK), "-r", "gpuops.relaunch.relaunch_on_alert", "-i", str(inventory),
                            "--vars", str(variables)], cwd=str(REPO), env=env, capture_output=True, text=True,
                           timeout=120, check=False)
    assert ended.returncode != 0, ended.stdout[-2000:]
    assert "the collection gpuops.relaunch is not found where the rulebook's playbook runs" in ended.stdout + ended.stderr
    assert "set ANSIBLE_CONFIG" in ended.stdout + ended.stderr
