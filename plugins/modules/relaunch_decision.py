#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# The work is done by the action plugin of the same name (plugins/action/relaunch_decision.py), on the controller;
# this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: relaunch_decision
short_description: "Decide whether this host's job is relaunched, for every rank of a multi-rank job at once"
version_added: 0.1.0
description:
  - >-
    Takes M(gpuops.relaunch.train_launch)'s probe (O(gpuops.relaunch.train_launch#module:state=probe)) and its
    RV(gpuops.relaunch.train_launch#module:decision), and for a rank of a multi-rank job (O(ranks)) the probes of the
    other ranks (read from C(hostvars), registered under O(probe_var)).
  - >-
    One rank that must be relaunched (or that the crash-loop guard refuses) relaunches every rank; a rank whose probe
    did not answer does not count. When one rank failed (crashed, stalled, missing) every rank resumes.
  - >-
    Fails, before anything changes, when O(force) is true on every host of the play and neither C(relaunch_hosts) nor
    C(--limit) names the hosts, when O(ranks) does not make one job in this run and batch, when O(ranks) is not this
    host's C(job_launch_ranks) in C(hostvars) (set as a play, role or task variable: the other ranks cannot read it),
    or when rank 0's C(job_launch_master_port) is not a port from 1 to 65535.
  - >-
    With O(alerted_job) or O(alerted_host) (an event-driven relaunch) that is not this host's job (O(job_name)) or
    this host, decides V(none) and says so: nothing is stopped or launched for an alert about another job or host.
  - >-
    Sets the facts C(relaunch_decision) and C(relaunch_rank) (null for a job of one host), both on every run, so that
    nothing reads what an earlier include of the role, for another job, left.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.info_module
  - gpuops.relaunch.attributes.platform
options:
  probe:
    description: The registered result of the probe.
    type: dict
    required: true
  force:
    description: Whether the relaunch is forced on this host (C(relaunch_force)).
    type: bool
    default: false
  ranks:
    description:
      - The inventory hostnames of the job's ranks in rank order (C(job_launch_ranks)); null for a job of one host.
      - C(job_launch_ranks) must be a host or group variable (the inventory), the same for every rank.
    type: raw
  probe_var:
    description: The name under which every host registered its probe.
    type: str
    default: relaunch_probe
  job_name:
    description:
      - This host's job (C(job_launch_name)), compared with O(alerted_job). Required with O(alerted_job).
    type: str
  alerted_job:
    description:
      - The job an event named (C(relaunch_alerted_job), where the event-driven relaunch passes the alert's C(gpuops_job)).
      - When it is set and is not O(job_name), the decision is V(none) whatever the probe found, and its C(why) says
        which job the alert named and which job the host runs.
      - Unset or empty, the probe's decision stands (a watchdog run).
    type: str
  alerted_host:
    description:
      - The inventory host an event named (C(relaunch_alerted_host), where the event-driven relaunch passes the alert's
        C(gpuops_host)).
      - When it is set and is not this host's C(inventory_hostname) (a group or a pattern in the label reached more
        hosts than it named), the decision is V(none) and its C(why) says so.
    type: str
attributes:
  action:
    description: Runs on the controller as an action plugin; nothing runs on the target.
    support: full
  platform:
    platforms: all
    details:
      - The controller only; it needs no connection to the target.
seealso:
  - module: gpuops.relaunch.train_launch
notes:
  - A step of the C(gpuops.relaunch.relaunch) role; the decisions are plain functions in
    C(plugins/plugin_utils/relaunch_flow.py), unit-tested.
"""

EXAMPLES = r"""
- name: Decide, for every rank of the job at once
  gpuops.relaunch.relaunch_decision:
    probe: "{{ relaunch_probe }}"
    force: "{{ relaunch_force | bool }}"
    ranks: "{{ job_launch_ranks | default(none) }}"
    job_name: "{{ job_launch_name }}"
    alerted_job: "{{ relaunch_alerted_job | default(omit, true) }}"
    alerted_host: "{{ relaunch_alerted_host | default(omit, true) }}"
"""

RETURN = r"""
decision:
  description:
    - C(action) (V(none), V(relaunch) or V(refused)), C(relaunch) (bool), C(why), C(resume) (bool), C(resume_mode)
      (V(always) when a rank of the job failed, else null, meaning the inventory's C(job_launch_resume)), C(stop)
      (something of the job runs that the stop must end first; nothing running, the stop is skipped) and C(wanted_by)
      (the ranks that must be relaunched). Also the fact C(relaunch_decision).
  returned: success
  type: dict
  sample: {action: relaunch, relaunch: true, why: "relaunched with its job, because rank(s) gpu2 must be", resume: true,
           resume_mode: always, stop: true, wanted_by: [gpu2]}
rank:
  description:
    - This host's place in a multi-rank job, C(index), C(of), C(ranks), C(master_addr) and C(master_port); null for a
      job of one host. Also the fact C(relaunch_rank).
  returned: success
  type: dict
  sample: {index: 1, of: 2, ranks: [gpu1, gpu2], master_addr: 10.0.0.1, master_port: 29500}
msg:
  description: The decision's C(why).
  returned: always
  type: str
"""
