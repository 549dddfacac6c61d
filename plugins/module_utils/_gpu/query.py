# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read GPU memory and compute processes from NVML, never letting a hung driver hang the caller.

NVML calls can block for ever in uninterruptible sleep inside the driver. So NVML is never loaded
in the calling process: a forked child (:class:`NvmlSession`) loads ``pynvml`` (package
``nvidia-ml-py``), initialises it once, and answers one query per request over a pipe; the caller
waits for each answer with its own deadline and, when it passes, kills the child and reports a
hung query. Where the Python bindings are not installed, :class:`NvidiaSmiSession` reads the same
facts from ``nvidia-smi --query-gpu``/``--query-compute-apps`` CSV, each run under a deadline too;
the GPUs' minor numbers, which no ``--query-gpu`` field gives, come from one ``nvidia-smi -q -x``
run, only for the caller that asks (:func:`add_minor_numbers`).

Failures are classified by NVML error code (``nvidia-smi`` exits with the same codes), so the
caller can say "driver not loaded" rather than print a traceback; :data:`NO_GPU_KINDS` are the
ones that mean "this host has no usable NVIDIA GPU at all".
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol
from xml.etree import ElementTree

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_seconds
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline, poll_until
# The highest minor number a GPU's own device file has (/dev/nvidia0 to /dev/nvidia247): see procfs.
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import MAX_GPU_MINOR
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
# The error kinds live beside the health reads, which the node's live health copies (standard library only).
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.health_reads import (  # noqa: F401 (re-exported)
    NOT_INSTALLED,
    LIBRARY_NOT_FOUND,
    DRIVER_NOT_LOADED,
    NO_DEVICES,
    VERSION_MISMATCH,
    GPU_LOST,
    RESET_REQUIRED,
    NO_PERMISSION,
    HUNG,
    NVML_ERROR,
    gpu_health_reads,
    kind_of_code,
)

MIB = 1024 * 1024

NO_GPU_KINDS = frozenset({NOT_INSTALLED, LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED, NO_DEVICES})

_ADVICE = {
    NOT_INSTALLED: "neither the NVML Python bindings (pip package nvidia-ml-py) nor nvidia-smi are installed on the target",
    LIBRARY_NOT_FOUND: "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver is installed here",
    DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded (or /dev/nvidia* is not passed into this container)",
    NO_DEVICES: "the NVIDIA driver reports no GPU",
    VERSION_MISMATCH: "the NVML library and the loaded kernel driver differ in version "
                      "(a driver upgrade without a reboot, or a container with another driver's libraries): reboot the host or match the versions",
    GPU_LOST: "a GPU is lost (fell off the bus or stopped answering): only a host reboot or GPU reset brings it back",
    RESET_REQUIRED: "a GPU requires a reset (nvidia-smi --gpu-reset or a host reboot)",
    NO_PERMISSION: "no permission to query the GPU",
    HUNG: "the GPU query did not answer",
    NVML_ERROR: "NVML failed",
}


class GpuQueryError(Exception):
    """A GPU query failed; `kind` says which way (one of the kind constants above)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        self.kind = kind
        self.detail = detail
        message = _ADVICE.get(kind, kind)
        super().__init__(f"{message} ({detail})" if detail else message)

    @property
    def means_no_gpu(self) -> bool:
        return self.kind in NO_GPU_KINDS


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU; `pid` is a pid of the host's PID namespace."""

    pid: int
    used_bytes: int | None

    @property
    def used_mib(self) -> float | None:
        return None if self.used_bytes is None else round(self.used_bytes / MIB, 1)


@dataclass(frozen=True)
class GpuDevice:
    """One GPU's memory as the driver reports it. `used_bytes` excludes the driver's reservation."""

    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    reserved_bytes: int | None = None
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)
    # The minor number of its character device (/dev/nvidiaN is 195:N), which proves that a process
    # holds this GPU and not another one; None where the driver could not say, and `minor_unknown` why.
    minor_number: int | None = None
    minor_unknown: str = ""

    @property
    def used_mib(self) -> float:
        return round(self.used_bytes / MIB, 1)

    @property
    def total_mib(self) -> float:
        return round(self.total_bytes / MIB, 1)

    @property
    def used_percent(self) -> float:
        return 100.0 * self.used_bytes / self.total_bytes if self.total_bytes else 0.0

    def process_entries(self) -> list[dict[str, Any]]:
        """The processes as the modules return them (pid and MiB used)."""
        return [{"pid": process.pid, "used_mib": process.used_mib} for process in self.processes]

    def entry(self, first: GpuDevice) -> dict[str, Any]:
        """This look at the GPU as gpu_mem_wait and gpu_reclaim return it in `gpus`, with `first`, the same
        GPU at the first look: what it is, and the MiB used then and now."""
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "total_mib": self.total_mib,
                "used_mib_before": first.used_mib, "used_mib_after": self.used_mib}


class GpuSource(Protocol):
    """Where GPU facts come from: a query answers for the given indices (None: all GPUs)."""

    backend: str

    def query(self, indices: list[int] | None = None) -> list[GpuDevice]: ...

    def close(self) -> None: ...


# --- the NVML child -----------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


NVIDIA_SMI_MINOR_UNKNOWN = "the nvidia-smi backend reads minor numbers only when asked (nvidia-smi -q -x)"


def _nvml_minor_number(pynvml: Any, handle: Any) -> tuple[int | None, str]:
    """(minor number, "") of the GPU's character device, or (None, why NVML could not give it)."""
    try:
        minor = pynvml.nvmlDeviceGetMinorNumber(handle)
    except pynvml.NVMLError as exc:
        return None, f"nvmlDeviceGetMinorNumber failed: {exc} ({type(exc).__name__})"
    except AttributeError:
        return None, "these NVML bindings have no nvmlDeviceGetMinorNumber"
    if not isinstance(minor, int) or isinstance(minor, bool) or not 0 <= minor <= MAX_GPU_MINOR:
        return None, f"nvmlDeviceGetMinorNumber gave {minor!r}, not a GPU's minor number (0 to {MAX_GPU_MINOR})"
    return minor, ""


def _nvml_devices(pynvml: Any, indices: list[int] | None) -> list[dict[str, Any]]:
    """Runs in the child: the facts of the requested GPUs as plain data."""
    count = pynvml.nvmlDeviceGetCount()
    devices = []
    for index in range(count) if indices is None else indices:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        reserved = None
        version = getattr(pynvml, "nvmlMemory_v2", None)
        try:
            # v2 reports the driver's reservation apart from "used"; v1 counts it as used.
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version) if version else None
            reserved = getattr(memory, "reserved", None)
        except (TypeError, pynvml.NVMLError):
            memory = None
        if memory is None:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        processes = [
            {"pid": int(p.pid), "used_bytes": None if p.usedGpuMemory is None else int(p.usedGpuMemory)}
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        ]
        minor_number, minor_unknown = _nvml_minor_number(pynvml, handle)
        devices.append({
            "index": index,
            "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
            "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "total_bytes": int(memory.total),
            "used_bytes": int(memory.used),
            "reserved_bytes": None if reserved is None else int(reserved),
            "processes": processes,
            "minor_number": minor_number,
            "minor_unknown": minor_unknown,
        })
    return devices


def _nvml_error(exc: BaseException) -> dict[str, Any]:
    code = getattr(exc, "value", None)
    if type(exc).__name__ == "NVMLLibraryMismatchError":
        return {"error": VERSION_MISMATCH, "detail": str(exc)}
    if isinstance(code, int):
        return {"error": kind_of_code(code), "detail": f"NVML error {code}: {exc} ({type(exc).__name__})"}
    return {"error": NVML_ERROR, "detail": f"{type(exc).__name__}: {exc}"}


def _serve(requests: int, replies: int) -> None:
    """The child's loop: load NVML once, then answer each request line with one reply line."""
    def reply(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(replies, data):]

    try:
        import pynvml  # pylint: disable=import-outside-toplevel
    except ImportError as exc:
        reply({"error": NOT_INSTALLED, "detail": f"import pynvml: {exc}"})
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pylint: disable=broad-except
        reply(_nvml_error(exc))
        return
    reply({"ready": True})
    with os.fdopen(requests, "rb") as incoming:
        for line in incoming:
            request = json.loads(line)
            if request.get("quit"):
                break
            try:
                if request.get("read") == "health":
                    reply({"health": gpu_health_reads(pynvml, request.get("indices"))})
                else:
                    reply({"devices": _nvml_devices(pynvml, request.get("indices"))})
            except Exception as exc:  # pylint: disable=broad-except
                reply(_nvml_error(exc))
    try:
        pynvml.nvmlShutdown()
    except Exception:  # pylint: disable=broad-except
        pass


def _detach_stdio(keep: set[int]) -> None:
    """In the child: nothing may hold the module's stdout, or Ansible waits for a hung child."""
    null = os.open(os.devnull, os.O_RDWR | os.O_NOFOLLOW)
    for target in (0, 1, 2):
        os.dup2(null, target)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


# How often the ending query process is looked for: it is normally gone within milliseconds.
CHILD_POLL_INTERVAL = 0.01


class NvmlSession:
    """NVML in a child process: one initialisation, then queries, each answered within a deadline."""

    backend = "pynvml"

    def __init__(self, query_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.query_timeout = check_seconds("query_timeout", query_timeout, allow_minimum=False)
        self.clock = clock
        self.pid: int | None = None
        self._requests: int | None = None
        self._replies: int | None = None
        self._buffer = b""

    def start(self) -> None:
        """Fork the child and wait for NVML to initialise; GpuQueryError if it cannot."""
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            status = 0
            try:
                os.close(request_write)
                os.close(reply_read)
                _detach_stdio({request_read, reply_write})
                _serve(request_read, reply_write)
            except BaseException:  # pylint: disable=broad-except
                status = 1
            os._exit(status)  # never run the parent's clean-up handlers in the child
        os.close(request_read)
        os.close(reply_write)
        self.pid, self._requests, self._replies = pid, request_write, reply_read
        answer = self._receive("initialising NVML")
        if "error" in answer:
            self.close()
            raise GpuQueryError(answer["error"], answer.get("detail", ""))

    def query(self, indices: list[int] | None = None) -> list[GpuDevice]:
        answer = self._ask({"indices": indices}, "querying GPU memory")
        if indices is None and not answer["devices"]:
            raise GpuQueryError(NO_DEVICES, "nvmlDeviceGetCount() is 0")
        return [_device_from_dict(d) for d in answer["devices"]]

    def health(self, indices: list[int] | None = None) -> list[dict[str, Any]]:
        """The health reads of the GPUs (all, or `indices`) as plain data: see health_reads.gpu_health_reads."""
        return list(self._ask({"read": "health", "indices": indices}, "reading GPU health")["health"])

    def _ask(self, request: dict[str, Any], doing: str) -> dict[str, Any]:
        """One request to the child (started on first use) and its answer; GpuQueryError for an error answer."""
        if self.pid is None:
            self.start()
        try:
            self._send(request)
        except OSError as exc:
            self._end_child(grace=0.5, kill=True)
            raise GpuQueryError(NVML_ERROR, f"the NVML query process is gone: {exc}") from exc
        answer = self._receive(doing)
        if "error" in answer:
            raise GpuQueryError(answer["error"], answer.get("detail", ""))
        return answer

    def close(self) -> None:
        if self.pid is None:
            return
        try:
            self._send({"quit": True})
        except OSError:
            pass
        self._end_child(grace=1.0)

    def _send(self, message: dict[str, Any]) -> None:
        if self._requests is None:
            raise OSError("no NVML query process")
        os.write(self._requests, (json.dumps(message) + "\n").encode())

    def _receive(self, doing: str) -> dict[str, Any]:
        if self._replies is None:
            raise GpuQueryError(NVML_ERROR, f"no NVML query process while {doing}")
        deadline = Deadline(self.query_timeout, self.clock)
        while b"\n" not in self._buffer:
            if deadline.expired():
                hung_pid = self.pid
                left = self._end_child(grace=0.5, kill=True)
                where = f"; the query process {hung_pid} did not end after SIGKILL (it is stuck in the kernel)" if left else ""
                raise GpuQueryError(HUNG, f"{doing} took longer than query_timeout={self.query_timeout:g}s{where}")
            readable = select.select([self._replies], [], [], deadline.remaining())[0]
            if not readable:
                continue
            chunk = os.read(self._replies, 65536)
            if not chunk:
                self._end_child(grace=0.5, kill=True)
                raise GpuQueryError(NVML_ERROR, f"the NVML query process died while {doing}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _end_child(self, grace: float, kill: bool = False) -> bool:
        """Make sure the child ends (SIGKILL once `grace` passes, or at once with `kill`).

        True if it is still there after that: stuck in the kernel, where no signal reaches it.
        It is then left behind rather than waited for.
        """
        pid, self.pid = self.pid, None
        for fd in (self._requests, self._replies):
            if fd is not None:
                os.close(fd)
        self._requests = self._replies = None
        self._buffer = b""
        if pid is None:
            return False

        def reaped() -> bool:
            return os.waitpid(pid, os.WNOHANG)[0] != 0

        # Our own child, not yet reaped: its pid cannot name anyone else (no gate needed).
        if kill:
            os.kill(pid, signal.SIGKILL)
        if poll_until(reaped, grace, CHILD_POLL_INTERVAL, self.clock):
            return False
        if kill:
            return True
        os.kill(pid, signal.SIGKILL)
        return not poll_until(reaped, grace, CHILD_POLL_INTERVAL, self.clock)


def _device_from_dict(data: dict[str, Any]) -> GpuDevice:
    return GpuDevice(
        index=data["index"],
        uuid=data["uuid"],
        name=data["name"],
        total_bytes=data["total_bytes"],
        used_bytes=data["used_bytes"],
        reserved_bytes=data.get("reserved_bytes"),
        processes=tuple(GpuProcess(p["pid"], p["used_bytes"]) for p in data.get("processes", [])),
        minor_number=data.get("minor_number"),
        minor_unknown=data.get("minor_unknown", ""),
    )


# --- the nvidia-smi fallback ---------------------------------------------------------------------

# The name goes last: it is the only free text, so a comma in it cannot shift the other columns.
QUERY_GPU = ["--query-gpu=index,uuid,memory.total,memory.used,name", "--format=csv,noheader,nounits"]
QUERY_APPS = ["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]
# The full report as XML: the only place nvidia-smi gives a GPU's minor number (<minor_number>, the N
# of /dev/nvidiaN; no --query-gpu field has it). Tens of KiB per GPU; more than MAX_OUTPUT_BYTES from
# any of these runs is not nvidia-smi's answer, and reading stops there.
QUERY_XML = ["-q", "-x"]
MAX_OUTPUT_BYTES = 8 * MIB
_MINOR_TEXT = re.compile(r"[0-9]{1,3}")


def _csv_rows(text: str, columns: int) -> list[list[str]]:
    """Rows of `columns` cells; only the last column may hold free text (commas included)."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",", columns - 1)]
        if len(cells) != columns:
            raise GpuQueryError(NVML_ERROR, f"unexpected nvidia-smi output line: {line!r}")
        rows.append(cells)
    return rows


def _mib_cell(cell: str) -> int | None:
    try:
        return int(float(cell) * MIB)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]", "[Insufficient Permissions]"


def parse_nvidia_smi(gpus_csv: str, apps_csv: str) -> list[GpuDevice]:
    """GPUs from the two CSV outputs (``--format=csv,noheader,nounits``; memory in MiB)."""
    processes: dict[str, list[GpuProcess]] = {}
    for uuid, pid, used in _csv_rows(apps_csv, 3):
        try:
            processes.setdefault(uuid, []).append(GpuProcess(int(pid), _mib_cell(used)))
        except ValueError as exc:
            raise GpuQueryError(NVML_ERROR, f"unexpected nvidia-smi process line: {uuid}, {pid}, {used}") from exc
    devices = []
    for index, uuid, total, used, name in _csv_rows(gpus_csv, 5):
        try:
            devices.append(GpuDevice(
                index=int(index),
                uuid=uuid,
                name=name,
                total_bytes=_mib_cell(total) or 0,
                used_bytes=_mib_cell(used) or 0,
                processes=tuple(processes.get(uuid, ())),
                minor_unknown=NVIDIA_SMI_MINOR_UNKNOWN,
            ))
        except ValueError as exc:
            raise GpuQueryError(NVML_ERROR, f"unexpected nvidia-smi GPU line: {index}, {uuid}, {name}") from exc
    return devices


def _smi_log(xml_text: str) -> ElementTree.Element:
    """The root of an ``nvidia-smi -q -x`` report; GpuQueryError for what is not that report (see
    parse_nvidia_smi_minor_numbers)."""
    if len(xml_text) > MAX_OUTPUT_BYTES:
        raise GpuQueryError(NVML_ERROR, f"nvidia-smi -q -x output is larger than {MAX_OUTPUT_BYTES} bytes")
    if "<!ENTITY" in xml_text:
        raise GpuQueryError(NVML_ERROR, "nvidia-smi -q -x output declares XML entities, which its report never does")
    try:
        root = ElementTree.fromstring(xml_text.encode("utf-8"))
    except ElementTree.ParseError as exc:
        raise GpuQueryError(NVML_ERROR, f"nvidia-smi -q -x output is not well-formed XML: {exc}") from exc
    if root.tag != "nvidia_smi_log":
        raise GpuQueryError(NVML_ERROR, f"nvidia-smi -q -x output is not an nvidia_smi_log: <{escape_controls(root.tag[:40])}>")
    return root


# What the report has no element for: NVML's recovery action and NVLink states (``nvidia-smi nvlink -s``).
SMI_NOT_REPORTED = "nvidia-smi -q -x does not report it (install nvidia-ml-py on the target)"
# The throttle (clocks event) reasons the report names, by the bit NVML gives them (health_judge.THROTTLE_WARNINGS).
_SMI_THROTTLE_BITS = {"hw_slowdown": 0x8, "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80}


def _smi_text(gpu: ElementTree.Element, path: str) -> str | None:
    """The text at `path`, or None where the report has no such element or says N/A / Not Supported."""
    text = (gpu.findtext(path) or "").strip()
    return None if not text or text.startswith(("N/A", "[N/A", "Not Supported", "[Not Supported")) else text


def _smi_read(value: Any, what: str) -> dict[str, Any]:
    return {"value": value} if value is not None else {"unsupported": f"nvidia-smi -q -x gives no {what} for this GPU"}


def _smi_count(gpu: ElementTree.Element, *paths: str) -> int | None:
    """The sum of the counts at `paths` that the report gives; None where it gives none of them."""
    counts = [int(text) for text in (_smi_text(gpu, path) for path in paths) if text is not None and text.isdigit()]
    return sum(counts) if counts else None


def _smi_yes(gpu: ElementTree.Element, *paths: str) -> bool | None:
    answers = [text for text in (_smi_text(gpu, path) for path in paths) if text is not None]
    return any(text.lower() == "yes" for text in answers) if answers else None


def _smi_gpu_reads(gpu: ElementTree.Element) -> dict[str, dict[str, Any]]:
    """One ``<gpu>``'s health reads as health_reads.gpu_health_reads gives them, from what the report has."""
    rows = [_smi_count(gpu, f"remapped_rows/remapped_row_{name}") for name in ("corr", "unc")]
    pending = _smi_yes(gpu, "remapped_rows/remapped_row_pending")
    failure = _smi_yes(gpu, "remapped_rows/remapped_row_failure")
    remapped = None if pending is None and failure is None else {
        "corrected": rows[0] or 0, "uncorrected": rows[1] or 0, "pending": bool(pending), "failure": bool(failure)}
    # Drivers before 535 say clocks_throttle_reasons/clocks_throttle_reason_*, later ones clocks_event_reasons.
    throttle = None
    for section, prefix in (("clocks_event_reasons", "clocks_event_reason_"), ("clocks_throttle_reasons", "clocks_throttle_reason_")):
        if gpu.find(section) is not None:
            throttle = 0
            for name, bit in _SMI_THROTTLE_BITS.items():
                if (_smi_text(gpu, f"{section}/{prefix}{name}") or "").lower() == "active":
                    throttle |= bit
            break
    return {
        "recovery_action": {"unsupported": SMI_NOT_REPORTED},
        "remapped_rows": _smi_read(remapped, "remapped rows (before Ampere there are none)"),
        "retired_pages_pending": _smi_read(_smi_yes(gpu, "retired_pages/pending_retirement", "retired_pages/pending_blacklist"),
                                           "retired pages (Ampere and later remap rows instead)"),
        # Volatile uncorrectable counts: DRAM and SRAM (driver 535+), or the older double-bit total.
        "ecc_uncorrected_volatile": _smi_read(_smi_count(
            gpu, "ecc_errors/volatile/dram_uncorrectable", "ecc_errors/volatile/sram_uncorrectable",
            "ecc_errors/volatile/sram_uncorrectable_parity", "ecc_errors/volatile/sram_uncorrectable_secded",
            "ecc_errors/volatile/double_bit/total"), "volatile ECC counts (ECC off, or not supported)"),
        "nvlink": {"unsupported": SMI_NOT_REPORTED},
        "throttle_reasons": _smi_read(throttle, "throttle reasons"),
    }


def parse_nvidia_smi_health(xml_text: str) -> dict[str, dict[str, Any]]:
    """By GPU UUID, its PCI bus id and health reads (health_reads' format) from ``nvidia-smi -q -x``: remapped
    rows, retired pages pending, volatile uncorrectable ECC counts, throttle reasons; the recovery action and
    NVLink say the report has none. GpuQueryError for what is not that report."""
    found: dict[str, dict[str, Any]] = {}
    for gpu in _smi_log(xml_text).findall("gpu"):
        uuid = (gpu.findtext("uuid") or "").strip()
        if uuid:
            bus = (gpu.findtext("pci/pci_bus_id") or gpu.get("id") or "").strip()
            found[uuid] = {"pci_bus_id": escape_controls(bus[:40]), "reads": _smi_gpu_reads(gpu)}
    return found


def parse_nvidia_smi_minor_numbers(xml_text: str) -> dict[str, tuple[int | None, str]]:
    """By GPU UUID, (minor number, "") or (None, why it is not known), from ``nvidia-smi -q -x``.

    Raises GpuQueryError for what is not that report: too large, not well-formed, another root, or
    any entity declaration (the report has none; refusing them keeps expansion bombs out of the
    parser; ElementTree fetches no external DTD). A GPU listed twice, or a minor number given to
    two GPUs, proves nothing: those GPUs' numbers are not known.
    """
    root = _smi_log(xml_text)
    found: dict[str, tuple[int | None, str]] = {}
    twice: set[str] = set()
    for gpu in root.findall("gpu"):
        uuid = (gpu.findtext("uuid") or "").strip()
        if not uuid:
            continue
        if uuid in found:
            twice.add(uuid)
        found[uuid] = _minor_number_of(gpu.find("minor_number"))
    for uuid in twice:
        found[uuid] = (None, "nvidia-smi -q -x lists this GPU twice")
    holders = Counter(minor for minor, _why in found.values() if minor is not None)
    for uuid, (minor, _why) in list(found.items()):
        if minor is not None and holders[minor] > 1:
            found[uuid] = (None, f"nvidia-smi -q -x gives minor number {minor} to more than one GPU")
    return found


def _minor_number_of(element: ElementTree.Element | None) -> tuple[int | None, str]:
    if element is None:
        return None, "nvidia-smi -q -x gives no minor_number for this GPU"
    text = (element.text or "").strip()
    if text == "N/A":
        return None, "nvidia-smi reports its minor number as N/A"
    if _MINOR_TEXT.fullmatch(text) and int(text) <= MAX_GPU_MINOR:
        return int(text), ""
    return None, f"nvidia-smi -q -x gives minor_number {escape_controls(text[:40])!r}, not a GPU's minor number (0 to {MAX_GPU_MINOR})"


def classify_nvidia_smi_failure(returncode: int, output: str) -> GpuQueryError:
    """nvidia-smi exits with the NVML code; its wording tells the rest."""
    text = " ".join(output.split())
    lowered = text.lower()
    if "version mismatch" in lowered:
        kind = VERSION_MISMATCH
    elif "couldn't communicate with the nvidia driver" in lowered:
        kind = DRIVER_NOT_LOADED
    elif "couldn't find libnvidia-ml.so" in lowered:
        kind = LIBRARY_NOT_FOUND
    elif "gpu is lost" in lowered or "fallen off the bus" in lowered:
        kind = GPU_LOST
    elif "no devices were found" in lowered:
        kind = NO_DEVICES
    else:
        kind = kind_of_code(returncode)
    return GpuQueryError(kind, f"nvidia-smi exited {returncode}: {text[:300]}")


class NvidiaSmiSession:
    """The nvidia-smi fallback: two CSV queries per poll, each under the query deadline; the minor
    numbers (one ``-q -x`` run) only through :meth:`with_minor_numbers`."""

    backend = "nvidia-smi"

    def __init__(self, executable: str, query_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.executable = executable
        self.query_timeout = check_seconds("query_timeout", query_timeout, allow_minimum=False)
        self.clock = clock

    def query(self, indices: list[int] | None = None) -> list[GpuDevice]:
        deadline = Deadline(self.query_timeout, self.clock)
        gpus = self._run(QUERY_GPU, deadline)
        apps = self._run(QUERY_APPS, deadline)
        devices = parse_nvidia_smi(gpus, apps)
        return devices if indices is None else [d for d in devices if d.index in indices]

    def with_minor_numbers(self, devices: list[GpuDevice]) -> list[GpuDevice]:
        """`devices` with the minor numbers of one ``nvidia-smi -q -x`` run, matched by UUID. Where
        that run fails, or gives no number for a GPU, its number stays unknown and says why."""
        try:
            xml_text = self._run(QUERY_XML, Deadline(self.query_timeout, self.clock), merge_stderr=False)
            minors = parse_nvidia_smi_minor_numbers(xml_text)
        except GpuQueryError as exc:
            return [dataclasses.replace(d, minor_number=None, minor_unknown=f"nvidia-smi -q -x failed: {exc}") for d in devices]
        numbered = []
        for device in devices:
            minor, why = minors.get(device.uuid, (None, "nvidia-smi -q -x does not list this GPU"))
            numbered.append(dataclasses.replace(device, minor_number=minor, minor_unknown=why))
        return numbered

    def health(self, indices: list[int] | None = None) -> list[dict[str, Any]]:
        """The health reads of the GPUs (all, or `indices`) from one ``nvidia-smi -q -x`` run, matched to the CSV
        query's indices by UUID: the same entries as NvmlSession.health, with what the report cannot give
        marked unsupported."""
        devices = self.query(indices)
        report = parse_nvidia_smi_health(self._run(QUERY_XML, Deadline(self.query_timeout, self.clock), merge_stderr=False))
        missing = {"pci_bus_id": "", "reads": {}}
        return [{"index": d.index, "uuid": d.uuid, "identity_errors": [], **report.get(d.uuid, missing)} for d in devices]

    def close(self) -> None:
        pass

    def command(self, arguments: list[str]) -> str:
        """What nvidia-smi with `arguments` wrote (bounded, under query_timeout); GpuQueryError when it failed."""
        return self._run(arguments, Deadline(self.query_timeout, self.clock))

    def _run(self, arguments: list[str], deadline: Deadline, merge_stderr: bool = True) -> str:
        """nvidia-smi's output (with its stderr, unless a warning there would spoil what is parsed)."""
        try:
            proc = subprocess.Popen(  # pylint: disable=consider-using-with
                [self.executable, *arguments],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge_stderr else subprocess.DEVNULL,
            )
        except FileNotFoundError as exc:
            raise GpuQueryError(NOT_INSTALLED, f"{self.executable}: not found") from exc
        except OSError as exc:
            raise GpuQueryError(NVML_ERROR, f"{self.executable}: {exc.strerror}") from exc
        try:
            output = _read_bounded(proc, deadline)
        except _OutputTooLarge as exc:
            proc.kill()
            proc.stdout.close()  # type: ignore[union-attr]
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel: the error says enough, and no more of its output is read
            raise GpuQueryError(NVML_ERROR, f"nvidia-smi {arguments[0]} wrote more than {MAX_OUTPUT_BYTES} bytes") from exc
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            try:
                proc.communicate(timeout=1.0)
                where = ""
            except subprocess.TimeoutExpired:
                where = f"; nvidia-smi (pid {proc.pid}) did not end after SIGKILL (it is stuck in the kernel)"
            raise GpuQueryError(
                HUNG, f"nvidia-smi {arguments[0]} took longer than query_timeout={self.query_timeout:g}s{where}"
            ) from exc
        proc.stdout.close()  # type: ignore[union-attr]
        text = output.decode("utf-8", "replace")
        if proc.returncode != 0:
            raise classify_nvidia_smi_failure(proc.returncode, text)
        return text


class _OutputTooLarge(Exception):
    pass


def _read_bounded(proc: "subprocess.Popen[bytes]", deadline: Deadline) -> bytes:
    """All of `proc`'s stdout and its exit, by `deadline`; never more than MAX_OUTPUT_BYTES held.

    Raises subprocess.TimeoutExpired at the deadline, _OutputTooLarge past the bound."""
    if proc.stdout is None:
        raise ValueError("_read_bounded needs a process started with stdout=PIPE")
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline.remaining()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise subprocess.TimeoutExpired(proc.args, deadline.elapsed())
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        size += len(chunk)
        if size > MAX_OUTPUT_BYTES:
            raise _OutputTooLarge()
        chunks.append(chunk)
    proc.wait(timeout=max(deadline.remaining(), 0.001))
    return b"".join(chunks)


def add_minor_numbers(source: GpuSource, devices: list[GpuDevice]) -> list[GpuDevice]:
    """`devices`, each with the minor number of its device file where the source can tell it.

    NVML gives them with every query. The nvidia-smi backend reads them only here, with one
    ``nvidia-smi -q -x`` run, so that a poll (gpu_mem_wait's, a release wait) costs no more.
    """
    if isinstance(source, NvidiaSmiSession) and any(d.minor_number is None for d in devices):
        return source.with_minor_numbers(devices)
    return devices


# The words of the modules' `backend` option.
BACKENDS = ("auto", "pynvml", "nvidia-smi")


def gpu_backend_spec() -> dict[str, dict[str, Any]]:
    """The options of open_gpu_source, as every GPU module takes them (doc fragment gpuops.relaunch.gpu_backend)."""
    return {
        "backend": {"type": "str", "default": "auto", "choices": list(BACKENDS)},
        "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
        "query_timeout": {"type": "float", "default": 30},
    }


def open_gpu_source(backend: str, nvidia_smi: str, query_timeout: float) -> GpuSource:
    """The first source that works: NVML bindings, else nvidia-smi (for backend=auto).

    Raises GpuQueryError; when neither is installed its kind is NOT_INSTALLED.
    """
    if backend in ("auto", "pynvml"):
        session = NvmlSession(query_timeout)
        try:
            session.start()
            return session
        except GpuQueryError as exc:
            if backend == "pynvml" or exc.kind != NOT_INSTALLED:
                raise
    executable = shutil.which(nvidia_smi)
    if executable is None:
        if backend == "nvidia-smi":
            raise GpuQueryError(NOT_INSTALLED, f"nvidia_smi: {nvidia_smi} not found")
        raise GpuQueryError(NOT_INSTALLED, f"no module pynvml and no {nvidia_smi} on PATH")
    return NvidiaSmiSession(executable, query_timeout)
