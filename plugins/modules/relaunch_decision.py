#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# The work is done by the action plugin of the same name (plugins/action/relaunch_decision.py), on the controller;
# this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: relaunch_decision
short_description: "Look at this host's job, decide whether to relaunch it (with every rank of its job), relaunch a job of one host"
version_added: 0.1.0
description:
  - >-
    Runs M(gpuops.relaunch.train_launch) with O(gpuops.relaunch.train_launch#module:state=probe) on the target (the one
    module run of a healthy host), with the options the role variables give it (C(job_launch_*), mapped once in
    C(plugins/plugin_utils/role_vars.py)), and decides from its RV(gpuops.relaunch.train_launch#module:decision).
  - >-
    For a job of one host that must be relaunched, relaunches it in the same task: stops it (where something of it
    runs), ends what the last run left (M(gpuops.relaunch.zombie_reap)), waits for the GPUs
    (M(gpuops.relaunch.gpu_mem_wait), with C(gpu_drain_environment)), checks that nothing left blocks the launch
    (M(gpuops.relaunch.relaunch_clearance)'s rule) and launches it (M(gpuops.relaunch.train_launch)), each a module run
    on the target with the options the role variables give, stopping at the first step that fails (RV(steps)). Where
    only a container reboot helps and C(container_reset_allowed) is true, it stops before the launch and the role
    reboots the container, looks again and launches.
  - >-
    For a job of one host that needs nothing more (running with its spec, refused by the crash-loop guard, an alert
    about another job or host) or that was relaunched here (or failed on the way), also summarizes the host as
    M(gpuops.relaunch.relaunch_summary) does (O(summary_dir), O(metrics_dir), O(fail_host)) and returns RV(done): the
    relaunch role then runs no other task on it. A step that failed fails the host with O(fail_host), naming the
    step.
  - >-
    A rank of a multi-rank job (O(ranks)) decides with its job in a second run of this action, given every rank's look
    (O(rank_looks)): one rank that must be relaunched (or that the crash-loop guard refuses) relaunches every rank; a
    rank whose look failed does not count. When one rank failed (crashed, stalled, missing) every rank resumes. Where
    the job is to be relaunched, that run also stops, cleans up, drains and checks the clearance of its rank, as for
    a job of one host (RV(steps)), but does not launch: the ranks launch after their barrier, in the role. A step
    that fails fails the task, naming the step (RV(failure)).
  - >-
    Before the probe, checks the role variables against the relaunch role's argument spec (its
    C(meta/argument_specs.yml), the options of its entry point C(main)), as Ansible's own check of an include of the
    role does; a missing C(job_launch_name) or C(job_launch_command), a wrong type or a bad choice fails the host
    before anything runs on it, naming the variable.
  - >-
    Fails, before anything changes, when a variable with one of the collection's prefixes (C(job_launch_),
    C(process_cleanup_), C(gpu_drain_), C(container_reset_), C(relaunch_)) is not one the collection knows (a typo;
    the message names the closest known one), when O(force) is true on every host of the play and neither
    C(relaunch_hosts) nor C(--limit) names the hosts, when O(ranks) does not make one job in this run and batch, when
    O(ranks) is not this host's C(job_launch_ranks) in C(hostvars), when the play's strategy cannot hold the ranks'
    barriers (only V(linear) can), or when rank 0's C(job_launch_master_port) is not a port from 1 to 65535. A probe
    that fails names the role variable behind a bad option (C(job_launch_command), not C(command)).
  - >-
    With O(alerted_job) or O(alerted_host) (an event-driven relaunch) that is not this host's job (O(job_name)) or
    this host, decides V(none) and says so: nothing is stopped or launched for an alert about another job or host.
  - >-
    Sets the facts C(relaunch_decision) and C(relaunch_rank) (null for a job of one host), both on every run, so that
    nothing reads what an earlier include of the role, for another job, left; and C(relaunch_clearance) where it
    checked the clearance.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
options:
  force:
    description: Whether the relaunch is forced on this host (C(relaunch_force)).
    type: bool
    default: false
  ranks:
    description:
      - The inventory hostnames of the job's ranks in rank order (C(job_launch_ranks)); unset for a job of one host.
      - C(job_launch_ranks) must be a host or group variable (the inventory), the same for every rank.
    type: raw
  rank_looks:
    description:
      - >-
        Every rank's registered result of this action, in rank order (null for a rank that has none). Given, this is
        the second run, for a rank of a multi-rank job: it decides for the whole job and runs nothing on the target.
    type: list
    elements: raw
  job_name:
    description:
      - This host's job (C(job_launch_name)), compared with O(alerted_job), and the summary's file and label.
    type: str
    required: true
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
  summary_dir:
    description: As M(gpuops.relaunch.relaunch_summary)'s, for a host summarized here.
    type: str
    default: ""
  metrics_dir:
    description: As M(gpuops.relaunch.relaunch_summary)'s, for a host summarized here.
    type: str
    default: ""
  fail_host:
    description: As M(gpuops.relaunch.relaunch_summary)'s, for a host summarized here.
    type: bool
    default: true
attributes:
  action:
    description: >-
      Runs on the controller as an action plugin; it runs train_launch (and, relaunching a job of one host, zombie_reap,
      gpu_mem_wait and train_launch again; with O(metrics_dir) relaunch_metrics) on the target.
    support: full
  check_mode:
    description: >-
      The probe changes nothing; in check mode each step of a relaunch runs in check mode, and the summary says what a
      real run would do.
    support: full
  diff_mode:
    description: With C(--diff), returns the probe's diff of the job's spec (what a restart would change).
    support: full
  platform:
    platforms: posix
seealso:
  - module: gpuops.relaunch.train_launch
  - module: gpuops.relaunch.relaunch_summary
notes:
  - The first step of the C(gpuops.relaunch.relaunch) role; the decisions are plain functions in
    C(plugins/plugin_utils/relaunch_flow.py), unit-tested.
"""

EXAMPLES = r"""
- name: Look at the job, decide, and relaunch a job of one host
  gpuops.relaunch.relaunch_decision:
    force: "{{ relaunch_force | bool }}"
    ranks: "{{ job_launch_ranks | default(omit) }}"
    job_name: "{{ job_launch_name }}"
  register: relaunch_decided
"""

RETURN = r"""
decision:
  description:
    - C(action) (V(none), V(relaunch) or V(refused)), C(relaunch) (bool), C(why), C(resume) (bool), C(resume_mode)
      (V(always) when a rank of the job failed, else null, meaning the inventory's C(job_launch_resume)), C(stop)
      (something of the job runs that the stop must end first; nothing running, the stop is skipped), C(wanted_by)
      (the ranks that must be relaunched) and C(expect_run_id) (the run the probe judged, its
      RV(gpuops.relaunch.train_launch#module:health.run_id), or the empty string for none - the role gives it to the
      stop and the clean-up, which leave a newer run, started meanwhile by another relaunch, alone). Also the fact
      C(relaunch_decision).
  returned: success
  type: dict
  sample: {action: relaunch, relaunch: true, why: "relaunched with its job, because rank(s) gpu2 must be", resume: true,
           resume_mode: always, stop: true, wanted_by: [gpu2], expect_run_id: 3f2a9c0e5b8d4e1f9a7c6b5d4e3f2a1b}
rank:
  description:
    - This host's place in a multi-rank job, C(index), C(of), C(ranks), C(master_addr) and C(master_port); null for a
      job of one host. Also the fact C(relaunch_rank).
  returned: success
  type: dict
  sample: {index: 1, of: 2, ranks: [gpu1, gpu2], master_addr: 10.0.0.1, master_port: 29500}
probe:
  description: M(gpuops.relaunch.train_launch)'s probe result (its C(health), C(decision), C(relaunch_guard), plan).
  returned: when the probe ran
  type: dict
launch_options:
  description:
    - The options of M(gpuops.relaunch.train_launch) that the decision fixes for the launch. For a rank of a multi-rank
      job C(env), the environment its probe compared (the job's C(job_launch_env) with C(MASTER_ADDR),
      C(MASTER_PORT), C(NODE_RANK) and C(NNODES)), and C(metrics_rank0), rank 0's inventory hostname (the
      C(gpuops_rank0) label of the live file); empty for a job of one host.
  returned: when the probe ran
  type: dict
  sample: {env: {MASTER_ADDR: 10.0.0.1, MASTER_PORT: "29500", NODE_RANK: "1", NNODES: "2"}, metrics_rank0: gpu1}
steps:
  description:
    - >-
      Each step's result, for a job of one host relaunched here or a rank stopped here: C(stop), C(cleanup) and C(launch)
      (M(gpuops.relaunch.train_launch)'s and M(gpuops.relaunch.zombie_reap)'s results), C(drain)
      (M(gpuops.relaunch.gpu_mem_wait)'s) and C(clearance) (as M(gpuops.relaunch.relaunch_clearance) returns it);
      null for a step that did not run (the stop when nothing of the job ran, the drain when the clean-up left a newer
      run alone, everything after a step that failed, the launch when only a container reboot helps).
  returned: when a job of one host was relaunched here, or a rank (with O(rank_looks)) was stopped, cleaned and drained
  type: dict
  sample: {stop: {changed: true, operation: stopped}, cleanup: {escalation: none}, drain: {released: true},
           clearance: {clear: true, reset: false}, launch: {changed: true, pid: 4242}}
failure:
  description: With O(rank_looks), the step that failed and why (C(STEP - MESSAGE)), as the summary names it.
  returned: when a step of a rank failed
  type: str
  sample: "Wait until the GPUs are released: GPU query failed: hung"
done:
  description:
    - >-
      Whether this host is decided and summarized: a job of one host that needs nothing more, or that was relaunched
      here (false while a container reboot is pending).
  returned: when the probe ran
  type: bool
host_fails:
  description:
    - For a host summarized here, whether it fails because its relaunch failed or was refused (at once with
      O(fail_host), else where the play fails it, after the fleet summary in C(playbooks/relaunch.yml)).
  returned: when the host was summarized here
  type: bool
host_failure:
  description:
    - The message the host fails with when RV(host_fails) (the failed step and its error, or the crash-loop guard's
      refusal), else null. C(playbooks/relaunch.yml) fails the host with it, read from this task's registered result;
      in a later node of an AWX workflow the fact C(relaunch_summary) is the earlier node's set_stats data, an extra var.
  returned: when the host was summarized here
  type: str
  version_added: 0.2.0
nothing_left:
  description:
    - >-
      RV(done) and the host does not fail (RV(host_fails) false), so nothing more is to be done for it in the play.
      C(playbooks/relaunch.yml) ends such a host's play at once (C(meta: end_host)).
  returned: always, except when O(rank_looks) is given
  type: bool
summary_path:
  description: As M(gpuops.relaunch.relaunch_summary)'s, for a host summarized here.
  returned: when O(summary_dir) is set and the host was summarized here
  type: str
msg:
  description: The decision's C(why); for a host summarized here, its one line (see M(gpuops.relaunch.relaunch_summary)).
  returned: always
  type: str
"""
