# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Real-GPU check: gpu_health's every read and the relaunch's GPU gate against the real driver.

1. ``gpuops.relaunch.gpu_health`` on localhost, for --device: every NVML read (recovery action, remapped rows,
   retired pages, volatile uncorrectable ECC, NVLink, throttle reasons) must answer ``ok`` or ``unsupported``,
   never ``error``; the kernel log must be ``read`` (as root on a host) or ``denied`` (in a container), never
   ``failed``. The verdict, each read and the kernel log's counts are printed.
2. ``gpuops.relaunch.gpu_gate`` in check mode (a state directory of its own: nothing is quarantined or reset)
   must give ``launch`` for a GPU gpu_health judged healthy, ``refuse`` or ``launch`` with the evidence otherwise.
3. The cost: each module's own ``elapsed`` (its look on the target), gpu_health's and gpu_gate's against
   gpu_mem_wait's NVML query of the same GPU, medians of --rounds rounds in one play, printed as ratios
   (issue 36's goal for the gate: under 0.2x of the drain's query).

Prints what it saw and PASS (exit 0) or FAIL (exit 1); ``SKIP: ...`` and exit 0 without a driver. Run it as
check_gpu_mem_wait.py is run (tests/gpu/README.md). It starts no GPU process and changes nothing on the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]
from tests.harness.playbook import run_playbook  # noqa: E402  pylint: disable=wrong-import-position

READ_ANSWERS = ("ok", "unsupported")
KERNEL_LOG_ANSWERS = ("read", "denied")


def skip(why: str) -> None:
    print(f"SKIP: {why}")
    sys.exit(0)


def find_driver() -> None:
    try:
        import pynvml  # pylint: disable=import-outside-toplevel
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            skip("NVML reports no GPU")
    except ImportError:
        skip(f"{sys.executable} has no pynvml")
    except Exception as exc:  # pylint: disable=broad-except  # NVMLError and its many subclasses
        skip(f"no usable NVIDIA driver here: {exc}")


def tasks(device: int, state_dir: str, rounds: int) -> list[dict]:
    """Per round: the drain's query (a GPU at any use passes at its first look), gpu_health, the gate (check mode)."""
    since = time.time() - 3600
    listed = []
    for number in range(rounds):
        listed += [
            {"name": f"query {number}", "gpuops.relaunch.gpu_mem_wait": {
                "devices": [str(device)], "max_used_percent": 100, "timeout": 60}},
            {"name": f"health {number}", "gpuops.relaunch.gpu_health": {"devices": [str(device)], "since": since}},
            {"name": f"gate {number}", "check_mode": True, "gpuops.relaunch.gpu_gate": {
                "devices": [str(device)], "since": since, "state_dir": state_dir}},
        ]
    return listed


def check_health(health: dict) -> list[str]:
    failures = []
    for gpu in health.get("gpus") or []:
        print(f"GPU {gpu.get('index')} {gpu.get('uuid')} {gpu.get('pci_bus_id')}: escalation {gpu.get('escalation')}, "
              f"healthy {gpu.get('healthy')}")
        for name, read in sorted((gpu.get("reads") or {}).items()):
            print(f"  {name}: {read}")
            if read.get("status") not in READ_ANSWERS:
                failures.append(f"GPU {gpu.get('index')}: the read {name} answered {read}")
        for finding in gpu.get("findings") or []:
            print(f"  finding: {finding}")
    if not health.get("gpus"):
        failures.append(f"gpu_health read no GPU: {health.get('msg')}")
    kernel_log = health.get("kernel_log") or {}
    print(f"kernel log: {kernel_log}")
    if kernel_log.get("status") not in KERNEL_LOG_ANSWERS:
        failures.append(f"the kernel log was {kernel_log.get('status')}: {kernel_log.get('why')}")
    return failures


def check_gate(health: dict, gate: dict) -> list[str]:
    print(f"gate (check mode): outcome {gate.get('outcome')}, escalation {gate.get('escalation')}: {gate.get('why')}")
    if health.get("healthy") and gate.get("outcome") != "launch":
        return [f"gpu_health found the GPU healthy, the gate said {gate.get('outcome')}: {gate.get('why')}"]
    if not health.get("healthy") and not gate.get("bad"):
        return ["gpu_health found a bad GPU, the gate names no evidence"]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    find_driver()
    with tempfile.TemporaryDirectory(prefix="gpuops-gpu-health-") as state_dir:
        play = [{"hosts": "localhost", "gather_facts": False,
                 "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
                 "tasks": tasks(args.device, state_dir, args.rounds)}]
        run = run_playbook(play)
    if run.rc != 0:
        print(run.stdout[-4000:], run.stderr[-2000:])
        return fail(["the play failed"])
    last = args.rounds - 1
    health, gate = run.result(f"health {last}"), run.result(f"gate {last}")
    failures = check_health(health) + check_gate(health, gate)
    elapsed = {kind: statistics.median(run.result(f"{kind} {number}")["elapsed"] for number in range(args.rounds))
               for kind in ("query", "health", "gate")}
    print(f"cost (module elapsed, medians of {args.rounds}): query {elapsed['query']:.3f} s, health "
          f"{elapsed['health']:.3f} s ({elapsed['health'] / elapsed['query']:.2f}x), gate {elapsed['gate']:.3f} s "
          f"({elapsed['gate'] / elapsed['query']:.2f}x the query)")
    return fail(failures) if failures else ok()


def fail(failures: list[str]) -> int:
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1


def ok() -> int:
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
