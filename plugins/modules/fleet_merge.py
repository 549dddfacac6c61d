#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# The work is done by the action plugin of the same name (plugins/action/fleet_merge.py), on the controller;
# this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: fleet_merge
short_description: Merge the fleet summaries of the parts of one relaunch (the slices of a sliced AWX job) into one
version_added: 0.2.0
description:
  - >-
    A sliced AWX job template runs the relaunch as several jobs at once, each over its share of the hosts, and each
    sums up only its own hosts (M(gpuops.relaunch.relaunch_fleet)): as DIR/fleet-awx-workflow-W-job-J.json (W the
    workflow job of the slices, J the slice's job) and as the set_stats data C(gpuops_fleet_awx_job_J), besides
    C(relaunch_fleet). This merges such parts into one fleet summary whose counts are the sum of the parts'.
  - >-
    The parts come from O(parts) (files in O(summary_dir)), from O(workflow_job) (every part file of that workflow job
    in O(summary_dir)) or, with neither, from the set_stats data an AWX workflow passes to the nodes after the sliced
    job (AWX passes each slice job's artifacts on as extra vars; C(relaunch_fleet) itself would be only the last slice's,
    as AWX merges them key by key).
  - >-
    Fails, merging nothing, when a part is not a fleet summary (not JSON, not the shape relaunch_fleet writes, counts
    that are not those of its hosts), a part file is a symbolic link or not a regular file, a host is in two parts
    (it would count twice), or a job's ranks differ between parts.
  - >-
    Sets the fact and the set_stats data C(relaunch_fleet) to the merged fleet and, with O(summary_dir), writes it to
    DIR/O(dest). Run it once (C(run_once), or a play of one host: C(playbooks/fleet_merge.yml)).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.controller_step
options:
  summary_dir:
    description:
      - The directory of relaunch_fleet's files (its O(gpuops.relaunch.relaunch_fleet#module:summary_dir)), where the
        parts are read and the merged fleet is written. In check mode DIR/check, as relaunch_fleet writes there in
        check mode.
      - Empty, nothing is read from or written to files (parts from the set_stats data only).
    type: str
    default: ""
  parts:
    description:
      - The names of the fleet files in O(summary_dir) to merge (file names, no directories).
    type: list
    elements: str
  workflow_job:
    description:
      - >-
        The id of the AWX workflow job of the slices (the sliced job's workflow job): merge every
        C(fleet-awx-workflow-ID-job-*.json) in O(summary_dir).
    type: str
  dest:
    description:
      - The merged fleet's file name in O(summary_dir). It must end in C(.json), have no C(@) and not be one of the parts.
      - By default C(fleet-awx-workflow-ID.json) with O(workflow_job), else C(fleet.json).
    type: str
attributes:
  check_mode:
    support: full
    details:
      - In check mode the parts are read from and the merged fleet written to DIR/check.
  diff_mode:
    support: N/A
    details:
      - It writes a report file, nothing else.
notes:
  - AWX's own source was read for this (ansible/awx, 2024) - the slices' inventories
    (C(awx/main/models/inventory.py) Inventory.get_sliced_hosts), and how a workflow passes its jobs'
    set_stats data on (C(awx/main/models/workflow.py) WorkflowJob.get_effective_artifacts).
seealso:
  - module: gpuops.relaunch.relaunch_fleet
"""

EXAMPLES = r"""
- name: Merge the slices' fleet files of AWX workflow job 120
  run_once: true
  gpuops.relaunch.fleet_merge:
    summary_dir: /srv/relaunch-reports
    workflow_job: "120"

- name: In a workflow node after the sliced job, merge what the slices passed on
  run_once: true
  gpuops.relaunch.fleet_merge: {}
"""

RETURN = r"""
fleet:
  description:
    - The merged fleet, in the shape of M(gpuops.relaunch.relaunch_fleet)'s (C(hosts), C(jobs) with each job's
      C(relaunched) and C(failed) ranks recounted over every part, C(counts)), and C(parts) (each part's number of
      hosts, by file name or variable name).
  returned: success
  type: dict
  sample: {hosts: {gpu1: {status: relaunched, health: crashed, found: signals, ended: 2, container_reset: false,
           pid: 4242, seconds: 21.4, rank: null, failed: null}}, jobs: {},
           counts: {relaunched: 1, unchanged: 0, refused: 0, failed: 0, would_relaunch: 0},
           parts: {fleet-awx-workflow-120-job-121.json: 1}}
summary_path:
  description: The JSON file written.
  returned: when O(summary_dir) is set and the merge succeeded
  type: str
msg:
  description: The merged fleet in one line, and how many parts it was merged from.
  returned: always
  type: str
  sample: "3 host(s): 1 relaunched, 2 failed (failed: r0, r1), merged from 2 part(s) (files in /srv/relaunch-reports)"
"""
