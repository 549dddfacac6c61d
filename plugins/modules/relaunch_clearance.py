#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# The work is done by the action plugin of the same name (plugins/action/relaunch_clearance.py), on the controller;
# this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: relaunch_clearance
short_description: "Decide whether a relaunch may launch after the clean-up and the drain, or only a container reboot helps"
version_added: 0.1.0
description:
  - >-
    Takes the worst escalation (the collection's one ranking) of M(gpuops.relaunch.zombie_reap)'s result and
    M(gpuops.relaunch.gpu_mem_wait)'s, and whether the GPUs were released.
  - >-
    Clear, the job may launch. Only a container reboot helps and O(reset_allowed) (and not O(reset_done)), RV(reset)
    is true. Anything else fails the task with the evidence, naming what must act (the host, a container reboot that
    is not allowed or did not help, GPUs not released). In check mode a reboot is only announced, so after it the task
    does not fail.
  - >-
    Sets the fact C(relaunch_clearance).
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.attributes
  - gpuops.relaunch.attributes.info_module
  - gpuops.relaunch.attributes.controller_step
options:
  cleanup:
    description: The registered result of M(gpuops.relaunch.zombie_reap).
    type: dict
    required: true
  drain:
    description: The registered result of M(gpuops.relaunch.gpu_mem_wait).
    type: dict
    default: {}
  reset_allowed:
    description: Whether the inventory allows a container reboot (C(container_reset_allowed)).
    type: bool
    default: false
  reset_done:
    description: Whether the container was rebooted already in this run.
    type: bool
    default: false
"""

EXAMPLES = r"""
- name: Check that nothing left blocks the launch
  gpuops.relaunch.relaunch_clearance:
    cleanup: "{{ relaunch_cleanup }}"
    drain: "{{ relaunch_drain }}"
    reset_allowed: "{{ container_reset_allowed | default(false) }}"
"""

RETURN = r"""
escalation:
  description: The worst of the two escalations.
  returned: always
  type: str
  choices: [none, signals, container_reboot, host_action]
released:
  description: Whether the GPUs were released.
  returned: always
  type: bool
clear:
  description: Nothing blocks the launch.
  returned: always
  type: bool
reset:
  description: Only a container reboot helps, and it is allowed and not done yet.
  returned: always
  type: bool
blocked:
  description: The message the task fails with, or null.
  returned: always
  type: str
reasons:
  description: What blocks, each naming its pids or GPUs.
  returned: always
  type: list
  elements: str
"""
