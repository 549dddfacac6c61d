# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations


class ModuleDocFragment:
    """Options that say which processes are the job, and which are never touched."""

    DOCUMENTATION = r"""
options:
  match:
    description:
      - Regular expressions (Python C(re), searched, not anchored) over the full command line of
        each process (arguments joined by spaces). A process matching any of them is part of the job.
      - Be specific. C(train\.py) also matches C(train_py_eval); C(/workspace/run/train\.py\b) does not.
      - Kernel threads and zombies have no command line and never match; zombies of the job are
        found through I(include_descendants) and their parent.
    type: list
    elements: str
    default: []
  pids:
    description:
      - Process IDs that are part of the job in addition to those found by I(match).
      - Pids that do not exist are ignored (reported in C(missing_pids)).
    type: list
    elements: int
    default: []
  include_descendants:
    description:
      - Whether all descendants of the selected processes (workers, data loaders, their children)
        are part of the job too.
    type: bool
    default: true
  protected:
    description:
      - Regular expressions over the command line or the comm of processes that must never be
        touched. Matching processes are left out of the job and listed under C(protected).
      - PID 1 of the namespace, kernel threads, and the process running the module with all its
        ancestors (the Ansible connection) are always protected, whatever this says.
      - The default protects sshd, systemd, init and the container runtime and Proxmox daemons.
        Setting this option replaces the default list.
    type: list
    elements: str
    default:
      - \bsshd\b
      - \bsystemd\b
      - ^(/usr)?/s?bin/init\b
      - \b(containerd|dockerd|runc|crun|lxcfs|lxc-start|lxc-monitor|lxc monitor|pve-lxc-syscalld)\b
      - \b(pvedaemon|pveproxy|pvestatd|pve-cluster|pmxcfs)\b
  gpu_device_glob:
    description:
      - Shell glob over the targets of open file descriptors that mark a process or thread as a
        GPU device holder.
      - When nothing on the machine matches the glob, the descriptor walk is skipped entirely.
    type: str
    default: /dev/nvidia*
  proc_root:
    description:
      - Where the process table is mounted. The PID namespace of that mount is the one analysed.
    type: path
    default: /proc
"""
