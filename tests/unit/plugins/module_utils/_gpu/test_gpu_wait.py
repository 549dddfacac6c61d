"""The release condition, the poll loop and the holders' description, on fixtures and a scripted clock."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.wait import (
    DEFAULT_BASELINE_MIB,
    PidWatch,
    ReleaseCondition,
    describe_holders,
    host_available_bytes,
    judge,
    options_from_params,
    resolve_devices,
    sees_host_pids,
    unmet_on_device,
    wait_for_release,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import MIB, GpuDevice, GpuProcess, GpuQueryError
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation
from tests.harness.clock import FakeClock
from tests.harness.fakeproc import FakeProc

TOTAL = 80 * 1024 * MIB


def device(index: int = 0, used_mib: float = 4, pids: tuple[int, ...] = (), uuid: str | None = None) -> GpuDevice:
    return GpuDevice(
        index=index, uuid=uuid or f"GPU-{index:04d}", name="NVIDIA H100 80GB HBM3", total_bytes=TOTAL,
        used_bytes=int(used_mib * MIB), reserved_bytes=527 * MIB,
        processes=tuple(GpuProcess(pid, 1024 * MIB) for pid in pids),
    )


class ScriptedSource:
    """Answers each query with the next snapshot (the last one repeats), on a clock the test drives."""

    backend = "scripted"

    def __init__(self, snapshots: list[list[GpuDevice]]) -> None:
        self.snapshots = snapshots
        self.asked: list[list[int] | None] = []

    def query(self, indices=None):
        self.asked.append(indices)
        snapshot = self.snapshots[min(len(self.asked) - 1, len(self.snapshots) - 1)]
        return [d for d in snapshot if indices is None or d.index in indices]

    def close(self):
        pass


@pytest.fixture
def proc(tmp_path) -> FakeProc:
    fake = FakeProc(tmp_path / "proc")
    fake.add(1, "sleep")
    (fake.root / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   2097152 kB\n", encoding="ascii")
    return fake


def test_default_ceiling_is_the_baseline():
    condition = ReleaseCondition()
    assert condition.ceiling_mib == DEFAULT_BASELINE_MIB
    assert unmet_on_device(device(used_mib=DEFAULT_BASELINE_MIB), condition) == []
    assert unmet_on_device(device(used_mib=DEFAULT_BASELINE_MIB + 1), condition) == [
        "GPU 0: 257 MiB used, more than 256 MiB"]


def test_percent_alone_replaces_the_baseline_and_both_ceilings_must_hold():
    assert unmet_on_device(device(used_mib=8000), ReleaseCondition(max_used_percent=10)) == []
    both = ReleaseCondition(max_used_mib=9000, max_used_percent=5)
    assert unmet_on_device(device(used_mib=8000), both) == ["GPU 0: 9.8% used, more than 5%"]


def test_no_processes_names_the_listed_pids():
    unmet = unmet_on_device(device(pids=(11, 12)), ReleaseCondition(no_processes=True))
    assert unmet == ["GPU 0: compute processes still listed: 11, 12"]
    assert unmet_on_device(device(pids=(11,)), ReleaseCondition()) == []


def test_resolve_devices_by_index_and_uuid():
    devices = [device(0, uuid="GPU-aaa"), device(1, uuid="GPU-BBB")]
    assert resolve_devices(devices, []) == [0, 1]
    assert resolve_devices(devices, ["1", "gpu-bbb", "0"]) == [1, 0]
    with pytest.raises(ValueError, match=r"devices: no GPU 3, GPU-zzz on this host; present: 0 \(GPU-aaa\)"):
        resolve_devices(devices, ["3", "GPU-zzz"])


def test_host_available_from_meminfo(proc):
    assert host_available_bytes(str(proc.root)) == 2 * 1024 * 1024 * 1024
    assert host_available_bytes(str(proc.root / "missing")) is None


def test_wait_polls_on_the_interval_until_released(proc):
    clock = FakeClock(100.0)
    source = ScriptedSource([[device(0, 40000), device(1, 9000)], [device(0, 40000)], [device(0, 20000)], [device(0, 4)]])
    outcome = wait_for_release(source, ["0"], ReleaseCondition(), timeout=10, poll_interval=0.5,
                               proc_root=str(proc.root), clock=clock, sleep=clock.sleep)
    assert outcome.released and outcome.polls == 4
    assert source.asked == [None, [0], [0], [0]]  # the inventory first, then only the chosen GPU
    assert clock.sleeps == [0.5, 0.5, 0.5]
    assert outcome.waited_s == pytest.approx(1.5)
    assert [d.used_mib for d in outcome.before] == [40000] and outcome.released_mib == 39996
    assert outcome.as_dict()["escalation"] == "none"
    assert "verdict" not in outcome.as_dict() and "waited_s" not in outcome.as_dict()  # one name each: escalation, elapsed


def test_wait_takes_a_last_look_at_the_deadline_then_describes_holders(proc):
    proc.add(77, "python3", state="S", ppid=1)
    clock = FakeClock(100.0)
    source = ScriptedSource([[device(0, 40000, pids=(77,))]])
    outcome = wait_for_release(source, [], ReleaseCondition(), timeout=1.2, poll_interval=0.5,
                               proc_root=str(proc.root), clock=clock, sleep=clock.sleep)
    assert not outcome.released
    assert clock.sleeps == [0.5, 0.5, pytest.approx(0.2)]  # the last pause ends at the deadline
    assert outcome.polls == 4
    assert outcome.unmet == ["GPU 0: 40000 MiB used, more than 256 MiB"]
    [holder] = outcome.holders
    assert holder["pid"] == 77 and holder["kind"] == "running" and holder["visible"]
    assert outcome.escalation == Escalation.SIGNALS and "verdict" not in outcome.as_dict()
    assert outcome.as_dict()["findings"] == [{"kind": "running", "escalation": "signals", "pids": [77],
                                              "why": holder["description"]}]


def test_timeout_zero_takes_exactly_one_look(proc):
    clock = FakeClock(100.0)
    source = ScriptedSource([[device(0, 40000)]])
    outcome = wait_for_release(source, [], ReleaseCondition(), timeout=0, poll_interval=0.5,
                               proc_root=str(proc.root), clock=clock, sleep=clock.sleep)
    assert outcome.polls == 1 and clock.sleeps == [] and not outcome.released


def test_no_gpu_source_still_waits_for_the_host_floor(proc):
    clock = FakeClock(100.0)
    outcome = wait_for_release(None, [], ReleaseCondition(min_host_available_gib=4), timeout=1, poll_interval=0.5,
                               proc_root=str(proc.root), clock=clock, sleep=clock.sleep)
    assert not outcome.released
    assert outcome.unmet == ["host MemAvailable 2.0 GiB, less than 4 GiB"]
    assert outcome.as_dict()["host_available_gib_after"] == 2.0


def holders_in(proc: FakeProc, pids: tuple[int, ...], visible: bool = True):
    table = ProcessTable.scan(str(proc.root))
    return describe_holders([device(0, 30000, pids=pids)], table, visible)


def test_zombie_orphaned_to_init_needs_a_reboot(proc):
    proc.add(40, "python3", state="Z", ppid=1)
    proc.add_thread(40, 40, "python3", state="Z")
    [holder] = holders_in(proc, (40,))
    assert holder["kind"] == "unreaped_orphan" and holder["parent"] == {"pid": 1, "comm": "sleep", "is_namespace_init": True}
    assert "only a restart of that container" in holder["description"]
    assert judge([device(0, 30000, pids=(40,))], [holder], ReleaseCondition(), []).escalation == Escalation.CONTAINER_REBOOT


def test_zombie_with_a_live_parent_is_reapable(proc):
    proc.add(30, "bash", ppid=1)
    proc.add(41, "python3", state="Z", ppid=30)
    proc.add_thread(41, 41, "python3", state="Z")
    [holder] = holders_in(proc, (41,))
    assert holder["kind"] == "zombie" and "its parent 30 (bash) has not reaped" in holder["description"]
    assert judge([], [holder], ReleaseCondition(), []).escalation == Escalation.SIGNALS


def test_zombie_leader_and_driver_d_state(proc):
    proc.add(50, "python3", state="Z", threads=2, ppid=1)
    proc.add_thread(50, 50, "python3", state="Z")
    proc.add_thread(50, 51, "pt_main_thread", state="S", wchan="futex_wait_queue")
    proc.add(60, "python3", state="D", threads=2, ppid=1)
    proc.add_thread(60, 60, "python3", state="S")
    proc.add_thread(60, 61, "cuda-EvtHandlr", state="D", wchan="uvm_va_space_destroy")
    leader, stuck = holders_in(proc, (50, 60))
    assert leader["kind"] == "zombie_leader" and [t["tid"] for t in leader["live_threads"]] == [51]
    assert "threads 51 still run" in leader["description"]
    assert stuck["kind"] == "uninterruptible"
    assert stuck["uninterruptible"] == [{"tid": 61, "wchan": "uvm_va_space_destroy", "in_gpu_driver": True}]
    assert judge([], [leader], ReleaseCondition(), []).escalation == Escalation.SIGNALS
    assert judge([], [leader, stuck], ReleaseCondition(), []).escalation == Escalation.HOST_ACTION


def test_invisible_holders(proc):
    proc.add(70, "python3")
    [gone] = holders_in(proc, (999,))
    assert gone["visible"] is False and gone["host_pids_visible"] is True and "no longer exists" in gone["description"]
    assert judge([], [gone], ReleaseCondition(), []).escalation == Escalation.HOST_ACTION
    # In a container of its own, pid 70 here is some other process than the host's pid 70.
    [elsewhere] = holders_in(proc, (70,), visible=False)
    assert elsewhere["visible"] is False and elsewhere["host_pids_visible"] is False
    assert "not visible in this container" in elsewhere["description"]
    assert judge([], [elsewhere], ReleaseCondition(), []).escalation == Escalation.CONTAINER_REBOOT


def test_memory_with_no_process_listed_is_explained():
    found = judge([device(0, 30000)], [], ReleaseCondition(), [])
    assert found.escalation == Escalation.SIGNALS and "no process listed" in found.reasons[0]
    assert found.findings[0].kind == "unlisted_memory"


def test_the_decision_reads_fields_not_wording(proc):
    proc.add(70, "python3")
    [elsewhere] = holders_in(proc, (70,), visible=False)
    reworded = dict(elsewhere, description="GPU held by someone (container or not)")
    assert judge([], [reworded], ReleaseCondition(), []).escalation == Escalation.CONTAINER_REBOOT
    [gone] = holders_in(proc, (999,))
    reworded = dict(gone, description="a container holds it")
    assert judge([], [reworded], ReleaseCondition(), []).escalation == Escalation.HOST_ACTION


def test_pid_watch_sees_a_real_process_go_and_a_recycled_pid(proc):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # pylint: disable=consider-using-with
    try:
        watch = PidWatch((child.pid, 4194999), "/proc")  # the second pid does not exist
        assert [p.pid for p in watch.remaining()] == [child.pid]
        child.kill()
        child.wait(timeout=30)
        assert watch.remaining() == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    proc.add(80, "python3", starttime=500)
    watch = PidWatch((80,), str(proc.root))
    assert [p.pid for p in watch.remaining()] == [80]
    proc.add(80, "bash", starttime=900)  # same pid, another process
    assert watch.remaining() == []


def test_this_machine_sees_host_pids_and_a_fixture_counts_as_host(proc):
    assert sees_host_pids("/proc") is True
    assert sees_host_pids(str(proc.root)) is True


@pytest.mark.parametrize("timeout, poll_interval, words", [
    (float("nan"), 0.5, "timeout: must be a finite number of seconds, got nan"),
    (float("inf"), 0.5, "timeout: must be a finite number of seconds, got inf"),
    (1e12, 0.5, "timeout: must be at least 0 and at most 86400 seconds, got 1e+12"),
    (10, 1e-9, "poll_interval: must be at least 0.01 and at most 3600 seconds, got 1e-09"),
    (10, float("nan"), "poll_interval: must be a finite number of seconds, got nan"),
])
def test_wait_refuses_unbounded_seconds_before_any_query(proc, timeout, poll_interval, words):
    clock = FakeClock(100.0)
    source = ScriptedSource([[device(0, 40000)]])
    with pytest.raises(ValueError) as caught:
        wait_for_release(source, [], ReleaseCondition(), timeout=timeout, poll_interval=poll_interval,
                         proc_root=str(proc.root), clock=clock, sleep=clock.sleep)
    assert str(caught.value) == words
    assert source.asked == [] and clock.sleeps == []


# --- gpu_mem_wait's options ----------------------------------------------------------------------

def wait_params(**overrides):
    values = {
        "devices": [], "max_used_mib": None, "max_used_percent": None, "no_processes": False, "pids_gone": [],
        "min_host_available_gib": None, "timeout": 300.0, "poll_interval": 0.5, "query_timeout": 30.0,
        "gpus_required": True, "backend": "auto", "nvidia_smi": "nvidia-smi", "proc_root": "/proc",
    }
    values.update(overrides)
    return values


def test_every_bad_option_is_reported_at_once():
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(wait_params(
            timeout=float("nan"), poll_interval=0, query_timeout=0, max_used_mib=float("inf"), max_used_percent=150,
            min_host_available_gib=-1, pids_gone=[5, -3], devices=["0", " "], nvidia_smi="",
        ))
    assert caught.value.options == ["timeout", "poll_interval", "query_timeout", "max_used_mib", "max_used_percent",
                                    "min_host_available_gib", "pids_gone", "devices", "nvidia_smi"]
    msg = caught.value.as_result()["msg"]
    assert "max_used_mib: must be a finite number, 0 or more, got inf" in msg
    assert "max_used_percent: must be between 0 and 100, got 150" in msg
    assert "query_timeout: must be more than 0" in msg


def test_good_options_become_the_condition_and_the_waits():
    options = options_from_params(wait_params(max_used_percent=5, pids_gone=[7], devices=["1"], timeout=0))
    assert options.condition == ReleaseCondition(max_used_percent=5, pids_gone=(7,))
    assert options.devices == ("1",) and options.timeout == 0.0 and options.query_timeout == 30.0


def test_an_internal_error_is_not_reported_as_a_bad_option(monkeypatch):
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import wait

    def broken(*_args, **_kwargs):
        raise ValueError("a bug, not the user's number")

    monkeypatch.setattr(wait, "check_poll_interval", broken)
    with pytest.raises(ValueError, match="a bug") as caught:
        options_from_params(wait_params())
    assert not isinstance(caught.value, (BadOption, OptionsInvalid))


def test_an_unknown_device_is_a_bad_option():
    with pytest.raises(BadOption, match="devices: no GPU 7 on this host") as caught:
        resolve_devices([device(0)], ["7"])
    assert caught.value.option == "devices"


class LostOneSource(ScriptedSource):
    """GPU 1 is lost: a look at all GPUs fails, a look at the others answers."""

    def query(self, indices=None):
        if indices is None or 1 in indices:
            self.asked.append(indices)
            raise GpuQueryError("gpu_lost", "NVML error 15: GPU is lost")
        return super().query(indices)


def test_a_lost_gpu_left_out_by_index_does_not_stop_the_drain_of_the_others(proc):
    source = LostOneSource([[device(0, 4), device(2, 4)]])
    outcome = wait_for_release(source, ["0", "2"], ReleaseCondition(), timeout=1, poll_interval=0.5, proc_root=str(proc.root))
    assert outcome.released and source.asked == [None, [0, 2]]
    # Named by UUID (or all GPUs), the lost GPU still fails the drain: only an index selection reads no inventory.
    with pytest.raises(GpuQueryError, match="lost"):
        wait_for_release(LostOneSource([[device(0, 4)]]), [], ReleaseCondition(), timeout=1, poll_interval=0.5,
                         proc_root=str(proc.root))
