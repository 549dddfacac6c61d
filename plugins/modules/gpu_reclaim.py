#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_reclaim
short_description: End every process that holds the chosen GPUs and is not spared, then wait for the release
version_added: 0.1.0
description:
  - For shared GPU machines (CI runners, shared boxes) where the GPUs are held by whatever ran last,
    not by one known job. Every process the driver lists on the chosen GPUs is ended unless it is
    spared, then the module waits until the GPUs are released, the way M(gpuops.relaunch.gpu_mem_wait)
    waits, and reports what was ended, what was spared and why, and what still holds on.
  - "Never signalled, whatever the options say: PID 1 of the namespace, the process running this
    module and all its ancestors (the Ansible connection), kernel threads, processes matching the
    default protected list or O(protected), members of the process group of the Ansible process
    running this module, and processes matching O(allow). A process that merely runs something named
    like Ansible is not spared: any GPU user can name its program so. These are returned in
    RV(spared) with their reason."
  - "Not signalled either, because no signal ends them or they cannot be identified: a plain zombie
    (its parent must reap it), a pid the driver lists that no longer exists, a pid newer than the
    module's look at the process table (a re-run ends it), and every listed pid where the driver's
    pids are not this PID namespace's (see O(driver_pids))."
  - "Only proven holders are signalled: the driver's list of pids is a hint, not a proof. It goes
    stale (DataLoader workers keep the CUDA device files open after the listed main process has
    died) and its pids get reused by unrelated processes. A listed process is signalled only if,
    at the moment of the signal, it holds open the device file of a GPU the driver lists it on:
    the character device with the NVIDIA driver's major number 195 and that GPU's minor number as
    the driver gives it (C(nvmlDeviceGetMinorNumber), or C(<minor_number>) of one C(nvidia-smi -q -x)
    run with O(backend=nvidia-smi); C(/dev/nvidiaN) for minor N), told by the kernel's
    device numbers of the file its descriptor leads to, never by a name (a C(Zl) leader by its live
    threads' files in C(/proc/PID/task/TID/fd)). C(/dev/nvidiactl), C(/dev/nvidia-uvm) and
    C(/dev/nvidia-modeset), which GPU users share, and another GPU's C(/dev/nvidiaM) prove nothing.
    One that does not hold it is returned in RV(not_holding) (and in RV(spared) with reason
    V(not_holding)), with what it holds instead, and never signalled."
  - "Where a GPU's minor number is not known (the NVML call fails or is not supported; nvidia-smi
    reports it as N/A, gives no number or a number no GPU has, or its C(-q -x) run fails), nothing
    proves a holder of that GPU: its holders are returned in RV(spared) with reason
    V(device_unknown) and never signalled, rather than judged by any NVIDIA file they hold.
    With O(backend=nvidia-smi) the report is read once per task, for the look, not on every poll
    of the release wait."
  - "Identity: the process table is read before the driver is asked, so a listed pid is identified
    by the (pid, start time) it had in that table. Each signal goes through the collection's one
    signal gate: the process is pinned with a pidfd (C(pidfd_open), Linux 5.3+) and only then its
    start time is checked, so a pid reused by another process at any moment is never signalled
    (RV(spared) reason V(recycled)). The device-file check runs in the gate too, on the pinned
    process, so a reused pid is judged as the process the signal would reach. There is no signal to
    a process group and no pattern kill."
  - "Ladder: SIGTERM to every target, a wait of up to O(term_timeout) for them to end, SIGKILL to the
    ones still running (unless O(kill=false)), then a wait of up to O(release_timeout) until no
    target is listed on the chosen GPUs any more and used memory, less what the spared holders
    use, is at or under O(max_used_mib)."
  - "What still holds memory at the deadline is judged with M(gpuops.relaunch.gpu_mem_wait)'s rules,
    in the collection's one vocabulary (RV(escalation)): a zombie orphaned to a PID 1 that does not
    reap it needs a restart of the container (V(container_reboot)); a thread asleep in the GPU
    driver, or a listed pid that no longer exists on the host, needs the host (V(host_action))."
  - The task fails when the GPUs are not released by O(release_timeout) (outside check mode).
  - Every problem with the options is found before the GPUs are queried or anything is signalled and
    reported at once, each naming its option (in RV(option_problems) too).
  - A second run once the GPUs are released finds nothing to end and returns C(changed=false).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.gpu_backend
options:
  devices:
    description:
      - The GPUs to reclaim, by index (V(0)) or UUID (C(GPU-...)).
      - V([all]) (the word alone) reclaims every GPU of the host. An empty list is an error, never
        "all", so that a variable that came out empty cannot end every GPU user of a shared machine.
    type: list
    elements: str
    required: true
  allow:
    description:
      - Regular expressions (Python C(re), searched, not anchored) over the command line (arguments
        joined by spaces) and the executable path (C(/proc/PID/exe)) of each holder. A holder that
        matches any of them is spared (RV(spared) reason V(allow_listed)) and keeps its memory; the
        release condition does not count it.
      - A process can change its own command line, so the allow list is a courtesy to well-behaved
        users, not a security boundary; it only ever spares more.
    type: list
    elements: str
    default: []
  protected:
    description:
      - Regular expressions over the command line or the comm of processes that must never be
        signalled, in addition to the collection's built-in protection, which always applies here -
        sshd, systemd, init, the container runtime and the Proxmox daemons, known by their
        executable (C(/proc/PID/exe)) and not by a command line. A process writes its own command
        line and comm, so these patterns spare whatever claims to match them.
      - Protected holders are spared (RV(spared) reason V(protected)) and keep their memory.
    type: list
    elements: str
    default: []
  term_timeout:
    description:
      - Seconds to wait after SIGTERM for the targets to end before SIGKILL.
      - Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 10
  kill:
    description:
      - Whether to send SIGKILL to the targets still running after O(term_timeout). With V(false),
        they are reported in RV(remaining) and the wait for the release goes on without them.
    type: bool
    default: true
  release_timeout:
    description:
      - Seconds to wait, after the signals, for the GPUs to be released before the task fails.
        V(0) takes one look.
      - Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 60
  poll_interval:
    description:
      - Seconds between two looks at the GPUs while waiting for the release.
      - At least 0.01 (a shorter pause only burns a core) and at most 3600.
    type: float
    default: 0.5
  max_used_mib:
    description:
      - Used memory per GPU, in MiB, less what the spared holders use, at or under which a GPU
        counts as released (as in M(gpuops.relaunch.gpu_mem_wait)). Where the driver reports the
        reservation apart (NVML memory info v2), it is not counted.
      - Where the driver does not report a spared holder's own use, its memory cannot be told apart
        and only the listing counts on that GPU.
      - A finite number, 0 or more. When not given, 256 MiB (gpu_mem_wait's baseline).
    type: float
  driver_pids:
    description:
      - Whose pids the driver lists. V(host) (NVIDIA's driver) lists pids of the host's PID
        namespace, so the holders are signalled only where this module runs in that namespace;
        inside a container the same numbers name other processes, so nothing is signalled there and
        every holder is reported with reason V(invisible) (run the module on the host instead).
      - V(own_namespace) says the driver's pids are pids of the namespace the module runs in (a
        runtime that shares or translates them, or the collection's simulated driver in a test
        namespace). Set it only where that is known, because a wrong V(own_namespace) would signal
        whatever process has the same number here.
    type: str
    choices: [host, own_namespace]
    default: host
  gpu_device_glob:
    description:
      - Shell glob over the targets of open file descriptors (C(/proc/PID/fd/*), and
        C(/proc/PID/task/TID/fd/*) for a C(Zl) leader) where the device files of the GPUs are
        looked for. Of the files matching it, only the character device of the GPU the process is
        listed on (major 195, the GPU's minor number from the driver) proves that it holds that GPU; a
        listed process holding no such file is not signalled (RV(not_holding)).
      - An absolute path glob that names the device files. Refused when its file name begins with a
        wildcard or it matches a file nearly every process holds (C(/dev/null), a terminal), because
        such a glob would prove any process a holder.
      - When nothing on the machine matches the glob, no process holds a device and nothing is
        signalled.
    type: str
    default: /dev/nvidia*
  gpus_required:
    description:
      - Whether a host without a usable NVIDIA GPU (no bindings nor C(nvidia-smi), no NVML library,
        driver not loaded, no device) is a failure. With V(false) the task then succeeds with
        RV(gpu_present=false) and does nothing.
    type: bool
    default: true
attributes:
  check_mode:
    support: full
    details:
      - Makes the same option checks and the same look as a real run, returns in RV(targets) what it
        would end and in RV(spared) what it would spare, and sends no signal. C(changed) says whether
        anything would be ended. RV(released) is from one look, without waiting.
  diff_mode:
    support: none
    details:
      - Reports no diff; RV(targets), RV(ended) and RV(signals) say what would be or was signalled.
  platform:
    platforms: linux
    details:
      - Linux only (NVML or C(nvidia-smi), C(/proc), C(pidfd_open)); the target, where the GPUs and the
        holders are, in the PID namespace whose pids the driver lists (normally the host).
notes:
  - Only the holders themselves are ended, not their children that do not hold the GPU (a data
    loader worker, say); they are orphaned and keep running.
  - C(changed) is true when a signal was delivered.
seealso:
  - module: gpuops.relaunch.gpu_mem_wait
  - module: gpuops.relaunch.zombie_reap
"""

EXAMPLES = r"""
- name: Free GPUs 0 and 1 of a CI runner, sparing the monitoring agent
  gpuops.relaunch.gpu_reclaim:
    devices: [0, 1]
    allow:
      - /usr/bin/dcgm-exporter\b
      - \bnv-hostengine\b
    term_timeout: 15
  register: reclaim

- name: Say what was ended and what was spared
  ansible.builtin.debug:
    msg: "{{ reclaim.ended | map(attribute='pid') | list }} ended; {{ reclaim.spared | map(attribute='reason') | list }}"

- name: Every GPU of a shared box, the word all spelled out; what would be ended, nothing signalled
  gpuops.relaunch.gpu_reclaim:
    devices: [all]
  check_mode: true
"""

RETURN = r"""
msg:
  description: One line saying what was ended, spared and whether the GPUs were released.
  returned: always
  type: str
  sample: "ended 2 of 2 holder(s) of GPU(s) 0, 1; spared 1; released"
released:
  description:
    - Whether, by O(release_timeout), no target was listed on the chosen GPUs any more and their used
      memory less the spared holders' was at or under O(max_used_mib). In check mode, from one look.
  returned: unless the options were refused
  type: bool
  sample: true
gpu_present:
  description: Whether a usable NVIDIA GPU was found.
  returned: unless the options were refused
  type: bool
  sample: true
backend:
  description: What the GPUs were read with, V(pynvml) or V(nvidia-smi); V(none) when no GPU was found.
  returned: unless the options were refused
  type: str
  sample: pynvml
targets:
  description:
    - The holders the look selected to end (in check mode, what would be ended), with C(gpus) and C(used_mib).
    - Each C(cmdline) here and below is escaped and cut to its first 4 KiB, marked as cut.
  returned: success
  type: list
  elements: dict
  sample: [{pid: 4121, starttime: 991200, comm: python3, cmdline: python3 train.py, gpus: [0], used_mib: 40960.0}]
ended:
  description:
    - Targets that ended, with the last C(signal) they got (V(SIGTERM) or V(SIGKILL)) and C(now),
      V(gone) or V(zombie) (ended, not yet reaped by its parent). Empty in check mode.
  returned: success
  type: list
  elements: dict
  sample: [{pid: 4121, starttime: 991200, comm: python3, cmdline: python3 train.py, gpus: [0], used_mib: 40960.0,
            signal: SIGTERM, now: gone}]
spared:
  description:
    - Holders that were not signalled, with C(reason) and C(detail). Reasons by policy (they keep
      their memory, the release does not count them) are V(allow_listed), V(protected), V(ancestor),
      V(pid1) and V(ansible) (in the process group of the Ansible process running this module). The
      others must still let go of the GPU for the release, they are
      V(zombie) (no signal ends it), V(gone) (listed, but no such process), V(recycled) (its pid now
      belongs to another process, which was not signalled), V(appeared) (newer than the look),
      V(invisible) (a host pid seen from another PID namespace, see O(driver_pids)), V(denied),
      V(not_holding) (listed, but holds no device file of that GPU, see RV(not_holding)) and
      V(device_unknown) (listed on a GPU whose minor number is not known, so that holding it cannot be
      proven; the C(detail) says why the number is not known).
  returned: success
  type: list
  elements: dict
  sample: [{pid: 3001, starttime: 120, comm: dcgm-exporter, cmdline: /usr/bin/dcgm-exporter, gpus: [0, 1], used_mib: 80.0,
            reason: allow_listed, detail: "matches allow pattern '/usr/bin/dcgm-exporter\\\\b'"}]
not_holding:
  description:
    - Listed holders that held no device file of the GPUs they are listed on (major 195, each GPU's
      minor number from the driver), in the look or when they were to be signalled, so were never signalled
      (the same entries are in RV(spared) with reason V(not_holding)); the C(detail) names what they
      hold instead (another GPU's device file, only the shared ones, or none). The driver's listing of
      them is stale, or their pid now names another process; while the driver still lists them the
      GPUs are not released.
  returned: success
  type: list
  elements: dict
  sample: [{pid: 4377, starttime: 1023311, comm: bash, cmdline: bash, gpus: [0], used_mib: 40960.0, reason: not_holding,
            detail: "holds /dev/nvidia1 (char 195:1), another GPU's device file, and no device file of GPU 0 (char 195:0) in the look: ..."}]
remaining:
  description: Targets that were signalled and still run (O(kill=false), or stuck), with their C(state).
  returned: success
  type: list
  elements: dict
  sample: []
signals:
  description:
    - Every signal tried, with C(result) V(sent), V(gone), V(recycled), V(denied), V(refused) or V(not_holding)
      (the target held no device file of its GPU any more when it was pinned), and C(elapsed) seconds.
  returned: success
  type: list
  elements: dict
  sample: [{pid: 4121, starttime: 991200, signal: SIGTERM, result: sent, elapsed: 0.001}]
gpus:
  description: Each chosen GPU, its used memory and listed processes before the signals and at the last look.
  returned: success
  type: list
  elements: dict
  sample:
    - {index: 0, uuid: GPU-5c3b1b8e-1d2f-4a7b-9e0c-2b1d1f3a4c5d, name: NVIDIA H100 80GB HBM3, total_mib: 81559.0,
       used_mib_before: 41044.0, used_mib_after: 84.0, processes_before: [{pid: 4121, used_mib: 40960.0}],
       processes_after: [{pid: 3001, used_mib: 80.0}]}
holders:
  description: When not released, what still holds the GPUs (spared holders left out), as M(gpuops.relaunch.gpu_mem_wait) describes them.
  returned: success
  type: list
  elements: dict
  sample: []
escalation:
  description:
    - What it takes to free what is still held, in the collection's one vocabulary, least force first,
      V(none), V(signals), V(container_reboot) or V(host_action) (see M(gpuops.relaunch.gpu_mem_wait)).
  returned: success
  type: str
  choices: [none, signals, container_reboot, host_action]
  sample: none
reasons:
  description: Why RV(escalation) is what it is; the C(why) of each of RV(findings).
  returned: success
  type: list
  elements: str
  sample: ["released"]
findings:
  description:
    - RV(reasons) with structured fields to decide on (never decide on the wording of C(why)).
    - C(kind) is a kind of M(gpuops.relaunch.gpu_mem_wait)'s findings (V(released), V(running), V(zombie),
      V(unreaped_orphan), V(zombie_leader), V(uninterruptible), V(invisible), V(unlisted_memory), V(gpu_condition)),
      V(permission_denied), V(not_holding) (a listed pid, not signalled, that holds no device file of its GPU, so what
      holds the memory is not listed) or V(not_signalled) (a listed pid on a GPU whose minor number is not known, not
      signalled), words of R(the collection's one finding vocabulary,ansible_collections.gpuops.relaunch.docsite.guide_relaunch.verdict_table).
  returned: success
  type: list
  elements: dict
  sample: [{kind: released, escalation: none, pids: [], why: released}]
option_problems:
  description: Every problem found with the options, each a dict of C(option), its name, and C(reason), what is wrong with its value.
  returned: when the options were refused, before any signal (the first GPU query finds a GPU of O(devices) that is not on the host)
  type: list
  elements: dict
  sample: [{"option": "devices", "reason": "is empty: name the GPUs to reclaim by index or UUID, or give [all] ..."}]
error_kind:
  description: Why a GPU query failed, when it did (the words of M(gpuops.relaunch.gpu_mem_wait)'s RV(gpuops.relaunch.gpu_mem_wait#module:error_kind)).
  returned: when a GPU query failed
  type: str
  sample: driver_not_loaded
elapsed:
  description: Seconds the task took, from the first GPU query.
  returned: unless the options were refused
  type: float
  sample: 1.42
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid, fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcfsError
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.query import GpuQueryError, gpu_backend_spec, open_gpu_source
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu.reclaim import (
    DEFAULT_GPU_DEVICE_GLOB,
    DRIVER_PIDS,
    QueryFailedAfterSignals,
    options_from_params,
    reclaim,
    summary,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "devices": {"type": "list", "elements": "str", "required": True},
            "allow": {"type": "list", "elements": "str", "default": []},
            "protected": {"type": "list", "elements": "str", "default": []},
            "term_timeout": {"type": "float", "default": 10},
            "kill": {"type": "bool", "default": True},
            "release_timeout": {"type": "float", "default": 60},
            "poll_interval": {"type": "float", "default": 0.5},
            "max_used_mib": {"type": "float"},
            "driver_pids": {"type": "str", "default": "host", "choices": list(DRIVER_PIDS)},
            "gpu_device_glob": {"type": "str", "default": DEFAULT_GPU_DEVICE_GLOB},
            "gpus_required": {"type": "bool", "default": True},
            **gpu_backend_spec(),
        },
        supports_check_mode=True,
    )
    params = module.params
    with fail_on_invalid_options(module, changed=False):
        options = options_from_params(params)
    began = time.monotonic()
    source = None
    try:
        source = open_gpu_source(params["backend"], params["nvidia_smi"], options.query_timeout)
        result = reclaim(source, options, check_mode=module.check_mode)
    except QueryFailedAfterSignals as exc:
        partial = exc.result.as_dict()
        module.fail_json(msg=f"GPU query failed while waiting for the release: {exc.error}", error_kind=exc.error.kind,
                         released=False, changed=partial["changed"], ended=partial["ended"], signals=partial["signals"],
                         targets=partial["targets"], spared=partial["spared"], remaining=partial["remaining"],
                         not_holding=partial["not_holding"],
                         backend=source.backend if source is not None else "none", gpu_present=True,
                         elapsed=round(time.monotonic() - began, 3))
    except GpuQueryError as exc:
        backend = source.backend if source is not None else "none"
        if exc.means_no_gpu and not params["gpus_required"]:
            module.exit_json(changed=False, released=True, gpu_present=False, backend="none",
                             msg=f"no NVIDIA GPU on this host (gpus_required=false): {exc}",
                             elapsed=round(time.monotonic() - began, 3))
        module.fail_json(msg=f"GPU query failed: {exc}", error_kind=exc.kind, released=False, changed=False,
                         backend=backend, gpu_present=not exc.means_no_gpu, elapsed=round(time.monotonic() - began, 3))
    except BadOption as exc:
        # Only the driver can tell that a GPU named in devices is not on this host; nothing was signalled.
        module.fail_json(changed=False, released=False, **OptionsInvalid([exc]).as_result())
    except ProcfsError as exc:
        module.fail_json(msg=f"reading the process table failed: {exc}", changed=False, released=False)
    finally:
        if source is not None:
            source.close()

    report = result.as_dict()
    report.update(msg=summary(result), backend=source.backend, gpu_present=True,
                  elapsed=round(time.monotonic() - began, 3))
    if not result.released and not module.check_mode:
        module.fail_json(**report)
    module.exit_json(**report)


if __name__ == "__main__":
    main()
