"""Benchmark: gpuops.relaunch.pct_ssh against community.proxmox.proxmox_pct_remote, in one run.

Both reach the same real LXC container through the same real sshd on 127.0.0.1 (the test harness:
tests/harness/pct_sshd.py, whose ``pct`` shim runs ``lxc-attach`` as ``pct exec`` does and counts
its calls; tests/harness/fakepve_lxc.py for the container). Measured, medians of N runs of
ansible-playbook, the two connections interleaved:

* a one-task playbook (``ansible.builtin.command``), and the same with T tasks; the per-task cost is
  (T-task time - one-task time) / (T - 1). Target: pct_ssh <= 0.3x proxmox_pct_remote per task.
  pct_ssh is measured warm (its shared connection to the node left by the previous run, as when
  playbooks follow one another within ``persist`` seconds) and cold (shared connections ended
  before each run, so the run pays the SSH login);
* a relaunch with nothing to do (playbooks/relaunch.yml; the demo job already runs with the same
  spec), both ways;
* the ``pct exec`` calls each of those cost (the shim's counter);
* for reference, the floor: the same playbooks through community.docker.nsenter straight into the
  container's namespaces (no SSH, no pct), as the tests' lighter path does.

Prints figures and ratios; asserts nothing about time. Needs root, lxc and openssh-server
(``make apt``); everything it starts (sshd, container, shared ssh connections) it ends.

    .venv/bin/python bench/pct_connection.py [--trials 5] [--tasks 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]

# pylint: disable=wrong-import-position
from tests.harness.fakepve_lxc import proxmox_lab  # noqa: E402
from tests.harness.pct_sshd import PctSshd, pct_sshd, stop_shared_connections  # noqa: E402
from tests.harness.pidns import nsenter_vars  # noqa: E402
from tests.harness.playbook import PlaybookRun, run_playbook  # noqa: E402
from tests.integration.test_relaunch_e2e import (  # noqa: E402
    HOSTNAME,
    RELAUNCH,
    install_demo_files,
    relaunch_vars,
)

VMID = 220


def command_play(tasks: int) -> list[dict[str, Any]]:
    return [{
        "hosts": "all",
        "gather_facts": False,
        "tasks": [
            {"name": f"task {n}", "ansible.builtin.command": "/bin/true", "changed_when": False}
            for n in range(tasks)
        ],
    }]


def write_inventory(path: Path, host_vars: dict[str, Any]) -> str:
    path.write_text(json.dumps({"all": {"hosts": {HOSTNAME: host_vars}}}), encoding="utf-8")
    return str(path)


class Way:
    """One way into the container: its inventory, environment, and what it should do before a run."""

    def __init__(self, name: str, inventory: str, env: dict[str, str], before: Callable[[], None] | None = None):
        self.name = name
        self.inventory = inventory
        self.env = env
        self.before = before
        self.times: dict[str, list[float]] = {}
        self.calls: dict[str, list[int]] = {}

    def run(self, sshd: PctSshd, label: str, plays: list[dict[str, Any]] | str) -> PlaybookRun:
        if self.before is not None:
            self.before()
        calls = sshd.pct_calls(vmid=VMID)
        start = time.monotonic()
        result = run_playbook(plays, inventory=self.inventory, env=self.env, timeout=600)
        elapsed = time.monotonic() - start
        if result.rc != 0:
            raise SystemExit(f"{self.name} {label}: ansible-playbook failed (rc {result.rc}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-2000:]}")
        self.times.setdefault(label, []).append(elapsed)
        self.calls.setdefault(label, []).append(sshd.pct_calls(vmid=VMID) - calls)
        return result

    def median(self, label: str) -> float:
        return statistics.median(self.times[label])

    def per_task(self, tasks: int, pick: Callable[[list[float]], float] = statistics.median) -> float:
        return (pick(self.times["many"]) - pick(self.times["one"])) / (tasks - 1)


def changed(run: PlaybookRun) -> int:
    return json.loads(run.stdout)["stats"][HOSTNAME]["changed"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--trials", type=int, default=5, help="runs of each playbook each way (median)")
    parser.add_argument("--tasks", type=int, default=6, help="tasks in the many-task playbook (>= 2)")
    args = parser.parse_args()
    if args.tasks < 2:
        parser.error("--tasks must be at least 2")

    with tempfile.TemporaryDirectory(prefix="bench-pct-") as tmp:
        base = Path(tmp)
        control = base / "cp"
        control.mkdir(mode=0o700)
        with proxmox_lab(base / "lab", vmid=VMID, hostname=HOSTNAME, time_scale=0.01) as lab, \
                pct_sshd(base / "sshd") as sshd:
            install_demo_files(lab.container)
            sshd.register(VMID, lab.container.lxcpath)
            try:
                job = relaunch_vars(lab, reset_allowed=False)
                remote = Way("proxmox_pct_remote",
                             write_inventory(base / "remote.json", {**sshd.host_vars(VMID), **job}),
                             sshd.environment())
                warm = Way("pct_ssh (warm)",
                           write_inventory(base / "pct_ssh.json", {**sshd.pct_ssh_host_vars(VMID, control), **job}),
                           {})
                cold = Way("pct_ssh (cold)", warm.inventory, {}, before=lambda: stop_shared_connections(control))
                init = lab.container.init_pid
                if init is None:
                    raise SystemExit("the container is not running")
                floor = Way("nsenter (no ssh)", write_inventory(base / "nsenter.json", {**nsenter_vars(init), **job}), {})
                ways = [remote, warm, cold, floor]

                # The demo job runs (launched once, through pct_ssh), so every relaunch below is a no-op.
                first = run_playbook(RELAUNCH, inventory=warm.inventory, timeout=600)
                if first.rc != 0:
                    raise SystemExit(f"the first relaunch failed:\n{first.stdout[-4000:]}\n{first.stderr[-2000:]}")

                plays = {"one": command_play(1), "many": command_play(args.tasks), "noop": RELAUNCH}
                # Interleaved run by run, so that a change in the machine's load falls on every way alike.
                for _trial in range(args.trials):
                    for label, plays_ in plays.items():
                        for way in ways:
                            result = way.run(sshd, label, plays_)
                            if label == "noop" and changed(result) != 0:
                                raise SystemExit(f"{way.name}: the relaunch was not a no-op: {changed(result)} changed")
            finally:
                stop_shared_connections(control)
                sshd.unregister(VMID)

    print(f"pct connection benchmark: same LXC container, same sshd on 127.0.0.1, medians of {args.trials}, "
          f"one-task and {args.tasks}-task playbooks of ansible.builtin.command")
    print(f"{'':20} {'one task':>10} {str(args.tasks) + ' tasks':>10} {'per task':>10} {'no-op relaunch':>15}"
          f" {'pct exec/task':>14} {'pct exec/relaunch':>18}")
    for way in ways:
        execs_per_task = (statistics.median(way.calls["many"]) - statistics.median(way.calls["one"])) / (args.tasks - 1)
        execs = (f"{execs_per_task:14.1f} {statistics.median(way.calls['noop']):18.0f}" if way is not floor
                 else f"{'-':>14} {'-':>18}")
        print(f"{way.name:20} {way.median('one'):9.2f}s {way.median('many'):9.2f}s {way.per_task(args.tasks):9.3f}s "
              f"{way.median('noop'):14.2f}s {execs}")
    for way in (warm, cold):
        print(f"{way.name} / proxmox_pct_remote: per task {way.per_task(args.tasks) / remote.per_task(args.tasks):.2f}x "
              f"(target <= 0.3), one-task playbook {way.median('one') / remote.median('one'):.2f}x, "
              f"no-op relaunch {way.median('noop') / remote.median('noop'):.2f}x")
    # The fastest run of each is what the machine gives without other jobs in the way: a second look
    # when the medians are noisy (load from other jobs on few cores).
    for way in (warm, cold):
        print(f"{way.name} / proxmox_pct_remote, fastest runs: per task "
              f"{way.per_task(args.tasks, min) / remote.per_task(args.tasks, min):.2f}x, "
              f"one-task playbook {min(way.times['one']) / min(remote.times['one']):.2f}x, "
              f"no-op relaunch {min(way.times['noop']) / min(remote.times['noop']):.2f}x")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
