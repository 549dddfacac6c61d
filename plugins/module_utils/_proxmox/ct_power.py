# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Rebooting one LXC container through the PVE API, with the checks an operator would make first.

Order of business: find the container's node, check that its configured hostname is the one
expected (the guard against rebooting the wrong container), check quorum (a stop without quorum
cannot be undone by a start), wait out a config lock, then run the power actions one task at a
time, each judged by its exit status, and finally wait until the container runs again and has
really restarted (a new init pid, or an uptime that began after we asked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_timeout
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import (
    ProxmoxApiError,
    ProxmoxClient,
    ProxmoxError,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.node_slots import (
    DEFAULT_SLOT_DIR,
    NodeSlot,
    SlotScope,
    check_slots,
    take_slot,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.tasks import (
    TaskFailed,
    TaskOutcome,
    TaskTimeout,
    poll,
    start_ct_task,
    wait_for_task,
)

METHODS = ("reboot", "stop_start")
# After its own timeout PVE needs a little longer to end a shutdown task; past this a forced
# stop_start stops the container with overrule-shutdown instead of waiting further.
SHUTDOWN_GRACE_S = 15.0
# PVE reports uptime in whole seconds.
UPTIME_SLACK_S = 1.0
MISSING_HOSTNAME = (
    "required: it is the guard against rebooting the wrong container through a wrong vmid; give the"
    " hostname of the container's PVE configuration, or set skip_hostname_check=true to reboot without"
    " that check"
)


class CtRebootRefused(ProxmoxError):
    """A check before any change said no; nothing was changed."""


@dataclass(frozen=True)
class CtRebootRequest:
    """What the caller asked for (the module's options, checked)."""

    vmid: int
    node: str | None = None
    expected_hostname: str | None = None
    method: str = "reboot"
    timeout: int = 60
    wait_timeout: float = 300
    force: bool = False
    lock_timeout: float = 60
    skiplock: bool = False
    skip_hostname_check: bool = False
    # At most node_slots reboots at once per node from this controller (0: no limit).
    node_slots: int = 1
    slot_dir: str = DEFAULT_SLOT_DIR
    slot_timeout: float = 3600

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> CtRebootRequest:
        """From a module's parameters: each field is the option of the same name."""
        return cls(**{request_field.name: params[request_field.name] for request_field in fields(cls)})

    def check_options(self, checks: OptionChecks, api_user: str, uses_token: bool) -> None:
        """Note in `checks` what is wrong with the request, each problem naming its option."""
        if self.vmid < 100:
            checks.add("vmid", f"must be 100 or more (PVE's guest ids start there), got {self.vmid}")
        if self.method not in METHODS:
            checks.add("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        timeout = checks.check(check_timeout, "timeout", self.timeout)
        wait_timeout = checks.check(check_timeout, "wait_timeout", self.wait_timeout)
        checks.check(check_timeout, "lock_timeout", self.lock_timeout)
        checks.check(check_slots, "node_slots", self.node_slots)
        checks.check(check_timeout, "slot_timeout", self.slot_timeout)
        if not self.slot_dir.strip():
            checks.add("slot_dir", "must not be empty")
        if timeout is not None and wait_timeout is not None and wait_timeout <= timeout:
            checks.add("wait_timeout", f"({self.wait_timeout}) must be greater than timeout ({self.timeout}):"
                       " the container needs time to start after its shutdown timeout")
        if self.skiplock:
            if self.method != "stop_start":
                checks.add("skiplock", "true needs method=stop_start: PVE's reboot and shutdown cannot skip a lock")
            if api_user != "root@pam" or uses_token:
                checks.add("skiplock", "true is only allowed to root@pam logging in with a password (PVE's rule)")
        if self.expected_hostname is not None and not self.expected_hostname.strip():
            checks.add("expected_hostname", "must not be empty when given")
        if self.expected_hostname is None and not self.skip_hostname_check:
            checks.add("expected_hostname", MISSING_HOSTNAME)
        if self.expected_hostname is not None and self.skip_hostname_check:
            checks.add("skip_hostname_check", "true contradicts expected_hostname: give one of them")


@dataclass(frozen=True)
class CtState:
    """What status/current and the config say about the container."""

    status: str
    uptime: int
    pid: int | None
    lock: str | None
    hostname: str | None

    def restarted_since(self, before: CtState, seconds_ago: float) -> bool:
        """True if it runs and has started since we asked, seconds_ago seconds back."""
        if self.status != "running":
            return False
        if self.pid is not None and before.pid is not None:
            return self.pid != before.pid
        return self.uptime <= seconds_ago + UPTIME_SLACK_S


@dataclass(frozen=True)
class PowerAction:
    """One POST to status/<name> with its parameters."""

    name: str
    data: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        args = ", ".join(f"{key}={value}" for key, value in sorted(self.data.items()))
        return f"{self.name}({args})" if args else self.name


def plan_actions(request: CtRebootRequest, status: str) -> list[PowerAction]:
    """The power actions that bring a container in `status` to a fresh start."""
    skip = {"skiplock": 1} if request.skiplock else {}
    if status == "stopped":
        return [PowerAction("start", dict(skip))]
    if status != "running":
        raise CtRebootRefused(f"CT {request.vmid} is in status {status!r}; only running or stopped ones are handled")
    if request.method == "reboot":
        return [PowerAction("reboot", {"timeout": request.timeout})]
    if request.skiplock:
        # PVE's shutdown has no skiplock; with the lock ignored the container is stopped hard.
        return [PowerAction("stop", dict(skip)), PowerAction("start", dict(skip))]
    shutdown = {"timeout": request.timeout}
    if request.force:
        shutdown["forceStop"] = 1
    return [PowerAction("shutdown", shutdown), PowerAction("start")]


@dataclass
class CtRebootResult:
    """What the module returns."""

    node: str
    vmid: int
    hostname: str | None
    method: str
    status_before: str
    actions: list[str]
    changed: bool
    status: str
    uptime: int
    lock_waited_s: float = 0.0
    elapsed: float = 0.0
    node_slot: NodeSlot | None = None
    tasks: list[TaskOutcome] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "vmid": self.vmid,
            "hostname": self.hostname,
            "method": self.method,
            "status_before": self.status_before,
            "actions": self.actions,
            "changed": self.changed,
            "status": self.status,
            "uptime": self.uptime,
            "elapsed": round(self.elapsed, 3),
            "lock_waited_s": round(self.lock_waited_s, 3),
            "node_slot": self.node_slot.as_dict() if self.node_slot else None,
            "tasks": [task.as_dict() for task in self.tasks],
        }


def find_node(client: ProxmoxClient, vmid: int) -> str:
    """The node the container lives on, from /cluster/resources."""
    for guest in client.get("cluster/resources", type="vm") or []:
        if int(guest.get("vmid", -1)) != vmid:
            continue
        if guest.get("type") != "lxc":
            raise CtRebootRefused(f"guest {vmid} is a {guest.get('type')} VM, not an LXC container")
        return str(guest["node"])
    raise CtRebootRefused(
        f"no guest with vmid {vmid} in the cluster (or {client.connection.identity} may not see it: VM.Audit)"
    )


def read_state(client: ProxmoxClient, node: str, vmid: int) -> CtState:
    base = f"nodes/{node}/lxc/{vmid}"
    config = client.get(base + "/config") or {}
    current = client.get(base + "/status/current") or {}
    pid = current.get("pid")
    return CtState(
        status=str(current.get("status", "unknown")),
        uptime=int(current.get("uptime") or 0),
        pid=int(pid) if pid not in (None, "") else None,
        lock=config.get("lock") or current.get("lock") or None,
        hostname=config.get("hostname"),
    )


@dataclass(frozen=True)
class ClusterStatus:
    """What GET /cluster/status says about the cluster: its name and whether it has quorum.

    A node in no cluster lists no entry of type ``cluster``: no name, and quorate (it needs none).
    Without Sys.Audit on / the list cannot be read: neither is known (`readable` false).
    """

    readable: bool
    name: str | None = None
    quorate: bool | None = None


def read_cluster_status(client: ProxmoxClient) -> ClusterStatus:
    """GET /cluster/status, believed only as far as its shape holds (entries that are not objects are
    skipped, a quorate flag that is not a number counts as no quorum, a name that is not text as none)."""
    try:
        entries = client.get("cluster/status") or []
    except ProxmoxApiError as exc:
        if exc.status == 403:
            return ClusterStatus(readable=False)
        raise
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("type") == "cluster":
            try:
                quorate = bool(int(entry.get("quorate", 0)))
            except (TypeError, ValueError):
                quorate = False  # a stop needs quorum proven, not assumed
            name = entry.get("name")
            return ClusterStatus(readable=True, name=name if isinstance(name, str) else None, quorate=quorate)
    return ClusterStatus(readable=True, quorate=True)


def node_fingerprint(client: ProxmoxClient, node: str) -> str:
    """The node's TLS certificate fingerprint from GET /nodes; "" when it is not given or may not be read."""
    try:
        nodes = client.get("nodes") or []
    except ProxmoxApiError as exc:
        if exc.status == 403:
            return ""
        raise
    for entry in nodes if isinstance(nodes, list) else []:
        if isinstance(entry, dict) and entry.get("node") == node and isinstance(entry.get("ssl_fingerprint"), str):
            return entry["ssl_fingerprint"]
    return ""


def slot_scope(client: ProxmoxClient, cluster: ClusterStatus, api: str, node: str) -> SlotScope:
    """What the node's reboot slots are shared across (see SlotScope): the cluster, the machine of a node
    in no cluster, or (when the cluster may not be looked at) only the API URL."""
    if not cluster.readable:
        return SlotScope("api", api)
    if cluster.name is not None:
        return SlotScope("cluster", cluster.name)
    return SlotScope("standalone", node_fingerprint(client, node))


def check_hostname(request: CtRebootRequest, node: str, state: CtState) -> None:
    """CtRebootRefused unless the configured hostname is the expected one (or the check was waived)."""
    expected = request.expected_hostname
    if expected is None:
        if request.skip_hostname_check:
            return
        raise CtRebootRefused(f"expected_hostname: {MISSING_HOSTNAME}; nothing was changed")
    if (state.hostname or "").strip().lower() != expected.strip().lower():
        raise CtRebootRefused(
            f"refusing to touch CT {request.vmid} on node {node}: its configured hostname is"
            f" {state.hostname!r}, not the expected {expected!r}"
        )


def wait_for_unlock(client: ProxmoxClient, node: str, vmid: int, state: CtState, seconds: float) -> CtState:
    """Poll until the config lock is gone; CtRebootRefused naming the lock if it outlasts `seconds`."""
    if not state.lock:
        return state
    deadline = Deadline(seconds)
    latest = [state]

    def unlocked() -> CtState | None:
        latest[0] = read_state(client, node, vmid)
        return latest[0] if not latest[0].lock else None

    cleared = poll(unlocked, deadline, interval=0.25)
    if cleared is None:
        raise CtRebootRefused(
            f"CT {vmid} is locked ({latest[0].lock}) and stayed locked for {seconds:g}s (lock_timeout);"
            " nothing was changed. skiplock=true (root@pam, method=stop_start) would ignore the lock."
        )
    return cleared


class CtRebooter:
    """Carries out one CtRebootRequest against one API."""

    def __init__(self, client: ProxmoxClient, request: CtRebootRequest, api: str = "") -> None:
        self.client = client
        self.request = request
        self.api = api  # keys the node's slot files only when the cluster may not be asked for its name
        self.tasks: list[TaskOutcome] = []

    def run(self, check_mode: bool = False) -> CtRebootResult:
        request = self.request
        client = self.client
        begun = time.monotonic()
        node = request.node or find_node(client, request.vmid)
        before = read_state(client, node, request.vmid)
        check_hostname(request, node, before)
        actions = plan_actions(request, before.status)
        stops = any(action.name in ("shutdown", "stop", "reboot") for action in actions)
        takes_slot = bool(request.node_slots) and not check_mode
        # Read once: the quorum guards a stop, the cluster's name keys the node's slots.
        cluster = read_cluster_status(client) if stops or takes_slot else None
        if stops and cluster is not None and cluster.quorate is False:
            raise CtRebootRefused(
                f"the cluster has no quorum: refusing to stop CT {request.vmid}, it could not be started again"
            )
        result = CtRebootResult(
            node=node,
            vmid=request.vmid,
            hostname=before.hostname,
            method=request.method,
            status_before=before.status,
            actions=[action.describe() for action in actions],
            changed=True,
            status=before.status,
            uptime=before.uptime,
        )
        if check_mode:
            if before.lock and not request.skiplock:
                result.warnings.append(f"CT {request.vmid} is locked ({before.lock}); a real run waits up to lock_timeout")
            result.elapsed = time.monotonic() - begun
            return result
        if takes_slot and cluster is not None:
            scope = slot_scope(client, cluster, self.api, node)
            if scope.kind == "api":
                result.warnings.append(
                    f"{client.connection.identity} may not read /cluster/status (Sys.Audit on /), so node {node}'s"
                    " reboot slots are shared only with reboots through this same API URL, not through another"
                    " address of the cluster"
                )
            result.node_slot = take_slot(request.slot_dir, scope, node, request.node_slots,
                                         Deadline(request.slot_timeout))
            if result.node_slot.waited:
                # Other reboots ran meanwhile: judge the container as it is now, not as it was.
                before = read_state(client, node, request.vmid)
                check_hostname(request, node, before)
        try:
            return self._act(node, before, actions, result, begun)
        finally:
            if result.node_slot:
                result.node_slot.release()

    def _act(self, node: str, before: CtState, actions: list[PowerAction], result: CtRebootResult,
             begun: float) -> CtRebootResult:
        """Wait out a config lock, carry out the actions and wait until the container runs again."""
        request = self.request
        if not request.skiplock:
            lock_began = time.monotonic()
            before = wait_for_unlock(self.client, node, request.vmid, before, request.lock_timeout)
            result.lock_waited_s = time.monotonic() - lock_began
        if before.status != result.status_before:
            # The lock holder (a backup in stop mode, say) or a wait for the node's slot saw the
            # state change: plan again.
            actions = plan_actions(request, before.status)
            result.actions = [action.describe() for action in actions]
        deadline = Deadline(request.wait_timeout)
        asked_at = time.monotonic()
        try:
            for action in actions:
                self._carry_out(node, action, deadline)
            after = self._wait_until_restarted(node, before, asked_at, deadline)
        except ProxmoxError as exc:
            raise ProxmoxError(f"{exc}{self._where_it_is_left(node)}") from None
        finally:
            result.tasks = self.tasks
        result.status = after.status
        result.uptime = after.uptime
        result.hostname = after.hostname or result.hostname
        result.elapsed = time.monotonic() - begun
        result.warnings.extend(
            f"task {task.type} {task.upid} ended with {task.exitstatus}" for task in self.tasks if task.exitstatus != "OK"
        )
        return result

    def _carry_out(self, node: str, action: PowerAction, deadline: Deadline) -> None:
        request = self.request
        forced_shutdown = action.name == "shutdown" and request.force
        try:
            self._run_task(node, action, deadline.sooner(request.timeout + SHUTDOWN_GRACE_S) if forced_shutdown else deadline)
        except (TaskFailed, TaskTimeout):
            if not forced_shutdown or read_state(self.client, node, request.vmid).status != "running":
                raise
            # force: the clean shutdown failed or hangs, so end it the hard way (and end the
            # shutdown task with it, as PVE's overrule-shutdown does).
            self._run_task(node, PowerAction("stop", {"overrule-shutdown": 1}), deadline)

    def _run_task(self, node: str, action: PowerAction, deadline: Deadline) -> TaskOutcome:
        posted_at = time.monotonic()
        upid = start_ct_task(
            self.client, node, self.request.vmid, action.name, self.client.connection.timeout, **action.data
        )
        try:
            outcome = wait_for_task(self.client, upid, deadline, posted_at)
        except (TaskFailed, TaskTimeout) as exc:
            self.tasks.append(exc.outcome)
            raise
        self.tasks.append(outcome)
        return outcome

    def _wait_until_restarted(self, node: str, before: CtState, asked_at: float, deadline: Deadline) -> CtState:
        latest = [before]

        def restarted() -> CtState | None:
            latest[0] = read_state(self.client, node, self.request.vmid)
            return latest[0] if latest[0].restarted_since(before, time.monotonic() - asked_at) else None

        state = poll(restarted, deadline, interval=0.1)
        if state is None:
            raise ProxmoxError(
                f"CT {self.request.vmid}: the tasks succeeded but it is {latest[0].status} (uptime"
                f" {latest[0].uptime}s) and had not restarted within wait_timeout={self.request.wait_timeout:g}s"
            )
        return state

    def _where_it_is_left(self, node: str) -> str:
        try:
            state = read_state(self.client, node, self.request.vmid)
        except ProxmoxError:
            return ""
        return f"; CT {self.request.vmid} is now {state.status}"
