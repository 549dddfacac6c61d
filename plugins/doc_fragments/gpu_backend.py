# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations


class ModuleDocFragment:
    """How the GPU modules read the GPUs: the NVML bindings, or nvidia-smi."""

    DOCUMENTATION = r"""
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
"""
