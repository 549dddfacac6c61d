"""The simulated NVML (tests/harness/simnvml) cannot drift from the real API: every function, constant
and class it offers is the installed nvidia-ml-py's, with the same arguments and the same values."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path

import pytest

SIMNVML = Path(__file__).resolve().parents[2] / "harness" / "simnvml" / "pynvml.py"


def load(name: str, path: Path | None = None) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path) if path else importlib.util.find_spec("pynvml")
    if path is None and spec is not None:
        spec = importlib.util.spec_from_file_location(name, spec.origin)
    assert spec is not None and spec.loader is not None, "nvidia-ml-py is not installed in the test venv"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the simulation finds itself there to make its error classes
    spec.loader.exec_module(module)
    return module


SIM = load("gpuops_simnvml", SIMNVML)
REAL = load("gpuops_real_pynvml")


def public(module: types.ModuleType) -> list[str]:
    """The names the simulation offers as API: what the real bindings name nvml*, NVML*, c_nvml*."""
    return sorted(name for name, value in vars(module).items()
                  if name.startswith(("nvml", "NVML", "c_nvml")) and getattr(value, "__module__", module.__name__) != "typing")


def test_the_simulation_is_the_real_package_and_not_simnvml_itself():
    assert Path(REAL.__file__).resolve() != SIMNVML
    assert "site-packages" in REAL.__file__


@pytest.mark.parametrize("name", public(SIM))
def test_every_simulated_name_is_the_real_apis(name):
    simulated = getattr(SIM, name)
    assert hasattr(REAL, name), f"{name} is not in nvidia-ml-py"
    real = getattr(REAL, name)
    if inspect.isfunction(simulated):
        assert callable(real)
        assert list(inspect.signature(simulated).parameters) == list(inspect.signature(real).parameters), name
    elif inspect.isclass(simulated):
        assert inspect.isclass(real), name
        if issubclass(simulated, Exception):
            assert issubclass(real, REAL.NVMLError) or real is REAL.NVMLError or name == "NVMLLibraryMismatchError"
    else:
        expected = real.value if hasattr(real, "value") and not isinstance(real, int) else real
        assert simulated == expected, f"{name}: simulated {simulated!r}, real {expected!r}"


def test_every_error_class_carries_the_real_code():
    for name in [n for n in public(SIM) if n.startswith("NVML_ERROR_")]:
        code = getattr(SIM, name)
        assert REAL.nvmlExceptionClass(code).__name__ == SIM.nvmlExceptionClass(code).__name__, name


def test_field_value_and_pci_info_carry_the_real_struct_fields():
    """What a caller reads off a returned struct exists on the real one too."""
    real_field = [name for name, _type in REAL.c_nvmlFieldValue_t._fields_]
    real_value = [name for name, _type in REAL.c_nvmlValue_t._fields_]
    real_pci = [name for name, _type in REAL.nvmlPciInfo_t._fields_]
    SIM._initialized = 0
    simulated_field = SIM.c_nvmlFieldValue_t(fieldId=230, scopeId=0, timestamp=0, latencyUsec=0, valueType=1,
                                             nvmlReturn=0, value=SIM.c_nvmlValue_t(uiVal=1))
    assert set(vars(simulated_field)) <= set(real_field)
    assert set(vars(simulated_field.value)) <= set(real_value)
    assert {"busId", "busIdLegacy", "domain", "bus", "device"} <= set(real_pci)
