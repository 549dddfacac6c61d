"""A fake `nvidia-smi` for tests: real CSV formats, answers from the simulated NVML state.

Understands the invocations gpu_mem_wait makes (``--query-gpu=...`` and ``--query-compute-apps=...``
with ``--format=csv[,noheader][,nounits]``) and gpu_reclaim's ``-q -x``: the XML report, with the
elements of the real one that the collection reads or that a parser must step over (``<gpu>``'s
``<uuid>`` and ``<minor_number>``, N/A where NVML cannot give it as the real tool prints; memory and
processes, whose free-text names are escaped as the real tool does). Failures print the real tool's
wording and exit with the NVML error code, as the real tool does. The simulated bindings are loaded from ../simnvml by path,
so the Python that runs the module under test does not see a `pynvml` module.
"""

import json
import os
import sys
import time
from xml.sax.saxutils import escape

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


def _or_na(call, *args):
    try:
        return call(*args)
    except pynvml.NVMLError:
        return None


def health_elements(handle):
    """The report's health elements (driver 550's layout) from the simulated state: what gpu_health's
    nvidia-smi fallback parses. N/A where the simulated NVML cannot give it, as the real tool prints."""
    def text(value):
        return "N/A" if value is None else str(value)

    def yes(value):
        return "N/A" if value is None else ("Yes" if value else "No")

    bus = _or_na(pynvml.nvmlDeviceGetPciInfo, handle)
    ecc = _or_na(pynvml.nvmlDeviceGetTotalEccErrors, handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                 pynvml.NVML_VOLATILE_ECC)
    rows = _or_na(pynvml.nvmlDeviceGetRemappedRows, handle)
    pages = _or_na(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    reasons = _or_na(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)

    def active(bit):
        return "N/A" if reasons is None else ("Active" if reasons & bit else "Not Active")

    return ["\t\t<pci>", f"\t\t\t<pci_bus_id>{'N/A' if bus is None else bus.busId.decode()}</pci_bus_id>", "\t\t</pci>",
            "\t\t<clocks_event_reasons>",
            f"\t\t\t<clocks_event_reason_gpu_idle>{active(0x1)}</clocks_event_reason_gpu_idle>",
            f"\t\t\t<clocks_event_reason_hw_slowdown>{active(0x8)}</clocks_event_reason_hw_slowdown>",
            f"\t\t\t<clocks_event_reason_hw_thermal_slowdown>{active(0x40)}</clocks_event_reason_hw_thermal_slowdown>",
            f"\t\t\t<clocks_event_reason_hw_power_brake_slowdown>{active(0x80)}</clocks_event_reason_hw_power_brake_slowdown>",
            "\t\t</clocks_event_reasons>",
            "\t\t<ecc_errors>", "\t\t\t<volatile>", "\t\t\t\t<sram_uncorrectable>0</sram_uncorrectable>",
            f"\t\t\t\t<dram_uncorrectable>{text(ecc)}</dram_uncorrectable>", "\t\t\t</volatile>", "\t\t</ecc_errors>",
            "\t\t<retired_pages>",
            f"\t\t\t<pending_retirement>{yes(None if pages is None else pages == pynvml.NVML_FEATURE_ENABLED)}</pending_retirement>",
            "\t\t</retired_pages>",
            "\t\t<remapped_rows>",
            f"\t\t\t<remapped_row_corr>{text(rows and rows[0])}</remapped_row_corr>",
            f"\t\t\t<remapped_row_unc>{text(rows and rows[1])}</remapped_row_unc>",
            f"\t\t\t<remapped_row_pending>{yes(rows and rows[2])}</remapped_row_pending>",
            f"\t\t\t<remapped_row_failure>{yes(rows and rows[3])}</remapped_row_failure>",
            "\t\t</remapped_rows>"]


def xml_report(handles):
    """`nvidia-smi -q -x`: the real report's layout (nvsmi_device_v12.dtd), the parts simulated."""
    lines = ['<?xml version="1.0" ?>', '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">', "<nvidia_smi_log>",
             f"\t<timestamp>{time.strftime('%a %b %d %H:%M:%S %Y')}</timestamp>",
             f"\t<driver_version>{pynvml.nvmlSystemGetDriverVersion()}</driver_version>",
             f"\t<attached_gpus>{len(handles)}</attached_gpus>"]
    for index, handle in enumerate(handles):
        try:
            minor = str(pynvml.nvmlDeviceGetMinorNumber(handle))
        except pynvml.NVMLError:
            minor = "N/A"  # what the real tool prints for a value NVML does not give
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        lines += [f'\t<gpu id="00000000:{0x18 + index:02X}:00.0">',
                  f"\t\t<product_name>{escape(pynvml.nvmlDeviceGetName(handle))}</product_name>",
                  f"\t\t<uuid>{escape(pynvml.nvmlDeviceGetUUID(handle))}</uuid>",
                  f"\t\t<minor_number>{minor}</minor_number>",
                  "\t\t<fb_memory_usage>",
                  f"\t\t\t<total>{memory.total // MIB} MiB</total>",
                  f"\t\t\t<used>{memory.used // MIB} MiB</used>",
                  f"\t\t\t<free>{memory.free // MIB} MiB</free>",
                  "\t\t</fb_memory_usage>",
                  "\t\t<processes>"]
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used = "N/A" if proc.usedGpuMemory is None else f"{proc.usedGpuMemory // MIB} MiB"
            lines += ["\t\t\t<process_info>", f"\t\t\t\t<pid>{proc.pid}</pid>", "\t\t\t\t<type>C</type>",
                      "\t\t\t\t<process_name>python3 &lt;train.py&gt;</process_name>",
                      f"\t\t\t\t<used_memory>{used}</used_memory>", "\t\t\t</process_info>"]
        lines += ["\t\t</processes>"]
        lines += health_elements(handle)
        lines += ["\t</gpu>"]
    lines += ["", "</nvidia_smi_log>"]
    return lines


def gpu_reset(argv):
    """``--gpu-reset -i N`` (or ``-i UUID``, as the real tool takes it too): what a reset clears in the simulated
    state (a pending remap is activated, the recovery action is none again; a lost GPU is not reset), each call
    recorded in STATE.resets (the index or UUID as given, one a line), as the real tool prints it. The state file
    is replaced atomically, as the harness writes it."""
    given = argv[argv.index("-i") + 1]
    path = os.environ[pynvml.STATE_ENV]
    with open(path, encoding="utf-8") as handle:
        state = json.load(handle)
    uuids = [device.get("uuid") for device in state["devices"]]
    if given.startswith("GPU-") and given not in uuids:
        print(f"No devices were found matching {given}")
        return 6
    index = uuids.index(given) if given in uuids else int(given)
    device = state["devices"][index]
    bus = device.get("pci_bus_id", "00000000:%02X:00.0" % (0x3B + index))
    with open(path + ".resets", "a", encoding="utf-8") as log:
        log.write(f"{given}\n")
    if device.get("lost"):
        print(f"Unable to reset GPU {bus}: GPU is lost.  Reboot the system to recover this GPU")
        return pynvml.NVML_ERROR_GPU_IS_LOST
    rows = device.get("remapped_rows")
    if isinstance(rows, list) and len(rows) == 4:
        device["remapped_rows"] = [rows[0], rows[1], 0, rows[3]]
    if device.get("recovery_action") not in (None, 0):
        device["recovery_action"] = 0
    tmp = path + ".reset-tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(state, handle)
    os.replace(tmp, path)
    print(f"GPU {bus} was successfully reset.\nAll done.")
    return 0


def main(argv):
    if "--gpu-reset" in argv:
        return gpu_reset(argv)
    options = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    formats = options.get("format", "").split(",")
    report = ("-q" in argv or "--query" in argv) and ("-x" in argv or "--xml-format" in argv)
    if not report and "csv" not in formats:
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
        if report:
            lines = xml_report(handles)
        elif "query-gpu" in options:
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
