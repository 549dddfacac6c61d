"""Fixture /proc trees for unit tests: the files the process model reads, nothing more."""

from __future__ import annotations

import os
from pathlib import Path


class FakeProc:
    """Builds PID directories with stat, cmdline, task/*/{stat,wchan} and fd symlinks."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def add(self, pid: int, comm: str, state: str = "S", ppid: int = 1, pgid: int | None = None,
            threads: int = 1, starttime: int = 1000, flags: int = 0, cmdline: list[str] | None = None,
            exe: str | None = None, environ: dict[str, str] | None = None, uid: int | None = None) -> Path:
        """One process. `exe` is the target of its ``exe`` link (what the kernel executed), `environ`
        its start environment, `uid` the real uid of its ``status``."""
        directory = self.root / str(pid)
        directory.mkdir(exist_ok=True)
        (directory / "stat").write_bytes(self.stat(pid, comm, state, ppid, pgid, threads, starttime, flags))
        args = [comm] if cmdline is None else cmdline
        (directory / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in args))
        (directory / "fd").mkdir(exist_ok=True)
        if exe is not None:
            if (directory / "exe").is_symlink():
                (directory / "exe").unlink()  # the pid taken by another process
            os.symlink(exe, directory / "exe")
        if environ is not None:
            (directory / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
        if uid is not None:
            (directory / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n", encoding="ascii")
        return directory

    def add_thread(self, pid: int, tid: int, comm: str, state: str = "S", wchan: str = "0", exe: str | None = None) -> None:
        task = self.root / str(pid) / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "stat").write_bytes(self.stat(tid, comm, state, 1, pid, 1, 1000, 0))
        (task / "wchan").write_text(wchan, encoding="ascii")
        (task / "fd").mkdir(exist_ok=True)
        if exe is not None:
            os.symlink(exe, task / "exe")

    def add_fd(self, pid: int, fd: str, target: str, tid: int | None = None) -> None:
        base = self.root / str(pid)
        fd_dir = base / "fd" if tid is None else base / "task" / str(tid) / "fd"
        fd_dir.mkdir(parents=True, exist_ok=True)
        os.symlink(target, fd_dir / fd)

    @staticmethod
    def stat(pid: int, comm: str, state: str, ppid: int, pgid: int | None, threads: int,
             starttime: int, flags: int) -> bytes:
        group = pid if pgid is None else pgid
        fields = [state, ppid, group, group, 0, -1, flags] + [0] * 10 + [threads, 0, starttime] + [0] * 30
        return f"{pid} ({comm}) {' '.join(str(f) for f in fields)}\n".encode()
