#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# The work is done by the action plugin of the same name (plugins/action/role_step.py), on the controller;
# this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: role_step
short_description: "Run a step role's module with its options taken from the role variables"
version_added: 0.1.0
description:
  - >-
    Runs O(module) on the target with its options built from the collection's role variables: C(job_launch_*) for
    M(gpuops.relaunch.train_launch), C(process_cleanup_*) for M(gpuops.relaunch.zombie_reap), C(gpu_drain_*) for
    M(gpuops.relaunch.gpu_mem_wait), C(container_reset_*) for M(gpuops.relaunch.proxmox_ct_reboot). The map, the
    role defaults and the fallbacks are declared once, in C(plugins/plugin_utils/role_vars.py); the roles'
    C(meta/argument_specs.yml) are generated from the same declaration.
  - >-
    A variable left unset takes its role default where it has one (C(job_launch_max_relaunches),
    C(job_launch_relaunch_window), C(job_launch_log_path) after C(job_launch_name); see
    R(the role variables guide,ansible_collections.gpuops.relaunch.docsite.guide_role_variables)) or the value of the
    variable it falls back to (C(process_cleanup_job_name) to C(job_launch_name), C(process_cleanup_job_state_dir)
    to C(job_launch_state_dir)); else it is not passed and the module's own default applies. A variable set to null
    is not passed either.
  - >-
    Before anything runs, fails when a variable with one of the collection's prefixes (C(job_launch_),
    C(process_cleanup_), C(gpu_drain_), C(container_reset_), C(relaunch_)) is not one the collection knows, naming
    the closest known one (C(job_launch_ready_regx is not a variable of gpuops.relaunch (did you mean
    job_launch_ready_regex?\))); host, group, play and extra variables alike.
  - >-
    Returns the module's result as it is; a failure that names bad options names the role variables behind them
    (C(job_launch_command: ...), not C(command: ...)).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
options:
  module:
    description: The module to run.
    type: str
    required: true
    choices: [gpu_mem_wait, proxmox_ct_reboot, train_launch, zombie_reap]
  options:
    description: Options given by the task itself; they win over the role variables (for example C(state=stopped)).
    type: dict
    default: {}
  environment:
    description:
      - >-
        Environment variables for this module run, added to the task's own: the drain's C(gpu_drain_environment).
        Ansible puts them in front of the module's command line unquoted, so a name that is not a shell variable's
        (letters, digits and C(_), not starting with a digit) fails the task before anything runs, as a value with a
        NUL byte does.
    type: dict
    default: {}
    version_added: 0.2.0
attributes:
  action:
    description: Runs on the controller as an action plugin; it runs O(module) on the target.
    support: full
  check_mode:
    description: The module runs in check mode when the task does.
    support: full
  diff_mode:
    description: The module gets the task's diff mode.
    support: full
  platform:
    platforms: posix
seealso:
  - module: gpuops.relaunch.train_launch
  - module: gpuops.relaunch.zombie_reap
  - module: gpuops.relaunch.gpu_mem_wait
notes:
  - The step of the roles C(gpuops.relaunch.job_launch), C(gpuops.relaunch.process_cleanup) and
    C(gpuops.relaunch.gpu_drain).
"""

EXAMPLES = r"""
- name: Stop the job and wait until its whole process tree is gone
  gpuops.relaunch.role_step:
    module: train_launch
    options:
      state: stopped
  register: job_launch_stop_result

- name: End the job and clear its zombies with the least force that works
  gpuops.relaunch.role_step:
    module: zombie_reap
  register: process_cleanup_result
"""

RETURN = r"""
msg:
  description: The module's message; on bad options, naming the role variables behind them.
  returned: always
  type: str
unknown_variables:
  description: One message per variable with a prefix of the collection that it does not know (then nothing ran).
  returned: when such a variable is set
  type: list
  elements: str
  sample: ["job_launch_ready_regx is not a variable of gpuops.relaunch (did you mean job_launch_ready_regex?)"]
option_problems:
  description: The module's problems with its options (each with RV(option_problems[].option) and RV(option_problems[].reason)).
  returned: when the module found bad options
  type: list
  elements: dict
  contains:
    option:
      description: The module option.
      type: str
    reason:
      description: What is wrong with its value.
      type: str
"""
