"""The signal gate's proof (what a target must show once pinned), on fixture /proc trees.

Delivery is recorded, never real: a ProcessControl whose kernel primitives write to a list; except
for the SIGCONT that follows SIGTERM, shown on a real stopped process of this test's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import Process, ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import Protection
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import (
    RECYCLED,
    REFUSED,
    SENT,
    UNPROVEN,
    Identity,
    ProcessControl,
    SignalGate,
)
from tests.harness.fakeproc import FakeProc
from tests.harness.procstates import SAVES_ON_SIGTERM


class RecordingControl(ProcessControl):
    """Records the pins and the deliveries (in `events`, in order) instead of signalling."""

    def __init__(self, proc_root: str, use_pidfd: bool = True) -> None:
        super().__init__(proc_root, use_pidfd=True)
        self.use_pidfd = use_pidfd
        self.events: list[str] = []

    def _open(self, pid: int) -> int:
        self.events.append(f"pin {pid}")
        return pid

    def _signal_handle(self, handle: int, sig: signal.Signals) -> None:
        self.events.append(f"signal {handle} {sig.name}")

    def _close(self, handle: int) -> None:
        pass

    def _kill(self, pid: int, sig: signal.Signals) -> None:
        self.events.append(f"kill {pid} {sig.name}")


def recording_proof(control: RecordingControl, answer: bool, during: Callable[[], None] | None = None):
    def proof(process: Process) -> bool:
        control.events.append(f"proof {process.pid} {process.starttime}")
        if during is not None:
            during()
        return answer
    return proof


def fixture(tmp_path) -> tuple[FakeProc, Identity]:
    proc = FakeProc(tmp_path)
    proc.add(1, "init", ppid=0)
    proc.add(200, "python3", starttime=500)
    return proc, Identity(200, 500, "python3")


def test_the_proof_is_read_after_the_pin_and_a_failed_proof_sends_nothing(tmp_path):
    _proc, target = fixture(tmp_path)
    control = RecordingControl(str(tmp_path))
    assert control.send(target, signal.SIGTERM, recording_proof(control, False)) == UNPROVEN
    assert control.events == ["pin 200", "proof 200 500"]
    assert control.send(target, signal.SIGTERM, recording_proof(control, True)) == SENT
    # SIGTERM is followed by SIGCONT through the same pinned handle (a stopped process runs its handler).
    assert control.events[2:] == ["pin 200", "proof 200 500", "signal 200 SIGTERM", "signal 200 SIGCONT"]
    assert control.send(target, signal.SIGKILL) == SENT
    assert control.events[6:] == ["pin 200", "signal 200 SIGKILL"]  # SIGKILL needs none
    # A signal that asks for anything but an end leaves a stopped process stopped (a debugger's, an operator's).
    assert control.send(target, signal.SIGCHLD) == SENT and control.send(target, signal.SIGUSR1) == SENT
    assert control.events[8:] == ["pin 200", "signal 200 SIGCHLD", "pin 200", "signal 200 SIGUSR1"]


def test_a_pid_recycled_while_the_proof_reads_is_not_signalled(tmp_path):
    # The proof read the files of whatever had the pid then; only a start time unchanged after
    # the read says they were the target's.
    proc, target = fixture(tmp_path)
    control = RecordingControl(str(tmp_path))

    def recycle() -> None:
        proc.add(200, "python3", starttime=900)

    assert control.send(target, signal.SIGKILL, recording_proof(control, True, during=recycle)) == RECYCLED
    assert control.events == ["pin 200", "proof 200 500"]


def test_without_pidfds_the_proof_still_applies(tmp_path):
    _proc, target = fixture(tmp_path)
    control = RecordingControl(str(tmp_path), use_pidfd=False)
    assert control.send(target, signal.SIGTERM, recording_proof(control, False)) == UNPROVEN
    assert control.send(target, signal.SIGTERM, recording_proof(control, True)) == SENT
    assert control.events == ["proof 200 500", "proof 200 500", "kill 200 SIGTERM", "kill 200 SIGCONT"]


def test_the_gate_hands_its_proof_to_every_send_and_protection_comes_first(tmp_path):
    proc, target = fixture(tmp_path)
    proc.add(300, "python3", cmdline=["python3", "AnsiballZ_gpu_reclaim.py"])  # the module itself
    control = RecordingControl(str(tmp_path))
    table = ProcessTable.scan(str(tmp_path))
    gate = SignalGate(Protection(table, (), own_pid=300), control, proof=recording_proof(control, False))
    assert gate.send(target, signal.SIGTERM) == UNPROVEN
    assert gate.send(Identity(300, 1000, "python3"), signal.SIGTERM) == REFUSED  # never pinned, never proven
    assert control.events == ["pin 200", "proof 200 500"]
    # Without a proof the gate is what it always was.
    assert SignalGate(Protection(table, (), own_pid=300), control).send(target, signal.SIGTERM) == SENT


# --- issue 24, item 7: a stopped process is continued after the signal that asks it to end --------

@pytest.mark.parametrize("use_pidfd", [True, False])
def test_sigterm_to_a_stopped_process_is_followed_by_sigcont_through_the_gate(tmp_path, use_pidfd) -> None:
    saved = tmp_path / "saved"
    proc = subprocess.Popen([sys.executable, "-c", SAVES_ON_SIGTERM, str(saved)], stdout=subprocess.PIPE, text=True)
    try:
        assert int(proc.stdout.readline()) == proc.pid
        os.kill(proc.pid, signal.SIGSTOP)
        assert Deadline(10).poll(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T")
        table = ProcessTable.scan("/proc")
        gate = SignalGate(Protection(table, ()), ProcessControl("/proc", use_pidfd=use_pidfd))
        assert gate.send(Identity.of(table.processes[proc.pid]), signal.SIGTERM) == SENT
        assert proc.wait(timeout=10) == 0 and saved.read_text() == "saved"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
