"""Real process states on demand: zombies, Zl leaders, D-state tasks, stale job trees.

Every maker returns the pids it made and registers its processes (and cgroups) with a
:class:`Reaper`, which ends exactly those — by recorded pid checked against the recorded start
time — and nothing else. Fixture programs are tiny Python scripts run with ``python3 -c``; the
optional ``runner`` prefix (e.g. ``["nsenter", "-t", PID, "-p", "-m", "--"]``) starts them inside
a PID namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline

from tests.harness.pidns import process_starttime, stat_fields

FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

# The maker scripts write the pids they want the test to know as one line "key=pid ..." on
# stdout, then keep running. Pids printed inside a namespace are namespace pids; `host_pid`
# translates with /proc/PID/status NSpid.

# What the maker scripts share: put first in each of them.
MAKER_PRELUDE = r"""
import os, sys, time
def sleeper():
    while True:
        time.sleep(3600)
def until_zombie(pid):
    while open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z":
        time.sleep(0.01)
def orphan():
    # A sleeper whose parent exits at once, so that it is orphaned to PID 1 of its namespace.
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:
            os.close(r)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            sleeper()
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.waitpid(middle, 0)
    return pid
"""

PLAIN_ZOMBIE = MAKER_PRELUDE + r"""
child = os.fork()
if child == 0:
    os._exit(0)
# The child is now a zombie: we never wait() for it.
until_zombie(child)
print(f"parent={os.getpid()} zombie={child}", flush=True)
sleeper()
"""

# A zombie leader: a child whose main thread calls pthread_exit while another thread runs on
# (optionally holding a file open), and whose parent never waits.
ZOMBIE_LEADER = MAKER_PRELUDE + r"""
import ctypes, threading
hold = sys.argv[1] if len(sys.argv) > 1 else ""  # further arguments only tag the command line
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    # O_PATH: a stand-in device node (a character device with no driver behind it) opens so too.
    held = os.open(hold, os.O_PATH) if hold else None
    threading.Thread(target=sleeper, daemon=False, name="linger").start()
    os.write(w, b"x")
    # ctypes drops the GIL around the call, so the other thread keeps running.
    ctypes.CDLL(None).pthread_exit(None)
os.close(w)
os.read(r, 1)
until_zombie(child)
print(f"parent={os.getpid()} zombie={child}", flush=True)
sleeper()
"""

# A stale training job: a parent running "train.py", worker children with grandchildren, one
# worker that has already exited (a zombie, the parent is hung and never waits), and an orphan
# that double-forked away from the tree.
STALE_JOB = MAKER_PRELUDE + r"""
workers = []
for _ in range(2):
    # Each worker forks a sleeper of its own; the report waits for both forks (the pipe's end is
    # closed by the worker after its fork and by its child), so a snapshot after it sees the whole tree.
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        if os.fork() == 0:
            os.close(ready_w)
            sleeper()
        os.close(ready_w)
        sleeper()
    os.close(ready_w)
    os.read(ready_r, 1)  # end of file: every copy of the write end is closed
    os.close(ready_r)
    workers.append(pid)
dead = os.fork()
if dead == 0:
    os._exit(7)
orphan_pid = orphan()
until_zombie(dead)
print(f"parent={os.getpid()} workers={','.join(map(str, workers))} zombie={dead} orphan={orphan_pid}", flush=True)
sleeper()
"""

# A process orphaned to its namespace's init (which, if it is `sleep`, never reaps it).
ORPHAN = MAKER_PRELUDE + r"""
print(f"parent={os.getpid()} orphan={orphan()}", flush=True)
sleeper()
"""

SLEEPER = MAKER_PRELUDE + r"""
print(f"pid={os.getpid()}", flush=True)
sleeper()
"""


# A vfork() parent sleeps (state D, killable) until its child execs or exits; this child does
# neither. Python cannot vfork safely, so this one is C, built once per test directory.
# A process that saves its work on SIGTERM (writes "saved" to argv[1]) and prints its pid: stopped
# (SIGSTOP) it runs the handler only once continued.
SAVES_ON_SIGTERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").write("saved"), sys.exit(0)))
print(os.getpid(), flush=True)
time.sleep(300)
"""

VFORK_PARENT_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) {
    if (vfork() == 0) {
        dprintf(1, "parent=%d child=%d\n", (int)getppid(), (int)getpid());
        pause();
        _exit(0);
    }
    return 0;
}
"""


def vfork_parent_program(directory: Path) -> str:
    """Compile the vfork maker into `directory` and return its path (extra argv only tags it)."""
    source = directory / "vfork_parent.c"
    binary = directory / "vfork_parent"
    if not binary.exists():
        source.write_text(VFORK_PARENT_C, encoding="utf-8")
        subprocess.run(["gcc", "-O0", "-o", str(binary), str(source)], check=True, capture_output=True, timeout=60)
    return str(binary)


def host_pid(namespace_init: int, ns_pid: int) -> int:
    """The host pid of the process that is `ns_pid` inside the namespace of `namespace_init`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text(encoding="utf-8")
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                chain = [int(x) for x in line.split()[1:]]
                if len(chain) > 1 and chain[-1] == ns_pid and _in_namespace(int(proc.name), namespace_init):
                    return int(proc.name)
    raise LookupError(f"no process is pid {ns_pid} in the namespace of {namespace_init}")


def _in_namespace(pid: int, namespace_init: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{namespace_init}/ns/pid")
    except OSError:
        return False


def state_of(pid: int) -> str | None:
    """The one-letter state of `pid`, or None if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else fields[0]


def wait_until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition", interval: float = 0.05) -> Any:
    """Poll `condition` until it returns something true, and return that; fail the test naming `what` at the deadline."""
    found = Deadline(timeout).poll_for(lambda: condition() or None, interval)
    if found is None:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return found


@dataclass
class Reaper:
    """Records what a test started and ends exactly that, by (pid, starttime)."""

    processes: list[tuple[int, int]] = field(default_factory=list)
    popens: list[subprocess.Popen] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)

    def record(self, pid: int) -> int:
        starttime = process_starttime(pid)
        if starttime is not None:
            self.processes.append((pid, starttime))
        return pid

    def start(self, script: str, *args: str, runner: list[str] | None = None) -> dict[str, str]:
        """Run a maker script, record its process, and return the "key=value" fields it printed."""
        return self.start_program([PYTHON, "-c", script, *args], runner=runner)

    def start_program(self, argv: list[str], runner: list[str] | None = None) -> dict[str, str]:
        """Run a maker program (any argv), record it, and return the "key=value" fields it printed."""
        argv = [*(runner or []), *argv]
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, start_new_session=True,
        )
        self.popens.append(proc)
        self.record(proc.pid)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"maker exited early with {proc.wait()}")
        return dict(item.split("=", 1) for item in line.split())

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Signal `pid` only if it is still the process we recorded."""
        for recorded, starttime in self.processes:
            if recorded == pid and process_starttime(pid) == starttime:
                os.kill(pid, sig)
                return

    def frozen(self, pid: int) -> Path:
        """Put `pid` into a new frozen cgroup-v1 freezer group: it is in D and survives SIGKILL."""
        group = FREEZER_ROOT / f"gpuops-test-{uuid.uuid4().hex[:8]}"
        group.mkdir()
        self.cgroups.append(group)
        (group / "cgroup.procs").write_text(str(pid), encoding="utf-8")
        (group / "freezer.state").write_text("FROZEN", encoding="utf-8")
        wait_until(lambda: (group / "freezer.state").read_text(encoding="utf-8").strip() == "FROZEN",
                   what=f"freezer {group} to freeze")
        return group

    @staticmethod
    def thaw(group: Path) -> None:
        (group / "freezer.state").write_text("THAWED", encoding="utf-8")

    def cleanup(self) -> None:
        for group in self.cgroups:
            if group.exists():
                self.thaw(group)
        # Each maker runs in a session of its own, so its pid is the process group of everything it
        # forked (the double-forked orphan included). A pid is never reused while it names a live
        # group, so the group signal reaches only what this test started.
        for proc in self.popens:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid, starttime in self.processes:
            if process_starttime(pid) == starttime and state_of(pid) != "Z":
                os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if proc.stdout:
                proc.stdout.close()
        for group in self.cgroups:
            if group.exists():
                wait_until(lambda g=group: not (g / "cgroup.procs").read_text(encoding="utf-8").strip(),
                           what=f"{group} to empty")
                group.rmdir()
