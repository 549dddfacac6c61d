"""zombie_reap's ``found`` (what the plan's own scan shows, judged as zombie_facts judges it) and
``left`` (one fresh scan after the ladder), on real processes in a private PID namespace, counting
the scans of /proc: one for the plan, one more per round of the ladder, none when there is nothing
to execute.

Each scenario runs as the child of PID 1 of a fresh PID namespace (``unshare --pid --fork
--mount-proc``); that PID 1 reaps every orphan, as a container's init does. Nothing outside the
namespace can be signalled, and ending PID 1 ends everything the scenario started.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.harness.playbook import REPO
from tests.harness.procstates import PYTHON

SCENARIO = textwrap.dedent(r"""
    import json, os, re, signal, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import procfs
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import JobSelector
    from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.executor import reap_job
    from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.plan import ReapOptions

    # The init of the namespace reaps every orphan; its only own child is the scenario.
    scenario_pid = os.fork()
    if scenario_pid:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                sys.exit(1)
            if pid == scenario_pid:
                sys.exit(os.waitstatus_to_exitcode(status))

    scans = []
    plain_scan = procfs.ProcessTable.scan.__func__

    def counted_scan(cls, proc_root="/proc"):
        scans.append(proc_root)
        return plain_scan(cls, proc_root)

    procfs.ProcessTable.scan = classmethod(counted_scan)

    def wait_for(condition, what):
        deadline = time.monotonic() + 20
        while not condition():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.02)

    def state(pid):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None

    OPTIONS = ReapOptions(term_timeout=2, kill_timeout=2, reap_timeout=2, d_state_timeout=1, orphan_grace=0.5)
    kind = sys.argv[2]
    # Put together here, so that the scenario's own command line does not match the job.
    FOREVER = "/w/" + "forever" + "/train.py"
    check_mode = sys.argv[3] == "check"
    if kind == "stale_zombie":
        # A parent that never waits (SIGCHLD ignored by handler, not SIG_IGN) with a dead child: the
        # zombie goes only when that parent is ended and PID 1 takes it.
        parent = subprocess.Popen([sys.executable, "-c",
                                   "import signal, subprocess, sys, time\n"
                                   "signal.signal(signal.SIGCHLD, lambda *a: None)\n"
                                   "child = subprocess.Popen(['true', '/w/stale/train.py'])\n"
                                   "print(child.pid, flush=True)\n"
                                   "time.sleep(3600)\n"], stdout=subprocess.PIPE, text=True)
        zombie = int(parent.stdout.readline())
        wait_for(lambda: state(zombie) == "Z", "the zombie")
        selector = JobSelector.from_options([], [zombie], True)
        options = ReapOptions(**dict(OPTIONS.__dict__, reap_parents=True))
        subject = {"zombie": zombie, "parent": parent.pid}
    else:
        # Every generation of this job forks the next one when asked to stop, and exits: after the
        # last round of the ladder one is still running.
        job = subprocess.Popen([sys.executable, "-c",
                                "import os, signal, time\n"
                                "def on_term(signum, frame):\n"
                                "    if os.fork() == 0:\n"
                                "        return\n"
                                "    os._exit(0)\n"
                                "signal.signal(signal.SIGTERM, on_term)\n"
                                "print(os.getpid(), flush=True)\n"
                                "while True:\n"
                                "    time.sleep(3600)\n", FOREVER], stdout=subprocess.PIPE, text=True)
        int(job.stdout.readline())
        selector = JobSelector.from_options([re.escape(FOREVER)], [], True)
        options = OPTIONS
        subject = {"first": job.pid}

    result = reap_job(selector, (), options, check_mode=check_mode)
    report = result.as_dict()
    survivors = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())
                 and state(int(p)) not in (None, "Z") and FOREVER in open(f"/proc/{p}/cmdline").read()]
    print(json.dumps({"scans": len(scans), "found": report["found"], "left": report["left"],
                      "escalation": report["escalation"], "reasons": report["reasons"], "findings": report["findings"],
                      "actions": report["actions"], "rounds": len(result.plans), "survivors": survivors,
                      "subject": subject, "zombie_state": state(subject.get("zombie", 0))}))
""")


def run_scenario(kind: str, mode: str = "real") -> dict:
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", PYTHON, "-c", SCENARIO,
         str(REPO / ".build" / "collections"), kind, mode],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def kinds(look: dict) -> dict[str, list[int]]:
    return {finding["kind"]: finding["pids"] for finding in look["findings"]}


def test_a_stale_zombie_whose_parent_must_be_ended_is_found_then_gone():
    report = run_scenario("stale_zombie")
    zombie, parent = report["subject"]["zombie"], report["subject"]["parent"]
    # found: the plan's own scan, judged as zombie_facts judges it.
    assert report["found"]["escalation"] == "signals"
    assert kinds(report["found"]).get("zombie") == [zombie], report["found"]
    assert {(a["stage"], a["pid"]) for a in report["actions"]} >= {("notify_parent", parent), ("end_parent", parent)}
    # left: one fresh scan after the ladder; PID 1 took the zombie once its parent was ended.
    assert report["zombie_state"] is None
    assert report["left"]["escalation"] == "none", report["left"]
    assert report["escalation"] == "none", report["reasons"]
    assert report["scans"] == 2  # the plan's, and the one after the only round


def test_a_process_that_survives_the_ladder_is_left_and_decides_the_escalation():
    report = run_scenario("forks_forever")
    assert report["found"]["escalation"] == "signals"
    assert kinds(report["found"])["running"] == [report["subject"]["first"]]
    assert report["rounds"] == 3
    (survivor,) = report["survivors"]
    assert report["left"]["escalation"] == "signals"
    assert kinds(report["left"])["running"] == [survivor]
    # The ladder did what it could in three rounds; what it did not see, the look after it did.
    assert report["escalation"] == "signals"
    assert any(str(survivor) in why for why in report["reasons"])
    assert report["scans"] == 4  # the plan's, and one at the end of each of the three rounds


@pytest.mark.parametrize("kind", ["stale_zombie", "forks_forever"])
def test_check_mode_judges_the_plans_scan_only(kind):
    report = run_scenario(kind, "check")
    assert report["actions"] == []
    assert report["found"]["escalation"] == "signals"
    assert report["left"] == report["found"]
    assert report["escalation"] == "signals" and report["reasons"] == report["found"]["reasons"]
    assert report["scans"] == 1
