"""Benchmark: how soon gpu_mem_wait notices a release, and what its polling costs.

Runs the module's own wait (``wait_for_release`` with the NVML child session, the code path of
``gpuops.relaunch.gpu_mem_wait`` minus Ansible's argument parsing) against the simulated NVML
driven by real processes:

* latency: a real holder process registered with N MiB is killed; the simulated driver releases its
  memory a random teardown delay (0.1-1.1 s, so the release falls at a random phase of the poll
  cycle) after it first sees the exit. Measured: from that release instant to ``wait_for_release``
  returning. Target: median at most ``poll_interval`` + 100 ms.
* CPU: a wait that never succeeds, at the default interval, for a fixed time; the CPU time of this
  process and of its NVML child together (the child is reaped, so its time is counted), divided by
  the wall time. Target: under 2% of one core. Baseline in the same run: the same wait through the
  ``nvidia-smi`` fallback (one process per query, the fake ``nvidia-smi`` of the test harness).

    .venv/bin/python bench/gpu_wait_latency.py [--trials 15] [--cpu-seconds 10] [--poll-interval 0.5]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]

# pylint: disable=wrong-import-position
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.wait import (  # noqa: E402
    ReleaseCondition,
    wait_for_release,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (  # noqa: E402
    NvidiaSmiSession,
    NvmlSession,
)
from tests.harness.gpu_holder import FAKE_NVIDIA_SMI_DIR, SIMNVML_DIR, plain_holder, sim_gpu  # noqa: E402
from tests.harness.procstates import Reaper  # noqa: E402


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def latency_trials(trials: int, poll_interval: float) -> list[float]:
    latencies = []
    rng = random.Random(4)
    reaper = Reaper()
    try:
        with sim_gpu(devices=1) as gpu:
            os.environ["GPUOPS_SIMNVML_STATE"] = str(gpu.state_path)
            for _trial in range(trials):
                gpu.teardown_delay = rng.uniform(0.1, 1.1)
                gpu.holders.clear()
                holder = plain_holder(reaper, gpu, mib=40960)
                reaper.kill(holder["pid"])
                session = NvmlSession(query_timeout=30)
                try:
                    outcome = wait_for_release(session, [], ReleaseCondition(), timeout=30, poll_interval=poll_interval)
                finally:
                    session.close()
                returned = time.time()
                released = gpu.release_instant(holder)
                if not outcome.released or released is None:
                    raise SystemExit(f"trial did not release: {outcome.as_dict()}")
                latencies.append(returned - released)
    finally:
        reaper.cleanup()
    return latencies


def polling_cost(seconds: float, poll_interval: float, backend: str) -> tuple[float, int]:
    """CPU seconds per wall second of a wait that never succeeds, and how many polls it made."""
    reaper = Reaper()
    try:
        with sim_gpu(devices=1) as gpu:
            os.environ["GPUOPS_SIMNVML_STATE"] = str(gpu.state_path)
            plain_holder(reaper, gpu, mib=40960)
            if backend == "pynvml":
                source = NvmlSession(query_timeout=30)
            else:
                source = NvidiaSmiSession(str(FAKE_NVIDIA_SMI_DIR / "nvidia-smi"), query_timeout=30)
            cpu_before, wall_before = cpu_seconds(), time.monotonic()
            try:
                outcome = wait_for_release(source, [], ReleaseCondition(), timeout=seconds, poll_interval=poll_interval)
            finally:
                source.close()
            cpu_used, wall = cpu_seconds() - cpu_before, time.monotonic() - wall_before
    finally:
        reaper.cleanup()
    return cpu_used / wall, outcome.polls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--cpu-seconds", type=float, default=10.0)
    parser.add_argument("--poll-interval", type=float, default=0.5, help="the module's default is 0.5")
    args = parser.parse_args()
    sys.path.insert(0, str(SIMNVML_DIR))  # the forked NVML child imports the simulated pynvml

    latencies = latency_trials(args.trials, args.poll_interval)
    median = statistics.median(latencies)
    target = args.poll_interval + 0.1
    print(f"detection latency over {len(latencies)} releases at poll_interval={args.poll_interval:g}s: "
          f"median {median * 1000:.0f} ms, min {min(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
    print(f"  target: median <= poll_interval + 100 ms = {target * 1000:.0f} ms -> "
          f"{'MET' if median <= target else 'MISSED'} (ratio {median / target:.2f})")

    nvml_cost, nvml_polls = polling_cost(args.cpu_seconds, args.poll_interval, "pynvml")
    smi_cost, smi_polls = polling_cost(args.cpu_seconds, args.poll_interval, "nvidia-smi")
    print(f"polling CPU at poll_interval={args.poll_interval:g}s over {args.cpu_seconds:g}s "
          f"(module process + NVML child, simulated driver included):")
    print(f"  NVML child session: {nvml_cost * 100:.2f}% of one core ({nvml_polls} polls)")
    print(f"  baseline, nvidia-smi per poll: {smi_cost * 100:.2f}% of one core ({smi_polls} polls); "
          f"ratio {nvml_cost / smi_cost:.3f}")
    print(f"  target: < 2% of one core -> {'MET' if nvml_cost < 0.02 else 'MISSED'}")


if __name__ == "__main__":
    main()
