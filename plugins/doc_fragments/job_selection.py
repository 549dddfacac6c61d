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
      - A list of patterns, or one pattern as a string. A string is one pattern, never split on its
        commas (V(train_\\d{1,3}\\.py) stays whole).
      - Be specific. V(train\\.py) also matches V(train_py_eval); V(/workspace/run/train\\.py\\b) does not.
      - A pattern that names more than a job makes M(gpuops.relaunch.zombie_reap) refuse the selection
        (the task fails, naming the pattern, and nothing is touched) unless O(allow_broad=true);
        M(gpuops.relaunch.zombie_facts) reports it in C(too_broad) instead. Such a pattern is one that
        matches the empty string (V(.*), V(""), V(x?)), or one that matches the command line of the
        module's own process or of one of its ancestors (the C(sh -c) and sshd session of the
        connection, or with C(ansible_connection=local) the C(ansible-playbook) worker); such a
        pattern also matches every process like them (every python process, every other connection,
        the controller's workers for other hosts). An Ansible program's command line is judged
        without the module arguments and extra variables typed on it (C(ansible -a ...),
        C(ansible-playbook -e ...)) - a pattern typed there names nothing of Ansible by that alone,
        and the other workers it would reach are refused as processes of Ansible (see O(allow_broad)).
      - Kernel threads and zombies have no command line and never match; zombies of the job are
        found through O(include_descendants) and their parent.
      - Processes of another train_launch job are left out (see O(job_name)).
    type: raw
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
      - Act on a selection that names more than a job. Without it, M(gpuops.relaunch.zombie_reap)
        refuses the selection when a O(match) pattern is too broad (see O(match)) or when the
        selection, with its descendants, takes in a process of Ansible itself - one that runs an
        Ansible program or module (its executable is a Python interpreter that runs
        C(ansible-playbook), another Ansible program or an C(AnsiballZ_*.py) module; what argv[0]
        says is not looked at), or one that the Ansible process running this module started (a
        descendant of it, or a member of the process group or session it leads).
      - "Risk: with V(true), everything the selection names that is not protected is part of the
        job. C(match: ['.*']) then means every process of the namespace except PID 1, kernel
        threads, the protected programs, O(protected) and the module's own connection chain - and
        with C(ansible_connection=local), the Ansible workers serving other hosts too, which hangs
        the play. Use it only where that is meant, for example inside a container reached over
        C(pct exec) or C(nsenter) that runs nothing but the job."
      - The always-protected processes stay protected whatever this says.
      - M(gpuops.relaunch.zombie_facts) never refuses, it only looks; it reports what
        M(gpuops.relaunch.zombie_reap) would refuse in C(too_broad) and leaves the processes of
        Ansible out of the job it reports (unless this is V(true)), so that a look at the job agrees
        with what M(gpuops.relaunch.zombie_reap) would act on.
    type: bool
    default: false
  protected:
    description:
      - Regular expressions over the command line or the comm of processes that must never be
        touched, on top of what is always protected. Matching processes are left out of the job and
        listed under C(protected).
      - A list of patterns, or one pattern as a string (never split on its commas).
      - A process writes its own command line and comm (any process can put C(sshd) among its
        arguments, or set argv[0] with C(exec -a)), so these patterns spare whatever claims to match
        them - a convenience, not a guarantee.
      - Always protected, whatever this says, judged by what a process cannot claim - PID 1 of the
        namespace, kernel threads, the process running the module with all its ancestors (the Ansible
        connection), and the protected programs, known by their executable (C(/proc/PID/exe)) in a
        system directory (C(/usr), C(/bin), C(/sbin), C(/lib)) - sshd (and sshd-session), init,
        systemd and its C(systemd-*) services, containerd (and its shims), dockerd, runc, crun,
        conmon, lxcfs, lxc-start (the LXC monitor), lxc-monitord, pve-lxc-syscalld, pmxcfs, and the
        Proxmox daemons written in Perl (pvedaemon, pveproxy, pvestatd, ...) when they run as root.
    type: raw
    default: []
  job_name:
    description:
      - The train_launch job this selection is for (its C(name)), with O(job_state_dir).
      - Processes proven to belong to another train_launch job are left out of the job and listed in
        C(other_jobs), whatever O(match) and O(pids) say (two jobs on one host may run the same script).
        Proven means that the process carries that job's run mark (C(GPUOPS_RELAUNCH_RUN)) and the
        job's run record names that run, or that it is or descends from that job's supervisor (its
        own mark and the pid and start time the job's records give it). The records are believed
        only from a job directory reached without a symlink, owned by root or by the user running
        the module, and writable by no one else.
      - Processes of the job named here are selected as usual. Without this option every process
        proven to belong to a train_launch job is left out.
    type: str
  job_state_dir:
    description:
      - The C(state_dir) of the job named by O(job_name) (as given to M(gpuops.relaunch.train_launch)).
    type: path
    default: /var/lib/gpuops
  gpu_device_glob:
    description:
      - Shell glob over the targets of open file descriptors where GPU device files are looked for.
        Of the files matching it, only a GPU's own character device (the NVIDIA major 195, minor 0 to
        247, C(/dev/nvidiaN)), told by the kernel's numbers of the opened file, marks a process or
        thread as a GPU device holder; C(/dev/nvidiactl), C(/dev/nvidia-modeset), C(/dev/nvidia-uvm) and
        files that are not character devices do not.
      - When nothing on the machine matches the glob, the descriptor walk is skipped entirely.
    type: str
    default: /dev/nvidia*
  proc_root:
    description:
      - Where the process table is mounted. The PID namespace of that mount is the one analysed.
    type: path
    default: /proc
"""
