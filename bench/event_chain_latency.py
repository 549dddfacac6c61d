"""Benchmark: failure -> running through the event chain (issue 25 item 5).

The chain of tests/integration/test_event_chain.py, started once (tests/harness/event_chain.py): the
job's live textfile on the node, Debian's node_exporter (textfile collector), Prometheus (scrape and
rule evaluation every second, the shipped rules), Alertmanager (the shipped route as shipped,
extensions/eda/alertmanager.yml: group_wait 0s, group_interval 1m, repeat_interval 10m; only its URL and
token file replaced) and ansible-rulebook with the shipped rulebook, which
runs playbooks/relaunch.yml on the alerted job's hosts. The job is the demo trainer in a PID namespace
whose init never reaps (nsenter connection), so every signal stays inside it.

Each round fails the running job one way and times until the relaunch proved the new run started:

* kill     SIGKILL to the job's main process (crashed: the supervisor's exit record)
* again    SIGKILL again, as soon as Prometheus saw the relaunched run running: the same failure with the
           same labels but another run's (issue 35: before gpuops_run, the shipped route sent it only after
           repeat_interval, 10 minutes)
* stop     SIGSTOP to it (alive, no progress: stalled once stall_after, 2 s, has passed)

split into detection (the failure -> the rulebook received Alertmanager's notification: its
meta.received_at) and relaunch (received -> the relaunch run's summary, written once the launch proved
the new run: its ready line and min_uptime). It prints each round and the medians, and the goal
(failure -> running at most 30 s on a 2-core machine; the 10-minute watchdog was the bound before). It
asserts no times. Needs root (unshare, nsenter) and what `make test` installs (`make setup
prometheus-tools`: Java 17, ansible-rulebook, the unpacked Debian binaries).

Clean-up, also after a failure or Ctrl-C: every service by the pid it recorded, the rulebook first;
the namespace by SIGKILL to its recorded init (the kernel ends everything inside).

    .venv/bin/python bench/event_chain_latency.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".build" / "collections"))
sys.path.insert(0, str(REPO))

# pylint: disable=wrong-import-position
from tests.harness.event_chain import Chain, event_chain, relaunched_through_the_chain  # noqa: E402
from tests.harness.procstates import wait_until  # noqa: E402

GOAL_S = 30.0
FAILURES = {"kill": signal.SIGKILL, "again": signal.SIGKILL, "stop": signal.SIGSTOP}


def one_round(chain: Chain, how: str) -> tuple[float, float, str]:
    """Fail gpu1's job `how`, wait for the chain's relaunch; (detection, relaunch, what the probe saw)."""
    old, before, runs = chain.run_record("gpu1"), chain.summary_stamp("gpu1"), len(chain.rulebook.recaps())
    target = chain.job_host_pid("gpu1")
    failed_at = time.time()
    os.kill(target, FAILURES[how])  # the job's main process, inside the namespace, just looked up
    summary, detection, relaunch = relaunched_through_the_chain(chain, "gpu1", failed_at, before, old, runs)
    # The next round fails a job that runs: Prometheus must have seen it running again, or its alert
    # would still be the last failure's.
    wait_until(lambda: chain.health_in_prometheus("gpu1") == "running", timeout=30, what="gpu1 running again")
    return detection, relaunch, str(summary["health"]["state"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="rounds of each failure (default 5)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (unshare, nsenter)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpuops-chain-bench-") as work:
        # The guard must not refuse the rounds: each one is a relaunch within its window.
        with event_chain(Path(work), max_relaunches=10 * args.repeat + 10) as chain:
            rows: dict[str, list[tuple[float, float]]] = {how: [] for how in FAILURES}
            for index in range(args.repeat):
                for how in FAILURES:
                    detection, relaunch, state = one_round(chain, how)
                    rows[how].append((detection, relaunch))
                    print(f"round {index + 1} {how:5}: {state:8} failure -> running {detection + relaunch:5.1f}s "
                          f"(detection {detection:4.1f}s, relaunch {relaunch:4.1f}s)", flush=True)
    print(f"\nmedians of {args.repeat} (scrape and evaluation every 1 s, the shipped route; goal <= {GOAL_S:.0f}s):")
    for how, values in rows.items():
        detection = statistics.median(d for d, _r in values)
        relaunch = statistics.median(r for _d, r in values)
        total = statistics.median(d + r for d, r in values)
        print(f"  {how:5}: failure -> running {total:5.1f}s (detection {detection:4.1f}s, relaunch {relaunch:4.1f}s), "
              f"slowest {max(d + r for d, r in values):5.1f}s")
    slowest = {how: max(d + r for d, r in values) for how, values in rows.items()}
    print(f"first and repeat failure within the same bound ({GOAL_S:.0f}s): "
          f"{'yes' if slowest['kill'] <= GOAL_S and slowest['again'] <= GOAL_S else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
