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
      - Be specific. V(train\\.py) also matches V(train_py_eval); V(/workspace/run/train\\.py\\b) does not.
      - A pattern that names more than a job is refused (the task fails, naming the pattern, and
        nothing is touched) unless O(allow_broad=true) - one that matches the empty string (V(.*),
        V(""), V(x?)), or one that matches the command line of the module's own process or of one
        of its ancestors (the C(sh -c) and sshd session of the connection, or with
        C(ansible_connection=local) the C(ansible-playbook) worker); such a pattern also matches
        every process like them (every python process, every other connection, the controller's
        workers for other hosts).
      - Kernel threads and zombies have no command line and never match; zombies of the job are
        found through O(include_descendants) and their parent.
    type: list
    elements: str
    default: []
  pids:
    description:
      - Process IDs that are part of the job in addition to those found by O(match).
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
  allow_broad:
    description:
      - Act on a selection that names more than a job. Without it, the selection is refused when a
        O(match) pattern is too broad (see O(match)) or when the selection, with its descendants,
        takes in a process of Ansible itself - one that runs an Ansible program or module
        (C(ansible-playbook) and its workers, C(AnsiballZ_*.py)), or one that the Ansible process
        running this module started (a descendant of it, or a member of the process group or
        session it leads).
      - "Risk: with V(true), everything the selection names that is not protected is part of the
        job. C(match: ['.*']) then means every process of the namespace except PID 1, kernel
        threads, O(protected) and the module's own connection chain - and with
        C(ansible_connection=local), the Ansible workers serving other hosts too, which hangs the
        play. Use it only where that is meant, for example inside a container reached over
        C(pct exec) or C(nsenter) that runs nothing but the job."
      - The always-protected processes stay protected whatever this says.
      - M(gpuops.relaunch.zombie_facts) applies the same rule, so that a look at the job agrees with
        what M(gpuops.relaunch.zombie_reap) would act on.
    type: bool
    default: false
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
