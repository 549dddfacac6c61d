# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The NVML health reads of one GPU, run in the NVML child of query.NvmlSession (never in the module).

Each read answers as plain data, one of:

* ``{"value": ...}``: what the driver said;
* ``{"unsupported": why}``: this GPU, driver or binding cannot give it (NVML_ERROR_NOT_SUPPORTED,
  NVML_ERROR_FUNCTION_NOT_FOUND, a binding without the call or constant): not an error;
* ``{"error": code, "detail": text}``: the call failed with NVML error `code` (15: the GPU is lost,
  16: it requires a reset, which the judgement in health.py turns into findings).

Imports nothing of the collection: it runs where NVML is loaded, and only its data leaves.
"""

from __future__ import annotations

from typing import Any, Callable

# Error kinds, named after what the operator has to do about them.
NOT_INSTALLED = "not_installed"
LIBRARY_NOT_FOUND = "library_not_found"
DRIVER_NOT_LOADED = "driver_not_loaded"
NO_DEVICES = "no_devices"
VERSION_MISMATCH = "version_mismatch"
GPU_LOST = "gpu_lost"
RESET_REQUIRED = "reset_required"
NO_PERMISSION = "no_permission"
HUNG = "hung"
NVML_ERROR = "nvml_error"

# NVML return codes (nvml.h); nvidia-smi uses the same numbers as exit codes.
_KIND_BY_CODE = {
    4: NO_PERMISSION,
    6: NO_DEVICES,  # nvidia-smi: "No devices were found"
    9: DRIVER_NOT_LOADED,
    12: LIBRARY_NOT_FOUND,
    15: GPU_LOST,
    16: RESET_REQUIRED,
    18: VERSION_MISMATCH,
    28: GPU_LOST,  # NVML_ERROR_GPU_NOT_FOUND: the device went away
}


def kind_of_code(code: int) -> str:
    return _KIND_BY_CODE.get(code, NVML_ERROR)


# NVML return codes that mean "this read does not exist here", not a failure (nvml.h).
_NOT_SUPPORTED = 3
_INVALID_ARGUMENT = 2
_FUNCTION_NOT_FOUND = 13
UNSUPPORTED_CODES = frozenset({_NOT_SUPPORTED, _FUNCTION_NOT_FOUND})

# The reads, in the order they are reported.
READS = ("recovery_action", "remapped_rows", "retired_pages_pending", "ecc_uncorrected_volatile", "nvlink",
         "throttle_reasons")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _read(pynvml: Any, call: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"value": call()}
    except pynvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code in UNSUPPORTED_CODES:
            return {"unsupported": f"the driver does not support it ({exc})"}
        return {"error": code, "detail": f"NVML error {code}: {exc}"}
    except AttributeError as exc:
        return {"unsupported": f"these NVML bindings lack it ({exc})"}


def _recovery_action(pynvml: Any, handle: Any) -> int:
    field_id = getattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")  # AttributeError: bindings before 570
    [value] = pynvml.nvmlDeviceGetFieldValues(handle, [field_id])
    if value.nvmlReturn != 0:
        raise pynvml.NVMLError(value.nvmlReturn)
    return int(value.value.uiVal)


def _remapped_rows(pynvml: Any, handle: Any) -> dict[str, int]:
    corrected, uncorrected, pending, failure = pynvml.nvmlDeviceGetRemappedRows(handle)
    return {"corrected": int(corrected), "uncorrected": int(uncorrected), "pending": bool(pending),
            "failure": bool(failure)}


def _nvlink(pynvml: Any, handle: Any) -> dict[str, list[int]]:
    """Links up and down. A GPU's links are numbered from 0 without gaps, and the first index it does not
    have answers NOT_SUPPORTED or INVALID_ARGUMENT: the probe stops there (a GPU without NVLink costs one
    call, not NVML_NVLINK_MAX_LINKS of them; an H100's 18 links cost 19)."""
    up, down = [], []
    for link in range(int(pynvml.NVML_NVLINK_MAX_LINKS)):
        try:
            state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as exc:
            if getattr(exc, "value", None) in (_NOT_SUPPORTED, _INVALID_ARGUMENT):
                break
            raise
        (up if state == pynvml.NVML_FEATURE_ENABLED else down).append(link)
    if not up and not down:
        raise pynvml.NVMLError(_NOT_SUPPORTED)
    return {"up": up, "down": down}


def _throttle_reasons(pynvml: Any, handle: Any) -> int:
    # Renamed "clocks event reasons" in 535; older bindings only have the throttle name.
    call = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(call(handle))


def gpu_health_reads(pynvml: Any, indices: list[int] | None) -> list[dict[str, Any]]:
    """Per GPU: index, uuid, PCI bus id and every read; a GPU whose handle fails carries `error` instead."""
    count = pynvml.nvmlDeviceGetCount()
    gpus = []
    for index in range(count) if indices is None else indices:
        entry: dict[str, Any] = {"index": index}
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            entry["error"] = {"error": getattr(exc, "value", None), "detail": f"nvmlDeviceGetHandleByIndex({index}): {exc}"}
            gpus.append(entry)
            continue
        uuid = _read(pynvml, lambda: _text(pynvml.nvmlDeviceGetUUID(handle)))
        bus = _read(pynvml, lambda: _text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
        entry["uuid"] = uuid.get("value", "")
        entry["pci_bus_id"] = bus.get("value", "")
        entry["identity_errors"] = [r for r in (uuid, bus) if "error" in r]
        entry["reads"] = {
            "recovery_action": _read(pynvml, lambda: _recovery_action(pynvml, handle)),
            "remapped_rows": _read(pynvml, lambda: _remapped_rows(pynvml, handle)),
            "retired_pages_pending": _read(pynvml, lambda: bool(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))),
            "ecc_uncorrected_volatile": _read(pynvml, lambda: int(pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))),
            "nvlink": _read(pynvml, lambda: _nvlink(pynvml, handle)),
            "throttle_reasons": _read(pynvml, lambda: _throttle_reasons(pynvml, handle)),
        }
        gpus.append(entry)
    return gpus


# --- the node's live look: this file run as a program ---------------------------------------------

CHILD_USAGE = "usage: health_reads.py NVML_DIR|-  (prints one JSON line: {\"health\": [...]} or {\"error\": ...})"


def child_main(argv: list[str]) -> int:
    """The node's live health runs this file's private copy as a short-lived child (``python3 -I
    health_reads.py NVML_DIR``) for each look: NVML is loaded there, never in the supervisor, and the
    child is killed if the driver hangs. NVML_DIR is where the module found pynvml at the start
    ("-": the interpreter's own path). One JSON line on stdout: the reads of every GPU, or the error."""
    # pylint: disable=import-outside-toplevel
    import json
    import sys

    if len(argv) != 1:
        sys.stderr.write(CHILD_USAGE + "\n")
        return 2
    if argv[0] != "-":
        sys.path.insert(0, argv[0])
    try:
        import pynvml  # pylint: disable=import-error
    except ImportError as exc:
        answer: dict[str, Any] = {"error": NOT_INSTALLED, "detail": f"import pynvml: {exc}"}
    else:
        try:
            pynvml.nvmlInit()
            try:
                answer = {"health": gpu_health_reads(pynvml, None)}
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # pylint: disable=broad-except
            code = getattr(exc, "value", None)
            kind = kind_of_code(code) if isinstance(code, int) else NVML_ERROR
            answer = {"error": kind, "detail": f"{type(exc).__name__}: {exc}"[:300]}
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    import sys as _sys
    raise SystemExit(child_main(_sys.argv[1:]))
