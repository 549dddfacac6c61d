# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Real-GPU check: playbooks/relaunch.yml relaunches a job that holds GPU memory, waits for the
memory to come back, and writes the node_exporter textfile from what NVML saw.

1. A first relaunch on localhost launches a small "training job" (PyTorch, else CuPy) that takes
   --mib MiB on --device and prints a step line every second.
2. A forced relaunch (``relaunch_force=true --limit localhost``) stops it, waits with gpu_mem_wait
   (NVML, ``gpus_required``) until its memory is released, and launches it again.
3. NVML shows the first run's --mib MiB before, and the new run's after; the summary must say
   relaunched, with the drain's last look at the GPU showing the old run's memory gone before the
   launch; the metrics file must hold ``gpuops_gpu_memory_used_mib`` for the real GPU and
   ``gpuops_job_health{state="running"} 1``.
4. The job is stopped through train_launch (``state: stopped``); only what the check started ends.

Prints what it measured and PASS (exit 0) or FAIL (exit 1); ``SKIP: ...`` and exit 0 without a
driver or without PyTorch/CuPy. Run it as check_gpu_mem_wait.py is run (tests/gpu/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]
from tests.harness.playbook import run_playbook  # noqa: E402  pylint: disable=wrong-import-position

JOB = r"""
import signal, sys, time
library, device, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if library == "torch":
    import torch
    held = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize()
else:
    import cupy
    with cupy.cuda.Device(device):
        held = cupy.empty(mib * 1024 * 1024, dtype=cupy.uint8)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
step = 0
while True:
    step += 1
    print(f"step {step} loss={1.0 / step:.4f}", flush=True)
    time.sleep(1)
"""


def skip(why: str) -> None:
    print(f"SKIP: {why}")
    sys.exit(0)


def library_of(python: str) -> str:
    for library in ("torch", "cupy"):
        probe = subprocess.run([python, "-c", f"import {library}"], capture_output=True, check=False, timeout=120)
        if probe.returncode == 0:
            return library
    skip(f"{python} can import neither PyTorch nor CuPy")
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--mib", type=int, default=4096)
    args = parser.parse_args()
    try:
        import pynvml  # pylint: disable=import-outside-toplevel
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            skip("NVML reports no GPU")
    except ImportError:
        skip(f"{sys.executable} has no pynvml")
    except Exception as exc:  # pylint: disable=broad-except  # NVMLError and its many subclasses
        skip(f"no usable NVIDIA driver here: {exc}")
    library = library_of(sys.executable)

    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpuops-gpu-relaunch-") as tmp:
        work = Path(tmp)
        job_file = work / "gpu_job.py"
        job_file.write_text(JOB, encoding="utf-8")
        (work / "metrics").mkdir()
        host = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "job_launch_name": "gpu-check",
            "job_launch_command": [sys.executable, str(job_file), library, str(args.device), str(args.mib)],
            # The driver's libraries where this machine finds them (a job starts with a clean environment).
            "job_launch_env": {k: os.environ[k] for k in ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "PATH")
                               if k in os.environ},
            "job_launch_log_path": str(work / "train.log"),
            "job_launch_state_dir": str(work / "state"),
            "job_launch_ready_regex": "^step 1 ",
            "job_launch_min_uptime": 1,
            "job_launch_startup_timeout": 120,
            "process_cleanup_match": [re.escape(str(job_file)) + r"\b"],
            "gpu_drain_gpus_required": True,
            "gpu_drain_devices": [args.device],
            "gpu_drain_timeout": 60,
            "container_reset_allowed": False,
            "relaunch_metrics_dir": str(work / "metrics"),
            "relaunch_summary_dir": str(work / "summary"),
        }
        inventory = work / "inventory.json"
        inventory.write_text(json.dumps({"all": {"hosts": {"localhost": host}}}), encoding="utf-8")
        relaunch = str(REPO / "playbooks" / "relaunch.yml")
        try:
            first = run_playbook(relaunch, inventory=str(inventory))
            if first.rc != 0:
                print(first.stdout[-4000:], first.stderr[-2000:])
                return fail(["the first relaunch failed"])
            launched = json.loads((work / "summary" / "localhost@gpu-check.json").read_text(encoding="utf-8"))
            print(f"first relaunch: {launched['status']}, pid {launched['job']['pid']}, seconds {launched['seconds']}")
            held_before = used_mib(args.device)
            print(f"NVML before the forced relaunch: {held_before:.0f} MiB used on GPU {args.device}")
            if held_before < args.mib * 0.9:
                failures.append(f"the first run does not hold its {args.mib} MiB")
            forced = run_playbook(relaunch, inventory=str(inventory), extra_vars={"relaunch_force": True},
                                  extra_args=["--limit", "localhost"])
            if forced.rc != 0:
                print(forced.stdout[-4000:], forced.stderr[-2000:])
                return fail(["the forced relaunch failed"])
            summary = json.loads((work / "summary" / "localhost@gpu-check.json").read_text(encoding="utf-8"))
            print(f"forced relaunch: {summary['status']}, pid {summary['job']['pid']}, seconds {summary['seconds']}, "
                  f"released {summary['gpu_released_mib']} MiB, gpus {summary['gpus']}")
            if summary["status"] != "relaunched" or summary["job"]["pid"] == launched["job"]["pid"]:
                failures.append("the forced relaunch did not start a new run")
            # The stop waits for the old run's whole tree to be gone, and the driver frees a context
            # when its process ends, so the drain usually finds the memory free at its first look:
            # what matters is that it saw it free before the launch, and that the new run holds it.
            drained = [gpu["used_mib"] for gpu in summary["gpus"] if gpu["index"] == args.device]
            if not summary["gpu_released"] or not drained or drained[0] > args.mib * 0.1:
                failures.append(f"the drain did not see the old run's {args.mib} MiB gone before the launch: {drained}")
            held_after = used_mib(args.device)
            print(f"NVML after the forced relaunch: {held_after:.0f} MiB used (the new run)")
            if held_after < args.mib * 0.9:
                failures.append(f"the new run does not hold its {args.mib} MiB")
            text = (work / "metrics" / "gpuops_relaunch_gpu-check.prom").read_text(encoding="utf-8")
            print("metrics file:\n" + "\n".join(line for line in text.splitlines() if not line.startswith("#")))
            used = re.findall(r'^gpuops_gpu_memory_used_mib\{[^}]*gpu="%d"[^}]*\} (\S+)$' % args.device, text, re.M)
            if not used:
                failures.append("no gpuops_gpu_memory_used_mib sample for the GPU")
            if not re.search(r'^gpuops_job_health\{[^}]*state="running"[^}]*\} 1$', text, re.M):
                failures.append('gpuops_job_health{state="running"} is not 1')
        finally:
            stopped = run_playbook([{"hosts": "localhost", "gather_facts": False, "tasks": [{
                "name": "Stop the check's job", "gpuops.relaunch.train_launch": {
                    "name": "gpu-check", "state": "stopped", "state_dir": str(work / "state")}}]}],
                inventory=str(inventory))
            if stopped.rc != 0:
                failures.append("stopping the check's job failed: " + stopped.stdout[-1000:])
    return fail(failures) if failures else ok()


def used_mib(device: int) -> float:
    import pynvml  # pylint: disable=import-outside-toplevel
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device)).used / (1024 * 1024)


def fail(failures: list[str]) -> int:
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1


def ok() -> int:
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
