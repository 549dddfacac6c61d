#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: relaunch_metrics
short_description: Write a relaunch's health and evidence as a Prometheus textfile for node_exporter
version_added: 0.2.0
description:
  - >-
    Writes one file per job, C(DIR/gpuops_relaunch_JOB.prom), in the Prometheus text exposition format, for
    node_exporter's textfile collector (C(--collector.textfile.directory=DIR)): the job's health, its progress, the
    crash-loop guard's count, what this run did and found, and the GPUs' memory at the drain's last look. The
    metrics are listed in
    R(the metrics guide,ansible_collections.gpuops.relaunch.docsite.guide_metrics).
  - >-
    The file is replaced whole: a temporary file in the same directory (created with C(O_CREAT|O_EXCL|O_NOFOLLOW),
    mode 0644, synced) is renamed over it, so the collector never reads half a file, and a symlink planted at the
    file's name is replaced, never followed. O(dir) must be an existing directory (it is not created); it is walked
    from C(/) and a symlink on the way is followed only where nobody but root can change it.
  - >-
    The file is rewritten on every run, so that C(gpuops_relaunch_last_run_timestamp_seconds) says when the last run
    was. C(changed) is true only when anything other than that timestamp differs from the file that was there.
  - >-
    M(gpuops.relaunch.relaunch_summary) runs this module on the target when its O(gpuops.relaunch.relaunch_summary#module:metrics_dir)
    is set (role variable C(relaunch_metrics_dir)), with the summary it just made: the relaunch needs no task more.
  - >-
    Label values are escaped as the format requires (a backslash, a double quote and a newline in a job name cannot
    break the file); a value that is not finite (NaN, infinity) or not known is left out, never written.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
options:
  dir:
    description:
      - The textfile collector's directory on the target (Debian's C(prometheus-node-exporter) reads
        C(/var/lib/prometheus/node-exporter)). It must exist.
    type: path
    required: true
  job:
    description:
      - The job's name, for the C(gpuops_job) label and the file name. Characters other than letters, digits, C(.), C(_) and
        C(-) are each replaced by C(_) in the file name, and a hash of the whole name is appended, so that two jobs never
        share a file; the label keeps the name as it is.
      - At most 200 characters.
    type: str
    required: true
  host:
    description:
      - The inventory hostname of the target, for the C(gpuops_host) label every series carries (node_exporter's
        C(instance) is an address, not the name a relaunch is limited to). M(gpuops.relaunch.relaunch_summary) passes
        C(inventory_hostname).
      - At most 253 characters; the label keeps the name as it is.
    type: str
    required: true
    version_added: 0.2.0
  summary:
    description:
      - >-
        The host's relaunch summary (M(gpuops.relaunch.relaunch_summary)'s RV(gpuops.relaunch.relaunch_summary#module:ansible_facts.relaunch_summary)),
        C(health) (C(state), C(since_progress), C(last_progress_at), C(last_step): what the probe saw before the run
        acted, C(gpuops_relaunch_probe_health)), C(after) (C(state), C(recent_relaunches): the job after the action,
        for C(gpuops_job_health) and C(gpuops_job_recent_relaunches); without it, the probe's), C(live_metrics) (the
        job's live file: when set, the job's health series are that file's and left out here), C(relaunch_guard)
        (C(recent), C(max_relaunches)), C(relaunched), C(action), C(failed), C(found), C(container_reset),
        C(gpu_released). A key that is missing is not known, and its metric is left out.
    type: dict
    required: true
  gpus:
    description:
      - The GPUs at the last look, one mapping each, with C(index) and/or C(uuid) and C(used_mib) (or
        M(gpuops.relaunch.gpu_mem_wait)'s C(used_mib_after), so its RV(gpuops.relaunch.gpu_mem_wait#module:gpus) can be given as
        it is).
    type: list
    elements: dict
    default: []
attributes:
  check_mode:
    support: full
    details:
      - Renders the metrics and reports whether the file would change (C(changed)); writes nothing.
  diff_mode:
    support: full
    details:
      - The file's text before and after.
  platform:
    platforms: posix
    details:
      - The target, where node_exporter runs.
seealso:
  - module: gpuops.relaunch.relaunch_summary
  - name: node_exporter's textfile collector
    description: How node_exporter reads C(*.prom) files from a directory.
    link: https://github.com/prometheus/node_exporter#textfile-collector
notes:
  - When the job keeps a live file (M(gpuops.relaunch.train_launch)'s O(gpuops.relaunch.train_launch#module:metrics_dir),
    C(DIR/gpuops_job_JOB.prom)), that file owns the job's health series (C(gpuops_job_health),
    C(gpuops_job_seconds_since_progress), C(gpuops_job_last_progress_timestamp_seconds), C(gpuops_job_last_step)) and
    this one leaves them out, as node_exporter refuses a series that two files write.
  - Every series carries C(gpuops_job) (the training job's name) and C(gpuops_host) (the inventory hostname). Not
    C(job), because Prometheus sets a C(job) label of its own on every target and, with the default
    C(honor_labels=false), renames a textfile's C(job) to C(exported_job).
"""

EXAMPLES = r"""
- name: Write the metrics of a relaunch summary made earlier in the play
  gpuops.relaunch.relaunch_metrics:
    dir: /var/lib/prometheus/node-exporter
    job: llm-pretrain
    host: "{{ inventory_hostname }}"
    summary: "{{ relaunch_summary }}"
    gpus: "{{ relaunch_summary.gpus }}"

# The usual way: the relaunch role writes it itself with relaunch_metrics_dir set.
- name: Relaunch, and write the metrics for node_exporter
  ansible.builtin.import_role:
    name: gpuops.relaunch.relaunch
  vars:
    relaunch_metrics_dir: /var/lib/prometheus/node-exporter
"""

RETURN = r"""
path:
  description: The file written (or that would be, in check mode).
  returned: success
  type: str
  sample: /var/lib/prometheus/node-exporter/gpuops_relaunch_llm-pretrain.prom
written:
  description: Whether the file was written (false in check mode).
  returned: success
  type: bool
  sample: true
metrics:
  description: How many samples the file holds.
  returned: success
  type: int
  sample: 27
msg:
  description: What was done, or what is wrong (naming the option).
  returned: always
  type: str
  sample: wrote 27 samples to /var/lib/prometheus/node-exporter/gpuops_relaunch_llm-pretrain.prom
option_problems:
  description:
    - On failure, each problem as C(option) (V(dir), V(job), V(summary) or V(gpus)) and C(reason); a directory that is
      missing, unsafe or not writable, or a write that failed, is a problem of V(dir).
  returned: failure
  type: list
  elements: dict
  sample: [{option: dir, reason: /var/lib/prometheus/node-exporter does not exist (...)}]
"""

import time

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._metrics.textfile import (
    MetricsWriteError,
    file_name,
    job_metrics,
    render,
    write_textfile,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dir": {"type": "path", "required": True},
            "job": {"type": "str", "required": True},
            "host": {"type": "str", "required": True},
            "summary": {"type": "dict", "required": True},
            "gpus": {"type": "list", "elements": "dict", "default": []},
        },
        supports_check_mode=True,
    )
    params = module.params
    problems = []
    name = ""
    families = []
    try:
        name = file_name(params["job"])
    except BadOption as exc:
        problems.append(exc)
    try:
        families = job_metrics(params["job"], params["summary"], params["gpus"], round(time.time(), 3),
                               params["host"])
    except BadOption as exc:
        problems.append(exc)
    if problems:
        module.fail_json(changed=False, **OptionsInvalid(problems).as_result())
    text = render(families)
    samples = sum(len(family.samples) for family in families)
    try:
        written = write_textfile(params["dir"], name, text, check_mode=module.check_mode)
    except MetricsWriteError as exc:
        module.fail_json(changed=False, **OptionsInvalid([BadOption("dir", str(exc))]).as_result())
    result = {
        "changed": written.changed,
        "path": written.path,
        "written": written.written,
        "metrics": samples,
        "msg": f"{'wrote' if written.written else 'would write'} {samples} samples to {written.path}",
    }
    if module._diff:
        result["diff"] = {"before": written.before or "", "after": text,
                          "before_header": written.path, "after_header": written.path}
    module.exit_json(**result)


if __name__ == "__main__":
    main()
