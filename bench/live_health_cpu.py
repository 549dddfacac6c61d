"""Benchmark: what the node's live health costs per job, as a fraction of one core.

train_launch's metrics_dir has the node keep the job's textfile current (plugins/module_utils/_launch/live.py):
the supervisor beside its wait, or the systemd backend's live unit (``live.py watch``). This runs both the
way the module installs them (the private copies in a job directory, ``python3 -I``), for a real job that
prints a progress line every second into a log that already holds 8 MiB of other output, and measures
the CPU time of the node-side process only (utime + stime of its own /proc/PID/stat, not the job's),
divided by the wall time:

* supervisor: the supervisor of a job with a live file, against the same supervisor without one (the
  difference is what the live file costs);
* systemd: ``live.py watch`` for the same job, on its own (as its unit runs it);
* GPUs: the supervisor with a live file that also reports 8 simulated GPUs (train_launch's metrics_gpus),
  counting the short-lived NVML children it reaps too (cutime + cstime): what the GPU look adds.

Nothing here needs root or systemd. Target: under 1 % of one core per job.

    .venv/bin/python bench/live_health_cpu.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]

# pylint: disable=wrong-import-position
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import install_supervisor  # noqa: E402
from tests.harness.gpu_holder import sim_gpu  # noqa: E402

JOB = ("import sys, time\n"
       "step = 0\n"
       "while True:\n"
       "    step += 1\n"
       "    print(sys.argv[1] % step, flush=True)\n"
       "    time.sleep(1)\n")
STEP_LINE = "step %d loss 0.5"
# The worst case: no progress line in the log's last 8 MiB, so every look reads all of them.
OTHER_LINE = "warming up %d"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """utime + stime of `pid` itself; with `reaped_children`, of the children it reaped too (the job is
    its child but not reaped while it runs: what counts then is the GPU look's NVML children)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()
    return sum(int(fields[i]) for i in ((11, 12, 13, 14) if reaped_children else (11, 12))) / TICKS


def prepare(work: Path, name: str, live: bool, line: str = STEP_LINE, gpus: dict | None = None) -> tuple[Path, dict]:
    job_dir = work / name
    job_dir.mkdir(mode=0o700)
    install_supervisor(str(job_dir))
    log = work / f"{name}.log"
    with open(log, "w", encoding="utf-8") as out:
        filler = "data loader: worker prefetch 0123456789 abcdefghij\n"
        out.write(filler * (8 * 1024 * 1024 // len(filler)))
    metrics = work / "textfiles"
    metrics.mkdir(exist_ok=True)
    launch = {"run_id": uuid.uuid4().hex, "argv": [sys.executable, "-c", JOB, line], "env": {"PATH": "/usr/bin:/bin"},
              "chdir": None, "user": None, "group": None, "spec_hash": "bench", "log_path": str(log),
              "health": {"progress_regex": r"^step (\d+) ", "stall_after": 600}}
    if live:
        launch["live"] = {"dir": str(metrics), "job": name, "host": "bench-host"}
        if gpus:
            launch["live"]["gpus"] = gpus
    (job_dir / "launch.json").write_text(json.dumps(launch), encoding="utf-8")
    (job_dir / "launch.json").chmod(0o600)
    return job_dir, launch


def start_supervisor(job_dir: Path, launch: dict) -> subprocess.Popen:
    log = open(launch["log_path"], "a", encoding="utf-8")  # pylint: disable=consider-using-with
    return subprocess.Popen([sys.executable, "-I", str(job_dir / "supervisor.py"), "run", str(job_dir), "never"],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"},
                            start_new_session=True)


def measure(pid: int, seconds: float, reaped_children: bool = False) -> float:
    begin_cpu, begin = cpu_seconds(pid, reaped_children), time.monotonic()
    time.sleep(seconds)  # the measurement window itself
    return (cpu_seconds(pid, reaped_children) - begin_cpu) / (time.monotonic() - begin)


def job_pid(job_dir: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(json.loads((job_dir / "run.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    raise SystemExit(f"no run.json in {job_dir} within {timeout}s")


def end(process: subprocess.Popen, pid: int) -> None:
    """The job (its group) first, then its supervisor: only what this benchmark started, by its pids."""
    try:
        os.killpg(pid, 9)
    except OSError:
        pass
    process.terminate()
    process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuops-live-bench-"))
    try:
        figures = {}
        with sim_gpu(devices=8) as gpu:
            gpus = {"devices": [str(index) for index in range(8)], "nvml_path": str(gpu.pinned_bindings())}
            job_dir, launch = prepare(work, "gpus", True, STEP_LINE, gpus)
            supervisor = start_supervisor(job_dir, launch)
            pid = job_pid(job_dir)
            try:
                time.sleep(1)
                figures["gpus_base"] = measure(supervisor.pid, args.seconds, reaped_children=True)
            finally:
                end(supervisor, pid)
            written = (work / "textfiles" / "gpuops_job_gpus.prom").read_text(encoding="utf-8")
            assert 'escalation="none"} 1' in written, written
        for name, live, line in (("plain", False, STEP_LINE), ("live", True, STEP_LINE), ("worst", True, OTHER_LINE)):
            job_dir, launch = prepare(work, name, live, line)
            supervisor = start_supervisor(job_dir, launch)
            pid = job_pid(job_dir)
            try:
                time.sleep(1)  # past the start
                figures[name] = measure(supervisor.pid, args.seconds, reaped_children=name == "live")
                if name == "live":
                    watch = subprocess.Popen([sys.executable, "-I", str(job_dir / "live.py"), "watch", str(job_dir),
                                              launch["run_id"]], stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})
                    try:
                        time.sleep(1)
                        figures["watch"] = measure(watch.pid, args.seconds)
                    finally:
                        watch.terminate()
                        watch.wait(timeout=30)
                    written = (work / "textfiles" / "gpuops_job_live.prom").read_text(encoding="utf-8")
                    assert 'state="running"} 1' in written, written
            finally:
                end(supervisor, pid)
        print(f"live health CPU per job over {args.seconds:g}s, as a fraction of one core "
              "(progress line every 1 s, 8 MiB log):")
        print(f"  supervisor without a live file:   {figures['plain'] * 100:.3f} %")
        print(f"  supervisor with a live file:      {figures['live'] * 100:.3f} %"
              f"  (the live file: {max(figures['live'] - figures['plain'], 0) * 100:.3f} %)")
        print(f"  systemd live unit (live.py watch): {figures['watch'] * 100:.3f} %")
        print(f"  supervisor with a live file, no progress line in the last 8 MiB (worst case): {figures['worst'] * 100:.3f} %")
        print(f"  supervisor with a live file and 8 GPUs (metrics_gpus; NVML children included): {figures['gpus_base'] * 100:.3f} %"
              f"  (the GPU look: {max(figures['gpus_base'] - figures['live'], 0) * 100:.3f} %)")
        print(f"  (CPU time is counted in clock ticks of {1000 / TICKS:g} ms: one tick in {args.seconds:g}s is "
              f"{100 / TICKS / args.seconds:.3f} %)")
        worst = max(figures["live"], figures["watch"], figures["worst"], figures["gpus_base"])
        print(f"target under 1 %: {'met' if worst < 0.01 else 'NOT met'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
