"""gpu_reclaim's options, who is spared and why, and the release view, on fixture trees and scripted GPUs.

No real signal is sent here (a recording kernel stands in for delivery): the integration tests
(tests/integration/test_gpu_reclaim.py) end real processes in a private PID namespace.
"""

from __future__ import annotations

import math
import os
import signal
import stat
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import ProcessControl
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import MIB, GpuDevice, GpuProcess
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.reclaim import (
    ReclaimOptions,
    _SparedView,
    options_from_params,
    plan_reclaim,
    reclaim,
    summary,
)
from tests.harness.clock import FakeClock
from tests.harness.fakeproc import FakeProc

TOTAL = 80 * 1024 * MIB


def params(**overrides: Any) -> dict[str, Any]:
    base = {
        "devices": ["0"], "allow": [], "protected": [], "term_timeout": 10, "kill": True, "release_timeout": 60,
        "poll_interval": 0.5, "max_used_mib": None, "query_timeout": 30, "driver_pids": "host",
        "gpus_required": True, "backend": "auto", "nvidia_smi": "nvidia-smi", "gpu_device_glob": "/dev/nvidia*",
    }
    base.update(overrides)
    return base


def device(index: int = 0, holders: dict[int, float | None] | None = None, base_mib: float = 4,
           minor: int | None | str = "index", minor_unknown: str = "") -> GpuDevice:
    """One GPU; its device file is /dev/nvidiaMINOR, MINOR its index unless given (None: NVML could not say)."""
    holders = holders or {}
    known = sum(mib for mib in holders.values() if mib is not None)
    return GpuDevice(
        index=index, uuid=f"GPU-{index:04d}", name="NVIDIA H100 80GB HBM3", total_bytes=TOTAL,
        used_bytes=int((base_mib + known) * MIB), reserved_bytes=527 * MIB,
        processes=tuple(GpuProcess(pid, None if mib is None else int(mib * MIB)) for pid, mib in holders.items()),
        minor_number=index if minor == "index" else minor, minor_unknown=minor_unknown,
    )


class ScriptedSource:
    """Answers each query with the next snapshot (the last one repeats)."""

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


# --- options ------------------------------------------------------------------------------------


def test_an_empty_device_list_is_refused_never_read_as_all():
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(params(devices=[]))
    assert caught.value.options == ["devices"]
    assert "an empty list never means all" in str(caught.value)


def test_all_is_the_explicit_word_and_stands_alone():
    assert options_from_params(params(devices=["all"])).all_devices is True
    assert options_from_params(params(devices=["ALL"])).devices == ()
    assert options_from_params(params(devices=["0", "GPU-1"])).devices == ("0", "GPU-1")
    with pytest.raises(OptionsInvalid, match="devices: 'all' stands alone"):
        options_from_params(params(devices=["all", "0"]))
    with pytest.raises(OptionsInvalid, match="devices: entries must not be empty"):
        options_from_params(params(devices=["0", " "]))


def test_every_bad_option_is_named_at_once():
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(params(
            allow=["train(", r"ok\b"], protected=["[z"], term_timeout=math.nan, release_timeout=math.inf,
            poll_interval=0, max_used_mib=-1, query_timeout=0, driver_pids="guess", nvidia_smi="",
        ))
    assert caught.value.options == [
        "allow", "protected", "term_timeout", "release_timeout", "poll_interval", "query_timeout", "max_used_mib",
        "driver_pids", "nvidia_smi"]
    text = str(caught.value)
    assert "allow: 'train(' is not a valid regular expression" in text
    assert "term_timeout: must be a finite number of seconds, got nan" in text
    assert "Traceback" not in text


def test_the_default_protected_list_always_applies_and_protected_adds_to_it():
    options = options_from_params(params(protected=[r"\bmy-agent\b"]))
    patterns = [rx.pattern for rx in options.protected]
    # The built-in protection judges executables (selection.PROTECTED_PROGRAMS); protected adds patterns.
    assert patterns == [r"\bmy-agent\b"]


# --- who is spared ------------------------------------------------------------------------------


@pytest.fixture
def proc(tmp_path) -> FakeProc:
    fake = FakeProc(tmp_path / "proc")
    fake.add(1, "sleep", ppid=0)
    return fake


def char_node(path: Path, major: int, minor: int) -> Path:
    """A real character device node (what the kernel compares is its major:minor, not its name)."""
    if os.geteuid() != 0:
        pytest.skip("a stand-in device node (mknod of a character device) needs root")
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
    return path


# The stand-ins of the NVIDIA device files: /dev/nvidiaN is 195:N, /dev/nvidia-modeset 195:254,
# /dev/nvidiactl 195:255, and /dev/nvidia-uvm has a dynamic major (here 511) and minor 0, like GPU 0's.
NODES = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidia3": (195, 3), "nvidia-modeset": (195, 254),
         "nvidiactl": (195, 255), "nvidia-uvm": (511, 0)}


@pytest.fixture
def nodes(tmp_path) -> dict[str, Path]:
    directory = tmp_path / "dev"
    directory.mkdir()
    return {name: char_node(directory / name, major, minor) for name, (major, minor) in NODES.items()}


@pytest.fixture
def gpu_file(nodes) -> Path:
    """The stand-in of /dev/nvidia0 (195:0): the fixture's device holders have an fd pointing at it."""
    return nodes["nvidia0"]


def device_glob(gpu_file: Path) -> str:
    return str(gpu_file.parent / "nvidia*")


def holding(proc: FakeProc, gpu_file: Path, *pids: int) -> None:
    """Give each pid an open fd on the GPU device file (as a CUDA process has)."""
    for pid in pids:
        proc.add_fd(pid, "5", str(gpu_file))


class RecordingControl(ProcessControl):
    """The kernel primitives record instead of signalling; `on_pin` runs when the gate pins a pid."""

    def __init__(self, proc_root: str, on_pin=None) -> None:
        super().__init__(proc_root, use_pidfd=True)
        self.use_pidfd = True
        self.on_pin = on_pin
        self.pinned: list[int] = []
        self.delivered: list[tuple[int, signal.Signals]] = []

    def _open(self, pid: int) -> int:
        self.pinned.append(pid)
        if self.on_pin is not None:
            self.on_pin(pid)
        return pid

    def _signal_handle(self, handle: int, sig: signal.Signals) -> None:
        self.delivered.append((handle, sig))

    def _close(self, handle: int) -> None:
        pass


def spared(plan) -> dict[int, str]:
    return {entry["pid"]: entry["reason"] for entry in plan.spared}


def test_plan_ends_unlisted_holders_and_spares_by_policy_with_reasons(proc, gpu_file):
    proc.add(100, "sshd", cmdline=["sshd: ops"])                              # the connection: an ancestor
    proc.add(101, "python3", ppid=100, cmdline=["python3", "AnsiballZ_gpu_reclaim.py"])  # the module itself
    proc.add(200, "python3", cmdline=["python3", "/ci/job/train.py"])         # a leftover: the target
    proc.add(201, "dcgm-exporter", cmdline=["/usr/bin/dcgm-exporter"])        # allow-listed
    proc.add(202, "containerd", cmdline=["/usr/bin/containerd"], exe="/usr/bin/containerd")  # a protected program
    proc.add(203, "python3", state="Z", cmdline=[])                           # a plain zombie
    proc.add(204, "ansible-playboo", cmdline=["/venv/bin/python", "/venv/bin/ansible-playbook", "x.yml"],
             exe="/usr/bin/python3.11")
    proc.add(205, "python3", pgid=77, cmdline=["python3", "helper.py"])       # in the module's process group
    holding(proc, gpu_file, 200, 204)
    gpus = [device(0, {1: 10, 100: 10, 101: 10, 200: 4096, 201: 80, 202: 10, 203: 512, 204: 10, 205: 10, 999: 64})]
    source = ScriptedSource([gpus])
    options = options_from_params(params(allow=[r"^/usr/bin/dcgm-exporter\b"], gpu_device_glob=device_glob(gpu_file)))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=101, spare_group=77)
    # 204 runs something named ansible-playbook and holds the GPU: a name anyone can give a program
    # spares nothing; only the module's own chain and process group are Ansible's.
    assert [holder.pid for holder in plan.targets] == [200, 204]
    assert spared(plan) == {1: "pid1", 100: "ancestor", 101: "ancestor", 201: "allow_listed", 202: "protected",
                            203: "zombie", 205: "ansible", 999: "gone"}
    assert plan.policy_spared_pids == {1, 100, 101, 201, 202, 205}
    entry = plan.targets[0].entry()
    assert entry["cmdline"] == "python3 /ci/job/train.py" and entry["gpus"] == [0] and entry["used_mib"] == 4096
    # The table is read before the driver is asked for the holders (the identity rests on that order).
    assert source.asked == [None, [0]]


def test_a_holder_on_two_gpus_is_one_target_and_unchosen_gpus_are_left_alone(proc, gpu_file):
    proc.add(300, "python3", cmdline=["python3", "ddp.py"])
    proc.add(301, "python3", cmdline=["python3", "other.py"])
    holding(proc, gpu_file, 300, 301)
    source = ScriptedSource([[device(0, {300: 1000}), device(1, {300: 1000}), device(2, {301: 50})]])
    options = options_from_params(params(devices=["0", "GPU-0001"], gpu_device_glob=device_glob(gpu_file)))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    (target,) = plan.targets
    assert target.pid == 300 and target.gpus == [0, 1] and target.used_mib == 2000
    assert plan.indices == [0, 1] and [d.index for d in plan.before] == [0, 1]


def test_an_unknown_gpu_names_the_option(proc):
    source = ScriptedSource([[device(0)]])
    with pytest.raises(BadOption, match="devices: no GPU 3 on this host"):
        plan_reclaim(source, options_from_params(params(devices=["3"])), str(proc.root))


def test_host_pids_seen_from_another_namespace_are_never_signalled(proc, gpu_file):
    # A /proc whose pid namespace is not the host's: the driver's pid 200 is some other process here.
    (proc.root / "self" / "ns").mkdir(parents=True)
    (proc.root / "self" / "ns" / "pid").write_text("", encoding="ascii")
    proc.add(200, "python3", cmdline=["python3", "unrelated.py"])
    holding(proc, gpu_file, 200)
    source = ScriptedSource([[device(0, {200: 4096})]])
    glob = device_glob(gpu_file)
    plan = plan_reclaim(source, options_from_params(params(gpu_device_glob=glob)), str(proc.root), own_pid=1)
    assert plan.targets == [] and spared(plan) == {200: "invisible"} and plan.host_pids_visible is False
    # Declared to be this namespace's own pids, the holder is a target.
    own = plan_reclaim(source, options_from_params(params(driver_pids="own_namespace", gpu_device_glob=glob)), str(proc.root),
                       own_pid=1)
    assert [holder.pid for holder in own.targets] == [200]


# --- the release view and check mode ------------------------------------------------------------


def test_spared_holders_are_left_out_of_the_release_condition():
    view = _SparedView(ScriptedSource([[device(0, {201: 80, 200: 1000})]]), {201})
    (seen,) = view.query()
    assert [p.pid for p in seen.processes] == [200] and seen.used_mib == 1004
    (raw,) = view.last
    assert raw.used_mib == 1084
    # Where the driver does not say what a spared holder uses, only the listing can count.
    unknown = _SparedView(ScriptedSource([[device(0, {201: None}, base_mib=9000)]]), {201})
    (seen,) = unknown.query()
    assert seen.processes == () and seen.used_bytes == 0


def test_check_mode_plans_signals_nothing_and_takes_one_look(proc, gpu_file):
    proc.add(200, "python3", cmdline=["python3", "/ci/job/train.py"])
    proc.add(201, "dcgm-exporter", cmdline=["/usr/bin/dcgm-exporter"])
    holding(proc, gpu_file, 200, 201)
    source = ScriptedSource([[device(0, {200: 4096, 201: 80})]])
    options = options_from_params(params(allow=["dcgm"], gpu_device_glob=device_glob(gpu_file)))
    clock = FakeClock()
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    result = reclaim(source, options, check_mode=True, proc_root=str(proc.root), clock=clock, sleep=clock.sleep, plan=plan)
    assert result.changed is True and result.signals == [] and result.ended == []
    assert clock.sleeps == []  # one look, no wait
    report = result.as_dict()
    assert report["released"] is False and [t["pid"] for t in report["targets"]] == [200]
    assert report["escalation"] == "signals"
    assert [h["pid"] for h in report["holders"]] == [200]  # the spared holder is not what holds the release
    assert summary(result).startswith("check mode: would end 1 holder(s) of GPU(s) 0; spared 1")


def test_nothing_to_end_is_released_and_unchanged(proc):
    proc.add(201, "dcgm-exporter", cmdline=["/usr/bin/dcgm-exporter"])
    source = ScriptedSource([[device(0, {201: 80})]])
    options = options_from_params(params(allow=["dcgm"]))
    clock = FakeClock()
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    result = reclaim(source, options, proc_root=str(proc.root), clock=clock, sleep=clock.sleep, plan=plan)
    assert result.changed is False and result.released is True
    assert result.as_dict()["escalation"] == "none"
    assert summary(result) == "nothing to end on GPU(s) 0; spared 1; released"


def test_release_options_reach_the_wait():
    options = ReclaimOptions(devices=("0",), max_used_mib=1024)
    assert options.max_used_mib == 1024 and options.kill is True and not options.all_devices


def test_a_zombie_leader_is_judged_by_the_program_its_live_threads_run(proc, gpu_file):
    # Zl: the main thread exited (its cmdline reads empty), another thread runs on and holds the GPU.
    for pid, tag in ((400, "/usr/bin/dcgm-exporter"), (401, "python3 /ci/job/train.py")):
        proc.add(pid, "leader", state="Z", threads=2, cmdline=[])
        proc.add_thread(pid, pid, "leader", state="Z")
        proc.add_thread(pid, pid + 100, "worker", state="S")
        (proc.root / str(pid) / "task" / str(pid + 100) / "cmdline").write_bytes(tag.replace(" ", "\0").encode() + b"\0")
        proc.add_fd(pid, "5", str(gpu_file), tid=pid + 100)
    source = ScriptedSource([[device(0, {400: 80, 401: 4096})]])
    options = options_from_params(params(allow=[r"dcgm-exporter\b"], gpu_device_glob=device_glob(gpu_file)))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    assert spared(plan) == {400: "allow_listed"}
    (target,) = plan.targets
    assert target.pid == 401 and target.entry()["cmdline"] == "python3 /ci/job/train.py"


# --- only proven holders: a GPU device file open now ---------------------------------------------


@pytest.mark.parametrize("glob, why", [
    ("", "must not be empty"),
    ("nvidia*", "must be an absolute path glob"),
    ("/dev/*", "its file name begins with a wildcard"),
    ("/*", "its file name begins with a wildcard"),
    ("/dev/[nt]*", "its file name begins with a wildcard"),
    ("/dev/n*", "also matches /dev/null"),
    ("/d*", "also matches /dev/null"),
    ("/dev/tt?", "also matches /dev/tty"),
])
def test_a_device_glob_that_would_prove_any_process_a_holder_is_refused(glob, why):
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(params(gpu_device_glob=glob))
    assert caught.value.options == ["gpu_device_glob"] and why in str(caught.value)


def test_the_device_glob_defaults_to_the_nvidia_device_files():
    assert options_from_params(params()).gpu_device_glob == "/dev/nvidia*"
    assert options_from_params(params(gpu_device_glob="/dev/nvidia[0-9]*")).gpu_device_glob == "/dev/nvidia[0-9]*"


def test_a_listed_pid_that_holds_no_device_file_is_reported_not_holding_and_never_a_target(proc, gpu_file):
    proc.add(200, "python3", cmdline=["python3", "/ci/job/train.py"])
    proc.add(206, "bash", cmdline=["bash"])                   # a listed pid that is not using the GPU (now)
    proc.add(207, "python3", cmdline=["python3", "x.py"])      # holds a file, but not a device file
    holding(proc, gpu_file, 200)
    proc.add_fd(207, "3", str(gpu_file.parent / "other"))
    (gpu_file.parent / "other").write_bytes(b"")
    source = ScriptedSource([[device(0, {200: 4096, 206: 1024, 207: 512})]])
    options = options_from_params(params(gpu_device_glob=device_glob(gpu_file)))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    assert [holder.pid for holder in plan.targets] == [200]
    assert spared(plan) == {206: "not_holding", 207: "not_holding"}
    assert "gpu_device_glob" in plan.spared[0]["detail"]
    clock = FakeClock()
    result = reclaim(source, options, check_mode=True, proc_root=str(proc.root), clock=clock, sleep=clock.sleep, plan=plan)
    report = result.as_dict()
    assert [entry["pid"] for entry in report["not_holding"]] == [206, 207]
    assert {entry["pid"] for entry in report["not_holding"]} <= {entry["pid"] for entry in report["spared"]}
    # Still listed, so not released; the finding says why it was not signalled.
    assert report["released"] is False
    finding = next(f for f in report["findings"] if f["kind"] == "not_holding" and f["pids"] == [206])
    assert finding["escalation"] == "signals" and "holds no device file of GPU [0]" in finding["why"]
    # Nothing on the machine matches the glob: nobody is a holder, nothing is a target.
    elsewhere = options_from_params(params(gpu_device_glob=str(gpu_file.parent / "absent*")))
    assert plan_reclaim(source, elsewhere, str(proc.root), own_pid=1).targets == []


def test_a_zombie_leader_holds_through_its_live_threads_files_only(proc, gpu_file):
    # The leader's own fd/ is empty; the file is on the live thread. A leader whose threads hold
    # nothing is not holding, whatever the driver lists.
    for pid, holds in ((400, True), (401, False)):
        proc.add(pid, "python3", state="Z", threads=2, cmdline=[])
        proc.add_thread(pid, pid, "python3", state="Z")
        proc.add_thread(pid, pid + 100, "pt_main_thread", state="S")
        if holds:
            proc.add_fd(pid, "7", str(gpu_file), tid=pid + 100)
    source = ScriptedSource([[device(0, {400: 4096, 401: 4096})]])
    plan = plan_reclaim(source, options_from_params(params(gpu_device_glob=device_glob(gpu_file))), str(proc.root), own_pid=1)
    assert [holder.pid for holder in plan.targets] == [400] and spared(plan) == {401: "not_holding"}


def test_the_gate_checks_the_device_file_on_the_pinned_process_before_every_signal(proc, gpu_file):
    """The plan saw the file; at the moment the gate pins the process it holds none: not signalled.

    The fd goes away inside the pin (the worst moment), so a look before the gate would have passed.
    """
    proc.add(200, "python3", cmdline=["python3", "/ci/job/train.py"])
    proc.add(201, "python3", cmdline=["python3", "/ci/job/eval.py"])
    holding(proc, gpu_file, 200, 201)
    source = ScriptedSource([[device(0, {200: 4096, 201: 1024})]])
    options = options_from_params(params(gpu_device_glob=device_glob(gpu_file), release_timeout=0))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    assert [holder.pid for holder in plan.targets] == [200, 201]

    def drop_files(pid: int) -> None:
        if pid == 200:
            (proc.root / "200" / "fd" / "5").unlink()

    control = RecordingControl(str(proc.root), on_pin=drop_files)
    clock = FakeClock()
    result = reclaim(source, options, proc_root=str(proc.root), control=control, clock=clock, sleep=clock.sleep, plan=plan)
    # SIGTERM is followed by SIGCONT (the gate continues a stopped holder so that its handler runs).
    assert control.delivered == [(201, signal.SIGTERM), (201, signal.SIGCONT), (201, signal.SIGKILL)]  # the fixture never exits
    report = result.as_dict()
    assert [(s["pid"], s["signal"], s["result"]) for s in report["signals"]] == [
        (200, "SIGTERM", "not_holding"), (201, "SIGTERM", "sent"), (201, "SIGKILL", "sent")]
    assert [(e["pid"], e["reason"]) for e in report["not_holding"]] == [(200, "not_holding")]
    assert "when it was to be signalled" in report["not_holding"][0]["detail"]
    assert spared(result.plan)[200] == "not_holding"


# --- the device file of *this* GPU: its minor number, from NVML ----------------------------------


def open_files(proc: FakeProc, pid: int, *paths: Path) -> None:
    for fd, path in enumerate(paths, 3):
        proc.add_fd(pid, str(fd), str(path))


def test_a_holder_of_another_gpus_device_file_is_not_proven_a_holder_of_this_gpu(proc, nodes):
    """The driver lists all four on GPU 0 (minor 0); only 200 holds GPU 0's device file (195:0).

    Every CUDA process holds /dev/nvidiactl and /dev/nvidia-uvm whatever GPU it uses (and uvm's
    minor is 0 too), a display client /dev/nvidia-modeset; a regular file has no device numbers at
    all: none of them proves GPU 0.
    """
    regular = nodes["nvidia0"].parent / "nvidia7"
    regular.write_bytes(b"")
    for pid in (200, 201, 202, 203):
        proc.add(pid, "python3", cmdline=["python3", f"/ci/{pid}/train.py"])
    open_files(proc, 200, nodes["nvidiactl"], nodes["nvidia-uvm"], nodes["nvidia0"])
    open_files(proc, 201, nodes["nvidiactl"], nodes["nvidia-uvm"], nodes["nvidia1"])  # a user of GPU 1
    open_files(proc, 202, nodes["nvidiactl"], nodes["nvidia-uvm"], nodes["nvidia-modeset"])
    open_files(proc, 203, regular)
    source = ScriptedSource([[device(0, {200: 4096, 201: 2048, 202: 64, 203: 64}), device(1)]])
    options = options_from_params(params(gpu_device_glob=device_glob(nodes["nvidia0"]), release_timeout=0))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    assert [holder.pid for holder in plan.targets] == [200]
    assert spared(plan) == {201: "not_holding", 202: "not_holding", 203: "not_holding"}
    detail = {entry["pid"]: entry["detail"] for entry in plan.spared}
    assert "no device file of GPU 0 (char 195:0)" in detail[201]
    assert f"{nodes['nvidia1']} (char 195:1)" in detail[201] and "nvidiactl" not in detail[201]
    assert "holds only device files GPU users share" in detail[202] and "nvidia-modeset (char 195:254)" in detail[202]
    assert "holds none of the NVIDIA device files" in detail[203]
    control = RecordingControl(str(proc.root))
    clock = FakeClock()
    result = reclaim(source, options, proc_root=str(proc.root), control=control, clock=clock, sleep=clock.sleep, plan=plan)
    assert control.delivered == [(200, signal.SIGTERM), (200, signal.SIGCONT), (200, signal.SIGKILL)]  # the fixture never exits
    finding = next(f for f in result.as_dict()["findings"] if f["kind"] == "not_holding" and f["pids"] == [201])
    assert "no device file of GPU [0]" in finding["why"]


def test_the_device_file_is_the_one_nvml_names_not_the_one_named_like_the_index(proc, nodes):
    # GPU 0 is the device with minor number 3 (index and minor differ where GPUs were probed in
    # another order than the PCI bus lists them).
    proc.add(300, "python3", cmdline=["python3", "by-index.py"])
    proc.add(301, "python3", cmdline=["python3", "by-minor.py"])
    open_files(proc, 300, nodes["nvidia0"])
    open_files(proc, 301, nodes["nvidia3"])
    source = ScriptedSource([[device(0, {300: 1024, 301: 1024}, minor=3)]])
    plan = plan_reclaim(source, options_from_params(params(gpu_device_glob=device_glob(nodes["nvidia0"]))),
                        str(proc.root), own_pid=1)
    assert [holder.pid for holder in plan.targets] == [301] and spared(plan) == {300: "not_holding"}


def test_a_gpu_whose_minor_number_nvml_cannot_give_has_no_holder_signalled(proc, nodes):
    """No "any NVIDIA file" fallback: without GPU 0's minor number nothing proves a holder of GPU 0."""
    proc.add(400, "python3", cmdline=["python3", "on-gpu0.py"])
    proc.add(401, "python3", cmdline=["python3", "on-both.py"])
    open_files(proc, 400, nodes["nvidiactl"], nodes["nvidia0"])
    open_files(proc, 401, nodes["nvidiactl"], nodes["nvidia1"])
    why = "nvmlDeviceGetMinorNumber failed: Not Supported (NVMLError_NotSupported)"
    source = ScriptedSource([[device(0, {400: 4096, 401: 512}, minor=None, minor_unknown=why), device(1, {401: 512})]])
    options = options_from_params(params(devices=["0", "1"], gpu_device_glob=device_glob(nodes["nvidia0"])))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    # 401 is listed on GPU 1 too, whose device file it holds: proven there.
    assert [holder.pid for holder in plan.targets] == [401] and spared(plan) == {400: "device_unknown"}
    (entry,) = plan.spared
    assert "GPU 0's device file is not known" in entry["detail"] and why in entry["detail"]
    clock = FakeClock()
    report = reclaim(source, options, check_mode=True, proc_root=str(proc.root), clock=clock, sleep=clock.sleep,
                     plan=plan).as_dict()
    assert report["not_holding"] == []
    finding = next(f for f in report["findings"] if f["kind"] == "not_signalled")
    assert finding["pids"] == [400] and finding["escalation"] == "signals" and why in finding["why"]
    # The nvidia-smi backend gives no minor numbers: nothing is signalled through it.
    smi = ScriptedSource([[device(0, {400: 4096}, minor=None, minor_unknown="the nvidia-smi backend does not report")]])
    assert spared(plan_reclaim(smi, options_from_params(params(gpu_device_glob=device_glob(nodes["nvidia0"]))),
                               str(proc.root), own_pid=1)) == {400: "device_unknown"}


def test_the_gate_proves_this_gpus_device_file_on_the_pinned_process(proc, nodes):
    # The look saw GPU 0's file; when pinned, 500 holds GPU 1's in its place: not signalled.
    proc.add(500, "python3", cmdline=["python3", "swap.py"])
    open_files(proc, 500, nodes["nvidia0"])
    source = ScriptedSource([[device(0, {500: 4096}), device(1)]])
    options = options_from_params(params(gpu_device_glob=device_glob(nodes["nvidia0"]), release_timeout=0))
    plan = plan_reclaim(source, options, str(proc.root), own_pid=1)
    assert [holder.pid for holder in plan.targets] == [500]

    def swap(pid: int) -> None:
        (proc.root / str(pid) / "fd" / "3").unlink()
        proc.add_fd(pid, "3", str(nodes["nvidia1"]))

    control = RecordingControl(str(proc.root), on_pin=swap)
    clock = FakeClock()
    report = reclaim(source, options, proc_root=str(proc.root), control=control, clock=clock, sleep=clock.sleep,
                     plan=plan).as_dict()
    assert control.delivered == []
    assert [(s["pid"], s["result"]) for s in report["signals"]] == [(500, "not_holding")]
    assert "no device file of GPU 0 (char 195:0)" in report["not_holding"][0]["detail"]
