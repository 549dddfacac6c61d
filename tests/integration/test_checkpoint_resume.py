"""Resume from the newest complete checkpoint, with real PyTorch saves SIGKILLed at random moments.

The job (tests/harness/ckpt_job.py) trains on the CPU and saves after every step - with torch.save, and
with torch.distributed.checkpoint from two ranks over gloo - under the real train_launch, inside a PID
namespace. The test SIGKILLs every process of the job (by the pids it reads there, nothing by pattern)
at a random moment once a few saves are done, so most kills land during a save; the relaunch
(state=started: the job crashed, so it resumes) must pick a complete checkpoint, and the job loads it
and prints the step stored inside it. The seed of each trial is printed, to replay one.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness.launch_targets import Target, in_pid_namespace
from tests.harness.playbook import REPO
from tests.harness.procstates import wait_until

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

JOB = str(REPO / "tests" / "harness" / "ckpt_job.py")
RESUME_ARGS = ["--resume", "{checkpoint}", "--resume-step", "{step}"]
RESUMED = re.compile(r"^RESUMED step=(\d+) path=(\S+)$", re.MULTILINE)


@pytest.fixture(name="ns")
def ns_fixture(tmp_path):
    with in_pid_namespace(tmp_path) as where:
        yield where


def launch(target: Target, fmt: str, ckpt: Path, **options: Any) -> dict[str, Any]:
    # 16 MiB a save: the saves take most of each step.
    command = [sys.executable, JOB, "--tag", str(target.work), "--dir", str(ckpt), "--format", fmt, "--floats", str(1 << 22)]
    task = target.launch_task(task_name="t", command=command, checkpoint_dir=str(ckpt), resume_args=RESUME_ARGS,
                              progress_regex=r"^step (\d+) saved", ready_regex=r"^(step \d+ saved|RESUME)",
                              min_uptime=0.2, startup_timeout=240, **options)
    return target.play([task], timeout=400).result("t")


def kill_the_job(target: Target) -> list[int]:
    """SIGKILL every process of the job (the launcher and its ranks), each by the pid read inside the namespace."""
    killed = []
    for proc in target.processes().values():
        if target.mine(proc) and not proc.zombie:
            host_pid = target.host_pid(proc.pid)
            if host_pid is not None:
                os.kill(host_pid, signal.SIGKILL)
                killed.append(proc.pid)
    return killed


def log_text(target: Target) -> str:
    return Path(target.log()).read_text(encoding="utf-8", errors="replace")


def loadable_steps(ckpt: Path) -> list[int]:
    """The torch.save checkpoints torch itself loads, newest first: the truth the resolver is held to."""
    steps = []
    for path in ckpt.glob("model_*.pt"):
        try:
            steps.append(int(torch.load(path, weights_only=True)["step"]))
        except Exception:  # pylint: disable=broad-except
            continue
    return sorted(steps, reverse=True)


@pytest.mark.parametrize("fmt", ["torch_save", "dcp"])
def test_a_job_killed_during_its_saves_resumes_from_a_complete_checkpoint(ns: Target, fmt: str) -> None:
    seed = random.SystemRandom().randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    ckpt = ns.work / f"ckpt-{fmt}"
    first = launch(ns, fmt, ckpt)
    assert first.get("failed") is not True, first
    assert first["resumed"] is False and first["checkpoint"]["dir"] == str(ckpt)  # a first start never resumes
    # A few saves done, then a random moment: the saves take most of each step, so most kills land in one.
    wait_until(lambda: re.search(r"^step [3-9]\d* saved", log_text(ns), re.MULTILINE), timeout=240, what="three saves")
    time.sleep(rng.uniform(0.0, 0.8))
    assert kill_the_job(ns)
    wait_until(lambda: not [proc for proc in ns.processes().values() if ns.mine(proc) and not proc.zombie],
               timeout=30, what="the job's end")
    truth = loadable_steps(ckpt) if fmt == "torch_save" else None

    again = launch(ns, fmt, ckpt)
    assert again.get("failed") is not True, again
    found = again["checkpoint"]
    print(f"resumed {found['path']} (step {found['step']}); torn skipped: {found['torn']}")
    assert again["resumed"] is True and found["resumed"] is True and found["step"] is not None
    if truth is not None:
        assert found["step"] == truth[0], (found, truth)  # the newest torch itself can load
    for torn in found["torn"]:
        assert torn["step"] > found["step"]
    # The job loaded it and says which step was stored inside.
    said = wait_until(lambda: RESUMED.search(log_text(ns)) or ("RESUME FAILED" in log_text(ns) and "failed"),
                      timeout=240, what="the job's word on its resume")
    assert said != "failed", log_text(ns)[-3000:]
    assert int(said.group(1)) == found["step"] and said.group(2) == found["path"]
    kill_the_job(ns)


def test_nothing_complete_refuses_before_anything_changes_then_the_marker_resumes(ns: Target) -> None:
    """checkpoint_missing=refuse: a relaunch with no complete checkpoint fails in its check, before the stop;
    once one is complete (the custom marker layout), the start resumes from it with the path as an argument."""
    ckpt = ns.work / "ckpt-marker"
    (ckpt / "run-3").mkdir(parents=True)  # torn: no marker yet
    options = {"checkpoint_dir": str(ckpt), "checkpoint_format": "marker", "checkpoint_missing": "refuse",
               "resume_args": ["--resume", "{checkpoint}"], "min_uptime": 0.2}
    task = ns.launch_task(task_name="t", command=ns.demo("--crash-at-step", "2", "--step-interval", "0.2"), **options)
    first = ns.play([task]).result("t")
    assert first.get("failed") is not True and first["checkpoint"]["torn_skipped"] == 1, first
    health = dict(task, **{"gpuops.relaunch.train_launch": dict(task["gpuops.relaunch.train_launch"], state="health")})
    wait_until(lambda: ns.play([health]).result("t")["health"]["state"] == "crashed", timeout=60, what="the crash")
    refused = ns.play([task]).result("t")
    assert refused.get("failed") is True and "checkpoint_missing=refuse" in refused["msg"], refused
    assert refused["health"]["state"] == "crashed" and ns.read_state("job", "run.json")["run_id"] == first["run_id"]
    (ckpt / "run-1").mkdir()
    (ckpt / "run-1" / "COMPLETE").write_text("")
    again = ns.play([task]).result("t")
    assert again.get("failed") is not True and again["resumed"] is True, again
    assert again["checkpoint"]["path"] == str(ckpt / "run-1") and again["checkpoint"]["torn_skipped"] == 1
    wait_until(lambda: f"resuming from {ckpt / 'run-1'}" in log_text(ns), timeout=30, what="the job's word")
