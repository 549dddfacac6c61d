"""A simulated NVML for tests: the `pynvml` API surface the GPU modules use, driven by real processes.

Every name here is the real nvidia-ml-py's, with its arguments and values
(tests/unit/harness/test_simnvml_api.py holds it to the installed package).

Test-only. Put ``tests/harness/simnvml`` on PYTHONPATH of the Python that imports ``pynvml`` and
name a state file in ``GPUOPS_SIMNVML_STATE`` (see :mod:`tests.harness.gpu_holder`, which writes
it). Without that variable the simulated library is "not installed": ``nvmlInit`` raises
``NVMLError_LibraryNotFound`` like the real bindings on a machine without ``libnvidia-ml.so.1``.

The state file (JSON, rewritten atomically by the harness, re-read on every call like live driver
state) holds:

* ``devices``: ``[{uuid, name, total_mib, reserved_mib, base_used_mib, minor_number}]`` (index =
  position; ``minor_number``, the N of the device's ``/dev/nvidiaN`` (char 195:N), defaults to the index);
* ``holders``: ``[{pid, starttime, device, bytes}]`` -- *host* pids, identified by (pid, starttime);
* ``teardown_delay`` (seconds) and ``stuck_teardown`` (bool), globally or per holder;
* ``faults``: ``[{call, error}]`` (``error`` an ``NVML_ERROR_*`` name without the prefix) or
  ``[{call, hang: true}]``; an optional ``device`` index limits a fault to one device;
* ``host_proc`` and ``host_witness``: where the host's process table is (see below).

How long a holder holds memory, as the real driver does it: while any thread of the process is
alive. Once the last thread has exited (the process is a zombie or gone) the memory is released
``teardown_delay`` seconds later -- or, with ``stuck_teardown``, only once the process has been
reaped (its pid gone), which a never-reaping init never does. The delay counts from the moment a
query first sees the exit (recorded once, atomically, in ``<state>.seen/``), because a stateless
library cannot know the exact instant a process ended; that instant plus the delay is the
"release instant" the benchmark measures from.

Liveness is judged by *host* pid, as the kernel driver does. The process that imports this module
may run inside a PID namespace whose own ``/proc`` does not show host pids, so the state file names
``host_proc``: a procfs mounted in the host's PID namespace (the harness bind-mounts the host's
``/proc`` before it starts the namespace, and the namespace's mount table inherits that mount).
``host_witness`` (pid and start time of the harness process) proves that ``host_proc`` really is the
host's: if the witness is not found there, every call raises ``NVMLError_Unknown`` instead of
wrongly declaring every holder dead. The *caller's* view stays its own ``/proc``: inside the
namespace the reported pids do not exist, exactly the "memory used, no process" of real hardware.
"""

from __future__ import annotations

import json
import os
import string
import sys
import time

STATE_ENV = "GPUOPS_SIMNVML_STATE"

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

nvmlMemory_v2 = 0x02000028

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_NVLINK_MAX_LINKS = 36

NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_VALUE_TYPE_UNSIGNED_INT = 1

nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksThrottleReasonGpuIdle = 0x1
nvmlClocksThrottleReasonHwSlowdown = 0x8
nvmlClocksThrottleReasonHwThermalSlowdown = 0x40
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x80

_MIB = 1024 * 1024

# The wording of the real bindings' NVMLError.__str__ for the codes that matter here.
_ERROR_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLLibraryMismatchError(Exception):
    pass


class NVMLError(Exception):
    """Same construction as the real one: NVMLError(code) returns the per-code subclass."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value):
        error_class = NVMLError._valClassMapping.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(error_class)
        obj.value = value
        return obj

    def __str__(self):
        return _ERROR_TEXT.get(self.value, "NVML Error with code %d" % self.value)

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = Exception.__hash__


def _make_error_classes() -> None:
    """NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost, exactly as the real bindings name them."""
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        code = getattr(module, name)

        def make_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)
            return new

        error_class = type(class_name, (NVMLError,), {"__new__": make_new(code)})
        error_class.__module__ = __name__
        setattr(module, class_name, error_class)
        NVMLError._valClassMapping[code] = error_class


_make_error_classes()


def nvmlExceptionClass(nvmlErrorCode):
    return NVMLError._valClassMapping[nvmlErrorCode]


def nvmlErrorString(result):
    return _ERROR_TEXT.get(result, "Unknown Error")


class _Handle:
    """Stands for a c_nvmlDevice_t: callers only pass it back."""

    def __init__(self, index):
        self.index = index

    def __repr__(self):
        return f"<simulated nvmlDevice {self.index}>"


class _Struct:
    """Plain attribute holder, like the real bindings' c structs and friendly objects."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


class c_nvmlMemory_t(_Struct):
    pass


class c_nvmlMemory_v2_t(_Struct):
    pass


class nvmlFriendlyObject(_Struct):
    pass


class nvmlPciInfo_t(_Struct):
    pass


class c_nvmlValue_t(_Struct):
    pass


class c_nvmlFieldValue_t(_Struct):
    pass


_initialized = 0


# --- state ----------------------------------------------------------------------------------------


def _state_path():
    path = os.environ.get(STATE_ENV)
    if not path:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    return path


def _load_state():
    try:
        with open(_state_path(), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND) from exc


def _apply_faults(state, call, index=None):
    for fault in state.get("faults", []):
        if fault.get("call") != call:
            continue
        if "device" in fault and fault["device"] != index:
            continue
        if fault.get("hang"):
            # A call stuck in the driver: it never returns (the caller must time it out).
            while True:
                time.sleep(3600)
        raise NVMLError(globals()["NVML_ERROR_" + fault["error"]])


def _stat_fields(proc, pid):
    try:
        with open(f"{proc}/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    return raw[raw.rindex(b")") + 2:].split()


def _starttime(proc, pid):
    fields = _stat_fields(proc, pid)
    return int(fields[19]) if fields else None


def _host_proc(state):
    proc = state.get("host_proc", "/proc")
    witness = state.get("host_witness")
    if witness and _starttime(proc, witness["pid"]) != witness["starttime"]:
        # This is not the host's process table: judging liveness here would be a lie.
        raise NVMLError(NVML_ERROR_UNKNOWN)
    return proc


def _liveness(proc, holder):
    """'alive' (a thread runs), 'exited' (all threads ended, pid not yet reaped) or 'reaped'."""
    if _starttime(proc, holder["pid"]) != holder["starttime"]:
        return "reaped"
    try:
        tids = os.listdir(f"{proc}/{holder['pid']}/task")
    except OSError:
        return "reaped"
    for tid in tids:
        try:
            with open(f"{proc}/{holder['pid']}/task/{tid}/stat", "rb") as handle:
                raw = handle.read()
        except OSError:
            continue
        if raw[raw.rindex(b")") + 2:raw.rindex(b")") + 3] not in (b"Z", b"X"):
            return "alive"
    return "exited"


def _first_seen_gone(holder):
    """When a query first saw this holder's teardown start (recorded once, race-free)."""
    directory = _state_path() + ".seen"
    os.makedirs(directory, exist_ok=True)
    path = f"{directory}/{holder['pid']}-{holder['starttime']}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
        if text:
            return float(text)
        return time.time()
    now = time.time()
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(repr(now))
    return now


def _holding(state, proc, holder):
    stuck = holder.get("stuck_teardown", state.get("stuck_teardown", False))
    delay = holder.get("teardown_delay", state.get("teardown_delay", 0.0))
    life = _liveness(proc, holder)
    if life == "alive" or (stuck and life == "exited"):
        return True
    return time.time() < _first_seen_gone(holder) + delay


def _active_holders(state, index):
    proc = _host_proc(state)
    return [h for h in state.get("holders", []) if h["device"] == index and _holding(state, proc, h)]


def _device(state, handle):
    if not isinstance(handle, _Handle):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    devices = state.get("devices", [])
    if handle.index >= len(devices):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    device = devices[handle.index]
    if device.get("lost"):
        # A GPU that fell off the bus: every call on its handle answers "GPU is lost".
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return device


def _health_call(call, handle):
    """The device's state for a health read, after the faults of `call` (on this device or all)."""
    _check_init()
    state = _load_state()
    device = _device(state, handle)
    _apply_faults(state, call, handle.index)
    return device


def _check_init():
    if not _initialized:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


# --- the API ----------------------------------------------------------------------------------


def nvmlInitWithFlags(flags):
    global _initialized
    state = _load_state()
    _apply_faults(state, "nvmlInit")
    _initialized += 1


def nvmlInit():
    nvmlInitWithFlags(0)


def nvmlShutdown():
    global _initialized
    _check_init()
    _initialized -= 1


def nvmlSystemGetDriverVersion():
    _check_init()
    state = _load_state()
    _apply_faults(state, "nvmlSystemGetDriverVersion")
    return state.get("driver_version", "550.54.15")


def nvmlDeviceGetCount():
    _check_init()
    state = _load_state()
    _apply_faults(state, "nvmlDeviceGetCount")
    return len(state.get("devices", []))


def nvmlDeviceGetHandleByIndex(index):
    _check_init()
    state = _load_state()
    if not 0 <= index < len(state.get("devices", [])):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    _apply_faults(state, "nvmlDeviceGetHandleByIndex", index)
    return _Handle(index)


def nvmlDeviceGetHandleByUUID(uuid):
    _check_init()
    state = _load_state()
    wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
    for index, device in enumerate(state.get("devices", [])):
        if device["uuid"] == wanted:
            return _Handle(index)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle):
    _check_init()
    _device(_load_state(), handle)
    return handle.index


def nvmlDeviceGetName(handle):
    _check_init()
    state = _load_state()
    _apply_faults(state, "nvmlDeviceGetName", handle.index)
    return _device(state, handle)["name"]


def nvmlDeviceGetUUID(handle):
    _check_init()
    state = _load_state()
    _apply_faults(state, "nvmlDeviceGetUUID", handle.index)
    return _device(state, handle)["uuid"]


def nvmlDeviceGetMinorNumber(handle):
    """The minor number of the device's character device: /dev/nvidiaN for minor N (major 195).

    The real call fails with NOT_SUPPORTED where there is none to give (a MIG device handle); a
    fault on ``nvmlDeviceGetMinorNumber`` simulates that, or any other failure, per device.
    """
    _check_init()
    state = _load_state()
    device = _device(state, handle)
    _apply_faults(state, "nvmlDeviceGetMinorNumber", handle.index)
    return int(device.get("minor_number", handle.index))


def nvmlDeviceGetMemoryInfo(handle, version=None):
    _check_init()
    state = _load_state()
    _apply_faults(state, "nvmlDeviceGetMemoryInfo", handle.index)
    device = _device(state, handle)
    total = int(device["total_mib"] * _MIB)
    reserved = int(device.get("reserved_mib", 0) * _MIB)
    used = int(device.get("base_used_mib", 0) * _MIB)
    used += sum(int(h["bytes"]) for h in _active_holders(state, handle.index))
    used = min(used, total - reserved)
    if not version:
        # v1 counts the driver's reserved memory as used (R510 and later), hence the v2 call.
        return c_nvmlMemory_t(total=total, free=total - reserved - used, used=used + reserved)
    if version != nvmlMemory_v2:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved, free=total - reserved - used, used=used)


def nvmlDeviceGetComputeRunningProcesses_v3(handle):
    _check_init()
    state = _load_state()
    _apply_faults(state, "nvmlDeviceGetComputeRunningProcesses", handle.index)
    _device(state, handle)
    processes = []
    for holder in _active_holders(state, handle.index):
        used = holder["bytes"] if holder.get("report_memory", True) else None
        processes.append(nvmlFriendlyObject(
            pid=holder["pid"], usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF,
        ))
    return processes


nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3
nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses_v3


# --- health reads (gpu_health) -----------------------------------------------------------------
#
# Device keys: ``pci_bus_id`` (default 00000000:<3B + index>:00.0); ``recovery_action`` (an
# NVML_GPU_RECOVERY_ACTION_* value, default 0; null: the driver predates it, the field answers
# NOT_SUPPORTED as drivers before 570 do); ``remapped_rows`` ([corrected, uncorrected, pending,
# failure]); ``retired_pages_pending`` (bool); ``ecc_uncorrected_volatile``; ``nvlink`` (a list of link
# states, 1 up / 0 down; default null: no NVLink, every link NOT_SUPPORTED); ``throttle_reasons``
# (a bit mask); ``lost`` (every call on the device answers GPU_IS_LOST). A fault on any call name
# makes that read fail (NOT_SUPPORTED, RESET_REQUIRED, ...).


def nvmlDeviceGetPciInfo(handle):
    device = _health_call("nvmlDeviceGetPciInfo", handle)
    bus = device.get("pci_bus_id", "00000000:%02X:00.0" % (0x3B + handle.index))
    domain, number, rest = bus.split(":")
    return nvmlPciInfo_t(busId=bus.encode(), busIdLegacy=bus[4:].encode(), domain=int(domain, 16),
                         bus=int(number, 16), device=int(rest.split(".")[0], 16), pciDeviceId=0x233010DE,
                         pciSubSystemId=0x16C110DE)


def nvmlDeviceGetFieldValues(handle, fieldIds):
    device = _health_call("nvmlDeviceGetFieldValues", handle)
    values = []
    for field_id in fieldIds:
        scope = 0
        if isinstance(field_id, tuple):
            field_id, scope = field_id
        result, number = NVML_ERROR_NOT_SUPPORTED, 0
        if field_id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and device.get("recovery_action", 0) is not None:
            result, number = NVML_SUCCESS, int(device.get("recovery_action", 0))
        values.append(c_nvmlFieldValue_t(
            fieldId=field_id, scopeId=scope, timestamp=int(time.time() * 1e6), latencyUsec=0,
            valueType=NVML_VALUE_TYPE_UNSIGNED_INT, nvmlReturn=result,
            value=c_nvmlValue_t(dVal=0.0, uiVal=number, ulVal=number, ullVal=number, sllVal=number, siVal=number,
                                usVal=number),
        ))
    return values


def nvmlDeviceGetRemappedRows(device):
    state = _health_call("nvmlDeviceGetRemappedRows", device)
    corrected, uncorrected, pending, failure = state.get("remapped_rows", [0, 0, 0, 0])
    return (int(corrected), int(uncorrected), int(pending), int(failure))


def nvmlDeviceGetRetiredPagesPendingStatus(device):
    state = _health_call("nvmlDeviceGetRetiredPagesPendingStatus", device)
    return NVML_FEATURE_ENABLED if state.get("retired_pages_pending") else NVML_FEATURE_DISABLED


def nvmlDeviceGetTotalEccErrors(handle, errorType, counterType):
    device = _health_call("nvmlDeviceGetTotalEccErrors", handle)
    if errorType not in (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED) \
            or counterType not in (NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED and counterType == NVML_VOLATILE_ECC:
        return int(device.get("ecc_uncorrected_volatile", 0))
    return 0


def nvmlDeviceGetNvLinkState(device, link):
    state = _health_call("nvmlDeviceGetNvLinkState", device)
    links = state.get("nvlink")
    if not 0 <= link < NVML_NVLINK_MAX_LINKS:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if links is None or link >= len(links):
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return NVML_FEATURE_ENABLED if links[link] else NVML_FEATURE_DISABLED


def nvmlDeviceGetCurrentClocksEventReasons(handle):
    device = _health_call("nvmlDeviceGetCurrentClocksEventReasons", handle)
    return int(device.get("throttle_reasons", 0))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
    device = _health_call("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    return int(device.get("throttle_reasons", 0))
