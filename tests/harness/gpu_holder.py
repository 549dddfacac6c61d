"""Real processes that "hold GPU memory" in the simulated NVML (tests/harness/simnvml/pynvml.py).

:class:`SimGpu` owns one simulated driver's state file; :meth:`SimGpu.env` is the environment that
makes a target Python import the simulated ``pynvml`` (PYTHONPATH) and find that state. The holder
makers start real processes with :class:`~tests.harness.procstates.Reaper` (which ends them) and
register them by host pid and start time:

* :func:`plain_holder` -- a sleeping process; kill it and its memory goes after the teardown delay;
* :func:`zombie_leader_holder` -- a ``Zl`` leader whose other thread runs on and holds the memory;
* :func:`namespace_holder` -- a process orphaned to the never-reaping init of a PID namespace: killed,
  it stays a zombie for ever, and with ``stuck_teardown`` its memory is never released.

For a simulated driver that is queried from *inside* a PID namespace, :func:`host_proc_view`
bind-mounts the host's ``/proc`` elsewhere before the namespace starts (its mount table inherits the
mount), so the simulated driver judges liveness by host pid as the real kernel driver does.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline

from tests.harness.pidns import PidNamespace, process_starttime
from tests.harness.procstates import ORPHAN, SLEEPER, ZOMBIE_LEADER, Reaper, host_pid

SIMNVML_DIR = Path(__file__).resolve().parent / "simnvml"
FAKE_NVIDIA_SMI_DIR = Path(__file__).resolve().parent / "fake_nvidia_smi"
STATE_ENV = "GPUOPS_SIMNVML_STATE"
MIB = 1024 * 1024

H100 = {"name": "NVIDIA H100 80GB HBM3", "total_mib": 81559, "reserved_mib": 527, "base_used_mib": 4}


@dataclass
class SimGpu:
    """One simulated driver: devices, registered holders, faults, in a JSON state file."""

    directory: Path
    devices: list[dict[str, Any]] = field(default_factory=list)
    holders: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    teardown_delay: float = 0.2
    stuck_teardown: bool = False
    host_proc: str = "/proc"

    @property
    def state_path(self) -> Path:
        return self.directory / "simnvml.json"

    def add_device(self, **overrides: Any) -> int:
        index = len(self.devices)
        self.devices.append({**H100, "uuid": f"GPU-5c3b1b8e-1d2f-4a7b-9e0c-{index:012x}", **overrides})
        self.save()
        return index

    def register(self, pid: int, mib: float, device: int = 0, **extra: Any) -> dict[str, Any]:
        """Make `pid` (a host pid, as it is now) hold `mib` MiB on `device`."""
        starttime = process_starttime(pid)
        if starttime is None:
            raise LookupError(f"pid {pid} does not exist")
        holder = {"pid": pid, "starttime": starttime, "device": device, "bytes": int(mib * MIB), **extra}
        self.holders.append(holder)
        self.save()
        return holder

    def fault(self, call: str, error: str | None = None, hang: bool = False, **extra: Any) -> None:
        self.faults.append({"call": call, **({"hang": True} if hang else {"error": error}), **extra})
        self.save()

    def save(self) -> None:
        state = {
            "driver_version": "550.54.15",
            "devices": self.devices,
            "holders": self.holders,
            "faults": self.faults,
            "teardown_delay": self.teardown_delay,
            "stuck_teardown": self.stuck_teardown,
            "host_proc": self.host_proc,
            "host_witness": {"pid": os.getpid(), "starttime": process_starttime(os.getpid())},
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
        os.replace(tmp, self.state_path)

    def env(self, with_bindings: bool = True) -> dict[str, str]:
        """Environment for the target: the state file, and (unless not wanted) the bindings on PYTHONPATH."""
        env = {STATE_ENV: str(self.state_path)}
        if with_bindings:
            env["PYTHONPATH"] = str(SIMNVML_DIR)
        return env

    def pinned_bindings(self) -> Path:
        """A directory whose ``pynvml`` is the simulated one pinned to this state file, for a Python that runs
        with a minimal environment (the node's live look at a job's GPUs runs ``python3 -I`` without PYTHONPATH
        or STATE_ENV, importing pynvml from where the module found it): put it on the module's PYTHONPATH."""
        directory = self.directory / "pinned_bindings"
        directory.mkdir(exist_ok=True)
        source = SIMNVML_DIR / "pynvml.py"
        (directory / "pynvml.py").write_text(
            f"import os\nos.environ[{STATE_ENV!r}] = {str(self.state_path)!r}\n"
            f"exec(compile(open({str(source)!r}, encoding='utf-8').read(), {str(source)!r}, 'exec'))\n", encoding="utf-8")
        return directory

    def fake_nvidia_smi_path(self) -> str:
        return str(FAKE_NVIDIA_SMI_DIR)

    def release_instant(self, holder: dict[str, Any]) -> float | None:
        """Wall-clock time at which the simulated driver released `holder` (None: not yet)."""
        seen = self.directory / "simnvml.json.seen" / f"{holder['pid']}-{holder['starttime']}"
        try:
            first = float(seen.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return first + holder.get("teardown_delay", self.teardown_delay)


@contextmanager
def sim_gpu(devices: int = 1, **settings: Any) -> Iterator[SimGpu]:
    with tempfile.TemporaryDirectory(prefix="gpuops-simnvml-") as tmp:
        gpu = SimGpu(Path(tmp), **settings)
        for _index in range(devices):
            gpu.add_device()
        gpu.save()
        yield gpu


def plain_holder(reaper: Reaper, gpu: SimGpu, mib: float, device: int = 0) -> dict[str, Any]:
    """A live sleeping process holding `mib` MiB; returns the registered holder."""
    fields = reaper.start(SLEEPER)
    return gpu.register(int(fields["pid"]), mib, device)


def zombie_leader_holder(reaper: Reaper, gpu: SimGpu, mib: float, device: int = 0) -> dict[str, Any]:
    """A ``Zl`` leader (main thread exited, another runs on) holding `mib` MiB.

    Its parent never waits, so once SIGKILL ends the threads it stays a plain zombie.
    """
    fields = reaper.start(ZOMBIE_LEADER)
    zombie = reaper.record(int(fields["zombie"]))
    return gpu.register(zombie, mib, device)


def namespace_holder(
    reaper: Reaper, namespace: PidNamespace, gpu: SimGpu, mib: float, device: int = 0, **extra: Any,
) -> dict[str, Any]:
    """A holder inside `namespace`, orphaned to its init; registered by its host pid."""
    fields = reaper.start(ORPHAN, runner=["nsenter", f"--target={namespace.init_pid}", "--pid", "--mount", "--"])
    holder = reaper.record(host_pid(namespace.init_pid, int(fields["orphan"])))
    return gpu.register(holder, mib, device, **extra)


@contextmanager
def host_proc_view() -> Iterator[str]:
    """A bind mount of the host's /proc at a temporary path, for as long as the block runs.

    Start a PID namespace inside the block: its mount namespace copies this mount, so the simulated
    driver inside it can judge liveness by host pid. Removing it here leaves the namespace's copy,
    which goes with the namespace.
    """
    path = tempfile.mkdtemp(prefix="gpuops-hostproc-")
    subprocess.run(["mount", "--bind", "/proc", path], check=True, capture_output=True)
    try:
        yield path
    finally:
        if not Deadline(10).poll(lambda: _unmount(path)):
            subprocess.run(["umount", "-l", path], check=False, capture_output=True)
        os.rmdir(path)


def _unmount(path: str) -> bool:
    return subprocess.run(["umount", path], check=False, capture_output=True).returncode == 0
