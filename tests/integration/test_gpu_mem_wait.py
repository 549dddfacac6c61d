"""gpuops.relaunch.gpu_mem_wait through ansible-playbook, against the simulated NVML.

The simulated driver (tests/harness/simnvml) is driven by real processes: a holder's memory shows
while any of its threads lives and goes after a teardown delay (or, stuck, only once the process
is reaped). The module runs on the target's own Python (/usr/bin/python3, which has no `pynvml`):
the simulated bindings reach it only through PYTHONPATH in the task's environment, exactly as the
real ones would be installed there.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.gpu_holder import (
    SimGpu,
    host_proc_view,
    namespace_holder,
    plain_holder,
    sim_gpu,
    zombie_leader_holder,
)
from tests.harness.pidns import parent_pid, pid_namespace
from tests.harness.playbook import run_playbook
from tests.harness.procstates import Reaper, state_of, wait_until
from tests.harness.real_nvml import DRIVER_ANSWERS

MODULE = "gpuops.relaunch.gpu_mem_wait"
TARGET_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    started = Reaper()
    try:
        yield started
    finally:
        started.cleanup()


@pytest.fixture
def gpu() -> Iterator[SimGpu]:
    with sim_gpu(devices=2, teardown_delay=0.3) as simulated:
        yield simulated


def wait_task(args: dict[str, Any], env: dict[str, str], name: str = "wait") -> dict[str, Any]:
    return {"name": name, MODULE: args, "environment": env, "ignore_errors": True}


def local_play(tasks: list[dict[str, Any]], python: str = TARGET_PYTHON) -> list[dict[str, Any]]:
    return [{
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": False,
        "vars": {"ansible_python_interpreter": python},
        "tasks": tasks,
    }]


def run_wait(args: dict[str, Any], env: dict[str, str], check: bool = False) -> dict[str, Any]:
    run = run_playbook(local_play([wait_task(args, env)]), check=check, timeout=300)
    return run.result("wait")


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment mentions `marker` (the state file path of one simulated driver)."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_release_after_a_real_holder_is_killed(reaper: Reaper, gpu: SimGpu) -> None:
    holder = plain_holder(reaper, gpu, mib=8192, device=1)
    other = plain_holder(reaper, gpu, mib=1024, device=0)
    state = str(gpu.state_path)

    # Kill the holder only once the module is really polling (its NVML child has our state file).
    def kill_when_polling() -> None:
        wait_until(lambda: len(processes_with_env(state)) >= 2, timeout=120, what="gpu_mem_wait to poll")
        reaper.kill(holder["pid"])
    killer = threading.Thread(target=kill_when_polling)
    killer.start()
    result = run_wait({"devices": ["1"], "timeout": 60, "poll_interval": 0.2}, gpu.env())
    killer.join()

    assert result["released"] is True, result
    assert not result.get("failed"), result
    assert result["backend"] == "pynvml"
    [gpu1] = result["gpus"]
    assert gpu1["index"] == 1 and gpu1["uuid"] == gpu.devices[1]["uuid"]
    assert gpu1["used_mib_before"] == 8192 + 4
    assert gpu1["used_mib_after"] == 4
    assert gpu1["processes"] == []
    assert result["released_mib"] == 8192
    assert result["polls"] >= 2
    # elapsed is the collection's one name for the seconds the task took; no second name, no old words.
    assert result["elapsed"] > 0 and f"after {result['elapsed']:g}s" in result["msg"]
    assert result["escalation"] == "none" and result["holders"] == []
    assert "waited_s" not in result and "verdict" not in result
    # GPU 0 still has its live holder: selecting it (by UUID) times out naming that process.
    held = run_wait({"devices": [gpu.devices[0]["uuid"]], "timeout": 0.5, "poll_interval": 0.1}, gpu.env())
    assert held["failed"] is True and held["released"] is False
    [holder0] = held["holders"]
    assert holder0["pid"] == other["pid"] and holder0["kind"] == "running" and holder0["visible"] is True
    assert held["escalation"] == "signals" and holder0["escalation"] == "signals"
    assert held["findings"][0]["kind"] == "running" and held["findings"][0]["pids"] == [other["pid"]]
    assert f"pid {other['pid']}" in held["msg"]
    # The NVML child of each run is gone with its run.
    assert processes_with_env(state) == []


def test_zombie_leader_holds_until_its_threads_end(reaper: Reaper, gpu: SimGpu) -> None:
    holder = zombie_leader_holder(reaper, gpu, mib=4096)
    assert state_of(holder["pid"]) == "Z"

    held = run_wait({"devices": [0], "timeout": 1.0, "poll_interval": 0.2}, gpu.env())
    assert held["failed"] is True
    [entry] = held["holders"]
    assert entry["pid"] == holder["pid"] and entry["kind"] == "zombie_leader"
    assert entry["state"] == "Z" and entry["live_threads"], entry
    assert "zombie leader" in held["msg"] and str(holder["pid"]) in held["msg"]
    assert held["gpus"][0]["used_mib_after"] == 4096 + 4
    assert held["escalation"] == "signals" and "verdict" not in held

    # SIGKILL to the leader ends its live threads; what is left is a plain zombie (never reaped
    # by its parent), and the simulated driver releases the memory after the teardown delay.
    reaper.kill(holder["pid"])
    wait_until(lambda: not os.listdir(f"/proc/{holder['pid']}/task") or
               all(state_of(int(t)) in (None, "Z") for t in os.listdir(f"/proc/{holder['pid']}/task")),
               what="the leader's threads to end")
    released = run_wait({"devices": [0], "timeout": 30, "poll_interval": 0.1}, gpu.env())
    assert released["released"] is True, released
    assert released["gpus"][0]["used_mib_after"] == 4
    assert state_of(holder["pid"]) == "Z"  # still a zombie: the memory went with the last thread


def test_stuck_teardown_under_a_never_reaping_init_times_out_naming_the_zombie(reaper: Reaper, gpu: SimGpu) -> None:
    with pid_namespace() as namespace:
        holder = namespace_holder(reaper, namespace, gpu, mib=16384, stuck_teardown=True)
        reaper.kill(holder["pid"])
        wait_until(lambda: state_of(holder["pid"]) == "Z", what="the holder to become a zombie")

        result = run_wait({"timeout": 1.5, "poll_interval": 0.2, "no_processes": True}, gpu.env())
        assert result["failed"] is True and result["released"] is False
        [entry] = result["holders"]
        assert entry["pid"] == holder["pid"] and entry["kind"] == "unreaped_orphan" and entry["visible"] is True
        assert entry["parent"]["pid"] == namespace.init_pid and entry["parent"]["is_namespace_init"] is True
        assert entry["used_mib"] == 16384
        assert result["escalation"] == "container_reboot" and result["needs_reboot"] is True
        assert entry["escalation"] == "container_reboot" and isinstance(entry["starttime"], int)
        assert f"pid {holder['pid']}" in result["msg"] and "zombie orphaned" in result["msg"]
        assert "only a restart of that container" in result["msg"]
        # Still a zombie and still held: nothing inside the namespace reaps it.
        assert state_of(holder["pid"]) == "Z"
    # The namespace is gone, its init took the zombie with it: the memory is released.
    wait_until(lambda: state_of(holder["pid"]) is None, what="the zombie to go with its namespace")
    after = run_wait({"timeout": 30, "poll_interval": 0.1, "no_processes": True}, gpu.env())
    assert after["released"] is True, after


def test_host_pid_is_invisible_inside_a_namespace_container(reaper: Reaper, gpu: SimGpu, tmp_path: Path) -> None:
    holder = plain_holder(reaper, gpu, mib=2048)
    with host_proc_view() as host_proc:
        gpu.host_proc = host_proc
        gpu.save()
        with pid_namespace() as namespace:
            inventory = namespace.write_inventory(tmp_path / "inventory")
            play = [{"hosts": "ct", "gather_facts": False,
                     "tasks": [wait_task({"devices": [0], "timeout": 1.0, "poll_interval": 0.2}, gpu.env(), "inside")]}]
            run = run_playbook(play, inventory=inventory, timeout=300)
            result = run.result("inside")
            assert result["failed"] is True, result
            [entry] = result["holders"]
            assert entry["pid"] == holder["pid"] and entry["visible"] is False and entry["kind"] == "invisible"
            assert "host pid" in entry["description"] and entry["host_pids_visible"] is False
            assert result["escalation"] == "container_reboot" and "verdict" not in result
            assert "not visible in this container" in result["msg"]

            # The simulated driver inside still judges the holder by its host pid: kill it, and the
            # wait inside the container sees the memory go.
            reaper.kill(holder["pid"])
            play[0]["tasks"][0][MODULE]["timeout"] = 30
            run = run_playbook(play, inventory=inventory, timeout=300)
            assert run.result("inside")["released"] is True, run.result("inside")


def test_hanging_query_fails_clearly_instead_of_hanging(gpu: SimGpu) -> None:
    gpu.fault("nvmlDeviceGetMemoryInfo", hang=True)
    result = run_wait({"timeout": 60, "query_timeout": 1.5}, gpu.env())
    assert result["failed"] is True
    assert result["error_kind"] == "hung"
    assert "did not answer" in result["msg"] and "query_timeout=1.5s" in result["msg"]
    assert processes_with_env(str(gpu.state_path)) == []  # the hung child was killed and reaped


def test_nvidia_smi_fallback_when_bindings_are_missing(reaper: Reaper, gpu: SimGpu) -> None:
    holder = plain_holder(reaper, gpu, mib=3072)
    # No PYTHONPATH: the target Python has no pynvml; nvidia-smi is on PATH.
    env = {**gpu.env(with_bindings=False), "PATH": f"{gpu.fake_nvidia_smi_path()}:{os.environ['PATH']}"}
    gpu.teardown_delay = 1.0
    gpu.save()
    reaper.kill(holder["pid"])
    broken = {**gpu.env(with_bindings=False), "PATH": env["PATH"], "GPUOPS_SIMNVML_STATE": "/nonexistent/state.json"}
    run = run_playbook(local_play([
        wait_task({"timeout": 60, "poll_interval": 0.2, "no_processes": True}, env, "fallback"),
        wait_task({"timeout": 5}, broken, "fallback without a driver"),
    ]), timeout=300)
    result = run.result("fallback")
    assert result["released"] is True and result["backend"] == "nvidia-smi", result
    gpu0 = result["gpus"][0]
    assert gpu0["used_mib_before"] == 3072 + 4 and gpu0["used_mib_after"] == 4
    assert gpu0["reserved_mib"] is None  # the CSV fallback does not report the reservation
    assert result["released_mib"] == 3072
    failed = run.result("fallback without a driver")
    assert failed["failed"] is True and failed["error_kind"] == "library_not_found"
    assert "libnvidia-ml.so" in failed["msg"] and failed["backend"] == "nvidia-smi"


def test_no_gpu_at_all(tmp_path: Path) -> None:
    bare = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    empty = SimGpu(tmp_path)  # a loaded driver that sees no GPU
    empty.save()
    run = run_playbook(local_play([
        wait_task({"timeout": 5}, empty.env(), "driver without GPUs"),
        wait_task({"timeout": 5, "gpus_required": False}, empty.env(), "driver without GPUs optional"),
        wait_task({"gpus_required": False, "timeout": 5}, bare, "optional"),
        wait_task({"timeout": 5}, bare, "required"),
        # The real nvidia-ml-py bindings (installed in the test venv) on a machine without a driver.
        dict(wait_task({"timeout": 5}, bare, "real bindings"), vars={"ansible_python_interpreter": sys.executable}),
        dict(wait_task({"timeout": 5, "gpus_required": False}, bare, "real bindings optional"),
             vars={"ansible_python_interpreter": sys.executable}),
    ]), timeout=300)
    optional = run.result("optional")
    assert not optional.get("failed") and optional["released"] is True, optional
    assert optional["gpu_present"] is False and optional["backend"] == "none" and optional["gpus"] == []
    assert "no NVIDIA GPU" in optional["msg"]
    required = run.result("required")
    assert required["failed"] is True and required["error_kind"] == "not_installed"
    assert "nvidia-ml-py" in required["msg"]
    real = run.result("real bindings")
    if not DRIVER_ANSWERS:  # where a driver answers, the real bindings find it: no such case there
        assert real["failed"] is True and real["error_kind"] == "library_not_found", real
        assert "libnvidia-ml.so.1" in real["msg"]
    no_devices = run.result("driver without GPUs")
    assert no_devices["failed"] is True and no_devices["error_kind"] == "no_devices", no_devices
    assert not run.result("driver without GPUs optional").get("failed")
    real_optional = run.result("real bindings optional")
    if not DRIVER_ANSWERS:
        assert not real_optional.get("failed") and real_optional["gpu_present"] is False, real_optional


def test_driver_errors_and_bad_options_fail_clearly(tmp_path: Path) -> None:
    faults = {
        "driver not loaded": ("nvmlInit", "DRIVER_NOT_LOADED", "driver_not_loaded", "kernel driver is not loaded"),
        "version mismatch": ("nvmlInit", "LIB_RM_VERSION_MISMATCH", "version_mismatch", "differ in version"),
        "gpu lost": ("nvmlDeviceGetMemoryInfo", "GPU_IS_LOST", "gpu_lost", "GPU is lost"),
        "reset required": ("nvmlDeviceGetComputeRunningProcesses", "RESET_REQUIRED", "reset_required", "requires a reset"),
    }
    tasks = []
    for name, (call, error, _kind, _words) in faults.items():
        sim = SimGpu(tmp_path / name.replace(" ", "_"))
        sim.directory.mkdir()
        sim.add_device()
        sim.fault(call, error)
        # gpus_required=false excuses a host without a driver, never a broken GPU.
        no_driver = name == "driver not loaded"
        tasks.append(wait_task({"timeout": 5, "gpus_required": no_driver}, sim.env(), name))
    ok = SimGpu(tmp_path / "ok")
    ok.directory.mkdir()
    ok.add_device()
    bad_options = {
        "unknown device": ({"devices": ["7"]}, "devices: no GPU 7 on this host"),
        "bad poll_interval": ({"poll_interval": 0}, "poll_interval: must be at least 0.01 and at most 3600 seconds, got 0"),
        "spinning poll_interval": ({"poll_interval": 1e-9}, "poll_interval: must be at least 0.01 and at most 3600 seconds"),
        "NaN timeout": ({"timeout": "nan"}, "timeout: must be a finite number of seconds, got nan"),
        "infinite timeout": ({"timeout": "inf"}, "timeout: must be a finite number of seconds, got inf"),
        "huge query_timeout": ({"query_timeout": 1e12}, "query_timeout: must be more than 0 and at most 86400 seconds"),
        "NaN query_timeout": ({"query_timeout": "nan"}, "query_timeout: must be a finite number of seconds"),
        "zero query_timeout": ({"query_timeout": 0}, "query_timeout: must be more than 0"),
        "infinite ceiling": ({"max_used_mib": "inf"}, "max_used_mib: must be a finite number, 0 or more, got inf"),
        "NaN percent": ({"max_used_percent": "nan"}, "max_used_percent: must be between 0 and 100, got nan"),
        "infinite host floor": ({"min_host_available_gib": "inf"}, "min_host_available_gib: must be a finite number"),
        "bad percent": ({"max_used_percent": 150}, "max_used_percent: must be between 0 and 100"),
        "bad pid": ({"pids_gone": [-3]}, "pids_gone: process IDs must be positive"),
    }
    for name, (args, _words) in bad_options.items():
        tasks.append(wait_task({"timeout": 5, **args}, ok.env(), name))
    everything = {"timeout": "nan", "poll_interval": 0, "max_used_percent": 150, "pids_gone": [-3], "nvidia_smi": ""}
    tasks.append(wait_task(everything, ok.env(), "every problem at once"))
    run = run_playbook(local_play(tasks), timeout=300)
    at_once = run.result("every problem at once")
    assert at_once["failed"] is True and "polls" not in at_once and "elapsed" not in at_once
    assert [p["option"] for p in at_once["option_problems"]] == [
        "timeout", "poll_interval", "max_used_percent", "pids_gone", "nvidia_smi"]
    unknown = run.result("unknown device")
    assert unknown["option_problems"] == [{"option": "devices", "reason": unknown["msg"].split(": ", 1)[1]}]
    for name, (_call, _error, kind, words) in faults.items():
        result = run.result(name)
        assert result["failed"] is True and result["error_kind"] == kind, (name, result)
        assert words in result["msg"], (name, result["msg"])
        assert "Traceback" not in result.get("module_stderr", "")
    for name, (_args, words) in bad_options.items():
        result = run.result(name)
        assert result["failed"] is True and words in result["msg"], (name, result)
        assert "Traceback" not in result.get("module_stderr", "") and "polls" not in result, (name, result)


def test_check_mode_and_host_memory_floor(reaper: Reaper, gpu: SimGpu) -> None:
    sleeper = plain_holder(reaper, gpu, mib=1, device=1)
    run = run_playbook(local_play([
        wait_task({"timeout": 5, "devices": [0]}, gpu.env(), "free"),
        wait_task({"timeout": 0.5, "poll_interval": 0.1, "devices": [0], "min_host_available_gib": 1e6}, gpu.env(), "floor"),
        wait_task({"timeout": 0.5, "poll_interval": 0.1, "devices": [0], "pids_gone": [sleeper["pid"]]}, gpu.env(), "pid"),
    ]), check=True, timeout=300)
    free = run.result("free")
    assert free["released"] is True and free["changed"] is False and not free.get("failed")
    floor = run.result("floor")
    assert floor["failed"] is True and "host MemAvailable" in floor["msg"]
    assert floor["host_available_gib_after"] > 0
    pid = run.result("pid")
    assert pid["failed"] is True and pid["pids_remaining"][0]["pid"] == sleeper["pid"]
    assert f"pids still present: {sleeper['pid']}" in pid["msg"]


def test_gpu_drain_role_says_when_only_a_reboot_helps(reaper: Reaper, gpu: SimGpu) -> None:
    live = plain_holder(reaper, gpu, mib=512, device=1)
    with pid_namespace() as namespace:
        holder = namespace_holder(reaper, namespace, gpu, mib=2048, stuck_teardown=True)
        reaper.kill(holder["pid"])
        wait_until(lambda: state_of(holder["pid"]) == "Z", what="the holder to become a zombie")
        common = {"gpu_drain_timeout": 1.0, "gpu_drain_poll_interval": 0.2, "gpu_drain_environment": gpu.env()}
        play = [{
            "hosts": "localhost", "connection": "local", "gather_facts": False,
            "vars": {"ansible_python_interpreter": TARGET_PYTHON},
            "tasks": [
                {"name": "stuck GPU", "ansible.builtin.include_role": {"name": "gpuops.relaunch.gpu_drain"},
                 "vars": {**common, "gpu_drain_devices": ["0"], "gpu_drain_fail_on_timeout": False}},
                {"name": "report stuck", "ansible.builtin.debug": {"msg": {
                    "needs_reboot": "{{ gpu_drain_needs_reboot }}", "verdict_defined": "{{ gpu_drain_verdict is defined }}",
                    "escalation": "{{ gpu_drain_escalation }}",
                    "pids": "{{ gpu_drain_holders | map(attribute='pid') | list }}"}}},
                # Last: with a live holder and gpu_drain_fail_on_timeout at its default, the role fails.
                {"name": "held GPU", "ansible.builtin.include_role": {"name": "gpuops.relaunch.gpu_drain"},
                 "vars": {**common, "gpu_drain_devices": ["1"]}},
            ],
        }]
        run = run_playbook(play, timeout=300)
        stuck = run.result("report stuck")["msg"]
        assert stuck["needs_reboot"] is True and stuck["escalation"] == "container_reboot", run.stdout
        assert stuck["verdict_defined"] is False  # one name: gpu_drain_escalation
        assert stuck["pids"] == [holder["pid"]]
        stop = run.tasks["gpuops.relaunch.gpu_drain : Stop when the GPUs are still held"]
        assert [entry.get("skipped", False) for entry in stop] == [True, False]
        assert stop[1]["failed"] is True and f"pid {live['pid']}" in stop[1]["msg"]
        held = run.tasks["gpuops.relaunch.gpu_drain : Wait until the GPUs are released"][1]
        assert held["escalation"] == "signals" and held["needs_reboot"] is False
        assert run.rc != 0


def test_query_stuck_in_the_kernel_is_left_behind_and_named(reaper: Reaper, gpu: SimGpu) -> None:
    """A query process that even SIGKILL cannot end (here: frozen by the cgroup freezer, in D)."""
    gpu.fault("nvmlDeviceGetMemoryInfo", hang=True)
    state = str(gpu.state_path)
    frozen: list[int] = []

    def freeze_the_query_process() -> None:
        def query_process() -> int | None:
            pids = set(processes_with_env(state))
            for pid in pids:
                parent = parent_pid(pid)
                if parent in pids and _cmdline(pid) == _cmdline(parent) and b"AnsiballZ" in _cmdline(pid) \
                        and _detached(pid):
                    return pid
            return None
        wait_until(lambda: query_process() is not None, timeout=120, what="the NVML query process")
        pid = query_process()
        reaper.frozen(pid)
        frozen.append(pid)

    freezer = threading.Thread(target=freeze_the_query_process)
    freezer.start()
    result = run_wait({"timeout": 60, "query_timeout": 8}, gpu.env())
    freezer.join()
    [stuck] = frozen
    assert result["failed"] is True and result["error_kind"] == "hung", result
    assert f"the query process {stuck} did not end after SIGKILL" in result["msg"]
    # The play came back although the stuck process still exists (it holds none of the module's pipes).
    assert state_of(stuck) == "D"


def _detached(pid: int) -> bool:
    """The query process has let go of the module's stdio (its stdio is /dev/null, only its two pipes
    are left): a process stuck in the driver is stuck there, not in the moment after its fork."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        return os.readlink(f"/proc/{pid}/fd/1") == os.devnull and sum(link.startswith("pipe:") for link in links) <= 2
    except OSError:
        return False


def _cmdline(pid: int | None) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
