"""What a selection may take, for real (issue 17, items 2, 9, 12 and 14).

* Item 9: a process cannot claim the built-in protection with its command line. Processes with
  ``sshd`` among their arguments, an argv[0] of ``ansible-playbook`` or ``sshd: ...`` (``exec -a``)
  or a comm of ``sshd`` (PR_SET_NAME) are selected and ended by zombie_reap, and ended by
  gpu_reclaim when they hold a GPU, whose release is then real; PID 1 stays protected.
* Item 12: ``ansible localhost -m gpuops.relaunch.zombie_facts -a '{"match": [...]}'`` is not
  refused because the pattern is on the ad-hoc command line of its own controller; zombie_reap
  run the same way ends the job.
* Item 2: two train_launch jobs running the same script: the clean-up for one leaves the other
  running and names it, including the other job's worker that cleared its environment.
* Item 14: ``process_cleanup_match: 'train_\\d{1,3}\\.py'`` (a string) is one pattern.

Everything that signals runs inside a private PID namespace.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from tests.harness.launch_targets import Target, in_pid_namespace
from tests.harness.pidns import pid_namespace, process_starttime
from tests.harness.playbook import REPO, run_playbook
from tests.harness.procstates import MAKER_PRELUDE, PYTHON, SLEEPER, Reaper, host_pid, state_of, wait_until
from tests.integration.test_gpu_reclaim import SCENE_PRELUDE, run_scene
from tests.integration.test_zombie_reap_pidns import REAPING_INIT, private_controller

BIN = Path(sys.executable).parent
REAP = "Reap the job"

# A sleeper that names itself sshd (its comm), as any process may.
SPOOF_COMM = MAKER_PRELUDE + r"""
import ctypes
ctypes.CDLL(None).prctl(15, b"sshd", 0, 0, 0)
print(f"pid={os.getpid()}", flush=True)
sleeper()
"""


def nsenter(init_pid: int) -> list[str]:
    return ["nsenter", f"--target={init_pid}", "--pid", "--mount", "--"]


def exec_a(argv0: str, tag: str) -> list[str]:
    """bash's ``exec -a ARGV0``: a python sleeper whose argv[0] says ARGV0."""
    return ["bash", "-c", 'exec -a "$0" ' + PYTHON + ' -c "$1" "$2"', argv0, SLEEPER, tag]


# --- item 9: what a process says about itself protects nothing -----------------------------------

def test_a_command_line_or_comm_that_claims_protection_is_selected_and_reaped(tmp_path):
    tag = f"/tmp/gpuops-claim-{uuid.uuid4().hex[:8]}/train.py"
    with pid_namespace([*REAPING_INIT, tag]) as namespace:
        reaper = Reaper()
        try:
            runner = nsenter(namespace.init_pid)
            started = {
                "sshd in its arguments": reaper.start(SLEEPER, tag, "--log-dir", "/var/log/sshd", "--note", "systemd", runner=runner),
                "argv[0] ansible-playbook": reaper.start_program(exec_a("ansible-playbook", tag), runner=runner),
                "argv[0] sshd": reaper.start_program(exec_a("sshd: root@pts/0", tag), runner=runner),
                "comm sshd": reaper.start(SPOOF_COMM, tag, runner=runner),
            }
            inside = {name: int(fields["pid"]) for name, fields in started.items()}
            hosts = {name: host_pid(namespace.init_pid, pid) for name, pid in inside.items()}
            # What the old rules read: their command lines and comm say sshd and ansible-playbook.
            assert Path(f"/proc/{hosts['comm sshd']}/comm").read_text(encoding="utf-8").strip() == "sshd"
            assert Path(f"/proc/{hosts['argv[0] ansible-playbook']}/cmdline").read_bytes().startswith(b"ansible-playbook\0")

            run = run_playbook([{
                "name": "reap", "hosts": "ct", "gather_facts": False,
                "tasks": [{"name": REAP, "gpuops.relaunch.zombie_reap": {
                    "match": [re.escape(tag)], "pids": [1], "term_timeout": 3, "kill_timeout": 3, "reap_timeout": 2,
                    "d_state_timeout": 2}}],
            }], inventory=namespace.write_inventory(tmp_path / "inventory"))
            assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]
            result = run.result(REAP)
            assert "refused" not in result, result["msg"]
            assert set(inside.values()) <= {entry["pid"] for entry in result["job"]}, result["job"]
            assert set(inside.values()) <= {entry["pid"] for entry in result["ended"]}, result["ended"]
            for name, pid in hosts.items():
                wait_until(lambda pid=pid: state_of(pid) is None, what=f"{name} ({pid}) to be gone")
            # PID 1, named twice (its command line carries the tag, and pids lists it), is never touched.
            assert {"pid": 1, "comm": "python3", "reason": "selected as the job, but PID 1 of this namespace"} in result["protected"]
            assert 1 not in {action["pid"] for action in result["actions"]}
            assert namespace.alive()
        finally:
            reaper.cleanup()


SPOOF_SCENE = SCENE_PRELUDE + textwrap.dedent(r"""
    gpu = SimGpu(work / "sim", teardown_delay=0.2)
    gpu.directory.mkdir()
    gpu.add_device()
    sys.path.insert(0, str(SIMNVML_DIR))
    os.environ[STATE_ENV] = str(gpu.state_path)
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import NvmlSession
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.reclaim import options_from_params, reclaim

    # GPU holders that claim what the old rules spared: sshd among the arguments, an argv[0] of
    # ansible-playbook (exec -a), both holding the device file as a CUDA process does.
    def spoofed(argv0, *words):
        proc = subprocess.Popen([argv0, "-c", HOLD, "plain", f"{work}/ci/train.py", str(GPU_FILE), *words],
                                executable=PYTHON, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    # And a Python running a script of its own named ansible-playbook: what it runs is named by its user too.
    named_script = work / "bin" / "ansible-playbook"
    named_script.parent.mkdir()
    named_script.write_text(HOLD)
    script = subprocess.Popen([PYTHON, str(named_script), "plain", f"{work}/ci/train.py", str(GPU_FILE)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert script.stdout.readline().strip() == "ready"
    holders = {"sshd_in_args": spoofed(PYTHON, "--via", "sshd"), "argv0_ansible": spoofed("ansible-playbook"),
               "script_named_ansible": script}
    for proc in holders.values():
        gpu.register(proc.pid, 2048)
    params = {"devices": ["0"], "allow": [], "protected": [], "term_timeout": 1, "kill": True, "release_timeout": 30,
              "poll_interval": 0.05, "max_used_mib": None, "query_timeout": 10, "driver_pids": "own_namespace",
              "gpus_required": True, "backend": "pynvml", "nvidia_smi": "nvidia-smi", "gpu_device_glob": GPU_GLOB}
    result = reclaim(NvmlSession(10), options_from_params(params)).as_dict()
    report = {key: result[key] for key in ("targets", "spared", "ended", "released", "escalation")}
    report["pids"] = {name: proc.pid for name, proc in holders.items()}
    report["alive"] = {name: proc.poll() is None for name, proc in holders.items()}
    for proc in holders.values():
        proc.kill()
        proc.wait()
    print(json.dumps(report))
""")


def test_gpu_reclaim_ends_holders_that_claim_protection_and_the_release_is_real(tmp_path):
    report = run_scene(SPOOF_SCENE, tmp_path)
    pids = set(report["pids"].values())
    assert {entry["pid"] for entry in report["targets"]} == pids, report["spared"]
    assert not pids & {entry["pid"] for entry in report["spared"]}
    assert report["alive"] == {"sshd_in_args": False, "argv0_ansible": False, "script_named_ansible": False}
    assert pids <= {entry["pid"] for entry in report["ended"]}
    assert report["released"] is True and report["escalation"] == "none", report


# --- item 12: the ad-hoc command line of Ansible itself ---------------------------------------------

def ad_hoc(module: str, args: dict, tag: str, tmp_path: Path) -> tuple[int, dict]:
    """`ansible localhost -c local -m MODULE -a ARGS` in a private PID namespace whose PID 1 starts a
    sleeper tagged `tag` first; returns the exit code and the module's result."""
    cmd = [*private_controller(tag), str(BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
           "-e", f"ansible_python_interpreter={PYTHON}", "-m", module, "-a", json.dumps(args)]
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "local-tmp"), PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout
    assert "=>" in out, out[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(out[out.index("=>") + 2:])


def test_ad_hoc_zombie_facts_with_a_pattern_on_its_own_command_line_is_not_refused(tmp_path):
    tag = f"/tmp/gpuops-adhoc-{uuid.uuid4().hex[:8]}/train.py"
    # The pattern as typed, unescaped: it is then, letter for letter, on the command line of the
    # controller and of its worker (both ancestors of the module).
    rc, result = ad_hoc("gpuops.relaunch.zombie_facts", {"match": [tag], "orphan_grace": 0}, tag, tmp_path)
    assert rc == 0 and not result.get("failed"), result
    facts = result["ansible_facts"]["zombie_facts"]
    assert facts["too_broad"] == []
    (job,) = facts["job_processes"]  # the sleeper; the controller and its worker are ancestors
    assert job["cmdline"].endswith(tag) and job["state"] == "S"


def test_ad_hoc_zombie_reap_with_a_pattern_on_its_own_command_line_ends_the_job(tmp_path):
    tag = f"/tmp/gpuops-adhoc-{uuid.uuid4().hex[:8]}/train.py"
    rc, result = ad_hoc("gpuops.relaunch.zombie_reap", {"match": [tag], "term_timeout": 3, "reap_timeout": 2}, tag, tmp_path)
    assert rc == 0 and not result.get("failed"), result
    assert "refused" not in result
    (job,) = result["job"]
    assert result["changed"] is True and [entry["pid"] for entry in result["ended"]] == [job["pid"]]
    # The controller and its worker carry the pattern too: protected as ancestors, never signalled.
    assert {action["pid"] for action in result["actions"]} == {job["pid"]}


def test_ad_hoc_with_a_pattern_that_names_ansible_itself_is_still_refused(tmp_path):
    tag = f"/tmp/gpuops-adhoc-{uuid.uuid4().hex[:8]}/train.py"
    rc, result = ad_hoc("gpuops.relaunch.zombie_reap", {"match": ["ansible"]}, tag, tmp_path)
    assert rc != 0 and result["signals_sent"] == 0 and result["actions"] == [], result
    assert result["refused"][0].startswith("match: 'ansible' matches the command line of")
    rc, result = ad_hoc("gpuops.relaunch.zombie_facts", {"match": ["ansible"], "orphan_grace": 0}, tag, tmp_path)
    assert rc == 0 and result["ansible_facts"]["zombie_facts"]["too_broad"], result


# --- item 2: another job running the same script --------------------------------------------------

JOB_SCRIPT = """\
import os, subprocess, sys, time
if sys.argv[1:] == []:
    # A worker that keeps the job's environment, and one that clears it (as `env -i` and `su -` do).
    subprocess.Popen([sys.executable, __file__, "--worker", "marked"])
    subprocess.Popen(["env", "-i", sys.executable, __file__, "--worker", "cleared"])
    print("step 1 ready", flush=True)
while True:
    time.sleep(3600)
"""


def job_tree(target: Target, state: dict) -> set[int]:
    """The leader's pid and its workers' (pids as the target sees them)."""
    procs = target.processes()
    leader = state["pid"]
    return {leader} | {p.pid for p in procs.values() if p.ppid == leader}


def whole_tree(target: Target, state: dict) -> set[int] | None:
    """The job's three processes once both workers have started, else None."""
    tree = job_tree(target, state)
    return tree if len(tree) == 3 else None


def test_the_clean_up_for_one_job_leaves_another_job_running_the_same_script(tmp_path):
    script = tmp_path / "same" / "train.py"
    script.parent.mkdir()
    script.write_text(JOB_SCRIPT, encoding="utf-8")
    (tmp_path / "work").mkdir()
    with in_pid_namespace(tmp_path / "work") as target:
        launch = [target.launch_task(name, f"launch {name}", command=[PYTHON, str(script)], log_path=target.log(f"{name}.log"),
                                     min_uptime=0.3) for name in ("a", "b")]
        started = target.play(launch)
        assert started.tasks and all(r.get("failed") is not True for t in started.tasks.values() for r in t), started.stdout[-3000:]
        runs = {name: target.read_state(name, "run.json") for name in ("a", "b")}
        trees = {name: wait_until(lambda name=name: whole_tree(target, runs[name]), what=f"job {name}'s workers")
                 for name in ("a", "b")}
        # The same command lines: a pattern for one is a pattern for both.
        procs = target.processes()
        assert {procs[pid].args for pid in trees["a"]} == {procs[pid].args for pid in trees["b"]}

        run = target.play([
            {"name": "Clean up job b", "ansible.builtin.include_role": {"name": "gpuops.relaunch.process_cleanup"},
             "vars": {"process_cleanup_match": [re.escape(str(script))], "job_launch_name": "b",
                      "job_launch_state_dir": target.state_dir, "process_cleanup_term_timeout": 3,
                      "process_cleanup_reap_timeout": 2, "process_cleanup_orphan_grace": 0}},
            {"name": "Show", "ansible.builtin.debug": {"msg": {
                "other_jobs": "{{ process_cleanup_other_jobs | default([]) }}", "ended": "{{ process_cleanup_ended }}",
                "found": "{{ process_cleanup_found_reasons }}"}}},
        ])
        assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]
        shown = run.result("Show")["msg"]
        after = target.processes()
        # Job a runs on, whole; job b's processes are gone.
        assert all(pid in after and not after[pid].zombie for pid in trees["a"]), (trees, after)
        assert not trees["b"] & {pid for pid, p in after.items() if not p.zombie}
        assert {entry["pid"] for entry in shown["ended"]} >= trees["b"]
        assert not trees["a"] & {entry["pid"] for entry in shown["ended"]}
        # ...and it is named: which job, and how it was proven (the worker without the mark by its supervisor).
        other = {entry["pid"]: entry for entry in shown["other_jobs"]}
        assert set(other) == trees["a"], shown["other_jobs"]
        job_a = str(Path(target.state_dir) / "a")
        assert {entry["job_dir"] for entry in other.values()} == {job_a}
        assert other[runs["a"]["pid"]]["proof"] == "run_mark" and other[runs["a"]["pid"]]["run_id"] == runs["a"]["run_id"]
        assert sorted(entry["proof"] for entry in other.values()) == ["run_mark", "run_mark", "supervisor"]
        assert any(f"belong to the job {job_a}" in reason for reason in shown["found"]), shown["found"]


# --- item 14: one string, one pattern ------------------------------------------------------------

def test_a_string_match_through_the_role_is_one_pattern(tmp_path):
    base = f"/tmp/gpuops-one-{uuid.uuid4().hex[:8]}"
    with pid_namespace(REAPING_INIT) as namespace:
        reaper = Reaper()
        try:
            runner = nsenter(namespace.init_pid)
            job = int(reaper.start(SLEEPER, f"{base}/train_42.py", runner=runner)["pid"])
            other = int(reaper.start(SLEEPER, f"{base}/train_1234.py", runner=runner)["pid"])
            job_host, other_host = host_pid(namespace.init_pid, job), host_pid(namespace.init_pid, other)
            other_start = process_starttime(other_host)
            run = run_playbook([{
                "name": "one pattern", "hosts": "ct", "gather_facts": False,
                "tasks": [{"name": "Clean up", "ansible.builtin.include_role": {"name": "gpuops.relaunch.process_cleanup"},
                           "vars": {"process_cleanup_match": r"train_\d{1,3}\.py\b", "process_cleanup_term_timeout": 3,
                                    "process_cleanup_reap_timeout": 2, "process_cleanup_orphan_grace": 0}},
                          {"name": "Show", "ansible.builtin.debug": {"msg": "{{ process_cleanup_ended }}"}}],
            }], inventory=namespace.write_inventory(tmp_path / "inventory"))
            assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]
            assert [entry["pid"] for entry in run.result("Show")["msg"]] == [job]
            wait_until(lambda: state_of(job_host) is None, what="the train_42.py sleeper to be gone")
            assert process_starttime(other_host) == other_start  # train_1234.py: \d{1,3} then \.py does not match
        finally:
            reaper.cleanup()


# --- the demo: one checkout's pattern and directory are its own ----------------------------------

def test_two_checkouts_demo_patterns_and_directories_are_their_own(tmp_path):
    shown = {}
    for checkout in ("one", "two"):
        playbooks = tmp_path / checkout / "playbooks"
        playbooks.mkdir(parents=True)
        (playbooks / "show.yml").write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": [
            {"name": "Show", "ansible.builtin.debug": {"msg": {"match": "{{ process_cleanup_match }}", "dir": "{{ demo_dir }}"}}}]}]),
            encoding="utf-8")
        run = run_playbook(str(playbooks / "show.yml"), inventory=str(REPO / "playbooks" / "inventory" / "demo.yml"),
                           env={"GPUOPS_DEMO_DIR": ""})
        assert run.rc == 0, run.stdout[-3000:] + run.stderr[-3000:]
        shown[checkout] = (run.result("Show")["msg"], playbooks)
    (one, one_dir), (two, two_dir) = shown["one"], shown["two"]
    assert one["dir"] != two["dir"] and one["dir"].startswith("/tmp/gpuops-demo-")
    for mine, theirs in ((one, two_dir), (two, one_dir)):
        own_dir = one_dir if mine is one else two_dir
        assert re.search(mine["match"], f"python3 {own_dir}/files/demo_train.py --workers 2")
        assert not re.search(mine["match"], f"python3 {theirs}/files/demo_train.py --workers 2")


# --- issue 24, item 4: a leftover cannot shield itself from its own job's clean-up ----------------

# Job a's worker copies job b's marks from b's running leader (both jobs run as one user, so it can
# read b's environ), re-execs itself with them, and writes its pid.
COPYING_SCRIPT = """\
import os, subprocess, sys, time
if sys.argv[1:2] == ["--copy"]:
    if "GPUOPS_COPIED" not in os.environ:
        wanted = "GPUOPS_RELAUNCH_RUN=" + sys.argv[2] + ":"
        while True:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    environ = open("/proc/%s/environ" % pid, "rb").read().decode().split("\\0")
                except OSError:
                    continue
                if any(entry.startswith(wanted) for entry in environ):
                    env = dict(os.environ, GPUOPS_COPIED="1")
                    env.update(entry.split("=", 1) for entry in environ if entry.startswith("GPUOPS_RELAUNCH_"))
                    env.setdefault("GPUOPS_RELAUNCH_SUPERVISOR", sys.argv[2])
                    os.execve(sys.executable, [sys.executable] + sys.argv, env)
            time.sleep(0.1)
    with open(sys.argv[3], "w") as out:
        out.write(str(os.getpid()))
    time.sleep(3600)
if sys.argv[1:2] == ["--a"]:
    subprocess.Popen([sys.executable, __file__, "--copy", sys.argv[2], sys.argv[3]])
print("step 1 ready", flush=True)
while True:
    time.sleep(3600)
"""


def test_a_worker_of_one_job_with_another_jobs_marks_is_its_own_jobs_and_a_conflict(tmp_path):
    script = tmp_path / "copying" / "train.py"
    script.parent.mkdir()
    script.write_text(COPYING_SCRIPT, encoding="utf-8")
    (tmp_path / "work").mkdir()
    worker_file = tmp_path / "work" / "copied.pid"
    with in_pid_namespace(tmp_path / "work") as target:
        job_b = str(Path(target.state_dir) / "b")
        started = target.play([
            target.launch_task("b", "launch b", command=[PYTHON, str(script)], log_path=target.log("b.log"), min_uptime=0.3),
            target.launch_task("a", "launch a", command=[PYTHON, str(script), "--a", job_b, str(worker_file)],
                               log_path=target.log("a.log"), min_uptime=0.3)])
        assert all(r.get("failed") is not True for t in started.tasks.values() for r in t), started.stdout[-3000:]
        runs = {name: target.read_state(name, "run.json") for name in ("a", "b")}
        worker = int(wait_until(lambda: worker_file.exists() and worker_file.read_text(), what="a's worker with b's marks"))
        assert f"GPUOPS_RELAUNCH_SUPERVISOR={job_b}".encode() in Path(f"/proc/{target.host_pid(worker)}/environ").read_bytes()

        run = target.play([
            {"name": "Facts for a", "gpuops.relaunch.zombie_facts": {
                "match": [re.escape(str(script))], "job_name": "a", "job_state_dir": target.state_dir, "orphan_grace": 0}},
            {"name": "Stop a", "gpuops.relaunch.train_launch": {
                "name": "a", "state": "stopped", "state_dir": target.state_dir, "log_path": target.log("a.log"),
                "term_timeout": 5}},
        ])
        assert run.rc == 0, run.stdout[-4000:] + run.stderr[-4000:]
        facts = run.result("Facts for a")["ansible_facts"]["zombie_facts"]
        assert worker in {entry["pid"] for entry in facts["job_processes"]}, facts["other_jobs"]
        assert worker not in {entry["pid"] for entry in facts["other_jobs"]}
        (conflict,) = [finding for finding in facts["findings"] if finding["kind"] == "mark_conflict"]
        assert conflict["pids"] == [worker] and conflict["escalation"] == "signals" and job_b in conflict["why"]
        assert facts["escalation"] != "none"
        stopped = run.result("Stop a")
        assert worker in stopped["stop"]["signalled"], stopped["stop"]
        assert [(e["pid"], e["marked_job_dir"]) for e in stopped["stop"]["mark_conflicts"]] == [(worker, job_b)]
        after = target.processes()
        assert worker not in after or after[worker].zombie
        # Job b, whose marks the worker carried, runs on.
        assert runs["b"]["pid"] in after and not after[runs["b"]["pid"]].zombie
