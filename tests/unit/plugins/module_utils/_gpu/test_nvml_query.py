"""NVML query: the child process with its deadline, error classification, the nvidia-smi parser.

The child runs for real (fork + the simulated bindings, or the real nvidia-ml-py bindings of the test
venv, which on this GPU-less machine fail exactly as on any host without a driver).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import query as nvml_query
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (
    MIB,
    GpuDevice,
    GpuProcess,
    GpuQueryError,
    MAX_OUTPUT_BYTES,
    NvidiaSmiSession,
    NvmlSession,
    add_minor_numbers,
    classify_nvidia_smi_failure,
    open_gpu_source,
    parse_nvidia_smi,
    parse_nvidia_smi_minor_numbers,
)
from tests.harness.gpu_holder import SIMNVML_DIR, STATE_ENV, sim_gpu
from tests.harness.pidns import process_starttime
from tests.harness.real_nvml import DRIVER_ANSWERS

GPUS_CSV = """0, GPU-5c3b1b8e-1d2f-4a7b-9e0c-2b1d1f3a4c5d, 81559, 40963, NVIDIA H100 80GB HBM3
1, GPU-0f6e3b2a-9c8d-4e7f-a1b2-c3d4e5f6a7b8, 81559, 4, NVIDIA H100 80GB HBM3
"""
APPS_CSV = """GPU-5c3b1b8e-1d2f-4a7b-9e0c-2b1d1f3a4c5d, 51234, 40960
GPU-5c3b1b8e-1d2f-4a7b-9e0c-2b1d1f3a4c5d, 51240, [N/A]
"""


@pytest.fixture
def simulated_bindings(monkeypatch):
    """Make `import pynvml` (in this process and in forked children) load the simulated module."""
    monkeypatch.syspath_prepend(str(SIMNVML_DIR))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    with sim_gpu(devices=2, teardown_delay=0.1) as gpu:
        monkeypatch.setenv("GPUOPS_SIMNVML_STATE", str(gpu.state_path))
        yield gpu


@pytest.fixture
def real_bindings(monkeypatch):
    """The real nvidia-ml-py module of the test venv."""
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "simnvml" not in p])
    return importlib.import_module("pynvml")


def test_process_entries_are_pid_and_mib_used_with_unknown_usage_kept_as_none():
    device = GpuDevice(0, "GPU-0", "H100", 80 * 1024 * MIB, 3 * 1024 * MIB,
                       processes=(GpuProcess(4121, 2048 * MIB + MIB // 2), GpuProcess(4122, None)))
    assert device.process_entries() == [{"pid": 4121, "used_mib": 2048.5}, {"pid": 4122, "used_mib": None}]


def test_parse_nvidia_smi_real_format():
    devices = parse_nvidia_smi(GPUS_CSV, APPS_CSV)
    assert [(d.index, d.used_mib, d.total_mib) for d in devices] == [(0, 40963, 81559), (1, 4, 81559)]
    assert devices[0].name == "NVIDIA H100 80GB HBM3"
    assert [(p.pid, p.used_mib) for p in devices[0].processes] == [(51234, 40960), (51240, None)]
    assert devices[1].processes == () and devices[0].reserved_bytes is None


def test_parse_nvidia_smi_keeps_a_comma_in_the_name_and_tolerates_blank_lines():
    [gpu] = parse_nvidia_smi("\n3, GPU-x, 16384, [N/A], Tesla T4, rev. B\n", "")
    assert gpu.name == "Tesla T4, rev. B" and gpu.used_bytes == 0 and gpu.total_bytes == 16384 * MIB


def test_parse_nvidia_smi_rejects_what_it_does_not_understand():
    with pytest.raises(GpuQueryError, match="unexpected nvidia-smi output line"):
        parse_nvidia_smi("0, GPU-x\n", "")


@pytest.mark.parametrize("returncode, output, kind", [
    (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
        "latest NVIDIA driver is installed and running.", "driver_not_loaded"),
    (18, "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 550.54", "version_mismatch"),
    (12, "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system.", "library_not_found"),
    (15, "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot the system", "gpu_lost"),
    (6, "No devices were found", "no_devices"),
    (16, "something new", "reset_required"),
    (255, "something else", "nvml_error"),
])
def test_nvidia_smi_failures_are_classified(returncode, output, kind):
    error = classify_nvidia_smi_failure(returncode, output)
    assert error.kind == kind
    assert f"nvidia-smi exited {returncode}" in str(error)


def test_no_gpu_kinds():
    assert GpuQueryError("driver_not_loaded").means_no_gpu
    assert GpuQueryError("not_installed").means_no_gpu
    assert not GpuQueryError("gpu_lost").means_no_gpu
    assert not GpuQueryError("version_mismatch").means_no_gpu


def test_session_reads_the_simulated_driver_in_a_child(simulated_bindings):
    simulated_bindings.holders.append({"pid": os.getpid(), "starttime": process_starttime(os.getpid()), "device": 1,
                                       "bytes": 2048 * MIB})
    simulated_bindings.save()
    session = NvmlSession(query_timeout=10)
    try:
        devices = session.query()
        child = session.pid
        assert child is not None and child != os.getpid()
        assert [d.used_mib for d in devices] == [4, 2052]
        assert devices[1].reserved_bytes == 527 * MIB
        assert [(p.pid, p.used_mib) for p in devices[1].processes] == [(os.getpid(), 2048)]
        assert [d.index for d in session.query([1])] == [1]
        assert session.pid == child  # one child, initialised once, for every query
    finally:
        session.close()
    assert session.pid is None and not Path(f"/proc/{child}").exists()
    assert "pynvml" not in sys.modules  # NVML is never loaded in the calling process


def test_each_gpu_carries_the_minor_number_of_its_device_file_or_why_there_is_none(simulated_bindings):
    # GPU 1 is /dev/nvidia6 (probe order need not be index order); GPU 0's number cannot be given;
    # GPU 2 answers 255, the number of /dev/nvidiactl, which no GPU has.
    simulated_bindings.devices[1]["minor_number"] = 6
    simulated_bindings.add_device(minor_number=255)
    simulated_bindings.fault("nvmlDeviceGetMinorNumber", "NOT_SUPPORTED", device=0)
    session = NvmlSession(query_timeout=10)
    try:
        gpu0, gpu1, gpu2 = session.query()
    finally:
        session.close()
    assert (gpu1.minor_number, gpu1.minor_unknown) == (6, "")
    assert gpu0.minor_number is None and gpu0.used_mib == 4  # the rest of the query stands
    assert gpu0.minor_unknown == "nvmlDeviceGetMinorNumber failed: Not Supported (NVMLError_NotSupported)"
    assert gpu2.minor_number is None and gpu2.minor_unknown.startswith("nvmlDeviceGetMinorNumber gave 255, not a GPU's")
    # nvidia-smi's CSV has no minor numbers (they come from -q -x, when asked): every GPU says so.
    assert {(d.minor_number, d.minor_unknown) for d in parse_nvidia_smi(GPUS_CSV, APPS_CSV)} == {
        (None, "the nvidia-smi backend reads minor numbers only when asked (nvidia-smi -q -x)")}


def test_hung_query_is_killed_at_its_deadline(simulated_bindings):
    simulated_bindings.fault("nvmlDeviceGetComputeRunningProcesses", hang=True, device=1)
    session = NvmlSession(query_timeout=0.5)
    session.start()
    child = session.pid
    assert [d.index for d in session.query([0])] == [0]  # GPU 0 still answers
    with pytest.raises(GpuQueryError) as caught:
        session.query()
    assert caught.value.kind == "hung"
    assert "querying GPU memory took longer than query_timeout=0.5s" in str(caught.value)
    assert session.pid is None and not Path(f"/proc/{child}").exists()


@pytest.mark.parametrize("call, error, kind", [
    ("nvmlInit", "DRIVER_NOT_LOADED", "driver_not_loaded"),
    ("nvmlInit", "LIB_RM_VERSION_MISMATCH", "version_mismatch"),
    ("nvmlDeviceGetMemoryInfo", "GPU_IS_LOST", "gpu_lost"),
    ("nvmlDeviceGetHandleByIndex", "RESET_REQUIRED", "reset_required"),
    ("nvmlDeviceGetCount", "NO_PERMISSION", "no_permission"),
    ("nvmlDeviceGetCount", "IRQ_ISSUE", "nvml_error"),
])
def test_nvml_errors_are_classified_by_code(simulated_bindings, call, error, kind):
    simulated_bindings.fault(call, error)
    with pytest.raises(GpuQueryError) as caught:
        open_gpu_source("pynvml", "nvidia-smi", 10).query()
    assert caught.value.kind == kind
    assert "NVMLError_" in caught.value.detail


@pytest.mark.skipif(DRIVER_ANSWERS, reason="a driver answers here: there is no missing library to report")
def test_real_bindings_without_a_driver_say_library_not_found(real_bindings):
    with pytest.raises(GpuQueryError) as caught:
        open_gpu_source("auto", "/nonexistent/nvidia-smi", 30)
    assert caught.value.kind == "library_not_found" and caught.value.means_no_gpu
    assert "NVMLError_LibraryNotFound" in caught.value.detail


def test_auto_falls_back_to_nvidia_smi_only_when_the_bindings_are_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p and "simnvml" not in p])
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    with pytest.raises(GpuQueryError) as caught:
        open_gpu_source("auto", str(tmp_path / "nvidia-smi"), 10)
    assert caught.value.kind == "not_installed"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n", encoding="ascii")
    smi.chmod(0o755)
    assert open_gpu_source("auto", str(smi), 10).backend == "nvidia-smi"
    with pytest.raises(GpuQueryError) as caught:
        open_gpu_source("pynvml", str(smi), 10)
    assert caught.value.kind == "not_installed"


def test_hung_nvidia_smi_is_killed_at_its_deadline(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 60\n", encoding="ascii")
    smi.chmod(0o755)
    with pytest.raises(GpuQueryError) as caught:
        NvidiaSmiSession(str(smi), query_timeout=0.3).query()
    assert caught.value.kind == "hung" and "--query-gpu" in str(caught.value)


def test_simulated_bindings_match_the_real_api_surface(real_bindings):
    """The simulated module must not drift from nvidia-ml-py: same names, codes, classes, wording."""
    sim = _load_simulated()
    used = ["nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID",
            "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlMemory_v2",
            "nvmlDeviceGetComputeRunningProcesses", "NVMLError", "NVMLLibraryMismatchError", "nvmlSystemGetDriverVersion",
            "nvmlDeviceGetMinorNumber"]
    for name in used:
        assert hasattr(real_bindings, name) and hasattr(sim, name), name
    assert sim.nvmlMemory_v2 == real_bindings.nvmlMemory_v2
    codes = [n for n in dir(real_bindings) if n.startswith("NVML_ERROR_")]
    for name in codes:
        code = getattr(real_bindings, name)
        assert getattr(sim, name) == code, name
        assert sim.NVMLError(code).__class__.__name__ == real_bindings.NVMLError(code).__class__.__name__
    for code in (9, 12, 15, 16, 18):
        assert str(sim.NVMLError(code)) == str(real_bindings.NVMLError(code))


def _load_simulated():
    spec = importlib.util.spec_from_file_location("simulated_pynvml", SIMNVML_DIR / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulated_pynvml"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["simulated_pynvml"]
    return module


def test_module_constants_are_the_nvml_codes(real_bindings):
    assert nvml_query.kind_of_code(real_bindings.NVML_ERROR_GPU_IS_LOST) == "gpu_lost"
    assert nvml_query.kind_of_code(real_bindings.NVML_ERROR_RESET_REQUIRED) == "reset_required"
    assert nvml_query.kind_of_code(real_bindings.NVML_ERROR_LIB_RM_VERSION_MISMATCH) == "version_mismatch"
    assert nvml_query.kind_of_code(real_bindings.NVML_ERROR_DRIVER_NOT_LOADED) == "driver_not_loaded"
    assert nvml_query.kind_of_code(real_bindings.NVML_ERROR_LIBRARY_NOT_FOUND) == "library_not_found"


def test_a_driver_without_gpus_is_no_devices(simulated_bindings):
    simulated_bindings.devices.clear()
    simulated_bindings.save()
    session = NvmlSession(query_timeout=10)
    try:
        with pytest.raises(GpuQueryError) as caught:
            session.query()
    finally:
        session.close()
    assert caught.value.kind == "no_devices" and caught.value.means_no_gpu


@pytest.mark.parametrize("query_timeout, words", [
    (1e12, "query_timeout: must be more than 0 and at most 86400 seconds, got 1e+12"),
    (float("nan"), "query_timeout: must be a finite number of seconds, got nan"),
    (float("inf"), "query_timeout: must be a finite number of seconds, got inf"),
    (0, "query_timeout: must be more than 0 and at most 86400 seconds, got 0"),
])
def test_query_timeout_is_bounded_before_anything_starts(tmp_path, query_timeout, words):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran\n", encoding="ascii")
    smi.chmod(0o755)
    for make in (lambda: NvmlSession(query_timeout), lambda: NvidiaSmiSession(str(smi), query_timeout),
                 lambda: open_gpu_source("auto", str(smi), query_timeout)):
        with pytest.raises(ValueError) as caught:
            make()
        assert str(caught.value) == words
    assert not (tmp_path / "ran").exists()


# --- minor numbers from nvidia-smi -q -x ---------------------------------------------------------

# The real report's layout (nvidia-smi -q -x, nvsmi_device_v12.dtd), cut to a few of its elements;
# the GPUs' <uuid> and <minor_number> are what is read.
XML_REPORT = """<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
\t<driver_version>550.54.15</driver_version>
\t<attached_gpus>{count}</attached_gpus>
{gpus}
</nvidia_smi_log>
"""
GPU_XML = """\t<gpu id="00000000:{bus:02X}:00.0">
\t\t<product_name>NVIDIA H100 80GB HBM3</product_name>
\t\t<uuid>{uuid}</uuid>
{minor}\t\t<fb_memory_usage><total>81559 MiB</total></fb_memory_usage>
\t\t<processes><process_info><pid>51234</pid><process_name>python3 &lt;x&gt;</process_name></process_info></processes>
\t</gpu>"""


def xml_report(*minors):
    """A report of one GPU per entry of `minors`: the text of its <minor_number>, or None for no element."""
    gpus = [GPU_XML.format(bus=0x18 + i, uuid=f"GPU-{i}",
                           minor="" if m is None else f"\t\t<minor_number>{m}</minor_number>\n")
            for i, m in enumerate(minors)]
    return XML_REPORT.format(count=len(gpus), gpus="\n".join(gpus))


def test_minor_numbers_from_the_xml_report_by_uuid():
    found = parse_nvidia_smi_minor_numbers(xml_report("0", "5", " 247 "))
    assert found == {"GPU-0": (0, ""), "GPU-1": (5, ""), "GPU-2": (247, "")}


@pytest.mark.parametrize("text, why", [
    ("N/A", "nvidia-smi reports its minor number as N/A"),
    (None, "nvidia-smi -q -x gives no minor_number for this GPU"),
    ("", "gives minor_number '', not a GPU's minor number (0 to 247)"),
    ("255", "gives minor_number '255', not a GPU's minor number"),   # /dev/nvidiactl's
    ("248", "gives minor_number '248'"),
    ("-1", "gives minor_number '-1'"),
    ("0x1", "gives minor_number '0x1'"),
    ("1e2", "gives minor_number '1e2'"),
    ("\u0663", "gives minor_number '\u0663'"),   # a digit to int(), not to the report
    ("12345678901234567890", "gives minor_number '1234567890"),
    ("1&#10;2", "gives minor_number '1\\\\x0a2'"),  # a control character comes back escaped
])
def test_a_missing_or_junk_minor_number_is_unknown_and_says_why(text, why):
    found = parse_nvidia_smi_minor_numbers(xml_report("3", text))
    assert found["GPU-0"] == (3, "")
    minor, said = found["GPU-1"]
    assert minor is None and why in said, said


def test_a_minor_number_given_twice_or_a_gpu_listed_twice_proves_nothing():
    found = parse_nvidia_smi_minor_numbers(xml_report("1", "1", "2"))
    assert found["GPU-0"][0] is None and "gives minor number 1 to more than one GPU" in found["GPU-0"][1]
    assert found["GPU-1"][0] is None and found["GPU-2"] == (2, "")
    twice = xml_report("1", "2").replace("GPU-1", "GPU-0")
    assert parse_nvidia_smi_minor_numbers(twice) == {"GPU-0": (None, "nvidia-smi -q -x lists this GPU twice")}


@pytest.mark.parametrize("text, words", [
    ("not xml at all", "not well-formed XML"),
    (xml_report("0")[:-30], "not well-formed XML"),
    ("<html><gpu><uuid>GPU-0</uuid><minor_number>0</minor_number></gpu></html>", "not an nvidia_smi_log: <html>"),
    ('<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaa"><!ENTITY b "&a;&a;&a;&a;">]><nvidia_smi_log>&b;</nvidia_smi_log>',
     "declares XML entities"),
    ('<!DOCTYPE l [<!ENTITY e SYSTEM "file:///etc/passwd">]><nvidia_smi_log>&e;</nvidia_smi_log>', "declares XML entities"),
    (xml_report("0") + " " * MAX_OUTPUT_BYTES, f"larger than {MAX_OUTPUT_BYTES} bytes"),
])
def test_what_is_not_the_report_is_refused(text, words):
    with pytest.raises(GpuQueryError, match=words) as caught:
        parse_nvidia_smi_minor_numbers(text)
    assert caught.value.kind == "nvml_error"


def smi_wrapper(tmp_path, body):
    """An nvidia-smi that logs its arguments, then runs `body` (sh)."""
    log = tmp_path / "calls.log"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{body}\n', encoding="ascii")
    smi.chmod(0o755)
    return smi, log


def test_the_nvidia_smi_backend_reads_minor_numbers_once_when_asked_and_never_per_poll(tmp_path):
    # The fake nvidia-smi answers from the simulated driver: GPU 1 is /dev/nvidia5, GPU 2's number
    # NVML cannot give (the real tool prints N/A then).
    with sim_gpu(devices=3) as gpu:
        gpu.devices[1]["minor_number"] = 5
        gpu.fault("nvmlDeviceGetMinorNumber", "NOT_SUPPORTED", device=2)
        fake = Path(gpu.fake_nvidia_smi_path()) / "nvidia-smi"
        smi, log = smi_wrapper(tmp_path, f'{STATE_ENV}={gpu.state_path} exec {fake} "$@"')
        session = NvidiaSmiSession(str(smi), query_timeout=30)
        polled = session.query()
        polled = session.query()
        assert [d.minor_number for d in polled] == [None, None, None]
        assert log.read_text().count("-q -x") == 0  # a poll costs the two CSV runs, as before
        gpu0, gpu1, gpu2 = add_minor_numbers(session, polled)
    assert log.read_text().count("-q -x") == 1
    assert (gpu0.minor_number, gpu1.minor_number) == (0, 5) and gpu1.minor_unknown == ""
    assert gpu2.minor_number is None and gpu2.minor_unknown == "nvidia-smi reports its minor number as N/A"
    assert gpu1.used_mib == polled[1].used_mib and gpu1.uuid == polled[1].uuid  # the rest as polled


@pytest.mark.parametrize("body, words", [
    ("case \"$*\" in *-q*) head -c 9000000 /dev/zero;; esac", f"wrote more than {MAX_OUTPUT_BYTES} bytes"),
    ("case \"$*\" in *-q*) echo 'No devices were found'; exit 6;; esac", "nvidia-smi exited 6: No devices were found"),
    ("case \"$*\" in *-q*) echo '<nvidia_smi_log><gpu>';; esac", "not well-formed XML"),
    ("case \"$*\" in *-q*) exec sleep 60;; esac", "took longer than query_timeout=0.5s"),
])
def test_when_the_report_fails_every_minor_number_is_unknown_and_says_why(tmp_path, body, words):
    smi, _log = smi_wrapper(tmp_path, body)
    devices = parse_nvidia_smi(GPUS_CSV, APPS_CSV)
    numbered = add_minor_numbers(NvidiaSmiSession(str(smi), query_timeout=0.5), devices)
    assert [d.minor_number for d in numbered] == [None, None]
    assert all(d.minor_unknown.startswith("nvidia-smi -q -x failed: ") and words in d.minor_unknown for d in numbered), \
        numbered[0].minor_unknown


def test_a_poll_whose_output_passes_the_bound_fails_without_holding_it(tmp_path):
    smi, _log = smi_wrapper(tmp_path, "head -c 9000000 /dev/zero")
    with pytest.raises(GpuQueryError, match=f"nvidia-smi --query-gpu=.* wrote more than {MAX_OUTPUT_BYTES} bytes"):
        NvidiaSmiSession(str(smi), query_timeout=10).query()


def test_the_nvml_backend_gives_minor_numbers_with_every_query_and_is_not_asked_again():
    devices = [dataclasses.replace(d, minor_number=i) for i, d in enumerate(parse_nvidia_smi(GPUS_CSV, APPS_CSV))]
    assert add_minor_numbers(object(), devices) is devices
