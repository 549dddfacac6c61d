#!/usr/bin/python
# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: proxmox_ct_reboot
short_description: Reboot a Proxmox VE LXC container through the API, after checking it is the right one
version_added: 0.1.0
description:
  - Reboots one LXC container through the Proxmox VE API (with C(proxmoxer)), either with PVE's
    reboot or with a shutdown followed by a start, and returns once the container runs again and
    has really restarted (a new init process, or an uptime that began after the request).
  - Before it changes anything it finds the container's node (when O(node) is not given), refuses
    to act when the configured hostname is not O(expected_hostname) (required unless
    O(skip_hostname_check=true)), refuses to stop a container of a cluster that has lost quorum (it
    could not be started again), and waits up to O(lock_timeout) for a config lock (a backup, a
    snapshot) to clear.
  - "Each PVE task is followed by its UPID and judged by its exit status. Only C(OK) and
    C(WARNINGS: N) are success; any other exit status fails the module at once with PVE's message
    and the state the container is left in."
  - A container that is stopped is started.
  - Every problem with the options is found before any request and reported at once, each naming its
    option (in RV(option_problems) too).
  - Requests that change something are never repeated blindly. When the answer to one is lost, the
    module reads the task list first, so a retry cannot reboot the container twice.
author:
  - gpuops.relaunch maintainers (@gpuops)
extends_documentation_fragment:
  - gpuops.relaunch.proxmox
  - gpuops.relaunch.attributes
options:
  vmid:
    description:
      - The container's ID.
    type: int
    required: true
  node:
    description:
      - The node the container lives on. When not given, it is looked up in C(/cluster/resources).
    type: str
  expected_hostname:
    description:
      - The hostname the container must have in its PVE configuration (its C(hostname) key), compared without
        regard to case. When it differs the module fails and changes nothing.
      - This is the guard against rebooting the wrong container through a wrong O(vmid). It is required
        unless O(skip_hostname_check=true); the roles of this collection pass the inventory hostname.
    type: str
  skip_hostname_check:
    description:
      - Reboot without O(expected_hostname), that is without checking that O(vmid) is the container
        you mean.
      - The risk is real. A wrong or stale O(vmid) (a typo, an inventory copied from another host, a
        vmid reused after a container was destroyed) reboots someone else's container, with every job
        in it. Prefer giving O(expected_hostname); use this only where the configured hostname is
        meaningless and the vmid is known to be right.
      - Refused together with O(expected_hostname), since the two contradict each other.
    type: bool
    default: false
  method:
    description:
      - V(reboot) uses PVE's reboot (C(POST .../status/reboot) with O(timeout)); PVE stops the
        container, forcing it after O(timeout) seconds, and starts it again in one task.
      - V(stop_start) shuts the container down (C(POST .../status/shutdown) with O(timeout), and
        C(forceStop) when O(force=true)), then starts it. Without O(force) a container that does not
        shut down within O(timeout) is left running and the module fails.
    type: str
    choices: [reboot, stop_start]
    default: reboot
  timeout:
    description:
      - Seconds PVE gives the container to shut down cleanly (passed to PVE as C(timeout)).
      - Between V(0) and V(86400) (a day).
    type: int
    default: 60
  force:
    description:
      - With O(method=stop_start), stop the container hard when it does not shut down cleanly, with PVE's
        C(forceStop) after O(timeout); and if the shutdown task still fails or hangs
        (O(timeout) plus 15 seconds), a stop with C(overrule-shutdown).
      - Ignored with O(method=reboot), where PVE always forces after O(timeout).
    type: bool
    default: false
  wait_timeout:
    description:
      - Seconds to wait, in all, for the tasks to end and for the container to run again. Must be
        greater than O(timeout) and at most 86400 (a day); NaN and infinity are refused.
    type: float
    default: 300
  lock_timeout:
    description:
      - Seconds to wait for a config lock (C(backup), C(snapshot), C(migrate), ...) to clear before
        doing anything. The module fails naming the lock when it outlasts this.
      - Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 60
  skiplock:
    description:
      - Ignore a config lock (PVE's C(skiplock)). Only O(api_user=root@pam) logging in with a password may,
        and only with O(method=stop_start), because PVE's shutdown and reboot cannot skip a lock; the
        container is then stopped hard instead of shut down.
    type: bool
    default: false
  node_slots:
    description:
      - At most this many containers of one node are rebooted at once by this controller, across every
        task and play running on it (a fleet relaunch runs this module for many hosts at once, up to
        C(forks)). Each reboot holds one of the node's slots - an exclusive lock on a file in
        O(slot_dir) - from before the power actions until the container runs again; the kernel drops
        the lock with the process, so a crashed or killed task never leaves a slot taken.
      - V(0) means no limit. Between V(0) and V(64).
      - Only reboots from the same controller (the same O(slot_dir)) count; reboots made elsewhere
        (the web UI, another controller) do not.
      - A node is known by its cluster's name (from C(GET /cluster/status)) and its own name, not by the
        address the API was reached through, so reboots through two addresses of one cluster (two
        nodes' addresses, a name and an IP) share the node's slots. A node in no cluster is known by its
        name and its certificate's fingerprint (from C(GET /nodes)). Without C(Sys.Audit) on C(/) the
        cluster cannot be asked; then only reboots through the same API URL share the slots, and the
        module warns.
    type: int
    default: 1
  slot_dir:
    description:
      - Directory of the node slot files on the host the module runs on (the controller). Created with
        mode 0700 when missing; it must be owned by the user running the module and writable by no one
        else.
      - Every directory above it, from C(/) down, must be a directory of C(root) or of that user that no
        other user may write to, unless it has the sticky bit (as C(/tmp) has). A symlink on the way (or
        the directory itself as a symlink) is followed only where only C(root) can change it; any other
        is refused.
      - The slot files are named by the node's name (made safe for a file name) and a hash of its
        cluster and name, so no answer of the API leads outside this directory.
    type: path
    default: ~/.ansible/gpuops_relaunch/node_slots
  slot_timeout:
    description:
      - Seconds to wait for a free slot of the node. When it passes the module fails and changes nothing.
      - Between 0 and 86400 (a day); NaN and infinity are refused.
    type: float
    default: 3600
attributes:
  check_mode:
    support: full
    details:
      - Makes the same checks as a real run (the options, the node, the hostname guard, quorum where
        a stop is planned) and fails where a real run would fail before acting; then reports the
        current RV(status) and in RV(actions) the power actions it would take, with C(changed=true).
      - Sends no power action and does not wait for a lock (a lock is reported as a warning). With
        O(api_password) its only POST is the login for a ticket, which changes nothing.
  diff_mode:
    support: none
    details:
      - Returns no diff; RV(status_before), RV(actions) and RV(status) say what changed.
  platform:
    platforms: posix
    details:
      - Runs on the host that reaches the API, usually the controller (C(delegate_to=localhost)), not
        inside the container it reboots.
notes:
  - The module talks to the API from wherever it runs. Run it on the controller (delegate the task
    to C(localhost)), which needs C(proxmoxer) and C(requests).
  - The user or token needs C(VM.Audit) and C(VM.PowerMgmt) on C(/vms/<vmid>); C(Sys.Audit) on C(/)
    lets the module check quorum (without it that check is skipped) and learn the cluster's name for
    O(node_slots).
seealso:
  - module: community.proxmox.proxmox
  - name: Proxmox VE API viewer
    description: The C(/nodes/{node}/lxc/{vmid}/status) endpoints used here.
    link: https://pve.proxmox.com/pve-docs/api-viewer/
"""

EXAMPLES = r"""
- name: Reboot each host's container, at most two containers of one node at a time
  gpuops.relaunch.proxmox_ct_reboot:
    vmid: "{{ pve_vmid }}"
    expected_hostname: "{{ inventory_hostname }}"
    node_slots: 2
  delegate_to: localhost

- name: Reboot the container this host lives in, through the API
  gpuops.relaunch.proxmox_ct_reboot:
    api_host: pve1.example.com
    api_user: automation@pve
    api_token_id: relaunch
    api_token_secret: "{{ vault_pve_token_secret }}"
    ca_path: /etc/ansible/pve-root-ca.pem
    vmid: 200
    expected_hostname: "{{ inventory_hostname_short }}"
  delegate_to: localhost

- name: Shut down cleanly, stop hard after 120 seconds, start again
  gpuops.relaunch.proxmox_ct_reboot:
    vmid: 200
    node: pve1
    expected_hostname: gpu-train-01
    method: stop_start
    timeout: 120
    force: true
    wait_timeout: 300
  delegate_to: localhost
  environment:
    PROXMOX_HOST: pve1.example.com
    PROXMOX_USER: root@pam
    PROXMOX_PASSWORD: "{{ vault_pve_root_password }}"
    PROXMOX_CA_PATH: /etc/ansible/pve-root-ca.pem
"""

RETURN = r"""
node:
  description: The node the container lives on.
  returned: success
  type: str
  sample: pve1
vmid:
  description: The container's ID.
  returned: success
  type: int
  sample: 200
hostname:
  description: The hostname in the container's PVE configuration.
  returned: success
  type: str
  sample: gpu-train-01
method:
  description: The method used (O(method)).
  returned: success
  type: str
  sample: reboot
status_before:
  description: The container's status before anything was done.
  returned: success
  type: str
  sample: running
actions:
  description: The power actions taken (or, in check mode, that would be taken), with their parameters.
  returned: success
  type: list
  elements: str
  sample: ["shutdown(forceStop=1, timeout=60)", "start"]
tasks:
  description:
    - The PVE tasks that ran, in order. Also returned on failure, with the failed task last (empty
      when the module failed before starting one).
  returned: always
  type: list
  elements: dict
  contains:
    upid:
      description: The task's UPID.
      type: str
      sample: "UPID:pve1:000A1B2C:0F3E1A2B:6650A1B2:vzreboot:200:root@pam:"
    type:
      description: The task type (C(vzreboot), C(vzshutdown), C(vzstop), C(vzstart)).
      type: str
      sample: vzreboot
    exitstatus:
      description:
        - "PVE's exit status: C(OK) or C(WARNINGS: N) on success, otherwise the error message."
        - C(null) for a task still running at the deadline.
      type: str
      sample: OK
    elapsed:
      description: Seconds from the request to the end of the task, as seen by the module.
      type: float
      sample: 4.21
status:
  description: The container's status at the end (C(running) on success; in check mode the current status).
  returned: success
  type: str
  sample: running
uptime:
  description: The container's uptime in seconds at the end, as PVE reports it.
  returned: success
  type: int
  sample: 1
elapsed:
  description:
    - Seconds the module spent on the task, from its start to its result, including waiting for a
      lock. The collection's one name for elapsed seconds (M(gpuops.relaunch.train_launch) and
      M(gpuops.relaunch.zombie_reap) return it too).
  returned: success
  type: float
  sample: 5.3
option_problems:
  description:
    - Every problem found with the options, each a dict of C(option), its name, and C(reason), what is wrong with its
      value (never the value of a secret).
  returned: when the options were refused, before any request was sent
  type: list
  elements: dict
  sample: [{"option": "wait_timeout", "reason": "must be a finite number of seconds, got nan"}]
lock_waited_s:
  description: Seconds of RV(elapsed) spent waiting for a config lock to clear.
  returned: success
  type: float
  sample: 0.0
node_slot:
  description:
    - The node slot the reboot held (see O(node_slots)), and how long it waited for it. V(null) in check
      mode and with O(node_slots=0).
  returned: success
  type: dict
  sample: {"node": "pve1", "slot": 0, "waited": 0.0}
  contains:
    node:
      description: The node.
      type: str
    slot:
      description: Which of the node's slots it held, from V(0).
      type: int
    waited:
      description: Seconds it waited for the slot.
      type: float
"""

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks, fail_on_invalid_options
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import (
    HAS_PROXMOXER,
    PROXMOX_CONNECTION_REQUIRED_ONE_OF,
    PROXMOX_CONNECTION_REQUIRED_TOGETHER,
    PROXMOXER_IMPORT_ERROR,
    ProxmoxClient,
    ProxmoxConnection,
    ProxmoxError,
    proxmox_connection_spec,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.ct_power import (
    CtRebooter,
    CtRebootRequest,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.node_slots import DEFAULT_SLOT_DIR


def main() -> None:
    argument_spec = proxmox_connection_spec()
    argument_spec.update(
        vmid={"type": "int", "required": True},
        node={"type": "str"},
        expected_hostname={"type": "str"},
        skip_hostname_check={"type": "bool", "default": False},
        method={"type": "str", "choices": ["reboot", "stop_start"], "default": "reboot"},
        timeout={"type": "int", "default": 60},
        force={"type": "bool", "default": False},
        wait_timeout={"type": "float", "default": 300},
        lock_timeout={"type": "float", "default": 60},
        skiplock={"type": "bool", "default": False},
        node_slots={"type": "int", "default": 1},
        slot_dir={"type": "path", "default": DEFAULT_SLOT_DIR},
        slot_timeout={"type": "float", "default": 3600},
    )
    module = AnsibleModule(
        argument_spec=argument_spec,
        required_one_of=PROXMOX_CONNECTION_REQUIRED_ONE_OF,
        required_together=PROXMOX_CONNECTION_REQUIRED_TOGETHER,
        supports_check_mode=True,
    )
    if not HAS_PROXMOXER:
        module.fail_json(msg=missing_required_lib("proxmoxer"), exception=PROXMOXER_IMPORT_ERROR, tasks=[])

    params = module.params
    connection = ProxmoxConnection.from_params(params)
    request = CtRebootRequest.from_params(params)
    checks = OptionChecks()
    connection.check_options(checks)
    request.check_options(checks, connection.user, connection.uses_token)
    with fail_on_invalid_options(module, tasks=[]):
        checks.raise_if_any()

    rebooter: CtRebooter | None = None
    try:
        rebooter = CtRebooter(ProxmoxClient(connection), request, api=connection.url)
        result = rebooter.run(check_mode=module.check_mode)
    except ProxmoxError as exc:
        tasks = [task.as_dict() for task in rebooter.tasks] if rebooter else []
        module.fail_json(msg=connection.redact(str(exc)), tasks=tasks)
    except Exception as exc:  # pylint: disable=broad-except
        # No traceback: a library's error can quote a request header, and with it the token secret.
        tasks = [task.as_dict() for task in rebooter.tasks] if rebooter else []
        message = f"unexpected error talking to {connection.url}: {type(exc).__name__}: {exc}"
        module.fail_json(msg=connection.redact(message), tasks=tasks)
    for warning in result.warnings:
        module.warn(warning)
    module.exit_json(**result.as_dict())


if __name__ == "__main__":
    main()
