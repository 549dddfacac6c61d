"""playbooks/relaunch.yml with multi-rank jobs and a fleet, for real: several hosts in one run.

Each rank is an inventory host of its own (local connection, its own job name, state directory,
log and copy of the demo trainer, so one rank's clean-up selector never matches another rank's
processes). What is asserted is what the issue asks of a multi-rank job: every rank gets the rank
environment, a rank that cannot be made ready keeps every rank from launching, a rank whose launch
fails leaves no rank running, and an independent host of the same run relaunches regardless.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.harness.gpu_holder import sim_gpu
from tests.harness.launch_targets import end_recorded_runs
from tests.harness.playbook import REPO, run_playbook
from tests.harness.procstates import state_of, wait_until

PLAYBOOK = str(REPO / "playbooks" / "relaunch.yml")
SUMMARY = "Summarize"
RANKS = ["rank-a", "rank-b", "rank-c"]


# Each rank's complete checkpoints in RANKS' fleet (other callers' hosts get none).
CHECKPOINTS_COMPLETE = {"rank-a": (100, 200, 300), "rank-b": (100, 200), "rank-c": (100, 300)}


def host_vars(tmp_path: Path, host: str, ranks: list[str] | None) -> dict:
    files = tmp_path / host
    files.mkdir()
    script = files / "demo_train.py"
    shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", script)
    found = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "job_launch_name": f"ranks-{host}-{os.getpid()}",
        "job_launch_command": [sys.executable, str(script)],
        "job_launch_log_path": str(files / "logs" / "train.log"),
        "job_launch_state_dir": str(files / "state"),
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 0.5,
        "job_launch_startup_timeout": 60,
        "job_launch_term_timeout": 10,
        "process_cleanup_match": [f"{script}\\b".replace(".", "\\.")],
        "process_cleanup_term_timeout": 5,
        "gpu_drain_gpus_required": False,
        "gpu_drain_timeout": 20,
        "container_reset_allowed": False,
    }
    complete = None
    if ranks:
        found["job_launch_ranks"] = ranks
        # Each rank's checkpoints (the marker layout): every rank resumes the newest step complete on all of
        # them (100), not its own newest (a and c: 300, b: 200; b's 300 and c's 200 are torn).
        complete = CHECKPOINTS_COMPLETE.get(host)
    if ranks and complete is not None:
        for step in (100, 200, 300):
            (files / "ckpt" / f"run-{step}").mkdir(parents=True)
            if step in complete:
                (files / "ckpt" / f"run-{step}" / "COMPLETE").write_text("", encoding="utf-8")
        found["job_launch_checkpoint_dir"] = str(files / "ckpt")
        found["job_launch_checkpoint_format"] = "marker"
        found["job_launch_resume_args"] = ["--resume", "ckpt-{step}"]
    return found


@pytest.fixture(name="fleet")
def fleet_fixture(tmp_path):
    """Three ranks of one job and one independent host, all on this machine."""
    hosts = {host: host_vars(tmp_path, host, RANKS) for host in RANKS}
    hosts["rank-a"]["job_launch_master_addr"] = "10.0.0.1"
    hosts["solo"] = host_vars(tmp_path, "solo", None)
    inventory = tmp_path / "inventory.json"

    def write() -> str:
        inventory.write_text(json.dumps({"all": {"hosts": hosts}}), encoding="utf-8")
        return str(inventory)

    write()
    yield {"dir": tmp_path, "hosts": hosts, "write": write}
    for host, variables in hosts.items():
        state_dir = Path(variables["job_launch_state_dir"])
        if state_dir.is_dir():
            run_playbook([{"hosts": host, "gather_facts": False, "tasks": [{"name": "Stop", "gpuops.relaunch.train_launch": {
                "name": variables["job_launch_name"], "state": "stopped", "state_dir": str(state_dir)}}]}],
                inventory=write())
            end_recorded_runs(state_dir)


def relaunch(fleet, **extra) -> tuple[object, dict]:
    run = run_playbook(PLAYBOOK, inventory=fleet["write"](), env={"ANSIBLE_SHOW_CUSTOM_STATS": "1"},
                       extra_vars={"relaunch_summary_dir": str(fleet["dir"]), **extra})
    fleet_summary = json.loads((fleet["dir"] / "fleet.json").read_text(encoding="utf-8"))
    return run, fleet_summary


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def job_pid(fleet, host: str) -> int | None:
    """The pid of the host's running job as its run record says (None when none runs)."""
    variables = fleet["hosts"][host]
    record = Path(variables["job_launch_state_dir"]) / variables["job_launch_name"] / "run.json"
    try:
        pid = json.loads(record.read_text(encoding="utf-8"))["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return pid if state_of(pid) not in (None, "Z") else None


def started(fleet, hosts: list[str]) -> dict[str, int | None]:
    return {host: job_pid(fleet, host) for host in hosts}


def gone(before: dict[str, int | None]) -> None:
    for host, pid in before.items():
        wait_until(lambda p=pid: state_of(p) is None, what=f"{host}'s old job to be gone")


def messages(run) -> str:
    return " ".join(json.dumps(results) for results in run.tasks.values())


# One scenario, run by run, because each run starts from what the last one left (and every run of
# four hosts costs real seconds): launch, nothing to do, one rank must relaunch, one rank cannot be
# made ready, one rank's launch fails, one rank's GPU is bad.
def test_a_multi_rank_job_is_relaunched_as_one_job_and_never_leaves_a_rank_alone(fleet):
    commands = {host: list(fleet["hosts"][host]["job_launch_command"]) for host in RANKS}
    # 1. Every rank launches, each with its rank environment; the independent host too.
    run, summary = relaunch(fleet)
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
    for index, host in enumerate(RANKS):
        result = run.summary(host)
        assert result["relaunched"] is True and result["rank"]["index"] == index
        env = environ(int(result["job"]["pid"]))
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["NODE_RANK"], env["NNODES"]) == (
            "10.0.0.1", "29500", str(index), "3")
    job = summary["jobs"]["rank-a"]
    assert job["ranks"] == RANKS and job["relaunched"] == RANKS and job["failed"] == []
    assert summary["hosts"]["solo"]["status"] == "relaunched" and summary["hosts"]["solo"]["rank"] is None
    assert set(summary["hosts"]) == {*RANKS, "solo"} and summary["counts"]["relaunched"] == 4
    assert json.loads(run.stdout)["global_custom_stats"]["relaunch_fleet"]["counts"] == summary["counts"]

    # 2. Nothing to do: nothing changes.
    again, quiet = relaunch(fleet)
    assert again.rc == 0
    assert quiet["counts"] == {"relaunched": 0, "unchanged": 4, "refused": 0, "failed": 0, "would_relaunch": 0}
    assert [name for name, hosts in again.tasks.items() if any(h.get("changed") for h in hosts)] == []

    # 3. rank-b must be relaunched (its spec changed), so every rank is: the others would wait at a
    #    rendezvous the new rank-b never joins. Not after a failure: nobody resumes. The independent
    #    host is left alone.
    before = started(fleet, RANKS)
    fleet["hosts"]["rank-b"]["job_launch_command"] = fleet["hosts"]["rank-b"]["job_launch_command"] + [
        "--step-interval", "0.2", "--crash-at-step", "5"]
    run, summary = relaunch(fleet)
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert summary["jobs"]["rank-a"]["relaunched"] == RANKS and summary["hosts"]["solo"]["status"] == "unchanged"
    assert [run.summary(host)["resumed"] for host in RANKS] == [False] * 3
    assert run.summary("rank-a")["why"] == "relaunched with its job, because rank(s) rank-b must be"
    gone(before)
    # (rank-b's new run, proven started, crashes a second later: it is checked in 3b.)
    assert all(job_pid(fleet, host) not in (None, before[host]) for host in ("rank-a", "rank-c"))

    # 3b. rank-b crashes at step 5: every rank relaunches, and every rank resumes from the
    #     checkpoint (resume_args), not only the one that crashed.
    wait_until(lambda: job_pid(fleet, "rank-b") is None, what="rank-b to crash")
    run, summary = relaunch(fleet)
    assert run.rc == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert run.summary("rank-b")["health"]["state"] == "crashed"
    assert [run.summary(host)["resumed"] for host in RANKS] == [True] * 3
    assert all(b"ckpt-100" in Path(f"/proc/{job_pid(fleet, host)}/cmdline").read_bytes() for host in ("rank-a", "rank-c"))
    assert [run.summary(host)["checkpoint"]["step"] for host in RANKS] == [100] * 3

    # 4. rank-c cannot be made ready (its state directory is a file: its stop fails). No rank
    #    launches; the independent host, forced too, relaunches all the same.
    before = started(fleet, [*RANKS, "solo"])
    blocked = fleet["dir"] / "blocked-state"
    blocked.write_text("not a directory\n", encoding="utf-8")
    rank_c_state = fleet["hosts"]["rank-c"]["job_launch_state_dir"]
    fleet["hosts"]["rank-c"]["job_launch_state_dir"] = str(blocked)
    run, summary = relaunch(fleet, relaunch_force=True, relaunch_hosts="all")
    fleet["hosts"]["rank-c"]["job_launch_state_dir"] = rank_c_state
    assert run.rc != 0
    gone({host: before[host] for host in ("rank-a", "rank-b")})
    assert job_pid(fleet, "rank-a") is None and job_pid(fleet, "rank-b") is None, "a rank launched alone"
    assert [summary["hosts"][host]["status"] for host in RANKS] == ["failed"] * 3
    assert summary["jobs"]["rank-a"]["relaunched"] == [] and summary["jobs"]["rank-a"]["failed"] == RANKS
    assert "rank(s) rank-c could not be made ready" in messages(run)
    assert summary["hosts"]["solo"]["status"] == "relaunched"
    assert job_pid(fleet, "solo") not in (None, before["solo"])

    # 5. rank-c is usable again (its old job still runs: it was never stopped), but rank-b's new
    #    spec ends before it is ready. Ranks that started are stopped again: none is left running.
    before = started(fleet, ["rank-c"])
    fleet["hosts"]["rank-b"]["job_launch_command"] = fleet["hosts"]["rank-b"]["job_launch_command"] + [
        "--ready-after", "5", "--exit-after", "0.2", "--exit-code", "3"]
    run, summary = relaunch(fleet)
    assert run.rc != 0
    gone(before)
    assert [job_pid(fleet, host) for host in RANKS] == [None] * 3, "a rank was left running"
    assert [summary["hosts"][host]["status"] for host in RANKS] == ["failed"] * 3
    assert "rank(s) rank-b did not start" in messages(run)

    # 6. Every rank has a GPU now (the simulated NVML), and rank-b's GPU fell off the bus (NVML error 15): the
    #    GPU gate refuses rank-b after its drain, and no rank launches, though rank-a and rank-c are healthy and
    #    their specs are good again. rank-b is refused with the evidence; the others fail naming it.
    started_at = time.time()
    with ExitStack() as stack:
        for number, host in enumerate(RANKS):
            gpu = stack.enter_context(sim_gpu(devices=1))
            # Buses no other test writes XID lines for; the cut-off is this step's start.
            gpu.devices[0]["pci_bus_id"] = f"00000000:{0xD0 + number:02X}:00.0"
            gpu.devices[0]["lost"] = host == "rank-b"
            gpu.save()
            fleet["hosts"][host].update(
                job_launch_command=commands[host], gpu_drain_gpus_required=True, gpu_drain_environment=gpu.env(),
                relaunch_gpu_xid_since=started_at, relaunch_gpu_kernel_log=False, job_launch_max_relaunches=20)
        run, summary = relaunch(fleet)
    assert run.rc != 0
    assert [job_pid(fleet, host) for host in RANKS] == [None] * 3, "a rank launched without rank-b"
    refused = run.summary("rank-b")
    assert summary["hosts"]["rank-b"]["status"] == "refused" and refused["gpu_gate"]["escalation"] == "host_reboot", refused
    assert [summary["hosts"][host]["status"] for host in ("rank-a", "rank-c")] == ["failed"] * 2
    assert all(run.summary(host)["gpu_gate"]["outcome"] == "launch" for host in ("rank-a", "rank-c"))
    assert "rank(s) rank-b could not be made ready" in messages(run)


def test_ranks_split_by_the_limit_are_refused_before_anything_changes(fleet):
    run = run_playbook(PLAYBOOK, inventory=fleet["write"](), extra_vars={"relaunch_hosts": "rank-a:rank-b"})
    assert run.rc != 0
    # Refused at the decision; the playbook fails the hosts after the fleet summary, with the decision's message.
    failed = run.tasks["Fail this host when a step failed or the crash-loop guard refused"]
    assert {entry["_host"] for entry in failed if entry.get("failed")} == {"rank-a", "rank-b"}
    assert "rank(s) rank-c are not in this run" in failed[0]["msg"]
    for host in RANKS:
        assert not Path(fleet["hosts"][host]["job_launch_state_dir"]).exists()
