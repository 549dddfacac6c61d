"""A fake `nvidia-smi` for tests: real CSV formats, answers from the simulated NVML state.

Understands the invocations gpu_mem_wait makes (``--query-gpu=...`` and ``--query-compute-apps=...``
with ``--format=csv[,noheader][,nounits]``). Failures print the real tool's wording and exit with the
NVML error code, as the real tool does. The simulated bindings are loaded from ../simnvml by path,
so the Python that runs the module under test does not see a `pynvml` module.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "simnvml"))
import pynvml  # noqa: E402  pylint: disable=wrong-import-position

MIB = 1024 * 1024

MESSAGES = {
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.",
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the "
        "NVIDIA Display Driver is properly installed and present in your system.\n"
        "Please also try adding directory that contains libnvidia-ml.so to your system PATH.",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 550.54",
    pynvml.NVML_ERROR_GPU_IS_LOST:
        "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot the system to recover this GPU",
    pynvml.NVML_ERROR_RESET_REQUIRED:
        "Unable to determine the device handle for GPU0000:3B:00.0: GPU requires reset",
}


def gpu_field(name, index, handle):
    if name == "index":
        return str(index)
    if name == "uuid":
        return pynvml.nvmlDeviceGetUUID(handle)
    if name == "name":
        return pynvml.nvmlDeviceGetName(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    values = {"memory.total": memory.total, "memory.used": memory.used, "memory.free": memory.free,
              "memory.reserved": memory.reserved}
    if name not in values:
        raise KeyError(name)
    return values[name] // MIB


def main(argv):
    options = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    formats = options.get("format", "").split(",")
    if "csv" not in formats:
        print("fake nvidia-smi: only --format=csv is simulated", file=sys.stderr)
        return 2
    units = "nounits" not in formats
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            print("No devices were found")
            return 6
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        lines = []
        if "query-gpu" in options:
            fields = options["query-gpu"].split(",")
            for bad in [f for f in fields if f not in ("index", "uuid", "name", "memory.total", "memory.used",
                                                       "memory.free", "memory.reserved")]:
                print(f'Field "{bad}" is not a valid field to query.')
                return 2
            if "noheader" not in formats:
                lines.append(", ".join(f + (" [MiB]" if f.startswith("memory.") and units else "") for f in fields))
            for index, handle in enumerate(handles):
                cells = [gpu_field(f, index, handle) for f in fields]
                lines.append(", ".join(f"{c} MiB" if isinstance(c, int) and units and f != "index" else str(c)
                                       for c, f in zip(cells, fields)))
        elif "query-compute-apps" in options:
            fields = options["query-compute-apps"].split(",")
            if "noheader" not in formats:
                lines.append(", ".join(f + (" [MiB]" if f == "used_memory" and units else "") for f in fields))
            for handle in handles:
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = "[N/A]" if proc.usedGpuMemory is None else (
                        f"{proc.usedGpuMemory // MIB} MiB" if units else str(proc.usedGpuMemory // MIB))
                    values = {"gpu_uuid": uuid, "pid": str(proc.pid), "used_memory": used,
                              "process_name": "[Not Found]", "gpu_bus_id": "00000000:3B:00.0"}
                    lines.append(", ".join(values.get(f, "[N/A]") for f in fields))
        else:
            print("fake nvidia-smi: only --query-gpu and --query-compute-apps are simulated", file=sys.stderr)
            return 2
    except pynvml.NVMLError as exc:
        print(MESSAGES.get(exc.value, f"Unable to query: {exc}"))
        return exc.value if exc.value < 256 else 255
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
