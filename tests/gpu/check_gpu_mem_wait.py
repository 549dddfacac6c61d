"""Real-GPU check of gpuops.relaunch.gpu_mem_wait (run by hand on a machine with an NVIDIA GPU).

Not part of `make test` (pytest collects tests/unit and tests/integration only). On a machine
without an NVIDIA driver, or without PyTorch/CuPy, it prints SKIP and exits 0.

    .venv/bin/python tests/gpu/check_gpu_mem_wait.py [--device 0] [--mib 4096] [--holder-python PY]

1. Plain holder: a child process allocates --mib MiB of device memory (PyTorch, else CuPy) and
   sleeps. gpu_mem_wait starts waiting (through ansible-playbook against localhost); once it
   polls, the child is SIGKILLed. Printed: the release time (kill -> NVML shows the memory back,
   measured here by a 10 ms NVML poll) and the detection time (release -> ansible-playbook
   returned, an upper bound on the module's detection latency that includes Ansible's own exit).
2. Zl holder: the CUDA context and the allocation live on a thread that outlives the main thread
   (the main thread calls pthread_exit, the parent never waits: state Zl). gpu_mem_wait with a short
   timeout must fail naming the pid as a zombie leader; after SIGKILL ends the threads it must pass.

Finishes in well under 5 minutes (each step has its own deadline).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]

from tests.harness.playbook import run_playbook  # noqa: E402  pylint: disable=wrong-import-position

MODULE = "gpuops.relaunch.gpu_mem_wait"
MIB = 1024 * 1024

HOLDER = r"""
import ctypes, os, sys, threading, time
library, device, mib, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def allocate():
    if library == "torch":
        import torch
        buf = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{device}")
        buf.fill_(1)
        torch.cuda.synchronize(device)
    else:
        import cupy
        with cupy.cuda.Device(device):
            buf = cupy.ones(mib * 1024 * 1024, dtype=cupy.uint8)
            cupy.cuda.runtime.deviceSynchronize()
    return buf

if mode == "plain":
    kept = allocate()
    print("ready", os.getpid(), flush=True)
    while True:
        time.sleep(3600)

ready = threading.Event()
def hold():
    global kept
    kept = allocate()
    ready.set()
    while True:
        time.sleep(3600)
threading.Thread(target=hold, name="cuda-holder").start()
ready.wait()
print("ready", os.getpid(), flush=True)
# The main thread ends; the CUDA context lives on in the other thread (ctypes drops the GIL).
ctypes.CDLL(None).pthread_exit(None)
"""


def skip(reason: str) -> None:
    print(f"SKIP: {reason}")
    sys.exit(0)


class Nvml:
    """This script's own NVML view, for the reference measurements (not the module's)."""

    def __init__(self, device: int) -> None:
        import pynvml  # pylint: disable=import-outside-toplevel
        self.pynvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(device)

    def used_mib(self) -> float:
        try:
            memory = self.pynvml.nvmlDeviceGetMemoryInfo(self.handle, version=self.pynvml.nvmlMemory_v2)
        except (TypeError, AttributeError, self.pynvml.NVMLError):
            memory = self.pynvml.nvmlDeviceGetMemoryInfo(self.handle)
        return memory.used / MIB

    def pids(self) -> list[int]:
        return [p.pid for p in self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)]


def find_driver() -> None:
    try:
        import pynvml  # pylint: disable=import-outside-toplevel
    except ImportError:
        skip(f"{sys.executable} has no pynvml (pip install nvidia-ml-py, or run with .venv/bin/python)")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        skip(f"no usable NVIDIA driver here: {exc}")
    if count == 0:
        skip("NVML reports no GPU")


def holder_python(wanted: str | None) -> tuple[str, str]:
    candidates = [wanted] if wanted else [sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]
    for python in [c for c in candidates if c]:
        for library in ("torch", "cupy"):
            probe = subprocess.run([python, "-c", f"import {library}"], capture_output=True, check=False, timeout=120)
            if probe.returncode == 0:
                return python, library
    skip("neither PyTorch nor CuPy is importable (pass --holder-python)")
    raise AssertionError("unreachable")


def start_holder(python: str, library: str, device: int, mib: int, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [python, "-c", HOLDER, library, str(device), str(mib), mode],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=120)
    if not ready or not ready[0].startswith("ready"):
        proc.kill()
        raise SystemExit(f"FAIL: the {mode} holder did not allocate within 120 s")
    return proc


def wait_play(device: int, ceiling_mib: float, timeout: float) -> list[dict]:
    return [{
        "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"ansible_python_interpreter": sys.executable},
        "tasks": [{
            "name": "wait", MODULE: {"devices": [str(device)], "max_used_mib": ceiling_mib, "timeout": timeout,
                                     "poll_interval": 0.5},
            "ignore_errors": True,
        }],
    }]


def module_is_polling() -> bool:
    """Whether the module's NVML child (a fork of the module process) has loaded NVML."""
    modules = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"AnsiballZ_gpu_mem_wait" in (entry / "cmdline").read_bytes():
                    stat = (entry / "stat").read_text(encoding="utf-8")
                    modules[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except OSError:
                continue
    for pid, ppid in modules.items():
        if ppid in modules:
            try:
                maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8")
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            # A dry run of this script against the simulated driver (tests/harness/simnvml) loads no library.
            if "libnvidia-ml" in maps or b"GPUOPS_SIMNVML_STATE=" in environ:
                return True
    return False


def poll_until(condition, timeout: float, step: float = 0.01) -> float | None:
    """Monotonic time at which `condition` first held, or None at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(step)
    return None


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def check_plain(nvml: Nvml, python: str, library: str, device: int, mib: int) -> bool:
    baseline = nvml.used_mib()
    proc = start_holder(python, library, device, mib, "plain")
    try:
        held = nvml.used_mib()
        print(f"[plain] pid {proc.pid} holds {held - baseline:.0f} MiB on GPU {device} (baseline {baseline:.0f} MiB)")
        ceiling = baseline + 128
        result: dict = {}

        def playbook() -> None:
            result["run"] = run_playbook(wait_play(device, ceiling, timeout=120), timeout=240)
            result["returned"] = time.monotonic()
        player = threading.Thread(target=playbook)
        player.start()
        if poll_until(module_is_polling, timeout=120, step=0.05) is None:
            print("[plain] FAIL: gpu_mem_wait did not start polling")
            return False
        # NVML is loaded in the module's child; two poll intervals later it has looked at least once,
        # so the kill falls inside the wait (the module's polls count says so in the output).
        time.sleep(1.0)
        killed = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL)
        released = poll_until(lambda: nvml.used_mib() <= ceiling, timeout=120)
        player.join(timeout=240)
        task = result["run"].result("wait")
        if released is None or not task.get("released"):
            print(f"[plain] FAIL: not released: {task.get('msg')}")
            return False
        print(f"[plain] release time (kill -> NVML shows it free): {(released - killed) * 1000:.0f} ms")
        print(f"[plain] detection (release -> ansible-playbook returned, includes Ansible's exit): "
              f"{(result['returned'] - released) * 1000:.0f} ms; module elapsed={task['elapsed']}, "
              f"polls={task['polls']}, released_mib={task['released_mib']}")
        return True
    finally:
        end(proc)


def check_zombie_leader(nvml: Nvml, python: str, library: str, device: int, mib: int) -> bool:
    baseline = nvml.used_mib()
    proc = start_holder(python, library, device, mib, "zl")
    try:
        if poll_until(lambda: _state(proc.pid) == "Z", timeout=30) is None:
            print(f"[Zl] FAIL: holder {proc.pid} did not become a zombie leader (state {_state(proc.pid)})")
            return False
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        print(f"[Zl] pid {proc.pid} state Z with {threads} threads holds {nvml.used_mib() - baseline:.0f} MiB; "
              f"NVML lists {nvml.pids()}")
        ceiling = baseline + 128
        held = run_playbook(wait_play(device, ceiling, timeout=3), timeout=240).result("wait")
        kinds = {h["pid"]: h.get("kind") for h in held.get("holders", [])}
        ok = held.get("failed") and kinds.get(proc.pid) == "zombie_leader"
        print(f"[Zl] while its thread lives: failed={held.get('failed')} holders={kinds} -> {'OK' if ok else 'FAIL'}")
        print(f"[Zl] message: {held.get('msg')}")
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # ends the live threads; the leader stays a zombie
        released = poll_until(lambda: nvml.used_mib() <= ceiling, timeout=120)
        after = run_playbook(wait_play(device, ceiling, timeout=60), timeout=240).result("wait")
        print(f"[Zl] after SIGKILL: release time {((released or killed) - killed) * 1000:.0f} ms; "
              f"gpu_mem_wait released={after.get('released')} (state now {_state(proc.pid)})")
        return bool(ok and after.get("released"))
    finally:
        end(proc)


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def main() -> None:
    parser = argparse.ArgumentParser(description="gpu_mem_wait against a real CUDA allocation")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--mib", type=int, default=4096)
    parser.add_argument("--holder-python", default=None)
    args = parser.parse_args()
    find_driver()
    python, library = holder_python(args.holder_python)
    print(f"holder: {python} with {library}; module: {sys.executable}")
    nvml = Nvml(args.device)
    started = time.monotonic()
    results = [check_plain(nvml, python, library, args.device, args.mib),
               check_zombie_leader(nvml, python, library, args.device, args.mib)]
    print(f"done in {time.monotonic() - started:.0f} s: {'PASS' if all(results) else 'FAIL'}")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
