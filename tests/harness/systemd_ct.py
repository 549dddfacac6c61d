"""A real LXC container whose init is systemd, for testing the systemd launch backend.

The root filesystem is a Debian minbase with systemd, dbus, python3 and procps, made once by
debootstrap (about 45 s, about 300 MB) and cached under .build/systemd-rootfs. The container boots
to ``systemctl is-system-running`` = running in about a second; Ansible reaches in with the
``community.docker.nsenter`` connection at the container init's host pid (``lxc-info -pH``).

    with systemd_container() as ct:
        ct.run_inside(["systemctl", "is-system-running"])
        run_playbook(plays, inventory=ct.write_inventory(path))

Clean-up is ``lxc-stop -k`` of the container by the name this harness gave it, and removal of its
private lxcpath; the cached rootfs is kept (its /run and /tmp are tmpfs inside the container).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from tests.harness.pidns import NsenterTarget
from tests.harness.playbook import REPO

ROOTFS = REPO / ".build" / "systemd-rootfs"
PACKAGES = "systemd,systemd-sysv,dbus,python3,procps"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def apt_mirror() -> str:
    """The Debian mirror apt already uses on this machine."""
    for source in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        try:
            text = source.read_text(encoding="utf-8")
        except OSError:
            continue
        match = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) or re.search(
            r"^deb\s+(\S+/debian)\s+bookworm", text, re.M)
        if match:
            return match.group(1)
    return DEFAULT_MIRROR


def available() -> str | None:
    """Why a systemd container cannot run here, or None if it can."""
    for tool in ("lxc-start", "lxc-info", "lxc-stop", "debootstrap", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make apt)"
    if os.geteuid() != 0:
        return "needs root"
    return None


def ensure_rootfs(rootfs: Path = ROOTFS, timeout: float = 900) -> Path:
    """The cached systemd rootfs, made by debootstrap on first use (one builder at a time)."""
    stamp = rootfs.parent / (rootfs.name + ".done")
    if stamp.exists():
        return rootfs
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    with open(rootfs.parent / (rootfs.name + ".lock"), "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return rootfs
        building = rootfs.parent / (rootfs.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", "bookworm", str(building), apt_mirror()],
            check=True, capture_output=True, timeout=timeout,
        )
        shutil.rmtree(rootfs, ignore_errors=True)
        building.rename(rootfs)
        stamp.write_text("ok\n", encoding="utf-8")
    return rootfs


CONFIG = """\
lxc.uts.name = {name}
lxc.rootfs.path = dir:{rootfs}
lxc.init.cmd = /lib/systemd/systemd
lxc.mount.auto = proc:mixed sys:mixed cgroup:mixed
lxc.autodev = 1
lxc.environment = container=lxc
lxc.signal.halt = SIGRTMIN+3
lxc.cgroup.relative = 1
lxc.tty.dir = lxc
lxc.tty.max = 0
lxc.pty.max = 16
lxc.net.0.type = empty
lxc.apparmor.profile = unconfined
"""


@dataclass
class SystemdContainer(NsenterTarget):
    name: str
    lxcpath: Path
    rootfs: Path
    init_pid: int

    def run_inside(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        kwargs.setdefault("check", False)
        cmd = ["nsenter", f"--target={self.init_pid}", "--mount", "--pid", "--uts", "--ipc", "--net", "--", *argv]
        return subprocess.run(cmd, **kwargs)  # pylint: disable=subprocess-run-check

    def path(self, inside: str) -> Path:
        """The host path of a path inside the container."""
        return self.rootfs / inside.lstrip("/")


def _lxc(*args: str, lxcpath: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([args[0], "-P", str(lxcpath), *args[1:]], capture_output=True, text=True,
                          timeout=timeout, check=False)


@contextmanager
def systemd_container(rootfs: Path | None = None, boot_timeout: float = 60) -> Iterator[SystemdContainer]:
    """Boot a systemd container on the cached rootfs; stop it (by name) afterwards."""
    rootfs = ensure_rootfs() if rootfs is None else rootfs
    name = f"gpuops-sd-{uuid.uuid4().hex[:8]}"
    lxcpath = REPO / ".build" / "lxc-systemd" / name
    (lxcpath / name).mkdir(parents=True)
    (lxcpath / name / "config").write_text(CONFIG.format(name=name, rootfs=rootfs), encoding="utf-8")
    started = _lxc("lxc-start", "-n", name, "-d", "-l", "INFO", "-o", str(lxcpath / "lxc.log"), lxcpath=lxcpath)
    try:
        if started.returncode != 0:
            raise RuntimeError(f"lxc-start failed: {started.stderr}\n{(lxcpath / 'lxc.log').read_text()}")
        deadline = Deadline(boot_timeout)

        def init_pid() -> int | None:
            out = _lxc("lxc-info", "-n", name, "-pH", lxcpath=lxcpath).stdout.strip()
            return int(out) if out.isdigit() and int(out) else None

        pid = deadline.poll_for(init_pid, 0.05)
        if pid is None:
            raise RuntimeError("the container's init pid did not appear")
        container = SystemdContainer(name, lxcpath, rootfs, pid)
        states = [""]

        def booted() -> bool:
            states.append(container.run_inside(["systemctl", "is-system-running"], timeout=30).stdout.strip())
            return states[-1] in ("running", "degraded")

        if not deadline.poll(booted, 0.1):
            raise RuntimeError(f"systemd did not finish booting: {states[-1]!r}")
        yield container
    finally:
        _lxc("lxc-stop", "-n", name, "-k", lxcpath=lxcpath)
        shutil.rmtree(lxcpath, ignore_errors=True)
