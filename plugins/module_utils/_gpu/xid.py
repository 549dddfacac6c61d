# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""XID events: the one table that classifies them, and the reader of the kernel's own log.

The NVIDIA driver reports a GPU fault as a kernel log line such as::

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.

Only the kernel's own records count. Anyone with write access to ``/dev/kmsg`` (root) or to syslog
(any user, through ``logger``) can put that text into *a* log, but the kernel stamps what user space
writes to ``/dev/kmsg`` with the user facility (it never lets a write claim facility 0, the
kernel's), so the reader keeps facility-0 records and counts the others only as ignored. The line
must start the record's message: a kernel message that merely quotes user text (a mount option,
an unknown parameter) does not start with ``NVRM: Xid``.

One fault writes a burst of lines (the driver repeats an XID for every channel it tears down), so
lines are judged as bursts: the lines of one XID on one GPU with no gap longer than the burst window.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

if not __package__:
    # The private copy the node's live health reads the kernel log with (see _gpu/live_gpus.py).
    from options import BadOption  # pylint: disable=import-error
    from polling import Deadline  # pylint: disable=import-error
    from terminal import decode_line  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import decode_line

# --- the table -------------------------------------------------------------------------------------

APPLICATION = "application"      # the application's fault: a relaunch is the fix
RESET_GPU = "reset_gpu"          # only a GPU reset clears it
REBOOT_HOST = "reboot_host"      # only a reboot of the machine that owns the GPU clears it
WORKFLOW = "workflow"            # follow NVIDIA's workflow: read the GPU's recovery action
INFORMATIONAL = "informational"  # recorded, nothing to do on its own
UNKNOWN = "unknown"              # not in the table: reported, judged through the recovery action
XID_CLASSES = (APPLICATION, RESET_GPU, REBOOT_HOST, WORKFLOW, INFORMATIONAL)

XID_CATALOG = "NVIDIA Xid catalog, https://docs.nvidia.com/deploy/xid-errors/ (Resolution Bucket, Immediate Action)"


@dataclass(frozen=True)
class XidRule:
    """How one XID is judged: its class, how many bursts of it on one GPU count (1: the first), and why."""

    code: int
    xid_class: str
    summary: str
    source: str = XID_CATALOG
    bursts: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {"xid": self.code, "class": self.xid_class, "summary": self.summary, "source": self.source,
                "bursts": self.bursts}


def _rule(code: int, xid_class: str, summary: str, source: str = XID_CATALOG) -> tuple[int, XidRule]:
    return code, XidRule(code, xid_class, summary, source)


# Kept as data: one entry per XID, each with where its class comes from.
XID_TABLE: dict[int, XidRule] = dict([
    _rule(13, APPLICATION, "Graphics Engine Exception (an illegal instruction or address in the application)"),
    _rule(31, APPLICATION, "GPU memory page fault (the application's out-of-range access)"),
    _rule(43, APPLICATION, "GPU stopped processing the application's channel (a fault of the application)"),
    _rule(45, APPLICATION, "Preemptive cleanup after earlier errors (the application's channels were torn down)"),
    _rule(94, APPLICATION, "Contained ECC error (only the application that touched the memory is ended)"),
    _rule(46, RESET_GPU, "GPU stopped processing"),
    _rule(62, RESET_GPU, "Internal micro-controller halt"),
    _rule(64, RESET_GPU, "Failed to record a page retirement or row remap"),
    _rule(95, RESET_GPU, "Uncontained ECC error (every application on the GPU is affected)"),
    _rule(109, RESET_GPU, "Context switch timeout",
          XID_CATALOG + "; the Kubernetes device plugin ignores 109 by default (it treats it as the "
          "application's), but a context that cannot be switched out can leave the GPU stuck for the next "
          "job too, so this table follows NVIDIA's catalog"),
    _rule(119, RESET_GPU, "GSP RPC timeout"),
    _rule(120, RESET_GPU, "GSP error"),
    _rule(140, RESET_GPU, "Unrecovered ECC error"),
    _rule(143, RESET_GPU, "GPU initialization failure"),
    _rule(79, REBOOT_HOST, "GPU has fallen off the bus"),
    _rule(48, WORKFLOW, "Double-bit ECC error: the recovery action (or a remap/retirement pending) says what is needed"),
    _rule(74, WORKFLOW, "NVLink error: the recovery action says what is needed"),
    _rule(154, WORKFLOW, "GPU recovery action changed: the recovery action says what is needed"),
    _rule(63, INFORMATIONAL, "Page retirement or row remap recorded (a reset activates it)",
          XID_CATALOG + "; Azure's node health checks fail a node on 63, this table follows NVIDIA's catalog: "
          "what 63 leads to (a remap or retirement pending a reset) is read and judged from NVML directly"),
    _rule(92, INFORMATIONAL, "High single-bit ECC error rate (corrected)",
          XID_CATALOG + "; Azure's node health checks fail a node on 92, this table follows NVIDIA's catalog: "
          "the errors were corrected, and an uncorrectable one is judged from NVML's ECC counts"),
])

SITE_SOURCE = "site override (xid_overrides)"
# More bursts than this are not a threshold anyone means.
MAX_BURSTS = 1000


def xid_table(overrides: Mapping[Any, Any] | None) -> dict[int, XidRule]:
    """XID_TABLE with a site's overrides: ``{xid: class}`` or ``{xid: {class: ..., bursts: N}}``.

    BadOption naming ``xid_overrides`` for a key that is not an XID number or a value that is not a class.
    """
    table = dict(XID_TABLE)
    for key, value in (overrides or {}).items():
        text = str(key).strip()
        if not re.fullmatch(r"[0-9]{1,4}", text):
            raise BadOption("xid_overrides", f"keys must be XID numbers (0 to 9999), got {str(key)[:40]!r}")
        code = int(text)
        spec = value if isinstance(value, Mapping) else {"class": value}
        unknown = set(spec) - {"class", "bursts"}
        if unknown:
            raise BadOption("xid_overrides", f"XID {code}: unknown keys {sorted(str(k)[:40] for k in unknown)}; "
                                             "allowed: class, bursts")
        xid_class = spec.get("class")
        if xid_class not in XID_CLASSES:
            raise BadOption("xid_overrides", f"XID {code}: class must be one of {', '.join(XID_CLASSES)}, "
                                             f"got {str(xid_class)[:40]!r}")
        bursts = spec.get("bursts", 1)
        if isinstance(bursts, bool) or not isinstance(bursts, int) or not 1 <= bursts <= MAX_BURSTS:
            raise BadOption("xid_overrides", f"XID {code}: bursts must be a whole number from 1 to {MAX_BURSTS}, "
                                             f"got {str(bursts)[:40]!r}")
        known = table.get(code)
        summary = known.summary if known else "not in NVIDIA's catalog as this collection ships it"
        table[code] = XidRule(code, str(xid_class), summary, SITE_SOURCE, bursts)
    return table


def rule_for(table: Mapping[int, XidRule], code: int) -> XidRule:
    return table.get(code) or XidRule(code, UNKNOWN, "not in the table", "none: judged through the GPU's recovery action")


# --- bus ids ---------------------------------------------------------------------------------------

BusId = tuple  # (domain, bus, device) as ints: the kernel log has no function, NVML ends in ".0"
_BUS = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-7])?")


def parse_bus_id(text: str) -> BusId | None:
    """``0000:3b:00`` (the kernel log) and ``00000000:3B:00.0`` (NVML) both as (0, 0x3b, 0)."""
    match = _BUS.fullmatch(text.strip())
    return None if match is None else tuple(int(part, 16) for part in match.groups())


def nvml_bus_id(bus: BusId) -> str:
    """The NVML spelling of a bus id, as a GPU's ``pci_bus_id`` reads."""
    domain, number, device = bus
    return f"{domain:08X}:{number:02X}:{device:02X}.0"


# --- the kernel log --------------------------------------------------------------------------------

KMSG = "/dev/kmsg"
KERNEL_FACILITY = 0
# One /dev/kmsg record is at most about 8 KiB (PRINTK_MESSAGE_MAX and its dictionary); a read with a
# smaller buffer fails with EINVAL.
RECORD_BUFFER = 65536
# What one scan reads at most: the kernel's ring buffer is a few MiB even when enlarged (log_buf_len).
MAX_SCAN_BYTES = 64 * 1024 * 1024
# What of a line's text reaches a result: the driver's own text is short; the rest is not its.
MAX_XID_TEXT = 240
MAX_NAME = 64

_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]{7,16})\): ([0-9]{1,4})(?:,\s?(.*))?", re.DOTALL)
_PID = re.compile(r"\bpid=([0-9]{1,10})\b")
_NAME = re.compile(r"\bname=([^,]{0,200})")

READ = "read"
DENIED = "denied"
ABSENT = "absent"
FAILED = "failed"


@dataclass(frozen=True)
class XidLine:
    """One XID line of the kernel's own log."""

    code: int
    bus: BusId
    time: float           # seconds since the epoch, from the record's timestamp
    seq: int
    pid: int | None
    name: str             # the process name the driver gave, bounded and escaped
    text: str             # the line, bounded and escaped


@dataclass
class KernelLogScan:
    """What a scan of the kernel log found: the XID lines after the cut-off, and what it could not count."""

    status: str = READ
    why: str = ""
    records: int = 0
    bytes: int = 0
    lines: list[XidLine] = field(default_factory=list)
    user_lines_ignored: int = 0    # "NVRM: Xid" text in records user space wrote: never counted
    before_cutoff: int = 0
    lost_records: int = 0          # overwritten in the ring buffer while it was read
    truncated: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "why": self.why, "records": self.records, "bytes": self.bytes,
                "xid_lines": len(self.lines), "user_lines_ignored": self.user_lines_ignored,
                "before_cutoff": self.before_cutoff, "lost_records": self.lost_records, "truncated": self.truncated}


def parse_record(raw: bytes) -> tuple[int, int, int, bytes] | None:
    """(facility, seq, microseconds since boot, message) of one /dev/kmsg record; None if it is not one.

    A record is ``PRI,SEQ,USEC,FLAGS[,...];MESSAGE`` then continuation lines (`` KEY=value``) that
    are the record's dictionary, not its message.
    """
    header, sep, rest = raw.partition(b";")
    if not sep:
        return None
    fields = header.split(b",")
    if len(fields) < 3:
        return None
    try:
        priority, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    message = rest.split(b"\n", 1)[0]
    return priority >> 3, seq, usec, message


def parse_xid(message: str) -> tuple[int, BusId, str] | None:
    """(XID, bus id, the rest of the line) where `message` starts with the driver's XID report."""
    match = _XID_LINE.match(message)
    if match is None:
        return None
    bus = parse_bus_id(match.group(1))
    if bus is None:
        return None
    return int(match.group(2)), bus, match.group(3) or ""


def scan_records(records: Iterable[bytes], since: float, boot_time: float, deadline: Deadline | None = None,
                 max_bytes: int = MAX_SCAN_BYTES) -> KernelLogScan:
    """The XID lines of the kernel's own records at or after `since` (seconds since the epoch).

    `boot_time` turns a record's microseconds since boot into seconds since the epoch. The scan
    stops (``truncated``) at `max_bytes` or at the deadline.
    """
    scan = KernelLogScan()
    for raw in records:
        if raw is _LOST:
            scan.lost_records += 1
            continue
        scan.records += 1
        scan.bytes += len(raw)
        if b"NVRM: Xid" in raw:
            _take(scan, raw, since, boot_time)
        if scan.bytes >= max_bytes or (deadline is not None and deadline.expired()):
            scan.truncated = True
            break
    return scan


def _take(scan: KernelLogScan, raw: bytes, since: float, boot_time: float) -> None:
    parsed = parse_record(raw)
    if parsed is None:
        return
    facility, seq, usec, message = parsed
    text = decode_line(message)
    xid = parse_xid(text)
    if xid is None:
        return
    if facility != KERNEL_FACILITY:
        scan.user_lines_ignored += 1
        return
    when = boot_time + usec / 1e6
    if when < since:
        scan.before_cutoff += 1
        return
    code, bus, rest = xid
    pid = _PID.search(rest)
    name = _NAME.search(rest)
    scan.lines.append(XidLine(code=code, bus=bus, time=round(when, 6), seq=seq,
                              pid=int(pid.group(1)) if pid else None,
                              name=name.group(1).strip()[:MAX_NAME] if name else "",
                              text=text[:MAX_XID_TEXT]))


# What _kmsg_records yields for records overwritten in the ring buffer before they were read.
_LOST = b"<lost>"


def boot_time_now(clock: Callable[[], float] = time.time) -> float:
    """The epoch time of the kernel's timestamp 0: its records count microseconds of CLOCK_MONOTONIC."""
    return clock() - time.monotonic()


def read_kernel_log(since: float, timeout: float, path: str = KMSG, max_bytes: int = MAX_SCAN_BYTES) -> KernelLogScan:
    """Scan the kernel log (``/dev/kmsg``) for XID lines at or after `since`, never blocking.

    Where the kernel log cannot be read, the scan says why (``denied``: inside an LXC container, or
    without CAP_SYSLOG under ``kernel.dmesg_restrict``; ``absent``) and holds no lines: not an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        status = DENIED if exc.errno in (errno.EACCES, errno.EPERM) else ABSENT if exc.errno == errno.ENOENT else FAILED
        return KernelLogScan(status=status, why=_not_read_why(path, exc))
    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            return KernelLogScan(status=FAILED, why=f"{path} is not a character device, so not the kernel log")
        deadline = Deadline(timeout)
        return scan_records(_kmsg_records(fd), since, boot_time_now(), deadline, max_bytes)
    except OSError as exc:
        return KernelLogScan(status=DENIED if exc.errno in (errno.EACCES, errno.EPERM) else FAILED,
                             why=_not_read_why(path, exc))
    finally:
        os.close(fd)


def _kmsg_records(fd: int) -> Iterator[bytes]:
    """Each record from the oldest the kernel still holds to the newest, then stop (never wait)."""
    while True:
        try:
            record = os.read(fd, RECORD_BUFFER)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # overwritten in the ring buffer before it was read: go on
                yield _LOST
                continue
            raise
        if not record:
            return
        yield record


def _not_read_why(path: str, exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"{path}: {exc.strerror}: the kernel log is not visible here (an LXC container is denied it; "
                "read it on the host or the Proxmox node)")
    return f"{path}: {exc.strerror}"


# --- bursts --------------------------------------------------------------------------------------

DEFAULT_BURST_WINDOW = 10.0


@dataclass
class XidBurst:
    """The lines of one XID on one GPU with no gap longer than the burst window: one fault."""

    code: int
    bus: BusId
    first: float
    last: float
    lines: int
    pids: list[int]
    names: list[str]
    text: str   # the first line

    def as_dict(self) -> dict[str, Any]:
        return {"xid": self.code, "pci_bus_id": nvml_bus_id(self.bus), "first": self.first, "last": self.last,
                "lines": self.lines, "pids": self.pids, "names": self.names, "text": self.text}


def bursts(lines: Iterable[XidLine], window: float = DEFAULT_BURST_WINDOW) -> list[XidBurst]:
    """Lines grouped into bursts per (bus, XID), in time order."""
    found: list[XidBurst] = []
    open_bursts: dict[tuple[BusId, int], XidBurst] = {}
    for line in sorted(lines, key=lambda entry: (entry.time, entry.seq)):
        key = (line.bus, line.code)
        current = open_bursts.get(key)
        if current is None or line.time - current.last > window:
            current = XidBurst(line.code, line.bus, line.time, line.time, 0, [], [], line.text)
            open_bursts[key] = current
            found.append(current)
        current.last = line.time
        current.lines += 1
        if line.pid is not None and line.pid not in current.pids and len(current.pids) < 16:
            current.pids.append(line.pid)
        if line.name and line.name not in current.names and len(current.names) < 16:
            current.names.append(line.name)
    return found
