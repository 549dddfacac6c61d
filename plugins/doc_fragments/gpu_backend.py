# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations


class ModuleDocFragment:
    """How the GPU modules read the GPUs: the NVML bindings, or nvidia-smi (the options of _gpu/query.py's gpu_backend_spec)."""

    DOCUMENTATION = r"""
requirements:
  - On the target, the NVIDIA driver and either the Python bindings C(pynvml) (package C(nvidia-ml-py)) for the
    interpreter that runs the module, or the C(nvidia-smi) program (see O(backend)).
options:
  backend:
    description:
      - How to read the GPUs. V(auto) uses the Python bindings and falls back to V(nvidia-smi) when
        they are not installed.
    type: str
    choices: [auto, pynvml, nvidia-smi]
    default: auto
  nvidia_smi:
    description:
      - The C(nvidia-smi) executable, a name looked up on C(PATH) or a path.
    type: str
    default: nvidia-smi
  query_timeout:
    description:
      - How long one GPU query (the first one includes initialising NVML) may take, in seconds,
        before it counts as hung and the task fails.
      - More than 0 and at most 86400 (a day); NaN and infinity are refused.
    type: float
    default: 30
"""
