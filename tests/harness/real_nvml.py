"""Whether the real NVIDIA library answers on this machine (a GPU machine with its driver loaded).

Some tests prove what the collection says where there is no driver (library_not_found, gpu_present
false) with the real nvidia-ml-py bindings of the test venv; on a machine whose driver answers those
cases do not exist, and the simulated NVML (tests/harness/simnvml) covers the rest there.
"""

from __future__ import annotations

import subprocess
import sys

# In a child: nvmlInit loads libnvidia-ml, which stays loaded in whatever process called it.
_PROBE = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept Exception:\n    raise SystemExit(1)\npynvml.nvmlShutdown()\n"


def driver_answers() -> bool:
    """True where the real bindings initialise NVML (a driver and its library are there)."""
    try:
        return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


DRIVER_ANSWERS = driver_answers()
