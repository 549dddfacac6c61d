"""NVML query: the child process with its deadline, error classification, the nvidia-smi parser.

The child runs for real (fork + the simulated bindings, or the real nvidia-ml-py bindings of the test
venv, which on this GPU-less machine fail exactly as on any host without a driver).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import query as nvml_query
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import (
    MIB,
    GpuQueryError,
    NvidiaSmiSession,
    NvmlSession,
    classify_nvidia_smi_failure,
    open_gpu_source,
    parse_nvidia_smi,
)
from tests.harness.gpu_holder import SIMNVML_DIR, sim_gpu
from tests.harness.pidns import process_starttime

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
    # nvidia-smi's CSV has no minor numbers: every GPU says so.
    assert {(d.minor_number, d.minor_unknown) for d in parse_nvidia_smi(GPUS_CSV, APPS_CSV)} == {
        (None, "the nvidia-smi backend does not report device minor numbers (the pynvml backend does)")}


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
