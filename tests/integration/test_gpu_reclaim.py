"""gpuops.relaunch.gpu_reclaim and playbooks/reclaim.yml against real processes and the simulated NVML.

Everything that may signal runs inside a private PID namespace (``unshare --pid --fork --mount-proc
--kill-child``): a scene script is its PID 1. The scene starts real holder processes, registers
them with the simulated driver (tests/harness/simnvml) by their pids *in that namespace*, which is
the "host" of this test (so the module runs with ``driver_pids: own_namespace``), runs
ansible-playbook with a local connection inside the namespace, and reports what each run returned
and which holders are still alive. If anything ever gave way, what it could end is only what the
scene started; the namespace dies with the test.

"Holds a GPU" is real too: character device nodes in the scene's directory, made with the NVIDIA
driver's numbers (``/dev/nvidiaN`` is 195:N, ``/dev/nvidiactl`` 195:255), stand for the device files;
the holders that use a GPU keep its node open, and every run names them with ``gpu_device_glob``
(``reclaim_gpu_device_glob``). A listed process is signalled only if it holds the node of the GPU
it is listed on, the minor number NVML gives for that GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.harness.procstates import PYTHON

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PRIVATE_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]

SCENE_PRELUDE = textwrap.dedent(r"""
    import json, os, signal, stat, subprocess, sys, time
    from pathlib import Path
    repo, work, venv_bin = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    sys.path[:0] = [str(repo / ".build" / "collections"), str(repo)]
    from tests.harness.gpu_holder import SIMNVML_DIR, STATE_ENV, SimGpu
    from tests.harness.procstates import ORPHAN, PYTHON, ZOMBIE_LEADER
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline

    # Stand-ins of the NVIDIA device files: real character devices with the driver's numbers
    # (/dev/nvidiaN is 195:N; /dev/nvidiactl, 195:255, every GPU user holds whatever its GPU). With
    # no driver behind them they cannot be opened for reading, so holders open them with O_PATH:
    # the fd is in /proc/PID/fd all the same and leads to the node. The glob every run is given.
    DEV = work / "dev"
    DEV.mkdir()

    def char_node(name, minor, major=195):
        os.mknod(DEV / name, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
        return DEV / name

    GPU_FILE = char_node("nvidia0", 0)
    NODES = {name: char_node(name, minor) for name, minor in (("nvidia1", 1), ("nvidia4", 4), ("nvidia5", 5),
                                                              ("nvidia7", 7), ("nvidiactl", 255))}
    GPU_GLOB = str(DEV / "nvidia*")

    # A holder: a sleeper whose command line carries its tag; "stubborn" ignores SIGTERM, and says
    # it is ready only once it does. Given device files (":"-joined), it keeps them open (as a CUDA
    # process keeps /dev/nvidia*) until SIGUSR1 makes it let go ("closed").
    HOLD = ("import os, signal, sys, time\n"
            "if sys.argv[1] == 'stubborn':\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "held = [os.open(path, os.O_PATH) for path in sys.argv[3].split(':') if path]\n"
            "def let_go(*_):\n    for fd in held:\n        os.close(fd)\n    print('closed', flush=True)\n"
            "signal.signal(signal.SIGUSR1, let_go)\n"
            "print('ready', flush=True)\n"
            "while True:\n    time.sleep(3600)\n")

    def start_holder(kind, tag, device_file=GPU_FILE):
        files = device_file if isinstance(device_file, (list, tuple)) else [device_file] if device_file else []
        proc = subprocess.Popen([PYTHON, "-c", HOLD, kind, tag, ":".join(str(f) for f in files)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    # A new process on `pid` (just freed) in this fresh namespace, where nobody else forks:
    # ns_last_pid hands it exactly that pid. Start times count clock ticks: one passes first, so
    # the newcomer cannot share the start time `after` of the process it replaces.
    def take_pid(pid, after, kind="plain", tag="/w/ci/train.py", device_file=None):
        probe = [PYTHON, "-c", "print(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])"]
        while int(subprocess.run(probe, capture_output=True, text=True).stdout) <= max(starttime(1), after):
            pass
        with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
            handle.write(str(pid - 1))
        newcomer = start_holder(kind, tag, device_file)
        assert newcomer.pid == pid, (newcomer.pid, pid)
        return newcomer

    def state(pid):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            return None
        return stat[stat.rindex(")") + 2]

    def starttime(pid):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            return None
        return int(stat[stat.rindex(")") + 2:].split()[19])
""")

PLAYBOOK_SCENE = SCENE_PRELUDE + textwrap.dedent(r"""
    gpu = SimGpu(work / "sim", teardown_delay=0.2)
    gpu.directory.mkdir()
    for _ in range(3):
        gpu.add_device()
    # GPU 3 is the device whose minor number NVML gives as 5 (not its index); GPU 4's minor number
    # NVML cannot give (as for a MIG device, or a failing call).
    gpu.add_device(minor_number=5)
    gpu.add_device()
    gpu.fault("nvmlDeviceGetMinorNumber", "NOT_SUPPORTED", device=4)
    # GPU 5 (minor number 7) is reclaimed through the nvidia-smi backend, which reads the numbers
    # from `nvidia-smi -q -x` (the fake tool answers from this simulated driver).
    gpu.add_device(minor_number=7)
    kinds = {"victim": ("plain", "ci/job/train.py", 0, 4096), "stubborn": ("stubborn", "ci/job/eval.py", 1, 2048),
             "allowed": ("plain", "agent/dcgm-exporter", 0, 80), "guarded": ("plain", "agent/gpuops-guarded-monitor", 1, 64),
             "elsewhere": ("plain", "ci/job/other.py", 2, 1024), "owner": ("plain", "ci/job/gpu3.py", 3, 512),
             "cross": ("plain", "ci/job/gpu1-user.py", 3, 256), "unproven": ("plain", "ci/job/gpu4.py", 4, 256),
             "smi_owner": ("plain", "ci/job/gpu5.py", 5, 512), "smi_cross": ("plain", "ci/job/gpu1-too.py", 5, 256)}
    # The holders of GPU 1 hold its node (195:1), those of GPU 0 GPU_FILE (195:0).
    # "elsewhere" is listed on GPU 2 but has no device file open: a stale listing. On GPU 3, "owner"
    # holds GPU 3's node (195:5) and "cross" only GPU 1's (195:1); both hold /dev/nvidiactl, as every
    # CUDA process does. "unproven" holds GPU 4's node, whose number NVML does not give. On GPU 5,
    # "smi_owner" holds its node (195:7), "smi_cross" GPU 1's and /dev/nvidiactl.
    files = {"stubborn": NODES["nvidia1"], "guarded": NODES["nvidia1"], "elsewhere": None,
             "owner": [NODES["nvidiactl"], NODES["nvidia5"]],
             "cross": [NODES["nvidiactl"], NODES["nvidia1"]], "unproven": [NODES["nvidiactl"], NODES["nvidia4"]],
             "smi_owner": [NODES["nvidiactl"], NODES["nvidia7"]], "smi_cross": [NODES["nvidiactl"], NODES["nvidia1"]]}
    holders = {}
    for name, (kind, tag, device, mib) in kinds.items():
        proc = start_holder(kind, f"{work}/{tag}", files.get(name, GPU_FILE))
        holders[name] = {"pid": proc.pid, "starttime": starttime(proc.pid), "proc": proc}
        gpu.register(proc.pid, mib, device)
    gpu.register(1, 16, 0)  # this scene, PID 1 of the namespace, holds memory too

    def alive():
        return {name: starttime(h["pid"]) == h["starttime"] and state(h["pid"]) not in (None, "Z")
                for name, h in holders.items()}

    previous_shell = None

    def play(name, extra_vars, playbook="gpuops.relaunch.reclaim", check=False):
        global previous_shell
        (work / f"{name}.json").write_text(json.dumps(extra_vars))
        cmd = [f"{venv_bin}/ansible-playbook", "-i", "localhost,", "-c", "local", playbook, "-e", f"@{work}/{name}.json"]
        cmd += ["--check"] if check else []
        env = dict(os.environ, ANSIBLE_CONFIG=str(repo / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.posix.json",
                   ANSIBLE_LOCAL_TEMP=str(work / "tmp"), ANSIBLE_NOCOLOR="1", ANSIBLE_SHOW_CUSTOM_STATS="1", PATH=f"{venv_bin}:{os.environ['PATH']}",
                   **gpu.env())
        # The controller's parent shell is an ancestor of the module, and it holds GPU memory: it is
        # registered before the controller starts ("read go"), so no run can miss it.
        shell = subprocess.Popen(["/bin/sh", "-c", 'read go; "$@"', "sh", *cmd], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(repo), env=env, text=True,
                                 start_new_session=True)
        gpu.holders = [h for h in gpu.holders if h["pid"] != previous_shell]
        gpu.register(shell.pid, 8, 0)
        previous_shell = shell.pid
        out, err = shell.communicate("go\n", timeout=400)
        try:
            parsed = json.loads(out)
        except ValueError:
            parsed = {}
        tasks = {}
        for play_ in parsed.get("plays", []):
            for task in play_.get("tasks", []):
                for host, result in task.get("hosts", {}).items():
                    tasks[task["task"]["name"]] = result
        return {"rc": shell.returncode, "tasks": tasks, "custom_stats": parsed.get("global_custom_stats", {}),
                "stderr": err[-3000:], "stdout": out[-3000:] if not parsed else "", "shell": shell.pid,
                "alive": alive()}

    common = {"reclaim_allow": [r"/agent/dcgm-exporter\b"], "reclaim_protected": [r"gpuops-guarded"],
              "reclaim_term_timeout": 1.5, "reclaim_release_timeout": 30, "reclaim_poll_interval": 0.1,
              "reclaim_driver_pids": "own_namespace", "reclaim_gpu_device_glob": GPU_GLOB,
              "ansible_python_interpreter": PYTHON}
    bad = [{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": name, "gpuops.relaunch.gpu_reclaim": dict({"devices": [0, 1], "driver_pids": "own_namespace",
                                                            "gpu_device_glob": GPU_GLOB}, **args),
         "ignore_errors": True}
        for name, args in [("empty devices", {"devices": []}), ("bad regex", {"allow": ["ok", "train("]}),
                           ("NaN timeout", {"term_timeout": "nan"}), ("everything wrong", {"devices": [], "protected": ["[x"],
                            "release_timeout": "inf", "poll_interval": 0}),
                           ("unknown GPU", {"devices": ["7"]}), ("glob of any file", {"gpu_device_glob": "/dev/*"})]]}]
    no_driver = {"GPUOPS_SIMNVML_STATE": str(work / "no-such-driver.json")}
    bad[0]["tasks"] += [
        {"name": "no GPU, optional", "gpuops.relaunch.gpu_reclaim": {"devices": ["all"], "gpus_required": False},
         "environment": no_driver},
        {"name": "no GPU, required", "gpuops.relaunch.gpu_reclaim": {"devices": ["all"]}, "environment": no_driver,
         "ignore_errors": True},
    ]
    # Not bad options: the proof of holding, case by case on GPUs 3 and 4 (left alone by the other runs).
    bad[0]["tasks"] += [
        {"name": name, "gpuops.relaunch.gpu_reclaim": {"devices": [index], "driver_pids": "own_namespace",
                                                       "gpu_device_glob": GPU_GLOB, "term_timeout": 1.5,
                                                       "release_timeout": 0.5, "poll_interval": 0.1},
         "ignore_errors": True}
        for name, index in [("GPU 3, holders of its own and of another GPU's device file", 3),
                            ("GPU 4, whose minor number NVML cannot give", 4)]]
    # The same proof with the nvidia-smi backend: GPU 5's number from nvidia-smi -q -x; GPU 4's is N/A there.
    smi = {"backend": "nvidia-smi", "nvidia_smi": str(repo / "tests" / "harness" / "fake_nvidia_smi" / "nvidia-smi")}
    bad[0]["tasks"] += [
        {"name": name, "gpuops.relaunch.gpu_reclaim": dict({"devices": [index], "driver_pids": "own_namespace",
                                                            "gpu_device_glob": GPU_GLOB, "term_timeout": 1.5,
                                                            "release_timeout": 0.5, "poll_interval": 0.1}, **smi),
         "ignore_errors": True}
        for name, index in [("GPU 5 through nvidia-smi", 5), ("GPU 4 through nvidia-smi, which says N/A", 4)]]
    (work / "bad.yml").write_text(json.dumps(bad))
    report = {"pids": {name: h["pid"] for name, h in holders.items()}}
    report["bad_options"] = play("bad_options", {"ansible_python_interpreter": PYTHON}, playbook=str(work / "bad.yml"))
    report["no_devices"] = play("no_devices", dict(common, reclaim_devices=[]))
    report["check"] = play("check", dict(common, reclaim_devices=[0, 1]), check=True)
    report["real"] = play("real", dict(common, reclaim_devices=[0, 1]))
    report["again"] = play("again", dict(common, reclaim_devices=[0, 1]))
    report["stale"] = play("stale", dict(common, reclaim_devices=[2], reclaim_release_timeout=0.3))
    print(json.dumps(report))
""")

RECYCLE_SCENE = SCENE_PRELUDE + textwrap.dedent(r"""
    # PID 1 of a fresh namespace where nobody else forks: ns_last_pid makes a new process take
    # exactly the pid of the one that just exited.
    gpu = SimGpu(work / "sim", teardown_delay=0.2)
    gpu.directory.mkdir()
    gpu.add_device()
    # GPUs 1 and 2: where listings that are never released stay (on GPU 0 they would hold up every release).
    gpu.add_device()
    gpu.add_device()
    sys.path.insert(0, str(SIMNVML_DIR))
    os.environ[STATE_ENV] = str(gpu.state_path)
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import NvmlSession
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.reclaim import (
        options_from_params, plan_reclaim, reclaim)

    params = {"devices": ["0"], "allow": [], "protected": [], "term_timeout": 1, "kill": True, "release_timeout": 10,
              "poll_interval": 0.05, "max_used_mib": None, "query_timeout": 10, "driver_pids": "own_namespace",
              "gpus_required": True, "backend": "pynvml", "nvidia_smi": "nvidia-smi", "gpu_device_glob": GPU_GLOB}
    options = options_from_params(params)
    stale_options = options_from_params(dict(params, devices=["1"], release_timeout=0.3))
    source = NvmlSession(10)
    report = {}
    keys = ("signals", "spared", "not_holding", "ended", "released", "changed", "escalation", "findings")

    # Recycled between the look and the signal: the start time tells them apart.
    target = start_holder("plain", "/w/ci/train.py")
    gpu.register(target.pid, 4096)
    plan = plan_reclaim(source, options)
    report["planned"] = [h.pid for h in plan.targets]
    target.kill()
    target.wait()
    # The very same command line, the very same pid (and a device file open: it must not matter).
    newcomer = take_pid(target.pid, plan.targets[0].process.starttime, device_file=GPU_FILE)
    report["target"], report["newcomer"] = target.pid, newcomer.pid
    result = reclaim(source, options, plan=plan).as_dict()
    report["recycled"] = {key: result[key] for key in keys}
    report["newcomer_alive"] = newcomer.poll() is None
    newcomer.kill()
    newcomer.wait()

    # Recycled before the look: the driver still lists the pid of a holder that died (its teardown
    # is slow), and an unrelated process that holds no device file has taken it. The look reads
    # the newcomer's own start time, so only the device-file check tells it from the holder.
    holder = start_holder("plain", "/w/ci/train.py")
    gpu.register(holder.pid, 4096, device=1, teardown_delay=3600)
    holder_start = starttime(holder.pid)
    holder.kill()
    holder.wait()
    stranger = take_pid(holder.pid, holder_start, tag="/w/ci/train.py")
    result = reclaim(source, stale_options).as_dict()
    report["stranger"] = {"pid": stranger.pid, "alive": stranger.poll() is None, **{key: result[key] for key in keys}}
    stranger.kill()
    stranger.wait()

    # Listed, alive, the registered process itself, but with no device file open (it never had one):
    # reported not_holding and left alone.
    idle = start_holder("plain", "/w/ci/idle.py", device_file=None)
    gpu.register(idle.pid, 1024, device=2)
    result = reclaim(source, options_from_params(dict(params, devices=["2"], release_timeout=0.3))).as_dict()
    report["idle"] = {"pid": idle.pid, "alive": idle.poll() is None, **{key: result[key] for key in keys}}
    idle.kill()
    idle.wait()

    # The look saw the device file; the holder let go of it before the signal: the gate's own check,
    # on the pinned process, spares it.
    quitter = start_holder("plain", "/w/ci/quitter.py")
    gpu.register(quitter.pid, 2048)
    plan = plan_reclaim(source, options_from_params(dict(params, release_timeout=0.3)))
    report["quitter_planned"] = [h.pid for h in plan.targets]
    quitter.send_signal(signal.SIGUSR1)  # started here, recorded pid, alive: it cannot be anyone else
    assert quitter.stdout.readline().strip() == "closed"
    result = reclaim(source, options_from_params(dict(params, release_timeout=0.3)), plan=plan).as_dict()
    report["quitter"] = {"pid": quitter.pid, "alive": quitter.poll() is None, **{key: result[key] for key in keys}}
    quitter.kill()
    quitter.wait()

    # A Zl leader (main thread gone, a thread runs on and holds the GPU and its device file) is a
    # target: its command line is read from the live thread, its device file from the live thread's
    # fd/ (the leader's own is empty), and a signal to it ends the thread group.
    leader_maker = subprocess.Popen([PYTHON, "-c", ZOMBIE_LEADER, str(GPU_FILE), "/w/ci/zl-train.py"],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)
    leader = int(dict(item.split("=") for item in leader_maker.stdout.readline().split())["zombie"])
    gpu.register(leader, 1024)
    report["leader_fd_dir"] = os.listdir(f"/proc/{leader}/fd")
    zl = reclaim(source, options).as_dict()
    report["zombie_leader"] = {"pid": leader, **{key: zl[key] for key in ("targets", "ended", "released", "spared", "signals")}}
    leader_maker.kill()
    leader_maker.wait()

    # A holder left a zombie under this init, which never reaps it, its teardown stuck until it is
    # reaped: no signal helps, and gpu_mem_wait's rules say only a restart of the container does.
    maker = subprocess.Popen([PYTHON, "-c", ORPHAN], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    orphan = int(dict(item.split("=") for item in maker.stdout.readline().split())["orphan"])
    gpu.register(orphan, 2048, stuck_teardown=True)
    os.kill(orphan, signal.SIGKILL)  # started here, recorded pid, not yet reaped: it cannot be anyone else
    Deadline(10).poll(lambda: state(orphan) == "Z", 0.02)
    stuck = reclaim(source, options_from_params(dict(params, release_timeout=0.5))).as_dict()
    report["stuck"] = {key: stuck[key] for key in ("spared", "signals", "released", "escalation", "findings", "holders")}
    os.waitpid(orphan, 0)
    maker.kill()
    maker.wait()

    # Both listed on GPU 0 (minor 0), both holding /dev/nvidiactl; "other" holds GPU 1's device
    # file, not GPU 0's: only "owner" is signalled.
    owner = start_holder("plain", "/w/ci/gpu0-user.py", [NODES["nvidiactl"], GPU_FILE])
    other = start_holder("plain", "/w/ci/gpu1-user.py", [NODES["nvidiactl"], NODES["nvidia1"]])
    gpu.register(owner.pid, 1024)
    gpu.register(other.pid, 1024)
    result = reclaim(source, options_from_params(dict(params, release_timeout=0.3))).as_dict()
    report["cross"] = {"owner": owner.pid, "other": other.pid, "other_alive": other.poll() is None,
                       **{key: result[key] for key in keys}}
    owner.wait()
    other.kill()
    other.wait()
    source.close()
    print(json.dumps(report))
""")


def run_scene(script: str, work: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [*PRIVATE_PID_NAMESPACE, PYTHON, "-c", script, str(REPO), str(work), str(BIN)],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def playbook_scene(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scene(PLAYBOOK_SCENE, tmp_path_factory.mktemp("reclaim"))


TASK = "End what holds the GPUs and is not spared, then wait for the release"


def _reasons(result: dict[str, Any]) -> dict[int, str]:
    return {entry["pid"]: entry["reason"] for entry in result["spared"]}


def test_reclaim_ends_the_unlisted_holders_and_spares_the_allow_listed_and_protected(playbook_scene):
    run, pids = playbook_scene["real"], playbook_scene["pids"]
    assert run["rc"] == 0, run["stderr"] + run["stdout"]
    result = run["tasks"][TASK]
    assert result["changed"] is True and result["released"] is True, result["msg"]
    assert sorted(e["pid"] for e in result["ended"]) == sorted([pids["victim"], pids["stubborn"]])
    by_pid = {e["pid"]: e for e in result["ended"]}
    assert by_pid[pids["victim"]]["signal"] == "SIGTERM" and "ci/job/train.py" in by_pid[pids["victim"]]["cmdline"]
    # The holder that ignores SIGTERM got SIGKILL once term_timeout had passed.
    assert by_pid[pids["stubborn"]]["signal"] == "SIGKILL"
    stubborn = [(s["signal"], s["result"]) for s in result["signals"] if s["pid"] == pids["stubborn"]]
    assert stubborn == [("SIGTERM", "sent"), ("SIGKILL", "sent")]
    kill_at = next(s["elapsed"] for s in result["signals"] if s["signal"] == "SIGKILL")
    assert kill_at >= 1.5
    reasons = _reasons(result)
    assert reasons[pids["allowed"]] == "allow_listed" and reasons[pids["guarded"]] == "protected"
    assert reasons[1] == "pid1" and reasons[run["shell"]] == "ancestor"
    assert pids["elsewhere"] not in reasons  # GPU 2 was not chosen: its holder is not even looked at
    assert run["alive"] == {"victim": False, "stubborn": False, "allowed": True, "guarded": True, "elsewhere": True,
                            "owner": False, "cross": True, "unproven": True,  # "owner": ended on GPU 3 in bad_options
                            "smi_owner": False, "smi_cross": True}  # "smi_owner": on GPU 5 in bad_options
    # Per-device memory: GPU 0 keeps what the spared holders use.
    gpus = {g["index"]: g for g in result["gpus"]}
    assert set(gpus) == {0, 1}
    assert gpus[0]["used_mib_before"] == 4 + 4096 + 80 + 16 + 8 and gpus[0]["used_mib_after"] == 4 + 80 + 16 + 8
    assert gpus[1]["used_mib_after"] == 4 + 64
    assert result["escalation"] == "none" and result["findings"][0]["kind"] == "released"
    summary = run["custom_stats"]["reclaim_summary"]["localhost"]
    assert summary["released"] is True and sorted(e["pid"] for e in summary["ended"]) == sorted(by_pid)


def test_a_second_run_once_released_changes_nothing(playbook_scene):
    first, again = playbook_scene["real"]["tasks"][TASK], playbook_scene["again"]
    assert again["rc"] == 0, again["stderr"]
    result = again["tasks"][TASK]
    assert result["changed"] is False and result["released"] is True
    assert result["ended"] == [] and result["signals"] == [] and result["targets"] == []
    same = {pid: reason for pid, reason in _reasons(first).items() if pid != playbook_scene["real"]["shell"]}
    assert {pid: reason for pid, reason in _reasons(result).items() if pid != again["shell"]} == same
    assert result["msg"].startswith("nothing to end on GPU(s) 0, 1")


def test_the_playbook_passes_the_device_glob_and_a_stale_listing_is_not_signalled(playbook_scene):
    # GPU 2 lists "elsewhere", which has no device file open: the playbook's reclaim_gpu_device_glob
    # reaches the module (with the default /dev/nvidia* nothing here would be a holder either, but
    # then the runs on GPUs 0 and 1 above would have ended nothing).
    run, pids = playbook_scene["stale"], playbook_scene["pids"]
    result = run["tasks"][TASK]
    assert run["rc"] != 0 and result["released"] is False, result["msg"]
    assert result["signals"] == [] and result["ended"] == [] and result["changed"] is False
    assert [(e["pid"], e["reason"]) for e in result["not_holding"]] == [(pids["elsewhere"], "not_holding")]
    assert any(f["kind"] == "not_holding" and f["pids"] == [pids["elsewhere"]] for f in result["findings"])
    assert run["alive"]["elsewhere"] is True
    summary = run["custom_stats"]["reclaim_summary"]["localhost"]
    assert [e["pid"] for e in summary["not_holding"]] == [pids["elsewhere"]]


def test_check_mode_reports_what_it_would_end_and_ends_nothing(playbook_scene):
    run, pids = playbook_scene["check"], playbook_scene["pids"]
    assert run["rc"] == 0, run["stderr"]
    result = run["tasks"][TASK]
    assert result["changed"] is True and result["signals"] == [] and result["ended"] == []
    assert sorted(t["pid"] for t in result["targets"]) == sorted([pids["victim"], pids["stubborn"]])
    assert result["msg"].startswith("check mode: would end 2 holder(s)")
    assert {name for name, alive in run["alive"].items() if not alive} == {"owner", "smi_owner"}, run["alive"]  # ended on GPUs 3, 5
    summary = run["custom_stats"]["reclaim_summary"]["localhost"]
    assert summary["check_mode"] is True and summary["ended"] == []
    assert sorted(summary["would_end"]) == sorted([pids["victim"], pids["stubborn"]])


def test_bad_options_name_the_option_and_change_nothing(playbook_scene):
    run = playbook_scene["bad_options"]
    tasks = run["tasks"]
    expected = {
        "empty devices": ["devices"],
        "bad regex": ["allow"],
        "NaN timeout": ["term_timeout"],
        "everything wrong": ["devices", "protected", "release_timeout", "poll_interval"],
        "unknown GPU": ["devices"],
        "glob of any file": ["gpu_device_glob"],
    }
    for name, options in expected.items():
        result = tasks[name]
        assert result["failed"] is True and result["changed"] is False, (name, result)
        assert [p["option"] for p in result["option_problems"]] == options, (name, result)
        assert "Traceback" not in json.dumps(result) and "signals" not in result, name
    assert "allow: 'train(' is not a valid regular expression" in tasks["bad regex"]["msg"]
    assert "term_timeout: must be a finite number of seconds, got nan" in tasks["NaN timeout"]["msg"]
    assert "an empty list never means all" in tasks["empty devices"]["msg"]
    assert "devices: no GPU 7 on this host" in tasks["unknown GPU"]["msg"]
    assert "gpu_device_glob: must name the GPU device files" in tasks["glob of any file"]["msg"]
    assert {name for name, alive in run["alive"].items() if not alive} == {"owner", "smi_owner"}, run["alive"]  # ended on GPUs 3, 5
    optional, required = tasks["no GPU, optional"], tasks["no GPU, required"]
    assert not optional.get("failed") and optional["gpu_present"] is False and optional["changed"] is False, optional
    assert required["failed"] is True and required["error_kind"] == "library_not_found", required
    # The playbook refuses an empty reclaim_devices itself, naming its variable.
    refused = playbook_scene["no_devices"]
    assert refused["rc"] != 0 and {name for name, alive in refused["alive"].items() if not alive} == {"owner", "smi_owner"}
    assert "reclaim_devices must list the GPUs" in refused["tasks"]["Refuse a run that does not name the GPUs"]["msg"]


def test_only_a_holder_of_the_gpus_own_device_file_is_signalled(playbook_scene):
    """GPU 3's minor number is 5: "owner" holds 195:5 and is ended; "cross", listed on GPU 3 too, holds
    only GPU 1's device file (and /dev/nvidiactl) and is not signalled, saying why; on GPU 4, whose
    minor number NVML cannot give, nothing proves a holder and nothing is signalled."""
    run, pids = playbook_scene["bad_options"], playbook_scene["pids"]
    gpu3 = run["tasks"]["GPU 3, holders of its own and of another GPU's device file"]
    assert [(e["pid"], e["signal"]) for e in gpu3["ended"]] == [(pids["owner"], "SIGTERM")], gpu3["msg"]
    assert {s["pid"] for s in gpu3["signals"]} == {pids["owner"]} and gpu3["changed"] is True
    (entry,) = gpu3["not_holding"]
    assert entry["pid"] == pids["cross"] and "gpu1-user.py" in entry["cmdline"]
    assert "no device file of GPU 3 (char 195:5)" in entry["detail"] and "/dev/nvidia1 (char 195:1)" in entry["detail"]
    assert gpu3["released"] is False and gpu3["failed"] is True  # "cross" is still listed
    assert any(f["kind"] == "not_holding" and f["pids"] == [pids["cross"]] for f in gpu3["findings"])
    gpu4 = run["tasks"]["GPU 4, whose minor number NVML cannot give"]
    assert gpu4["signals"] == [] and gpu4["ended"] == [] and gpu4["changed"] is False
    assert [(e["pid"], e["reason"]) for e in gpu4["spared"]] == [(pids["unproven"], "device_unknown")]
    assert "GPU 4's device file is not known" in gpu4["spared"][0]["detail"]
    assert "nvmlDeviceGetMinorNumber" in gpu4["spared"][0]["detail"] and "Not Supported" in gpu4["spared"][0]["detail"]
    assert any(f["kind"] == "not_signalled" and f["pids"] == [pids["unproven"]] for f in gpu4["findings"])
    assert run["alive"]["cross"] is True and run["alive"]["unproven"] is True and run["alive"]["owner"] is False


@pytest.fixture(scope="module")
def recycle_scene(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scene(RECYCLE_SCENE, tmp_path_factory.mktemp("recycle"))


def test_a_pid_recycled_between_the_look_and_the_signal_is_not_signalled(recycle_scene):
    report = recycle_scene
    assert report["planned"] == [report["target"]] and report["newcomer"] == report["target"]
    recycled = report["recycled"]
    assert [(s["signal"], s["result"]) for s in recycled["signals"]] == [("SIGTERM", "recycled")]
    assert [(e["pid"], e["reason"]) for e in recycled["spared"]] == [(report["target"], "recycled")]
    assert recycled["ended"] == [] and recycled["changed"] is False
    assert report["newcomer_alive"] is True
    assert recycled["released"] is True  # the planned holder is gone; the newcomer holds nothing


def test_a_listed_pid_taken_by_an_unrelated_process_without_a_device_file_is_not_signalled(recycle_scene):
    stranger = recycle_scene["stranger"]
    assert stranger["alive"] is True
    assert stranger["signals"] == [] and stranger["ended"] == [] and stranger["changed"] is False
    assert [(e["pid"], e["reason"]) for e in stranger["not_holding"]] == [(stranger["pid"], "not_holding")]
    assert [(e["pid"], e["reason"]) for e in stranger["spared"]] == [(stranger["pid"], "not_holding")]
    # The driver still lists the dead holder's pid: not released, and the finding says why nothing was signalled.
    assert stranger["released"] is False
    assert any(f["kind"] == "not_holding" and f["pids"] == [stranger["pid"]] for f in stranger["findings"])


def test_a_listed_process_that_holds_no_device_file_is_reported_not_holding_and_survives(recycle_scene):
    idle = recycle_scene["idle"]
    assert idle["alive"] is True
    assert idle["signals"] == [] and idle["ended"] == [] and idle["changed"] is False
    (entry,) = idle["not_holding"]
    assert entry["pid"] == idle["pid"] and "idle.py" in entry["cmdline"] and "gpu_device_glob" in entry["detail"]
    assert idle["released"] is False and idle["escalation"] == "signals"


def test_the_gate_checks_the_device_file_again_on_the_pinned_process(recycle_scene):
    quitter = recycle_scene["quitter"]
    assert recycle_scene["quitter_planned"] == [quitter["pid"]]  # the look saw its device file
    assert quitter["alive"] is True
    assert [(s["signal"], s["result"]) for s in quitter["signals"]] == [("SIGTERM", "not_holding")]
    assert [(e["pid"], e["reason"]) for e in quitter["not_holding"]] == [(quitter["pid"], "not_holding")]
    assert "when it was to be signalled" in quitter["not_holding"][0]["detail"]
    assert quitter["ended"] == [] and quitter["changed"] is False


def test_a_zombie_leader_whose_live_thread_holds_the_device_file_is_signalled(recycle_scene):
    zl = recycle_scene["zombie_leader"]
    assert recycle_scene["leader_fd_dir"] == []  # the leader's own fd/ is empty: the file is on the live thread
    assert [t["pid"] for t in zl["targets"]] == [zl["pid"]] and "zl-train.py" in zl["targets"][0]["cmdline"]
    assert [(s["signal"], s["result"]) for s in zl["signals"]] == [("SIGTERM", "sent")]
    assert [(e["pid"], e["signal"], e["now"]) for e in zl["ended"]] == [(zl["pid"], "SIGTERM", "zombie")]
    assert zl["released"] is True and zl["pid"] not in [e["pid"] for e in zl["spared"]]


def test_a_zombie_holder_under_a_non_reaping_init_needs_a_container_restart(recycle_scene):
    stuck = recycle_scene["stuck"]
    assert stuck["released"] is False and stuck["signals"] == []
    assert [e["reason"] for e in stuck["spared"]] == ["zombie"]
    assert stuck["escalation"] == "container_reboot"
    (holder,) = stuck["holders"]
    assert holder["kind"] == "unreaped_orphan" and holder["parent"]["pid"] == 1
    assert stuck["findings"][0]["kind"] == "unreaped_orphan" and stuck["findings"][0]["escalation"] == "container_reboot"


def test_a_process_holding_only_another_gpus_device_file_is_not_signalled_for_this_gpu(recycle_scene):
    cross = recycle_scene["cross"]
    assert [(s["pid"], s["signal"], s["result"]) for s in cross["signals"]] == [(cross["owner"], "SIGTERM", "sent")]
    assert [e["pid"] for e in cross["ended"]] == [cross["owner"]]
    assert cross["other_alive"] is True
    (entry,) = cross["not_holding"]
    assert entry["pid"] == cross["other"] and "no device file of GPU 0 (char 195:0)" in entry["detail"]
    assert "nvidia1 (char 195:1)" in entry["detail"]
    assert cross["released"] is False  # "other" is still listed on GPU 0


def test_the_nvidia_smi_backend_proves_holding_by_the_minor_number_of_nvidia_smi_q_x(playbook_scene):
    """Through backend=nvidia-smi: GPU 5's minor number (7) comes from one `nvidia-smi -q -x` run;
    "smi_owner" holds 195:7 and is ended, "smi_cross", listed on GPU 5 too, holds only GPU 1's device
    file and is spared. GPU 4's number is N/A in the report: nothing is signalled there."""
    run, pids = playbook_scene["bad_options"], playbook_scene["pids"]
    gpu5 = run["tasks"]["GPU 5 through nvidia-smi"]
    assert [(e["pid"], e["signal"]) for e in gpu5["ended"]] == [(pids["smi_owner"], "SIGTERM")], gpu5["msg"]
    assert {s["pid"] for s in gpu5["signals"]} == {pids["smi_owner"]} and gpu5["changed"] is True
    (entry,) = gpu5["not_holding"]
    assert entry["pid"] == pids["smi_cross"] and "gpu1-too.py" in entry["cmdline"]
    assert "no device file of GPU 5 (char 195:7)" in entry["detail"] and "nvidia1 (char 195:1)" in entry["detail"]
    assert gpu5["released"] is False and gpu5["failed"] is True  # "smi_cross" is still listed
    gpu4 = run["tasks"]["GPU 4 through nvidia-smi, which says N/A"]
    assert gpu4["signals"] == [] and gpu4["ended"] == [] and gpu4["changed"] is False
    assert [(e["pid"], e["reason"]) for e in gpu4["spared"]] == [(pids["unproven"], "device_unknown")]
    assert "GPU 4's device file is not known: nvidia-smi reports its minor number as N/A" in gpu4["spared"][0]["detail"]
    assert run["alive"]["smi_cross"] is True and run["alive"]["unproven"] is True and run["alive"]["smi_owner"] is False
