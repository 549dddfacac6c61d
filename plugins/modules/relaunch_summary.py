#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# The work is done by the action plugin of the same name (plugins/action/relaunch_summary.py), on the controller;
# this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: relaunch_summary
short_description: "Sum up one host's relaunch: health, what was done and why, the new pid, the seconds"
version_added: 0.1.0
description:
  - >-
    Builds the host's summary from the results the C(gpuops.relaunch.relaunch) role registered (O(results)) as native
    data (the same types on every ansible-core), displays one line of it, sets it as the fact C(relaunch_summary) and as set_stats data
    (C(relaunch_summary), keyed by host, aggregated), and with O(summary_dir) writes it to DIR/HOST@JOB.json on the
    controller (a temporary file renamed into place, mode 0644), one file per host and job.
  - >-
    With O(metrics_dir), also writes the summary as a Prometheus textfile for node_exporter on the target
    (DIR/gpuops_relaunch_JOB.prom), by running M(gpuops.relaunch.relaunch_metrics) there over the task's connection:
    no task more. A failure to write it fails the host, naming O(metrics_dir).
  - >-
    With O(fail_host), fails when a step failed or the crash-loop guard refused (the summary is then in the failed
    result only: Ansible applies no facts or stats of a failed task).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.info_module
  - gpuops.relaunch.attributes.controller_step
options:
  results:
    description:
      - The role's registered results, keyed C(probe), C(decision), C(stop), C(cleanup), C(drain), C(reset),
        C(reset_wait), C(cleanup_again), C(drain_again), C(launch); null or skipped for a step that did not run.
    type: dict
    required: true
  decision_steps:
    description:
      - >-
        The steps a decision's task ran itself (RV(gpuops.relaunch.relaunch_decision#module:steps)): the stop, the
        clean-up and the drain of a rank (its joint decision's), or of a job of one host whose container had to be
        rebooted. A step's result in O(results) that is neither null nor skipped wins.
    type: dict
    default: {}
  failure:
    description: Why a step failed (C(TASK - MESSAGE)); unset when none did.
    type: str
  rank:
    description: The fact C(relaunch_rank) of a rank of a multi-rank job.
    type: dict
  job_name:
    description: The job's name, for the refusal message and the names of the files written; needed with O(summary_dir) or O(metrics_dir).
    type: str
    default: ""
  summary_dir:
    description:
      - When set, also write the summary to DIR/HOST@JOB.json on the controller (the directory is created), where HOST is
        the inventory hostname and JOB is O(job_name).
      - Both are percent-encoded (as Python's C(urllib.parse.quote), which C(urllib.parse.unquote) reverses) except for
        lower case letters, digits, C(-), C(_), C(~) and a C(.) that does not lead, so that every host and job has a file
        of its own inside DIR, even where the file system folds case, and none is the fleet summary's C(fleet.json)
        (M(gpuops.relaunch.relaunch_fleet)).
      - In check mode the file goes to DIR/check/HOST@JOB.json instead, so that it never replaces a real run's.
    type: str
    default: ""
  metrics_dir:
    description:
      - When set, also write the metrics of this summary to DIR/gpuops_relaunch_JOB.prom on the target (JOB is O(job_name)),
        for node_exporter's textfile collector, with M(gpuops.relaunch.relaunch_metrics). The directory must exist.
      - The file is rewritten on every run (in check mode it is not written); it is a report, so the task stays unchanged
        (RV(metrics_changed) says whether anything but the run's timestamp differs).
      - It tells the job after this run acted (C(after) of the summary - the new run after a relaunch, this relaunch
        counted), what the probe saw before as C(gpuops_relaunch_probe_health), and carries C(gpuops_host), the
        inventory hostname. When the job keeps a live file (M(gpuops.relaunch.train_launch)'s
        O(gpuops.relaunch.train_launch#module:metrics_dir), C(live_metrics) of the summary) the job's health series are
        that file's and left out here.
      - See R(the metrics guide,ansible_collections.gpuops.relaunch.docsite.guide_metrics).
    type: str
    default: ""
    version_added: 0.2.0
  fail_host:
    description: Fail when a step failed or the crash-loop guard refused.
    type: bool
    default: true
attributes:
  action:
    description:
      - Runs on the controller as an action plugin; nothing runs on the target, except M(gpuops.relaunch.relaunch_metrics)
        when O(metrics_dir) is set.
    support: full
  platform:
    details:
      - The controller; the target too (POSIX) when O(metrics_dir) is set.
seealso:
  - module: gpuops.relaunch.relaunch_metrics
"""

EXAMPLES = r"""
- name: Summarize
  gpuops.relaunch.relaunch_summary:
    results:
      probe: "{{ relaunch_decided.probe | default(none) }}"
      decision: "{{ relaunch_decision | default(none) }}"
      launch: "{{ relaunch_launch | default(none) }}"
    failure: "{{ relaunch_failure | default(omit) }}"
"""

RETURN = r"""
ansible_facts:
  description: The fact C(relaunch_summary) (also set_stats data C(relaunch_summary), keyed by host).
  returned: success
  type: dict
  contains:
    relaunch_summary:
      description:
        - >-
          C(host), C(check_mode), C(status) (V(relaunched), V(unchanged), V(refused), V(failed), V(would_relaunch)),
          C(relaunched), C(would_relaunch), C(action), C(failed), C(why), C(health), C(incident), C(resumed),
          C(checkpoint) (with train_launch's checkpoint_dir, else null: C(resumed), C(path), C(step), C(format),
          C(torn_skipped), C(torn) (paths), C(work_lost_steps) - the probe's last progress step minus the step resumed),
          C(relaunch_guard), C(found) (the clean-up's first escalation, or "not looked"), C(reasons), C(ended) (pids),
          C(gpu_released_mib), C(gpu_released) (the drain's last look: released or not; null without a drain), C(gpus) (each
          GPU's C(index), C(uuid), C(name), C(total_mib) and C(used_mib) at that look; empty without a drain),
          C(container_reset), C(mark_conflicts) (each process whose GPUOPS_* marks named another job while its ancestry
          proved it this job's, ended as this job's: C(pid), C(marked_job_dir), C(seen_by) V(stop) or V(cleanup)), C(job)
          (operation, pid, log_path, ready_line), C(seconds) (per phase that ran (stop, cleanup,
          drain, container_reset, launch), the modules' own elapsed time, and C(rank).
        - C(health) is what the probe saw before the run acted; C(after) the job after it - C(state) (V(running) once a
          relaunch's start was proven, V(unknown) after a failed relaunch, else the probe's) and C(recent_relaunches) (the
          crash-loop guard's count, this run's relaunch included). C(live_metrics) is the job's live file (train_launch's
          O(gpuops.relaunch.train_launch#module:metrics_dir)) or null.
      returned: success
      type: dict
host_fails:
  description: Whether the host fails because its relaunch failed or was refused (at once with O(fail_host)).
  returned: success
  type: bool
host_failure:
  description:
    - The message the host fails with when RV(host_fails) (the failed step and its error, or the crash-loop guard's
      refusal), else null. C(playbooks/relaunch.yml) fails the host with it, read from this task's registered result;
      in a later node of an AWX workflow the fact C(relaunch_summary) is the earlier node's set_stats data, an extra var.
  returned: success
  type: str
  version_added: 0.2.0
summary_path:
  description: The JSON file written (DIR/HOST@JOB.json, or in check mode DIR/check/HOST@JOB.json).
  returned: when O(summary_dir) is set
  type: str
metrics_path:
  description: The metrics file written on the target (in check mode, the one that would be).
  returned: when O(metrics_dir) is set and the metrics were written
  type: str
  sample: /var/lib/prometheus/node-exporter/gpuops_relaunch_llm-pretrain.prom
  version_added: 0.2.0
metrics_changed:
  description: Whether the metrics file differs from the one that was there in anything but the run's timestamp.
  returned: when O(metrics_dir) is set and the metrics were written
  type: bool
  sample: false
  version_added: 0.2.0
msg:
  description:
    - One line a person reads (host, job, the health the probe saw, what was done, why), also displayed without -v;
      the whole summary shows at -v. Or the failure message.
  returned: always
  type: str
  sample: "gpu1 [llm-pretrain]: crashed, relaunched (pid 4242, resumed): the job crashed (exit code 1)"
"""
