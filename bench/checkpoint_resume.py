"""Benchmark: resume from the newest complete checkpoint (issue 37).

* resolve: a checkpoint directory of 1,000 checkpoints, the newest 100 of them torn (the worst place
  for them: each is judged before the first complete one), laid out as torch.save files (small zips
  whose central directory is cut off) and as torch.distributed.checkpoint step directories (no
  ``.metadata``). Printed: the median time of ``checkpoints.resolve`` (what train_launch calls), of a
  walk forced through all 1,000 (the ranks' step is the oldest), and of a plain ``os.listdir`` of
  the same directory as the baseline. Goal (issue 37): resolve under 0.2 s.
* kills: the real job (tests/harness/ckpt_job.py: torch.save, and DCP from two ranks over gloo)
  SIGKILLed at a random moment once it has saved twice - the whole job at once, by the recorded pid
  of the init of its private PID namespace (``unshare --pid --fork``: the kernel ends every process of
  a namespace whose init dies) - then resolved with ``checkpoints.resolve`` and started again with
  ``--resume {checkpoint} --resume-step {step}`` filled in by ``checkpoints.resume_arguments`` (the
  very calls train_launch makes; Ansible is left out so that 50 trials a format fit in minutes; the
  tests run the same kills through train_launch). A trial resumed correctly when the job loaded that
  checkpoint and printed the step stored inside it, and (torch.save) it is the newest file torch.load
  itself can load. Printed per format: trials, kills that left a torn checkpoint, correct resumes.

    .venv/bin/python bench/checkpoint_resume.py [--trials 50] [--resolve-trials 15] [--seed N]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / ".build" / "collections"), str(REPO)]

# pylint: disable=wrong-import-position
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import checkpoints  # noqa: E402

JOB = str(REPO / "tests" / "harness" / "ckpt_job.py")
RESUMED = re.compile(r"^RESUMED step=(\d+) path=(\S+)$", re.MULTILINE)


def median_seconds(call, trials: int) -> float:
    times = []
    for _trial in range(trials):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def lay_out(directory: Path, fmt: str, count: int = 1000, torn: int = 100) -> None:
    directory.mkdir(parents=True)
    for step in range(1, count + 1):
        broken = step > count - torn
        if fmt == "torch_save":
            path = directory / f"model_{step}.pt"
            with zipfile.ZipFile(path, "w") as archive:
                archive.writestr("archive/data.pkl", b"x" * 512)
            if broken:
                data = path.read_bytes()
                path.write_bytes(data[: len(data) // 2])
        else:
            step_dir = directory / f"step_{step}"
            step_dir.mkdir()
            (step_dir / "__0_0.distcp").write_bytes(b"d" * 64)
            if not broken:
                (step_dir / ".metadata").write_bytes(b"m" * 64)


def resolve_figures(trials: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        for fmt in ("torch_save", "dcp"):
            directory = Path(work) / fmt
            lay_out(directory, fmt)
            found = checkpoints.resolve(str(directory))
            assert found.step == 900 and len(found.torn) == 100, found.as_dict()
            resolve = median_seconds(lambda: checkpoints.resolve(str(directory)), trials)
            full = median_seconds(lambda: checkpoints.resolve(str(directory), wanted_step=1), trials)
            listing = median_seconds(lambda: os.listdir(directory), trials)
            print(f"resolve {fmt:10s} 1,000 checkpoints (newest 100 torn): {resolve * 1000:7.2f} ms "
                  f"(walk through all 1,000: {full * 1000:7.2f} ms; os.listdir alone: {listing * 1000:6.2f} ms, "
                  f"ratio {resolve / listing:5.1f}x)  goal < 200 ms: {'met' if resolve < 0.2 else 'MISSED'}")


def _namespace_init(unshare_pid: int, deadline: float) -> int | None:
    """The host pid of the namespace's init (unshare's forked child), polled until it is there."""
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text(encoding="ascii").split()
        except OSError:
            return None
        if children:
            return int(children[0])
        time.sleep(0.01)
    return None


def run_job(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, JOB, *argv],  # pylint: disable=consider-using-with
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def end_job(process: subprocess.Popen) -> None:
    """SIGKILL the namespace's init by its recorded pid (every process of the namespace ends with it)."""
    init = _namespace_init(process.pid, time.monotonic() + 5)
    if init is not None:
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=60)


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def newest_loadable(directory: Path) -> int | None:
    import torch  # pylint: disable=import-outside-toplevel
    steps = []
    for path in directory.glob("model_*.pt"):
        try:
            steps.append(int(torch.load(path, weights_only=True)["step"]))
        except Exception:  # pylint: disable=broad-except
            continue
    return max(steps, default=None)


def kill_trial(fmt: str, rng: random.Random, work: Path) -> tuple[bool, bool, str]:
    """(a torn checkpoint was left, resumed correctly, what happened)."""
    directory = work / "ckpt"
    log = work / "train.log"
    base = ["--dir", str(directory), "--format", fmt, "--floats", str(1 << 22)]
    job = run_job(base, log)
    try:
        if not wait_for(lambda: re.search(r"^step [2-9]\d* saved", log.read_text(errors="replace"), re.M), 300):
            return False, False, "the job never saved twice"
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        end_job(job)
    found = checkpoints.resolve(str(directory), fmt)
    torn = bool(found.torn)
    if found.chosen is None:
        return torn, False, "no complete checkpoint found"
    truth = newest_loadable(directory) if fmt == "torch_save" else found.step
    args = checkpoints.resume_arguments(("--resume", "{checkpoint}", "--resume-step", "{step}"), found)
    resumed_log = work / "resumed.log"
    job = run_job([*base, *args], resumed_log)
    try:
        wait_for(lambda: RESUMED.search(resumed_log.read_text(errors="replace"))
                 or "RESUME FAILED" in resumed_log.read_text(errors="replace"), 300)
    finally:
        end_job(job)
    said = RESUMED.search(resumed_log.read_text(errors="replace"))
    correct = bool(said) and int(said.group(1)) == found.step == truth and said.group(2) == found.path
    return torn, correct, f"step {found.step}, torn {len(found.torn)}, job said {said.group(0) if said else 'nothing'}"


def kill_figures(trials: int, seed: int) -> None:
    rng = random.Random(seed)
    for fmt in ("torch_save", "dcp"):
        torn = correct = 0
        began = time.monotonic()
        for trial in range(trials):
            work = Path(tempfile.mkdtemp(prefix=f"gpuops-ckpt-bench-{fmt}-"))
            try:
                left_torn, right, what = kill_trial(fmt, rng, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            torn += left_torn
            correct += right
            if not right:
                print(f"  {fmt} trial {trial}: NOT resumed correctly: {what}")
        print(f"kills {fmt:10s}: {trials} trials (seed {seed}), {torn} left a torn checkpoint, {correct} resumed "
              f"correctly ({time.monotonic() - began:.0f} s)  goal: all")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=50, help="kill trials per format (issue 37: at least 50)")
    parser.add_argument("--resolve-trials", type=int, default=15)
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(1 << 30))
    args = parser.parse_args()
    resolve_figures(args.resolve_trials)
    if args.trials:
        kill_figures(args.trials, args.seed)


if __name__ == "__main__":
    main()
