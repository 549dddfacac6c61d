"""zombie_reap through ansible-playbook on localhost, against real processes.

One playbook run covers the scenarios that need no special clean-up (each selects only its own
processes through a unique tag on their command lines); the frozen D-state case, bad input and the
recycled pid have tests of their own. The namespace container is in test_zombie_reap_pidns.py, the
role in test_zombie_reap_role.py.

Each job is started the way a supervisor starts one: under a parent that reaps it (a small ``sh``),
in that parent's process group. The tag reaches the job's command line through the environment, so
the ``sh`` itself does not match the job and is an outsider sharing the job's process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.harness.pidns import process_starttime
from tests.harness.playbook import REPO, run_playbook
from tests.harness.procstates import (
    PLAIN_ZOMBIE,
    PYTHON,
    SLEEPER,
    STALE_JOB,
    ZOMBIE_LEADER,
    Reaper,
    state_of,
    wait_until,
)

# A supervisor-like parent: starts "$@" with the tag appended, waits for it, and (optionally) a
# look-alike decoy in the same process group that it does not wait for.
SUPERVISED = '"$@" "$GPUOPS_TAG" & job=$!; if [ -n "$GPUOPS_DECOY" ]; then ' \
             f'{PYTHON} -c "import time; time.sleep(3600)" "$GPUOPS_DECOY" >/dev/null 2>&1 & fi; wait $job'
# A job whose SIGTERM handler forks a child (a "checkpoint writer") that outlives it: the child did
# not exist at the snapshot, so only a second look finds it.
FORKS_ON_TERM = r"""
import os, signal, time
def on_term(signum, frame):
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(3600)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
print(f"pid={os.getpid()}", flush=True)
while True:
    time.sleep(3600)
"""
FAST = {"term_timeout": 3, "kill_timeout": 3, "reap_timeout": 5, "d_state_timeout": 2}


def supervised(tag: str, decoy: str = "") -> list[str]:
    return ["env", f"GPUOPS_TAG={tag}", f"GPUOPS_DECOY={decoy}", "/bin/sh", "-c", SUPERVISED, "sh"]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text(encoding="utf-8").split()]
    except OSError:
        return []


def tree(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        pending.extend(children(current))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def identities(pids) -> dict[int, int]:
    """pid -> starttime now, for the pids that exist."""
    return {pid: st for pid in pids if (st := process_starttime(pid)) is not None}


def still_same(identity: dict[int, int]) -> set[int]:
    """The pids of `identity` that are still the very same process (and not a zombie)."""
    return {pid for pid, st in identity.items() if process_starttime(pid) == st and state_of(pid) != "Z"}


def gone_or_other(identity: dict[int, int]) -> bool:
    return all(process_starttime(pid) != st for pid, st in identity.items())


def reap_task(name: str, args: dict, **extra) -> dict:
    return {"name": name, "gpuops.relaunch.zombie_reap": dict(FAST, **args), **extra}


def play(tasks: list[dict], hosts: str = "all") -> list[dict]:
    return [{"name": "zombie_reap", "hosts": hosts, "gather_facts": False, "tasks": tasks}]


@pytest.fixture(name="local_inventory", scope="module")
def local_inventory_fixture(tmp_path_factory):
    inventory = tmp_path_factory.mktemp("inv") / "inventory"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={PYTHON}\n", encoding="utf-8")
    return str(inventory)


@pytest.fixture(name="reaper")
def reaper_fixture():
    reaper = Reaper()
    yield reaper
    reaper.cleanup()


class Scenarios:
    """The real processes of the combined run, and what the playbook returned for them."""


@pytest.fixture(name="localhost_run", scope="module")
def localhost_run_fixture(local_inventory):
    reaper = Reaper()
    base = f"/tmp/gpuops-reap-{uuid.uuid4().hex[:8]}"
    s = Scenarios()
    try:
        # A stale job tree, a look-alike in its own process group sharing the job's, and two
        # more look-alikes elsewhere: train_eval.py, and train.py in another directory.
        s.job_tag = f"{base}/run/train.py"
        s.match = [rf"{base}/run/train\.py\b"]
        fields = reaper.start(STALE_JOB, runner=supervised(s.job_tag, decoy=f"{base}/run/train_eval.py --shared"))
        s.supervisor = reaper.popens[-1].pid
        s.parent, s.zombie, s.orphan = int(fields["parent"]), int(fields["zombie"]), int(fields["orphan"])
        s.job = identities(tree(s.parent) + tree(s.orphan))
        wait_until(lambda: any("--shared" in cmdline(c) for c in children(s.supervisor)), what="the shared-group decoy")
        s.shared_decoy = [c for c in children(s.supervisor) if "--shared" in cmdline(c)][0]
        lookalikes = [reaper.start(SLEEPER, f"{base}/run/train_eval.py"), reaper.start(SLEEPER, f"{base}/other/train.py")]
        s.decoys = identities([s.shared_decoy] + [int(f["pid"]) for f in lookalikes])
        assert os.getpgid(s.shared_decoy) == os.getpgid(s.parent) == s.supervisor

        # A plain zombie whose parent is a job process.
        s.plain_tag = f"{base}/plain/train.py"
        fields = reaper.start(PLAIN_ZOMBIE, runner=supervised(s.plain_tag))
        s.plain_parent, s.plain_zombie = int(fields["parent"]), int(fields["zombie"])
        s.plain_supervisor = reaper.popens[-1].pid
        s.plain = identities([s.plain_parent, s.plain_zombie])

        # A Zl leader selected by pid alone; its parent (outside the job) never waits.
        fields = reaper.start(ZOMBIE_LEADER, "", runner=supervised(f"{base}/leader/train.py"))
        s.leader_parent, s.leader = int(fields["parent"]), int(fields["zombie"])
        s.leader_supervisor = reaper.popens[-1].pid
        s.leader_threads = [int(t) for t in os.listdir(f"/proc/{s.leader}/task")]
        assert state_of(s.leader) == "Z" and len(s.leader_threads) == 2

        # A plain zombie selected by pid, whose parent never waits and may not be ended.
        fields = reaper.start(PLAIN_ZOMBIE, runner=supervised(f"{base}/kept/train.py"))
        s.kept_parent, s.kept_zombie = int(fields["parent"]), int(fields["zombie"])
        s.kept = identities([s.kept_parent, s.kept_zombie])

        # A job that forks while it is being ended.
        s.forking_tag = f"{base}/forking/train.py"
        s.forking = int(reaper.start(FORKS_ON_TERM, runner=supervised(s.forking_tag))["pid"])
        s.forking_supervisor = reaper.popens[-1].pid

        s.run = run_playbook(play([
            reap_task("plan only", {"match": s.match}, check_mode=True),
            reap_task("stale job", {"match": s.match}),
            reap_task("stale job again", {"match": s.match}),
            reap_task("plain zombie of a job parent", {"match": [rf"{base}/plain/train\.py\b"]}),
            reap_task("zombie leader by pid", {"pids": [s.leader], "reap_parents": True}),
            reap_task("zombie of a parent that may not be ended", {"pids": [s.kept_zombie], "reap_timeout": 1}),
            reap_task("job that forks while being ended", {"match": [rf"{base}/forking/train\.py\b"]}),
        ]), inventory=local_inventory)
        s.forking_left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if s.forking_tag in cmdline(pid)]
        s.decoys_after = still_same(s.decoys)
        s.kept_after = {pid: state_of(pid) for pid in s.kept}
        yield s
    finally:
        reaper.cleanup()


def result(s, name: str) -> dict:
    assert s.run.rc == 0, s.run.stdout[-4000:] + s.run.stderr[-4000:]
    return s.run.result(name)


def signalled(res: dict) -> list[tuple[str, int, str]]:
    return [(a["stage"], a["pid"], a["signal"]) for a in res["actions"] if a["result"] == "sent"]


def test_check_mode_prints_the_full_plan_and_signals_nothing(localhost_run):
    s = localhost_run
    plan = result(s, "plan only")
    assert plan["actions"] == [] and plan["signals_sent"] == 0
    assert plan["changed"] is True  # it would change something
    planned = {(step["stage"], step["pid"]) for step in plan["plan"]}
    live = {pid for pid in s.job if pid != s.zombie}
    assert {pid for stage, pid in planned if stage == "terminate"} == live
    assert {pid for stage, pid in planned if stage == "kill"} == live
    assert all(step["starttime"] == s.job[step["pid"]] for step in plan["plan"] if step["pid"] in s.job)
    # Nothing was signalled: the real run right after still found every job process running.
    real = result(s, "stale job")
    assert {e["pid"] for e in real["ended"] if e["was"] == "running"} == live


def test_stale_job_tree_is_ended_and_look_alikes_survive(localhost_run):
    s = localhost_run
    res = result(s, "stale job")
    assert res["changed"] is True
    assert res["escalation"] == "none", res["reasons"]
    assert {j["pid"] for j in res["job"]} == set(s.job)
    assert gone_or_other(s.job), {pid: state_of(pid) for pid in s.job}
    # Polite first: every live job process got SIGTERM, and SIGTERM was enough.
    assert {pid for stage, pid, sig in signalled(res) if stage == "terminate" and sig == "SIGTERM"} == set(s.job) - {s.zombie}
    assert not [a for a in res["actions"] if a["signal"] == "SIGKILL"]
    # Never the wrong process: not the look-alikes, not the process group they share, not the supervisor.
    assert s.decoys_after == set(s.decoys)
    assert not {a["pid"] for a in res["actions"]} & set(s.decoys)
    # The supervisor is the job's parent: at most asked to reap (it reaps on its own, so usually not even that).
    assert all(a["stage"] == "notify_parent" for a in res["actions"] if a["pid"] == s.supervisor)
    shared = [step for step in res["plan"] if step["stage"] == "terminate" and step["pid"] == s.parent][0]
    assert f"process group {s.supervisor}, which it shares with" in shared["reason"]
    assert "signalled alone, never as a group" in shared["reason"]


def test_second_run_changes_nothing(localhost_run):
    res = result(localhost_run, "stale job again")
    assert res["changed"] is False
    assert res["plan"] == [] and res["actions"] == []
    assert res["msg"].startswith("nothing to reap")


def test_plain_zombie_of_a_job_parent_is_reaped_by_ending_the_parent(localhost_run):
    s = localhost_run
    res = result(s, "plain zombie of a job parent")
    sent = signalled(res)
    assert [a for a in sent if a[0] != "notify_parent"] == [("terminate", s.plain_parent, "SIGTERM")]  # never the zombie
    # The ended parent is a zombie of its supervisor for a moment: at most that supervisor is asked
    # to reap it (on a busy machine the look after the stop may come before the supervisor's wait).
    assert all(a == ("notify_parent", s.plain_supervisor, "SIGCHLD") for a in sent if a[0] == "notify_parent")
    ended = {e["pid"]: (e["was"], e["now"]) for e in res["ended"] if e["pid"] != s.plain_supervisor}
    assert ended == {s.plain_parent: ("running", "gone"), s.plain_zombie: ("zombie", "gone")}
    assert gone_or_other(s.plain)
    assert res["changed"] is True and res["escalation"] == "none"


def test_zombie_leader_live_thread_is_ended_and_the_leader_reaped(localhost_run):
    s = localhost_run
    res = result(s, "zombie leader by pid")
    sent = signalled(res)
    assert sent[0] == ("kill_leader", s.leader, "SIGKILL")
    assert ("notify_parent", s.leader_parent, "SIGCHLD") in sent
    assert ("end_parent", s.leader_parent, "SIGTERM") in sent
    assert process_starttime(s.leader) is None or not os.path.exists(f"/proc/{s.leader}/task/{s.leader_threads[-1]}")
    ended = {e["pid"]: e["now"] for e in res["ended"]}
    assert ended[s.leader] == "gone" and s.leader_parent in ended
    assert s.leader_supervisor not in {a["pid"] for a in res["actions"]}
    assert res["escalation"] == "none" and res["remaining"] == []


def test_zombie_whose_parent_may_not_be_ended_is_reported_not_escalated(localhost_run):
    s = localhost_run
    res = result(s, "zombie of a parent that may not be ended")
    assert signalled(res) == [("notify_parent", s.kept_parent, "SIGCHLD")]
    assert res["changed"] is False  # a signal was sent, but nothing went away
    assert res["escalation"] == "none"
    (left,) = res["remaining"]
    assert left["pid"] == s.kept_zombie and left["state"] == "Z"
    assert "reap_parents: true would end that parent" in left["reason"]
    assert s.kept_after == {s.kept_parent: "S", s.kept_zombie: "Z"}


def test_frozen_task_escalates_to_host_action_naming_its_wchan(reaper, local_inventory):
    tag = f"/tmp/gpuops-reap-{uuid.uuid4().hex[:8]}/frozen/train.py"
    fields = reaper.start(SLEEPER, runner=supervised(tag))
    pid = int(fields["pid"])
    group = reaper.frozen(pid)
    wait_until(lambda: state_of(pid) == "D", what="the frozen task to be in D")
    args = {"match": [tag.replace(".", r"\.")], "term_timeout": 1, "kill_timeout": 1, "d_state_timeout": 2,
            "fail_on_escalation": True}
    run = run_playbook(play([reap_task("frozen", args, ignore_errors=True)]), inventory=local_inventory)
    res = run.result("frozen")
    assert res.get("failed") is True and res["msg"].startswith("ended 0 process(es) with 2 signal(s); escalation host_action: ")
    wchan = Path(f"/proc/{pid}/wchan").read_text(encoding="utf-8").strip()
    assert wchan and wchan != "0"
    assert res["escalation"] == "host_action"
    assert [(a["stage"], a["signal"]) for a in res["actions"]] == [("terminate", "SIGTERM"), ("kill", "SIGKILL")]
    (left,) = res["remaining"]
    assert left["pid"] == pid and left["state"] == "D"
    assert f"wchan {wchan}" in left["reason"] and f"pid {pid} thread {pid}" in res["reasons"][0]
    assert res["changed"] is False
    # The SIGKILL is pending, not lost: thawed, the task dies of it at once.
    reaper.thaw(group)
    wait_until(lambda: state_of(pid) in (None, "Z"), timeout=30, what="the thawed task to die of its pending SIGKILL")


BAD_INPUT = [
    ("unknown signal", {"term_signal": "SIGFOO"}, "term_signal: 'SIGFOO' is not a signal name"),
    ("signal that does not end", {"term_signal": "STOP"}, "term_signal: SIGSTOP does not end a process"),
    ("negative timeout", {"term_timeout": -1}, "term_timeout: must be at least 0 and at most 86400 seconds"),
    ("absurd timeout", {"d_state_timeout": 1e12}, "d_state_timeout: must be at least 0 and at most 86400 seconds"),
    ("NaN timeout", {"kill_timeout": "nan"}, "kill_timeout: must be a finite number of seconds"),
    ("infinite timeout", {"reap_timeout": "inf"}, "reap_timeout: must be a finite number of seconds"),
    ("bad match regex", {"match": ["train(.py"]}, "match: 'train(.py' is not a valid regular expression"),
    ("bad protected regex", {"protected": ["[sshd"]}, "protected: '[sshd' is not a valid regular expression"),
    ("non-positive pid", {"pids": [0]}, "pids: process IDs must be positive integers"),
    ("empty selection", {"match": [], "pids": []}, "match: is empty, and so is pids"),
    ("foreign proc root", {"proc_root": "/nonexistent"}, "proc_root: /nonexistent is not the process table"),
]


def test_bad_input_fails_clearly_and_signals_nothing(reaper, local_inventory):
    tag = f"/tmp/gpuops-reap-{uuid.uuid4().hex[:8]}/canary/train.py"
    canary = int(reaper.start(SLEEPER, tag)["pid"])
    canary_id = identities([canary])
    match = [tag.replace(".", r"\.")]
    tasks = [reap_task(name, dict({"match": match}, **args), ignore_errors=True) for name, args, _message in BAD_INPUT]
    tasks.append(reap_task("pids that do not exist", {"pids": [2**22 + 17, 2**22 + 19]}))
    everything = {"match": ["train(.py"], "protected": ["[sshd"], "pids": [0], "term_signal": "STOP",
                  "term_timeout": -1, "kill_timeout": "nan", "proc_root": "/nonexistent"}
    tasks.append(reap_task("every problem at once", everything, ignore_errors=True))
    run = run_playbook(play(tasks), inventory=local_inventory)
    at_once = run.result("every problem at once")
    assert at_once.get("failed") is True and at_once.get("changed") is False and "plan" not in at_once
    assert [p["option"] for p in at_once["option_problems"]] == [
        "pids", "match", "protected", "term_signal", "term_timeout", "kill_timeout", "proc_root"]
    assert all(f"{p['option']}: {p['reason']}" in at_once["msg"] for p in at_once["option_problems"])
    for name, _args, message in BAD_INPUT:
        res = run.result(name)
        assert res.get("failed") is True, (name, res)
        assert message in res["msg"], (name, res["msg"])
        assert "Traceback" not in json.dumps(res), name
        assert res.get("changed") is False
    missing = run.result("pids that do not exist")
    assert missing.get("failed") is not True and missing["changed"] is False
    assert missing["missing_pids"] == [2**22 + 17, 2**22 + 19]
    assert "do not exist" in missing["msg"] and missing["actions"] == []
    assert still_same(canary_id) == {canary}


RECYCLE = textwrap.dedent(r"""
    # Runs as PID 1 of a fresh PID namespace, where nobody else forks: ns_last_pid makes a new
    # process take exactly the pid of the one that just exited.
    import json, os, re, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.executor import (
        Executor, ProcessControl, snapshot_for_plan)
    from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.plan import ReapOptions, plan_reap
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import JobSelector

    SLEEP = [sys.executable, "-c", "import time; time.sleep(3600)", "/w/run/train.py"]
    options = ReapOptions(term_timeout=1, kill_timeout=1, reap_timeout=1, d_state_timeout=1)
    selector = JobSelector.from_options([r"/w/run/train\.py"], [], True)

    def plan_now():
        look = snapshot_for_plan("/proc", selector, ())
        return plan_reap(look.table, selector, look.protection, options), look.protection

    def started(argv):
        # Popen returns once the exec has begun; /proc/PID/cmdline stays empty until the new program's
        # arguments are in place (a busy machine shows that window), and a look in it matches nothing.
        proc = subprocess.Popen(argv)
        while not open(f"/proc/{proc.pid}/cmdline", "rb").read():
            time.sleep(0.001)
        return proc

    target = started(SLEEP)
    stale, protection = plan_now()
    (step,) = stale.stage("terminate")
    target.kill(); target.wait()
    # Start times count clock ticks: let one pass so the newcomer cannot share the target's.
    probe = [sys.executable, "-c", "print(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])"]
    while int(subprocess.run(probe, capture_output=True, text=True).stdout) <= step.target.starttime:
        pass
    with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
        handle.write(str(target.pid - 1))
    newcomer = started(SLEEP)  # the very same command line, the very same pid
    report = {"target": target.pid, "newcomer": newcomer.pid}
    for use_pidfd in (True, False):
        control = ProcessControl("/proc", use_pidfd=use_pidfd)
        report[f"gate pidfd={use_pidfd}"] = control.send(step.target, step.signal)
        outcome = Executor(stale, control, protection, options).run()
        report[f"ladder pidfd={use_pidfd}"] = [a.result for a in outcome.actions]
    report["newcomer_alive"] = newcomer.poll() is None
    fresh, protection = plan_now()  # the control: a plan of the newcomer itself does reach it
    Executor(fresh, ProcessControl("/proc"), protection, options).run()
    report["fresh_plan_ends_it"] = newcomer.wait(timeout=10) == -15
    print(json.dumps(report))
""")


def test_a_recycled_pid_is_never_signalled():
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", PYTHON, "-c", RECYCLE, str(REPO / ".build" / "collections")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["newcomer"] == report["target"]
    # The gate itself refuses (pidfd pinned, then start time checked; or start time re-read before kill)...
    assert report["gate pidfd=True"] == "recycled"
    assert report["gate pidfd=False"] == "recycled"
    # ...and the ladder does not even try: the process it planned for is no longer there.
    assert report["ladder pidfd=True"] == [] and report["ladder pidfd=False"] == []
    assert report["newcomer_alive"] is True
    assert report["fresh_plan_ends_it"] is True


def test_processes_forked_while_the_job_is_ended_get_a_second_round(localhost_run):
    s = localhost_run
    res = result(s, "job that forks while being ended")
    first = [step for step in res["plan"] if step["round"] == 1]
    second = [step for step in res["plan"] if step["round"] == 2]
    assert {step["pid"] for step in first if step["stage"] == "terminate"} == {s.forking}
    (late,) = {step["pid"] for step in second if step["stage"] == "terminate"}
    assert late != s.forking
    assert ("terminate", late, "SIGTERM") in signalled(res)
    # On a busy machine the ended job may still be a zombie of its supervisor at the next look: the
    # supervisor is then asked to reap it (and, its job gone, ends too). Nothing else is touched.
    assert {e["pid"] for e in res["ended"]} - {s.forking_supervisor} == {s.forking, late}
    assert all(a["stage"] == "notify_parent" for a in res["actions"] if a["pid"] == s.forking_supervisor)
    assert res["escalation"] == "none" and res["remaining"] == []
    assert s.forking_left == []
