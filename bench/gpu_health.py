"""Benchmark: what gpu_health's look costs, against gpu_mem_wait's own NVML query in the same run.

* reads: in one NVML child session (the module's code path minus Ansible's argument parsing) against
  the simulated NVML with 8 GPUs, the median time of one health read of every GPU (``NvmlSession.health``)
  and of one memory query (``NvmlSession.query``, what gpu_mem_wait does per poll). Printed: both, and
  their ratio. The simulated driver re-reads its state file on every call, so the ratio is mostly the
  ratio of the two looks' NVML calls: printed too (counted in this process, on the same simulated driver),
  with what one simulated call costs. On a real driver a call is an ioctl, not a JSON file read.
* kernel log: 100,000 /dev/kmsg records (1 in 1,000 an XID line) scanned by ``scan_records``, against
  reading the same records plainly (iterating them and counting their bytes). Printed: both and the
  ratio. Goal (issue 36): the scan under 0.5 s.

    .venv/bin/python bench/gpu_health.py [--trials 15] [--records 100000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]

# pylint: disable=wrong-import-position
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.health_reads import gpu_health_reads  # noqa: E402
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import NvmlSession, _nvml_devices  # noqa: E402
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.xid import scan_records  # noqa: E402
from tests.harness.gpu_holder import SIMNVML_DIR, sim_gpu  # noqa: E402


def median_seconds(call, trials: int) -> float:
    times = []
    for _trial in range(trials):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def reads(trials: int) -> None:
    with sim_gpu(devices=8) as gpu:
        os.environ["GPUOPS_SIMNVML_STATE"] = str(gpu.state_path)
        sys.path.insert(0, str(SIMNVML_DIR))  # the child imports the simulated pynvml
        session = NvmlSession(30)
        try:
            session.start()
            query = median_seconds(session.query, trials)
            health = median_seconds(session.health, trials)
        finally:
            session.close()
        health_calls, query_calls, per_call = calls_per_look(trials)
    print(f"reads (8 simulated GPUs, median of {trials}): health {health * 1000:.1f} ms, "
          f"gpu_mem_wait's query {query * 1000:.1f} ms, ratio {health / query:.2f}x")
    print(f"  NVML calls per look: health {health_calls}, query {query_calls} (ratio {health_calls / query_calls:.2f}x); "
          f"one simulated call {per_call * 1e6:.0f} us (the state file read again)")


def calls_per_look(trials: int) -> tuple[int, int, float]:
    """(NVML calls of one health look, of one memory query, seconds per simulated call), in this process."""
    import pynvml  # pylint: disable=import-outside-toplevel,import-error

    counted = {"calls": 0}

    class Counting:  # pylint: disable=too-few-public-methods
        def __getattr__(self, name):
            value = getattr(pynvml, name)
            if name.startswith("nvml") and callable(value) and name not in ("nvmlInit", "nvmlShutdown"):
                def call(*args, **kwargs):
                    counted["calls"] += 1
                    return value(*args, **kwargs)
                return call
            return value

    pynvml.nvmlInit()
    try:
        gpu_health_reads(Counting(), None)
        health_calls, counted["calls"] = counted["calls"], 0
        _nvml_devices(Counting(), None)
        query_calls = counted["calls"]
        per_call = median_seconds(pynvml.nvmlDeviceGetCount, trials * 20)
    finally:
        pynvml.nvmlShutdown()
    return health_calls, query_calls, per_call


def kernel_log(records: int, trials: int) -> None:
    lines = []
    for index in range(records):
        message = (f"NVRM: Xid (PCI:0000:3b:00): 79, pid={index}, name=python3, GPU has fallen off the bus."
                   if index % 1000 == 0 else f"usb 1-1: new high-speed USB device number {index} using xhci_hcd")
        lines.append(f"3,{index},{index * 1000},-;{message}\n SUBSYSTEM=usb\n".encode())

    def plain() -> int:
        return sum(len(line) for line in lines)

    scan = median_seconds(lambda: scan_records(lines, since=0, boot_time=0), trials)
    base = median_seconds(plain, trials)
    size = plain()
    print(f"kernel log ({records:,} records, {size / 1e6:.1f} MB, median of {trials}): scan {scan * 1000:.1f} ms "
          f"(goal under 500 ms), plain read {base * 1000:.1f} ms, ratio {scan / base:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    reads(args.trials)
    kernel_log(args.records, args.trials)


if __name__ == "__main__":
    main()
