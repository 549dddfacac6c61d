"""Benchmark: our process snapshot against `ps -eo pid,ppid,stat,nlwp,comm`, same machine, same run.

Spawns N extra processes (default 10,000; each a forked child that waits for a signal), then times,
alternating so both see the same machine state:

* ps        `ps -eo pid,ppid,stat,nlwp,comm` (the baseline)
* scan      ProcessTable.scan(): stat of every process, cmdline where one can exist
* snapshot  what zombie_facts does in one run: one scan + job selection by regex with descendants +
            the selection floor (judged on that same scan) + protection + other jobs' processes + GPU
            device holders (glob /dev/nvidia*) + zombie/D classification
* members   one look of train_launch's stop path at its worst: every spawned process carries the
            run's mark and started after the run, so each one's environment is read and checked

and prints medians and the ratio to ps, of the wall time and of the CPU time (user + system: our
process's own, ps's from its rusage as a reaped child). On a shared machine the wall time measures
the neighbours too; the CPU time is the work each side did, and the verdict is on it. The target: the
snapshot in at most half the CPU time of ps. Every spawned process shares one command line of many lines (the spawner's code,
``python -c``), so each holds control characters to escape: escaped once, when something reads it.
The spawned processes are ended by their recorded process group and reaped by the spawner; nothing
else is touched.

    .venv/bin/python bench/scan_vs_ps.py [--processes 10000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".build" / "collections"))

# pylint: disable=wrong-import-position
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.assessment import AssessmentOptions, assess  # noqa: E402
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable  # noqa: E402
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import JobSelector  # noqa: E402
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import RUN_MARK, run_mark  # noqa: E402
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import JobIdentity, look  # noqa: E402

BENCH_JOB_DIR = "/nonexistent/gpuops-bench/job"

SPAWNER = r"""
import os, signal, sys
count = int(sys.argv[1])
os.setpgid(0, 0)
children = []
for _index in range(count):
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    children.append(pid)
print("ready", flush=True)
sys.stdin.read()            # until the benchmark closes our stdin
for pid in children:
    os.kill(pid, signal.SIGKILL)
for pid in children:
    os.waitpid(pid, 0)
"""


def spawn(count: int) -> subprocess.Popen:
    # Every child inherits the run's mark: the worst case for the stop path's membership proof.
    spawner = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-c", SPAWNER, str(count)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, **{RUN_MARK: run_mark(BENCH_JOB_DIR, "bench")}),
    )
    assert spawner.stdout is not None
    if spawner.stdout.readline().strip() != "ready":
        raise SystemExit(f"spawner failed with {spawner.wait()}")
    return spawner


def time_once(action) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process's and its reaped children's) of one `action()`."""
    start, cpu = time.perf_counter(), _cpu()
    action()
    return time.perf_counter() - start, _cpu() - cpu


def _cpu() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    # The module's defaults: no protected patterns (the built-in protection judges executables).
    options = AssessmentOptions(
        selector=JobSelector.from_options([r"/workspace/run/train\.py\b"], [], True),
        orphan_grace=0.0,
    )
    actions = {
        "ps": lambda: subprocess.run(["ps", "-eo", "pid,ppid,stat,nlwp,comm"], stdout=subprocess.DEVNULL, check=True),
        "scan": lambda: ProcessTable.scan("/proc"),
        "snapshot": lambda: assess(options),
        "members": lambda: look(JobIdentity(job_dir=BENCH_JOB_DIR, run_id="bench", starttime=0)),
    }

    load = os.getloadavg()[0]  # before the spawn, whose burst of forks the load average would count
    spawner = spawn(args.processes)
    try:
        total = len(ProcessTable.scan("/proc").processes)
        timings: dict[str, list[float]] = {name: [] for name in actions}
        cpu: dict[str, list[float]] = {name: [] for name in actions}
        for name, action in actions.items():  # warm the page cache and imports once
            action()
        for _round in range(args.rounds):
            for name, action in actions.items():
                wall, used = time_once(action)
                timings[name].append(wall)
                cpu[name].append(used)
    finally:
        assert spawner.stdin is not None
        spawner.stdin.close()
        spawner.wait()

    baseline = statistics.median(timings["ps"])
    cpu_baseline = statistics.median(cpu["ps"])
    print(f"processes on the machine during the run: {total} ({args.processes} spawned), {args.rounds} rounds, "
          f"load average {load:.1f} before, medians:")
    print(f"  {'':<9} {'wall':>8}      {'vs ps':>5}   {'CPU':>8}      {'vs ps':>5}")
    for name in actions:
        median, cpu_median = statistics.median(timings[name]), statistics.median(cpu[name])
        print(f"  {name:<9} {median * 1000:8.1f} ms   {median / baseline:5.2f}x   "
              f"{cpu_median * 1000:8.1f} ms   {cpu_median / cpu_baseline:5.2f}x")
    ratio = statistics.median(timings["snapshot"]) / baseline
    cpu_ratio = statistics.median(cpu["snapshot"]) / cpu_baseline
    # Judged on the CPU time: the wall time of either side also counts the neighbours' turns on the CPUs.
    verdict = "meets" if cpu_ratio <= 0.5 else "MISSES"
    print(f"full snapshot / ps = {cpu_ratio:.2f} CPU ({verdict} the target of at most 0.5), {ratio:.2f} wall")
    members = statistics.median(timings["members"])
    print(f"stop-path membership look / scan = {members / statistics.median(timings['scan']):.2f} "
          f"(the price of reading {args.processes} environments)")


if __name__ == "__main__":
    main()
