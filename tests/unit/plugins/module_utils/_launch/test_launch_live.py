"""_launch/live.py: the node's live health - the same judgement as state=health, its file, its private copy.

Real files and real processes: the job's records in a directory of this test's, the log read by the
judgement's own code, the file written by the textfile writer, and the private copy run alone
(``python3 -I``, an empty environment) against a process this test started.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import live
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.health import iso, last_progress
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import install_supervisor, process_starttime
from tests.harness.procstates import wait_until

STEP = re.compile(r"^step (\d+) ")
NOW = 1796400000.0


def job_dir(tmp_path: Path, **live_settings) -> tuple[Path, Path, dict]:
    """A job's directory with launch.json and run.json of run r1 (a pid that is not running), its log, and
    node_exporter's directory."""
    directory = tmp_path / "job"
    directory.mkdir(mode=0o700)
    textfiles = tmp_path / "textfiles"
    textfiles.mkdir()
    log = tmp_path / "train.log"
    log.write_text("setting up\n", encoding="utf-8")
    launch = {"run_id": "r1", "log_path": str(log), "health": {"progress_regex": STEP.pattern, "stall_after": 60},
              "live": {"dir": str(textfiles), "job": "llm", "host": "node-1", **live_settings}}
    (directory / "launch.json").write_text(json.dumps(launch), encoding="utf-8")
    run = {"run_id": "r1", "pid": 999999, "starttime": 1, "started_at": iso(NOW - 100), "log_path": str(log)}
    (directory / "run.json").write_text(json.dumps(run), encoding="utf-8")
    return directory, textfiles, launch


def live_state(textfiles: Path) -> str | None:
    text = (textfiles / "gpuops_job_llm.prom").read_text(encoding="utf-8")
    found = re.findall(r'^gpuops_job_health\{gpuops_job="llm",gpuops_host="node-1",gpuops_rank0="node-1",gpuops_run="r1",state="(\w+)"\} 1$',
                       text, re.M)
    return found[0] if len(found) == 1 else None


@pytest.mark.parametrize(("stored", "label"), [({"rank0": "node-0"}, "node-0"), ({}, "node-1"), ({"rank0": 7}, "node-1")])
def test_every_series_names_the_jobs_rank_0_as_the_start_stored_it(tmp_path, stored, label) -> None:
    """A rank's live file names its job's rank 0 (the event path groups a job's alerts by it); a start that
    stored none (a job of one host, or one started before the label) or a broken one names the host."""
    directory, textfiles, launch = job_dir(tmp_path, **stored)
    (directory / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 0}))
    assert live.Monitor.of_launch(str(directory), launch, clock=lambda: NOW).refresh() == "finished"
    samples = [line for line in (textfiles / "gpuops_job_llm.prom").read_text(encoding="utf-8").splitlines()
               if line and not line.startswith("#")]
    assert samples and all(f'gpuops_rank0="{label}"' in line for line in samples), samples
    # And the run it judged: the next run's failure is another series, so another alert (extensions/eda).
    assert all('gpuops_run="r1"' in line for line in samples), samples


def test_reading_only_what_was_written_since_finds_what_a_full_scan_finds(tmp_path) -> None:
    """The node looks every few seconds and reads only the new bytes: over random appends (steps,
    chatter, lines cut in two, blank lines), its answer is the full scan's, every time."""
    chooser = random.Random(25)
    log = tmp_path / "log"
    log.write_bytes(b"")
    since = None
    for _look in range(300):
        with open(log, "ab") as out:
            for _piece in range(chooser.randint(0, 4)):
                out.write(chooser.choice([b"step %d loss 1\n" % chooser.randint(1, 99), b"chatter " * chooser.randint(1, 400)
                                          + b"\n", b"step 7", b" loss\n", b"\n  \n", b"x" * chooser.randint(1, 3000)]))
        # A small limit and chunk, so that the limit is passed and lines cross chunks often.
        full = last_progress(str(log), STEP, limit=4096, chunk=256)
        since = last_progress(str(log), STEP, limit=4096, chunk=256, since=since)
        assert (since.line, since.step, since.line_end, since.size) == (full.line, full.step, full.line_end, full.size)
        assert since.whole == full.whole


def test_a_log_replaced_or_cut_is_read_again_whole(tmp_path) -> None:
    log = tmp_path / "log"
    log.write_text("step 5 loss 1\n", encoding="utf-8")
    seen = last_progress(str(log), STEP)
    log.unlink()
    log.write_text("nothing yet\n", encoding="utf-8")  # a new file (a rotation): the old step is not its
    assert last_progress(str(log), STEP, since=seen).line is None
    seen = last_progress(str(log), STEP)
    log.write_text("step 1 loss 1\n", encoding="utf-8")  # cut and rewritten in place
    assert last_progress(str(log), STEP, since=seen).step == "1"


@pytest.mark.parametrize("stored, expect", [
    ({"health": {"progress_regex": "^step (\\d+) ", "stall_after": 30}}, ("^step (\\d+) ", 30.0)),
    ({"health": {"progress_regex": "^step", "stall_after": math.nan}}, ("^step", None)),
    ({"health": {"progress_regex": "^step", "stall_after": True}}, ("^step", None)),
    ({"health": {"progress_regex": "(", "stall_after": 30}}, (None, None)),
    ({"health": "^step"}, (None, None)),
    ({}, (None, None)),
    (None, (None, None)),
])
def test_the_stored_stall_rule_is_taken_only_where_it_is_sound(stored, expect) -> None:
    assert live.stall_rule(stored) == expect


@pytest.mark.parametrize("settings", [
    {"dir": "relative/dir", "job": "j", "host": "h"}, {"dir": "/d", "job": "", "host": "h"},
    {"dir": "/d", "job": "j"}, {"dir": ["/d"], "job": "j", "host": "h"}, "nonsense",
])
def test_live_settings_that_are_not_sound_keep_no_file(settings) -> None:
    assert live.settings_of({"run_id": "r", "live": settings}) is None
    assert live.Monitor.of_launch("/tmp/x", {"run_id": "r", "live": settings}) is None


def test_the_judgement_is_state_healths_on_the_same_records(tmp_path) -> None:
    directory, textfiles, launch = job_dir(tmp_path)
    settings = live.settings_of(launch)
    run = json.loads((directory / "run.json").read_text())
    log = Path(launch["log_path"])
    log.write_text("step 3 loss 1\n", encoding="utf-8")
    os.utime(log, (NOW - 10, NOW - 10))
    running = live.assess(str(directory), settings, run, alive=True, now=lambda: NOW)
    assert running.state.value == "running" and running.progress.step == "3"
    assert round(running.since_progress) == 10
    # The progress record is noted as the module notes it: a later look tells a stall behind chatter.
    noted = json.loads((directory / "progress.json").read_text())
    assert noted["run_id"] == "r1" and noted["step"] == "3" and noted["first_seen"] == NOW - 10
    stalled = live.assess(str(directory), settings, run, alive=True, now=lambda: NOW + 60)
    assert stalled.state.value == "stalled"
    (directory / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": None, "exit_signal": "SIGKILL"}))
    assert live.assess(str(directory), settings, run, alive=False, now=lambda: NOW).state.value == "crashed"
    (directory / "stop.json").write_text(json.dumps({"run_id": "r1", "health": "running"}))
    assert live.assess(str(directory), settings, run, alive=False, now=lambda: NOW).state.value == "stopped"
    (directory / "exit.json").write_text(json.dumps({"run_id": "r0", "exit_code": 0}))  # another run's exit
    (directory / "stop.json").unlink()
    # Not alive, no exit record of its own (after the settle wait): missing.
    assert live.assess(str(directory), settings, run, alive=None, now=lambda: NOW).state.value == "missing"


def test_the_file_is_written_for_the_recorded_run_only_and_never_through_a_link(tmp_path) -> None:
    directory, textfiles, launch = job_dir(tmp_path)
    (directory / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": 0}))
    victim = tmp_path / "victim"
    victim.write_text("root's\n", encoding="utf-8")
    (textfiles / "gpuops_job_llm.prom").symlink_to(victim)
    monitor = live.Monitor.of_launch(str(directory), launch, clock=lambda: NOW)
    assert monitor.refresh() == "finished" and live_state(textfiles) == "finished"
    assert victim.read_text(encoding="utf-8") == "root's\n" and not (textfiles / "gpuops_job_llm.prom").is_symlink()
    assert monitor.finished() is True
    # Another run is recorded now (a stop and a start crossed): this monitor writes nothing more.
    (directory / "run.json").write_text(json.dumps({"run_id": "r2", "pid": 1, "starttime": 1}))
    (textfiles / "gpuops_job_llm.prom").unlink()
    assert monitor.refresh() is None and list(textfiles.iterdir()) == []
    assert monitor.finished() is True


def test_a_write_that_fails_never_raises_and_is_said_once(tmp_path) -> None:
    directory, textfiles, launch = job_dir(tmp_path, dir=str(tmp_path / "typo"))
    said: list[str] = []
    monitor = live.Monitor.of_launch(str(directory), launch, warn=said.append)
    assert monitor.refresh() is None and monitor.refresh() is None
    assert len(said) == 1 and "typo" in said[0] and "does not exist" in said[0]


def test_a_file_no_run_keeps_is_removed_and_a_link_there_is_not_followed(tmp_path) -> None:
    textfiles = tmp_path / "textfiles"
    textfiles.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("x", encoding="utf-8")
    (textfiles / "gpuops_job_llm.prom").symlink_to(victim)
    assert live.remove_live_file(str(textfiles / "gpuops_job_llm.prom")) is True
    assert victim.exists() and list(textfiles.iterdir()) == []
    assert live.remove_live_file(str(textfiles / "gpuops_job_llm.prom")) is False


def test_the_private_copy_watches_a_real_process_alone(tmp_path) -> None:
    """live.py watch from the job's directory, with -I and an empty environment: nothing but the copies."""
    directory, textfiles, launch = job_dir(tmp_path)
    # The newest complete checkpoint's step too, resolved by the copy of checkpoints.py (step 2: step 3 is torn).
    ckpt = tmp_path / "ckpt"
    for step in (1, 2, 3):
        (ckpt / f"step_{step}").mkdir(parents=True)
        if step < 3:
            (ckpt / f"step_{step}" / ".metadata").write_bytes(b"m")
    launch["checkpoint"] = {"dir": str(ckpt), "format": "dcp"}
    (directory / "launch.json").write_text(json.dumps(launch), encoding="utf-8")
    install_supervisor(str(directory))
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    watch = None
    try:
        run = {"run_id": "r1", "pid": job.pid, "starttime": process_starttime(job.pid),
               "started_at": iso(time.time()), "log_path": launch["log_path"]}
        (directory / "run.json").write_text(json.dumps(run), encoding="utf-8")
        watch = subprocess.Popen([sys.executable, "-I", str(directory / live.LIVE_FILE), "watch", str(directory), "r1"],
                                 env={}, cwd="/", stderr=subprocess.PIPE, text=True)
        wait_until(lambda: (textfiles / "gpuops_job_llm.prom").exists() and live_state(textfiles) == "running",
                   timeout=30, what="the copy to write running")
        assert re.search(r'^gpuops_job_checkpoint_step\{gpuops_job="llm",.*\} 2$',
                         (textfiles / "gpuops_job_llm.prom").read_text(encoding="utf-8"), re.M)
        job.kill()  # our own child
        job.wait()
        (directory / "exit.json").write_text(json.dumps({"run_id": "r1", "exit_code": None, "exit_signal": "SIGKILL"}))
        assert watch.wait(timeout=30) == 0, watch.stderr.read()
        assert live_state(textfiles) == "crashed"
    finally:
        for process in (job, watch):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_a_zombie_main_process_is_not_alive(tmp_path) -> None:
    """Under an init that never reaps, a killed job stays a zombie with its pid and start time."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        starttime = process_starttime(child.pid)
        run = {"pid": child.pid, "starttime": starttime}
        wait_until(lambda: Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                   what="the child a zombie")
        assert process_starttime(child.pid) == starttime  # the identity still matches...
        assert live._identity_alive(run) is False  # ...but it runs nothing
        assert live._identity_alive({"pid": os.getpid(), "starttime": process_starttime(os.getpid())}) is True
        assert live._identity_alive({"pid": os.getpid(), "starttime": 1}) is False
        assert live._identity_alive({"pid": True, "starttime": 1}) is False
    finally:
        child.wait()


@pytest.mark.parametrize("gpus, kept", [({"devices": ["0"], "nvml_path": None}, True), ({"devices": []}, False),
                                        (["0"], False), (None, False)])
def test_the_jobs_gpus_are_looked_at_only_where_the_start_named_some(gpus, kept) -> None:
    settings = live.settings_of({"run_id": "r", "live": {"dir": "/m", "job": "j", "host": "h", "gpus": gpus}})
    assert settings is not None and (settings.gpus is not None) == kept
