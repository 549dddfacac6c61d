"""zombie_facts through ansible-playbook against real process states, on localhost and inside a
PID-namespace container whose init never reaps (reached with community.docker.nsenter)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import uuid

import pytest

from tests.harness.pidns import parent_pid, pid_namespace
from tests.harness.playbook import run_playbook
from tests.harness.procstates import (
    PLAIN_ZOMBIE,
    PYTHON,
    SLEEPER,
    STALE_JOB,
    ZOMBIE_LEADER,
    Reaper,
    host_pid,
    state_of,
    vfork_parent_program,
    wait_until,
)

TASK = "Gather zombie facts"


def facts_play(args: dict, hosts: str = "all") -> list[dict]:
    return [{
        "name": "zombie_facts",
        "hosts": hosts,
        "gather_facts": False,
        "tasks": [{"name": TASK, "gpuops.relaunch.zombie_facts": args}],
    }]


@pytest.fixture(name="reaper")
def reaper_fixture():
    reaper = Reaper()
    yield reaper
    reaper.cleanup()


@pytest.fixture(name="tag")
def tag_fixture():
    """A token on the command line of this test's processes only: the job selector matches it."""
    return f"gpuops-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture(name="local_inventory")
def local_inventory_fixture(tmp_path):
    inventory = tmp_path / "inventory"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={PYTHON}\n", encoding="utf-8")
    return str(inventory)


def gather(inventory: str, args: dict, check: bool = False) -> dict:
    run = run_playbook(facts_play(args), inventory=inventory, check=check)
    assert run.rc == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = run.result(TASK)
    assert result["changed"] is False
    return result["ansible_facts"]["zombie_facts"]


def by_pid(entries: list[dict]) -> dict[int, dict]:
    return {entry["pid"]: entry for entry in entries}


def test_stale_job_tree_on_localhost(reaper, tag, local_inventory):
    job = reaper.start(STALE_JOB, tag)
    parent, zombie, orphan = int(job["parent"]), int(job["zombie"]), int(job["orphan"])
    workers = [int(w) for w in job["workers"].split(",")]
    decoy = reaper.start(SLEEPER, tag.replace("gpuops-test", "gpuops-tesx"))

    # Orphans of other processes on this machine may pass through PID 1 meanwhile: the default
    # grace lets it reap them, so the verdict is about this test's processes.
    facts = gather(local_inventory, {"match": [tag]})

    job_pids = set(by_pid(facts["job_processes"]))
    assert {parent, zombie, *workers} <= job_pids
    assert int(decoy["pid"]) not in job_pids
    # The orphan double-forked out of the tree; its command line still names the job.
    assert orphan in job_pids
    entry = by_pid(facts["zombies"])[zombie]
    assert entry["kind"] == "zombie" and entry["blocking"] is True and entry["job"] is True
    assert entry["parent"]["pid"] == parent and entry["parent"]["job"] is True
    assert entry["parent_chain"][0] == parent
    assert facts["escalation"] == "signals"
    assert any(str(parent) in reason for reason in facts["reasons"])


def test_job_descendants_only_on_request(reaper, tag, local_inventory):
    job = reaper.start(STALE_JOB, tag)
    parent = int(job["parent"])
    facts = gather(local_inventory, {"pids": [parent], "include_descendants": False, "orphan_grace": 0})
    assert [p["pid"] for p in facts["job_processes"]] == [parent]
    facts = gather(local_inventory, {"pids": [parent], "orphan_grace": 0})
    assert set(int(w) for w in job["workers"].split(",")) < set(by_pid(facts["job_processes"]))


def test_zombie_leader_with_live_thread_holding_a_device(reaper, tag, local_inventory, tmp_path):
    # Stand-ins of the NVIDIA device files, real character nodes with the driver's numbers: GPU 0's
    # own (195:0) and /dev/nvidiactl (195:255), which every GPU user holds whatever its GPU.
    device, control = tmp_path / "nvidia0", tmp_path / "nvidiactl"
    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(195, 0))
    os.mknod(control, 0o600 | stat.S_IFCHR, os.makedev(195, 255))
    made = reaper.start(ZOMBIE_LEADER, str(device), tag)
    zombie = int(made["zombie"])
    # Another program's Zl whose live thread holds only /dev/nvidiactl: it holds no GPU.
    other = int(reaper.start(ZOMBIE_LEADER, str(control), tag.replace("gpuops-test", "gpuops-tesx"))["zombie"])

    facts = gather(local_inventory, {"match": [tag], "gpu_device_glob": str(tmp_path / "nvidia*")})

    entry = by_pid(facts["zombies"])[zombie]
    assert entry["kind"] == "zombie_leader"
    assert entry["threads"] == 2
    (thread,) = entry["live_threads"]
    assert thread["tid"] != zombie and thread["state"] in ("S", "R")
    holders = [h for h in facts["gpu_holders"] if h["pid"] == zombie]
    # The leader's own fd/ is empty; the device is found on the live thread.
    assert holders == [{"pid": zombie, "tid": thread["tid"], "comm": thread["comm"], "state": thread["state"], "device": str(device),
                        "device_number": "195:0"}]
    assert facts["escalation"] == "signals"
    entry = by_pid(facts["zombies"])[other]
    assert entry["kind"] == "zombie_leader" and entry["job"] is False and entry["blocking"] is False, entry
    assert [h for h in facts["gpu_holders"] if h["pid"] == other] == []


def test_frozen_task_is_uninterruptible(reaper, tag, local_inventory):
    sleeper = int(reaper.start(SLEEPER, tag)["pid"])
    reaper.frozen(sleeper)
    assert state_of(sleeper) == "D"
    os.kill(sleeper, signal.SIGKILL)  # pending until thawed: the task stays
    facts = gather(local_inventory, {"match": [tag]})
    (stuck,) = [u for u in facts["uninterruptible"] if u["pid"] == sleeper]
    assert stuck["tid"] == sleeper and stuck["wchan"]
    assert facts["escalation"] == "signals"  # not the GPU driver: it ends once it wakes
    assert any(f"{sleeper}/{sleeper}" in reason for reason in facts["reasons"])


def test_vfork_parent_is_uninterruptible(reaper, tag, local_inventory, tmp_path):
    made = reaper.start_program([vfork_parent_program(tmp_path), tag])
    parent, child = int(made["parent"]), int(made["child"])
    wait_until(lambda: state_of(parent) == "D", what="the vfork parent to sleep in D")
    facts = gather(local_inventory, {"match": [tag]})
    (stuck,) = [u for u in facts["uninterruptible"] if u["pid"] == parent]
    assert stuck["tid"] == parent and stuck["wchan"]
    job = by_pid(facts["job_processes"])
    assert job[parent]["state"] == "D" and job[child]["ppid"] == parent
    assert facts["escalation"] == "signals"  # a vfork wait is killable: not the GPU driver


def test_plain_zombie_of_someone_else_is_reported_but_not_blocking(reaper, tag, local_inventory):
    made = reaper.start(PLAIN_ZOMBIE, tag)
    zombie = int(made["zombie"])
    facts = gather(local_inventory, {"match": ["no-such-job-" + tag], "orphan_grace": 0})
    entry = by_pid(facts["zombies"])[zombie]
    assert entry["kind"] == "zombie" and entry["blocking"] is False
    # The verdict also covers the rest of this machine, which this test does not own.
    assert not any(str(zombie) in reason for reason in facts["reasons"])


def test_check_mode_reports_the_same(reaper, tag, local_inventory):
    job = reaper.start(STALE_JOB, tag)
    facts = gather(local_inventory, {"match": [tag], "orphan_grace": 0}, check=True)
    assert int(job["parent"]) in by_pid(facts["job_processes"])


def test_orphan_zombies_under_a_never_reaping_namespace_init(reaper, tag, tmp_path):
    with pid_namespace() as namespace:
        runner = ["nsenter", f"--target={namespace.init_pid}", "--pid", "--mount", "--"]
        made = reaper.start(PLAIN_ZOMBIE, tag, runner=runner)
        zombie_ns = int(made["zombie"])
        zombie_host = host_pid(namespace.init_pid, zombie_ns)
        parent_host = reaper.record(host_pid(namespace.init_pid, int(made["parent"])))
        reaper.kill(parent_host)
        # The zombie is handed to the namespace's init (`sleep`), which never reaps it.
        wait_until(lambda: parent_pid(zombie_host) == namespace.init_pid, what="the zombie to be orphaned to the init")

        inventory = namespace.write_inventory(tmp_path / "inventory")
        facts = gather(inventory, {"match": [tag], "orphan_grace": 1.0})

        entry = by_pid(facts["zombies"])[zombie_ns]  # pids as seen inside the namespace
        assert entry["parent"]["pid"] == 1 and entry["parent"]["is_namespace_init"] is True
        assert entry["parent"]["comm"] == "sleep"
        assert entry["unreaped_orphan"] is True and entry["blocking"] is True
        assert facts["escalation"] == "container_reboot"
        assert any(str(zombie_ns) in reason and "PID 1 (sleep)" in reason for reason in facts["reasons"])
        assert state_of(zombie_host) == "Z"  # gathering facts changed nothing


def test_orphan_zombie_reaped_by_host_init_is_not_a_reboot(reaper, tag, local_inventory):
    made = reaper.start(PLAIN_ZOMBIE, tag)
    zombie, parent = int(made["zombie"]), int(made["parent"])
    reaper.kill(parent)
    wait_until(lambda: state_of(parent) in (None, "Z") and parent_pid(zombie) != parent, what="the parent to die")
    # PID 1 of this machine reaps orphans, if about 1.5 s late: the module watches, not guesses.
    facts = gather(local_inventory, {"match": [tag], "orphan_grace": 10})
    assert facts["escalation"] != "container_reboot"
    assert zombie not in by_pid(facts["zombies"]) or by_pid(facts["zombies"])[zombie]["unreaped_orphan"] is False


BAD_INPUT = [
    ({"match": ["("]}, "match: '(' is not a valid regular expression"),
    ({"protected": ["[z-a]"]}, "protected: '[z-a]' is not a valid regular expression"),
    ({"pids": [-3]}, "pids: process IDs must be positive integers"),
    ({"orphan_grace": -1}, "orphan_grace: must be at least 0 and at most 600 seconds, got -1"),
    ({"orphan_grace": 1e12}, "orphan_grace: must be at least 0 and at most 600 seconds, got 1e+12"),
    ({"orphan_grace": "nan"}, "orphan_grace: must be a finite number of seconds, got nan"),
    ({"orphan_grace": "inf"}, "orphan_grace: must be a finite number of seconds, got inf"),
    ({"driver_wchan": "(("}, "driver_wchan"),
    ({"proc_root": "/nonexistent-proc"}, "proc_root: cannot list /nonexistent-proc"),
    ({"pids": ["abc"]}, "pids"),
]


def test_bad_input_fails_clearly(local_inventory):
    # One play, a task per case (ignore_errors): each case is a module run of its own, without an
    # ansible-playbook start for each.
    play = [{"name": "bad input", "hosts": "all", "gather_facts": False, "tasks": [
        {"name": f"bad {index}", "gpuops.relaunch.zombie_facts": args, "ignore_errors": True}
        for index, args in enumerate(args for args, _message in BAD_INPUT)]}]
    run = run_playbook(play, inventory=local_inventory)
    for index, (args, message) in enumerate(BAD_INPUT):
        result = run.result(f"bad {index}")
        assert result["failed"] is True, args
        assert message in result["msg"], (args, result["msg"])
        assert "Traceback" not in result.get("module_stderr", "") and "Traceback" not in result["msg"]


def test_every_bad_option_is_reported_in_one_failure(local_inventory):
    args = {"match": ["("], "protected": ["[z-a]"], "pids": [-3], "orphan_grace": "nan", "driver_wchan": "(("}
    result = run_playbook(facts_play(args), inventory=local_inventory).result(TASK)
    assert result["failed"] is True and "ansible_facts" not in result
    assert [p["option"] for p in result["option_problems"]] == ["pids", "match", "protected", "orphan_grace", "driver_wchan"]
    assert result["msg"].startswith("pids: process IDs must be positive integers, got [-3]; match: '(' is not a valid")


# A process chooses its comm and its arguments: as it names itself, they reach results and the
# operator's terminal. What a look reports of it is escaped (issue 17, item 7).
TERMINAL_ATTACK = "\x1b]0;owned\x07\x1b[2J\x9b31m"
NAMES_ITSELF = ("import ctypes, sys, time\n"
                "ctypes.CDLL(None).prctl(15, sys.argv[1].encode()[:15], 0, 0, 0)\n"
                "print('ready', flush=True)\n"
                "time.sleep(300)\n")


def test_what_a_process_writes_about_itself_is_reported_escaped(tag, local_inventory):
    proc = subprocess.Popen([PYTHON, "-c", NAMES_ITSELF, "\x1b]0;x\x07\x9b", TERMINAL_ATTACK, tag],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        run = run_playbook(facts_play({"match": [tag]}), inventory=local_inventory)
        assert run.rc == 0, run.stdout[-3000:] + run.stderr[-3000:]
        (entry,) = run.result(TASK)["ansible_facts"]["zombie_facts"]["job_processes"]
        assert entry["pid"] == proc.pid
        assert entry["comm"] == "\\x1b]0;x\\x07\\x9b"
        assert "\\x1b]0;owned\\x07\\x1b[2J\\x9b31m" in entry["cmdline"]
        for text in (run.stdout, run.stderr, json.dumps(entry, ensure_ascii=False)):
            assert not any(char in text for char in "\x1b\x07\x9b"), text[-2000:]
    finally:
        proc.kill()
        proc.wait()
