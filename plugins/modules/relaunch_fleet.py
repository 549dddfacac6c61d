#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# The work is done by the action plugin of the same name (plugins/action/relaunch_fleet.py), on the controller;
# this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: relaunch_fleet
short_description: "Sum up a relaunch over every host of the play: per host, per multi-rank job, counts"
version_added: 0.1.0
description:
  - >-
    Reads each play host's summary as this run made it: the fact O(summary_var) in the registered result of the task
    that set it, O(started_var) (the decision, where it finished the host) or else O(summarized_var) (the relaunch role's
    summary task), never the host's fact itself, which a fact cache (AWX's fact storage, the jsonfile cache) carries
    over from an earlier run to a host that did not get that far this time. A host that got as far as the decision
    but has no summary this run counts as failed, and so does a host that failed before it (the role's argument check, an
    unreachable host: C(failed) says so); hosts of later batches are not in it yet. Run it once (C(run_once)).
  - >-
    Displays one line (how many hosts, how many of each status, which failed; the whole summary shows at -v), sets the
    fact C(relaunch_fleet), the set_stats data C(relaunch_fleet), and with O(summary_dir) writes
    DIR/fleet.json on the controller (DIR/check/fleet.json in check mode, so that it never replaces a real run's).
  - >-
    In an AWX job that is a node of a workflow job (every slice job of a sliced job template is one; AWX passes
    C(awx_job_id) and C(awx_workflow_job_id)), the fleet is a part of the run: the file is DIR/fleet-awx-workflow-W-job-J.json
    (W the workflow job, J the job), so that slices running at once never replace each other's, and the fleet is also
    the set_stats data C(gpuops_fleet_awx_job_J), since AWX passes a workflow's set_stats data on merged key by key
    (the last job to finish wins C(relaunch_fleet)). M(gpuops.relaunch.fleet_merge) merges the parts into one. With
    batches (C(serial)) the fleet is summed up after each batch over the hosts so far, so the last batch's file holds
    them all.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.info_module
  - gpuops.relaunch.attributes.controller_step
seealso:
  - module: gpuops.relaunch.fleet_merge
options:
  summary_var:
    description: The fact holding each host's summary (read from the registered results, see above).
    type: str
    default: relaunch_summary
  started_var:
    description: The variable a host has once it got as far as the decision (the relaunch role registers it).
    type: str
    default: relaunch_decided
  summarized_var:
    description: The registered result of the summary task (the relaunch role registers it), for a host the decision did not finish.
    type: str
    default: relaunch_summarized
    version_added: 0.2.0
  summary_dir:
    description:
      - When set, also write DIR/fleet.json on the controller (no host's summary file, DIR/HOST@JOB.json, can have that name);
        DIR/fleet-awx-workflow-W-job-J.json in an AWX job of a workflow job (a slice).
      - In check mode, DIR/check/fleet.json instead.
    type: str
    default: ""
attributes:
  check_mode:
    support: full
    details:
      - In check mode the counts say what a real run would do (C(would_relaunch)), and the file is DIR/check/fleet.json.
"""

EXAMPLES = r"""
- name: Sum up the fleet
  run_once: true
  gpuops.relaunch.relaunch_fleet:
    summary_dir: "{{ relaunch_summary_dir | default('') }}"
"""

RETURN = r"""
fleet:
  description:
    - C(hosts) (per host C(status), C(health), C(found), C(ended) (a count), C(container_reset), C(pid), C(seconds),
      C(rank), C(failed) (why it failed, or null)), C(jobs) (per multi-rank job, keyed by rank 0, C(ranks), C(relaunched), C(failed)) and C(counts) (how
      many hosts relaunched, unchanged, refused, failed, would_relaunch).
  returned: always
  type: dict
  sample: {hosts: {gpu1: {status: relaunched, health: crashed, found: signals, ended: 2, container_reset: false,
           pid: 4242, seconds: 21.4, rank: null, failed: null}}, jobs: {},
           counts: {relaunched: 1, unchanged: 0, refused: 0, failed: 0, would_relaunch: 0}}
summary_path:
  description: The JSON file written.
  returned: when O(summary_dir) is set
  type: str
part:
  description: The part of the run this fleet is (C(awx-workflow-W-job-J)), or null for a whole run.
  returned: always
  type: str
  sample: awx-workflow-120-job-121
msg:
  description: The fleet in one line.
  returned: always
  type: str
  sample: "16 host(s): 15 unchanged, 1 relaunched"
"""
