# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One snapshot of a process table, read from a /proc root.

The scan reads only what is needed: ``stat`` of every process (one read each), ``cmdline`` only of
processes that can have one, and threads, wchan and open files only of the few processes that are
interesting (zombies with threads, D-state, the job, possible GPU holders). Processes vanish while
we read; that is normal and never an error. Whether a process is still the one seen earlier is
answered in one place, :class:`.signal_gate.Identity` (pid, starttime).

What a process writes about itself (comm, arguments) is kept as the bytes read and escaped the
first time anything asks for it (:attr:`Process.comm`, :attr:`Process.cmdline`): those are the
only ways to read it, so nothing unescaped leaves this module, and a scan of ten thousand processes
escapes only what a selection matches or a result names. A caller that asks about a few processes
only (the stop path, which proves members by start time, marks and descent) scans without command
lines: each is read when asked for, and proven by the start time then.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import stat
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Iterator, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls

PF_KTHREAD = 0x00200000
# The wchan of a thread asleep in the NVIDIA driver (uvm_*, nv_*, os_*): where only the host helps.
DEFAULT_DRIVER_WCHAN = r"^(uvm_|nv_|nvidia|os_|_nv)"
_READ_SIZE = 4096
# Never through a link, never blocking: a fixture tree (proc_root) could hold anything.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# The NVIDIA driver's character devices: /dev/nvidiaN is 195:N for the GPU whose minor number is N,
# /dev/nvidia0 to /dev/nvidia247 (the driver's NV_MINOR_DEVICE_NUMBER_REGULAR_MAX);
# /dev/nvidia-modeset is 195:254 and /dev/nvidiactl 195:255, which every GPU user holds whatever its
# GPU; /dev/nvidia-uvm and /dev/nvidia-caps/* have majors of their own, given at load time.
NVIDIA_MAJOR = 195
MAX_GPU_MINOR = 247


def read_small(path: str) -> bytes | None:
    """The content of a small /proc file, or None if it (or its process) is gone or unreadable."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        return None
    try:
        chunk = os.read(fd, _READ_SIZE)
        if len(chunk) < _READ_SIZE:
            return chunk  # the whole file: /proc hands out a small one in one read
        chunks = [chunk]
        while chunk:
            chunk = os.read(fd, _READ_SIZE)
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class StatFields:
    """The fields of /proc/PID/stat (or task/TID/stat) that we use."""

    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    flags: int
    threads: int
    starttime: int


# A byte that is neither printable ASCII nor tab, or one that may start what Jinja reads ("{{",
# "#jinja2:"): text without one is shown as it is.
_NOT_PLAIN = re.compile(b"[^\t\x20-\x7e]|[{#]")


def shown_text(raw: bytes) -> str:
    """What a process wrote about itself (comm, an argument), as text that is safe to show and to
    match: every control character escaped (see terminal.escape_controls). A process chooses these
    bytes, and every result and message that names a process carries them to a terminal."""
    if _NOT_PLAIN.search(raw) is None:
        return raw.decode("ascii")  # nothing escape_controls would change
    return _escaped(raw)


@lru_cache(maxsize=256)
def _escaped(raw: bytes) -> str:
    # The workers of one job share their command line: each distinct one is escaped once.
    return escape_controls(raw.decode("utf-8", "replace"))


def shown_cmdline(raw: bytes) -> str:
    """A /proc/PID/cmdline as one line: the arguments joined by spaces, shown as shown_text."""
    return shown_text(raw.rstrip(b"\0").replace(b"\0", b" "))


def parse_stat(raw: bytes) -> StatFields | None:
    """Parse a stat line; comm may hold spaces and ')' so split after the *last* ')'."""
    try:
        open_paren = raw.index(b"(")
        close_paren = raw.rindex(b")")
        comm = shown_text(raw[open_paren + 1:close_paren])
        rest = raw[close_paren + 2:].split()
        return StatFields(
            comm=comm,
            state=rest[0].decode("ascii", "replace"),
            ppid=int(rest[1]),
            pgid=int(rest[2]),
            sid=int(rest[3]),
            flags=int(rest[6]),
            threads=int(rest[17]),
            starttime=int(rest[19]),
        )
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Thread:
    """One thread (task) of a process."""

    tid: int
    state: str
    wchan: str
    comm: str

    def as_dict(self) -> dict[str, object]:
        return {"tid": self.tid, "state": self.state, "wchan": self.wchan, "comm": self.comm}


class Process:  # pylint: disable=too-many-instance-attributes
    """One process as seen in the snapshot.

    `comm` and `cmdline` are always shown text (escaped, see :func:`shown_text`); a scanned process
    holds the bytes it read and escapes them when first asked (:func:`read_process`). One read
    without its cmdline reads that when first asked, and proves it by the start time (see
    :meth:`cmdline`).
    """

    __slots__ = ("pid", "starttime", "ppid", "pgid", "sid", "state", "threads", "is_kernel_thread", "uid",
                 "task_list", "exe", "_comm", "_comm_raw", "_cmdline", "_cmdline_raw", "_cmdline_root")

    def __init__(self, pid: int, starttime: int, ppid: int, pgid: int, sid: int, state: str, comm: str,
                 threads: int, is_kernel_thread: bool, cmdline: str = "", uid: int | None = None,
                 task_list: list[Thread] | None = None, exe: str | None = None) -> None:
        self.pid = pid
        self.starttime = starttime
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid
        self.state = state
        self.threads = threads
        self.is_kernel_thread = is_kernel_thread
        self.uid = uid
        self.task_list: list[Thread] = [] if task_list is None else task_list
        # The target of /proc/PID/exe as read (None: not read yet, "": unreadable); see ProcessTable.executable.
        self.exe = exe
        self._comm: str | None = comm
        self._comm_raw = b""
        self._cmdline: str | None = cmdline
        self._cmdline_raw = b""
        # The /proc root to read the cmdline from when first asked; None: read with the stat, or given.
        self._cmdline_root: str | None = None

    @classmethod
    def as_read(cls, pid: int, fields: list[bytes], is_kernel_thread: bool, comm_raw: bytes,
                cmdline_raw: bytes, cmdline_root: str | None = None) -> "Process":
        """A process from its stat fields after the comm (`fields`) and the raw bytes of its comm and
        cmdline, shown (escaped) only when asked for; with `cmdline_root`, its cmdline is read from
        there when first asked (see :meth:`cmdline`)."""
        process = cls(pid, int(fields[19]), int(fields[1]), int(fields[2]), int(fields[3]),
                      fields[0].decode("ascii", "replace"), "", int(fields[17]), is_kernel_thread)
        process._comm, process._comm_raw = None, comm_raw
        if cmdline_raw or cmdline_root is not None:
            process._cmdline, process._cmdline_raw, process._cmdline_root = None, cmdline_raw, cmdline_root
        return process

    @property
    def comm(self) -> str:
        """Its comm (``/proc/PID/stat``), escaped."""
        if self._comm is None:
            self._comm, self._comm_raw = shown_text(self._comm_raw), b""
        return self._comm

    @comm.setter
    def comm(self, text: str) -> None:
        self._comm, self._comm_raw = text, b""

    @property
    def cmdline(self) -> str:
        """Its arguments joined by spaces (``/proc/PID/cmdline``), escaped; "" when it has none.

        Where it was not read with the stat, it is read now, once; and kept only if the pid still
        has this process's start time after the read ("" otherwise: this process is gone, and the
        arguments read were a later process's with its pid).
        """
        if self._cmdline is None:
            if self._cmdline_root is not None:
                self._cmdline_raw = _cmdline_of(self._cmdline_root, self.pid, self.starttime)
                self._cmdline_root = None
            self._cmdline, self._cmdline_raw = shown_cmdline(self._cmdline_raw), b""
        return self._cmdline

    @cmdline.setter
    def cmdline(self, text: str) -> None:
        self._cmdline, self._cmdline_raw, self._cmdline_root = text, b"", None

    @property
    def is_zombie(self) -> bool:
        return self.state == "Z"

    @property
    def live_threads(self) -> list[Thread]:
        """Threads that have not exited (a Zl leader's main thread is Z, the others run on)."""
        return [t for t in self.task_list if t.state not in ("Z", "X")]

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, starttime={self.starttime}, ppid={self.ppid}, state={self.state!r}, comm={self.comm!r})"


@dataclass(frozen=True)
class OpenDevice:
    """A character device a process holds open: the path its fd leads to (shown escaped) and the
    kernel's numbers of the opened file, which say what it is (a name says nothing)."""

    path: str
    major: int
    minor: int

    @property
    def is_gpu(self) -> bool:
        """A GPU's own device file (/dev/nvidiaN), not one GPU users share (/dev/nvidiactl, -modeset, -uvm)."""
        return self.major == NVIDIA_MAJOR and self.minor <= MAX_GPU_MINOR

    @property
    def number(self) -> str:
        return f"{self.major}:{self.minor}"

    def __str__(self) -> str:
        return f"{self.path} (char {self.number})"


@dataclass(frozen=True)
class DeviceHolder:
    """A process (or one of its threads) holding open a character device at a path matching the glob."""

    pid: int
    tid: int
    comm: str
    state: str
    device: OpenDevice

    def as_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "tid": self.tid, "comm": self.comm, "state": self.state, "device": self.device.path,
                "device_number": self.device.number}


class ProcessTable:
    """A snapshot of all processes under a /proc root, with lazy per-process detail."""

    def __init__(self, processes: dict[int, Process], proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self.processes = processes
        self._children: dict[int, list[int]] | None = None

    # --- reading -----------------------------------------------------------------------------

    @classmethod
    def scan(cls, proc_root: str = "/proc", cmdlines: bool = True) -> "ProcessTable":
        """Read every process's stat (and cmdline where it can have one) once.

        Without `cmdlines`, a process's cmdline is read when something first asks for it (see
        :attr:`Process.cmdline`): for a caller that asks about a few processes, never one that
        matches patterns against the whole table.
        """
        processes: dict[int, Process] = {}
        try:
            names = os.listdir(proc_root)
        except OSError as exc:
            raise ProcfsError(f"cannot list {proc_root}: {exc.strerror}") from exc
        for name in names:
            if not name.isdigit():
                continue
            process = read_process(proc_root, int(name), cmdlines)
            if process is not None:
                processes[process.pid] = process
        return cls(processes, proc_root)

    def load_threads(self, pid: int) -> list[Thread]:
        """Read (once) the threads of `pid` with their state and wchan."""
        process = self.processes[pid]
        if not process.task_list:
            process.task_list = list(_read_threads(self.proc_root, pid))
        return process.task_list

    def load_uid(self, pid: int) -> int | None:
        """The real uid of `pid` (read once), from the ``Uid:`` line of its ``status``; None if unreadable.

        Not the owner of /proc/PID: a process that makes itself non-dumpable
        (``prctl(PR_SET_DUMPABLE, 0)``) gets a /proc directory owned by root.
        """
        process = self.processes[pid]
        if process.uid is None:
            process.uid = _status_uid(read_small(f"{self.proc_root}/{pid}/status"))
        return process.uid

    def argv(self, pid: int) -> list[str]:
        """The arguments of `pid` one by one (the snapshot's cmdline joins them with spaces, so an
        argument holding a space cannot be told apart there). Read again from /proc; where that
        fails or no longer agrees with the snapshot, the snapshot's words."""
        process = self.processes[pid]
        raw = read_small(f"{self.proc_root}/{pid}/cmdline")
        if raw:
            args = [shown_text(arg) for arg in raw.rstrip(b"\0").split(b"\0")]
            if " ".join(args) == process.cmdline:
                return args
        return process.cmdline.split(" ") if process.cmdline else []

    def executable(self, pid: int) -> str:
        """The program `pid` runs, as the kernel knows it (``/proc/PID/exe``, read once); "" when unknown.

        A process chooses its arguments and its comm, but not this: it is the file the kernel
        executed. A zombie leader whose threads run on (``Zl``) has no ``exe`` of its own any more;
        a live thread's is read instead. Kernel threads and plain zombies have none; neither has a
        process of another user to a caller without the right to trace it. A binary deleted since it
        started ends in " (deleted)" (see :func:`program_path`).
        """
        process = self.processes[pid]
        if process.exe is None:
            base = f"{self.proc_root}/{pid}"
            if process.is_zombie and process.threads > 1:
                live = [t for t in self.load_threads(pid) if t.state not in ("Z", "X")]
                base = f"{base}/task/{live[0].tid}" if live else ""
            process.exe = "" if process.is_kernel_thread or not base else escape_controls(_readlink(f"{base}/exe"))
        return process.exe

    # --- structure ---------------------------------------------------------------------------

    @property
    def children(self) -> dict[int, list[int]]:
        if self._children is None:
            children: dict[int, list[int]] = {}
            for process in self.processes.values():
                children.setdefault(process.ppid, []).append(process.pid)
            self._children = children
        return self._children

    def descendants(self, pid: int) -> list[int]:
        """All descendants of `pid` in the snapshot, breadth first."""
        found: list[int] = []
        queue = list(self.children.get(pid, ()))
        seen = set(queue)
        while queue:
            child = queue.pop(0)
            found.append(child)
            for grandchild in self.children.get(child, ()):
                if grandchild not in seen:
                    seen.add(grandchild)
                    queue.append(grandchild)
        return found

    def ancestors(self, pid: int) -> list[int]:
        """The parent chain of `pid`, nearest first, ending at the namespace's PID 1 (or 0)."""
        chain: list[int] = []
        current = self.processes.get(pid)
        while current is not None and current.ppid > 0 and current.ppid not in chain:
            chain.append(current.ppid)
            current = self.processes.get(current.ppid)
        return chain

    # --- selection ---------------------------------------------------------------------------

    def matching(self, patterns: Iterable[Pattern[str]]) -> list[int]:
        """Processes whose full command line matches any pattern (kernel threads never do)."""
        compiled = list(patterns)
        if not compiled:
            return []
        # One verdict per command line: the workers of a job share theirs.
        verdicts: dict[str, bool] = {}
        found = []
        for process in self.processes.values():
            cmdline = process.cmdline
            if not cmdline:
                continue
            verdict = verdicts.get(cmdline)
            if verdict is None:
                verdict = verdicts[cmdline] = any(rx.search(cmdline) for rx in compiled)
            if verdict:
                found.append(process.pid)
        return sorted(found)

    def device_holders(self, device_glob: str, candidates: Iterable[int] | None = None) -> list[DeviceHolder]:
        """Processes/threads holding open a character device at a path matching `device_glob`, with
        the device's numbers (:attr:`OpenDevice.is_gpu` tells a GPU's own file). The one walk for
        every "holds a GPU" in the collection: zombie_facts, zombie_reap and gpu_reclaim's proof.

        Reads ``task/*/fd`` only where it differs from the process's ``fd`` (a zombie leader's own
        ``fd/`` is empty while its live threads still hold the files). Skips the whole fd walk when
        nothing on this machine matches the glob: then nobody can hold such a device.
        """
        if not glob.glob(device_glob):
            return []
        holders: list[DeviceHolder] = []
        pids = sorted(self.processes) if candidates is None else sorted(set(candidates))
        for pid in pids:
            process = self.processes.get(pid)
            if process is None or process.is_kernel_thread:
                continue
            if process.is_zombie:
                for thread in self.load_threads(pid):
                    if thread.state in ("Z", "X"):
                        continue
                    for device in _open_devices(f"{self.proc_root}/{pid}/task/{thread.tid}/fd", device_glob):
                        holders.append(DeviceHolder(pid, thread.tid, thread.comm, thread.state, device))
                continue
            for device in _open_devices(f"{self.proc_root}/{pid}/fd", device_glob):
                holders.append(DeviceHolder(pid, pid, process.comm, process.state, device))
        return holders


class ProcfsError(Exception):
    """The /proc root cannot be read at all."""


def read_process(proc_root: str, pid: int, with_cmdline: bool = True) -> Process | None:
    """What `pid` is now (whatever process that is), or None if there is none.

    Without `with_cmdline` only its stat is read, enough to tell whether it is still the process an
    identity names; its cmdline is read when first asked for (:attr:`Process.cmdline`).
    """
    raw = read_small(f"{proc_root}/{pid}/stat")
    if raw is None:
        return None
    # comm may hold spaces and ')': the fields follow the *last* ')'.
    open_paren = raw.find(b"(")
    close_paren = raw.rfind(b")")
    if open_paren < 0 or close_paren < open_paren:
        return None
    # Up to the start time (the 20th field after the comm): the 30-odd after it are never used.
    fields = raw[close_paren + 2:].split(None, 20)
    try:
        # The flag alone: inside a PID namespace, pid 2 and its children are ordinary processes.
        is_kernel_thread = bool(int(fields[6]) & PF_KTHREAD)
        # Kernel threads and zombies have an empty cmdline: no need to read it.
        has_cmdline = not is_kernel_thread and fields[0] != b"Z"
        cmdline = b""
        if has_cmdline and with_cmdline:
            cmdline = read_small(f"{proc_root}/{pid}/cmdline") or b""
        return Process.as_read(pid, fields, is_kernel_thread, raw[open_paren + 1:close_paren], cmdline,
                               proc_root if has_cmdline and not with_cmdline else None)
    except (ValueError, IndexError):
        return None


def _cmdline_of(proc_root: str, pid: int, starttime: int) -> bytes:
    """The raw cmdline of `pid` if it is still the process that started at `starttime` after the read, else b""."""
    raw = read_small(f"{proc_root}/{pid}/cmdline") or b""
    now = read_process(proc_root, pid, with_cmdline=False) if raw else None
    return raw if now is not None and now.starttime == starttime else b""


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _status_uid(raw: bytes | None) -> int | None:
    """The real uid of a ``status`` file's ``Uid:`` line (real, effective, saved, fs)."""
    for line in (raw or b"").splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            try:
                return int(fields[1])
            except (IndexError, ValueError):
                return None
    return None


DELETED_SUFFIX = " (deleted)"


def program_path(exe: str) -> str:
    """The path of an executable as ``/proc/PID/exe`` names it, without the " (deleted)" the kernel
    appends once the file is gone (a binary replaced by a package upgrade keeps running)."""
    return exe[: -len(DELETED_SUFFIX)] if exe.endswith(DELETED_SUFFIX) else exe


def read_environ_value(proc_root: str, pid: int, name: str) -> str | None:
    """The value of `name` in the environment `pid` was started with (None if absent or unreadable).

    Says nothing about which process that was: :meth:`.signal_gate.ProcessControl.environ_value`
    ties the value to one identity.
    """
    raw = read_small(f"{proc_root}/{pid}/environ")
    if not raw:
        return None
    # The first entry that starts with NAME=: the buffer's start, or right after a NUL.
    prefix = name.encode() + b"="
    if raw.startswith(prefix):
        start = len(prefix)
    else:
        found = raw.find(b"\0" + prefix)
        if found < 0:
            return None
        start = found + 1 + len(prefix)
    end = raw.find(b"\0", start)
    return raw[start:end if end >= 0 else len(raw)].decode("utf-8", "surrogateescape")


def _read_threads(proc_root: str, pid: int) -> Iterator[Thread]:
    task_dir = f"{proc_root}/{pid}/task"
    try:
        tids = sorted(int(name) for name in os.listdir(task_dir) if name.isdigit())
    except OSError:
        return
    for tid in tids:
        raw = read_small(f"{task_dir}/{tid}/stat")
        fields = parse_stat(raw) if raw is not None else None
        if fields is None:
            continue
        wchan = read_small(f"{task_dir}/{tid}/wchan") or b""
        wchan_text = wchan.decode("ascii", "replace").strip()
        yield Thread(tid=tid, state=fields.state, wchan="" if wchan_text == "0" else wchan_text, comm=fields.comm)


def _open_devices(fd_dir: str, device_glob: str) -> list[OpenDevice]:
    """The character devices open in `fd_dir` at paths matching `device_glob`.

    The numbers are the kernel's, of the file each fd leads to (``stat`` follows /proc/PID/fd/N to
    the opened file itself), never read from a name; a regular file or a FIFO named like a device is
    none. Only paths that match the glob are stat'ed (a file on a hung network mount would block).
    """
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    devices: list[OpenDevice] = []
    for name in names:
        link = f"{fd_dir}/{name}"
        try:
            target = os.readlink(link)
            if not fnmatch.fnmatchcase(target, device_glob):
                continue
            info = os.stat(link)
        except OSError:
            continue  # closed meanwhile, or the process is gone
        if stat.S_ISCHR(info.st_mode):
            device = OpenDevice(escape_controls(target), os.major(info.st_rdev), os.minor(info.st_rdev))
            if device not in devices:
                devices.append(device)
    return sorted(devices, key=lambda d: (d.path, d.major, d.minor))


def compile_patterns(patterns: Iterable[str], option: str) -> list[Pattern[str]]:
    """Compile user regexes; BadOption names the option and every pattern that does not compile."""
    compiled: list[Pattern[str]] = []
    bad: list[str] = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            bad.append(f"{pattern!r} is not a valid regular expression: {exc}")
    if bad:
        raise BadOption(option, "; ".join(bad))
    return compiled


def self_and_ancestors(table: ProcessTable, pid: int | None = None) -> set[int]:
    """The given pid (default: this process) and its whole parent chain in `table`."""
    own = os.getpid() if pid is None else pid
    return {own, *table.ancestors(own)}
