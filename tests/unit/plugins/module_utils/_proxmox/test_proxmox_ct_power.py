"""The reboot plan: option checks, the actions for each state, restart evidence, and runs against fakepve.

The runs here use fakepve's own (simulated) containers; the real-LXC runs are in
tests/integration/test_proxmox_ct_reboot.py.
"""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import (
    ProxmoxClient,
    ProxmoxConnection,
    ProxmoxError,
    RetryPolicy,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.ct_power import (
    CtRebooter,
    CtRebootRefused,
    CtRebootRequest,
    CtState,
    find_node,
    plan_actions,
)

# ------------------------------------------------------------------------------- pure parts


def request_problems(request_: CtRebootRequest, user: str, token: bool) -> list[str]:
    checks = OptionChecks()
    request_.check_options(checks, user, token)
    return [str(problem) for problem in checks.problems]


@pytest.mark.parametrize(
    "request_, status, expected",
    [
        (CtRebootRequest(200), "running", ["reboot(timeout=60)"]),
        (CtRebootRequest(200, method="stop_start", timeout=30), "running", ["shutdown(timeout=30)", "start"]),
        (CtRebootRequest(200, method="stop_start", force=True), "running", ["shutdown(forceStop=1, timeout=60)", "start"]),
        (CtRebootRequest(200, method="stop_start", skiplock=True), "running", ["stop(skiplock=1)", "start(skiplock=1)"]),
        (CtRebootRequest(200), "stopped", ["start"]),
        (CtRebootRequest(200, method="stop_start", skiplock=True), "stopped", ["start(skiplock=1)"]),
    ],
)
def test_plan_for_each_method_and_state(request_, status, expected):
    assert [action.describe() for action in plan_actions(request_, status)] == expected


def test_plan_refuses_a_state_it_does_not_know():
    with pytest.raises(CtRebootRefused, match="'unknown'"):
        plan_actions(CtRebootRequest(200), "unknown")


@pytest.mark.parametrize(
    "request_, user, token, fragment",
    [
        (CtRebootRequest(99), "root@pam", False, "vmid: must be 100 or more"),
        (CtRebootRequest(200, method="bounce"), "root@pam", False, "method: must be one of"),
        (CtRebootRequest(200, timeout=300, wait_timeout=300), "root@pam", False, "must be greater than timeout"),
        (CtRebootRequest(200, lock_timeout=-1), "root@pam", False, "lock_timeout: must be at least 0 and at most 86400"),
        (CtRebootRequest(200, lock_timeout=float("nan")), "root@pam", False, "lock_timeout: must be a finite number"),
        (CtRebootRequest(200, wait_timeout=float("inf")), "root@pam", False, "wait_timeout: must be a finite number"),
        (CtRebootRequest(200, wait_timeout=float("nan")), "root@pam", False, "wait_timeout: must be a finite number"),
        (CtRebootRequest(200, wait_timeout=1e12), "root@pam", False, "wait_timeout: must be at least 0 and at most 86400"),
        (CtRebootRequest(200, timeout=-1), "root@pam", False, "timeout: must be at least 0 and at most 86400"),
        (CtRebootRequest(200, timeout=10**12), "root@pam", False, "timeout: must be at least 0 and at most 86400"),
        (CtRebootRequest(200), "root@pam", False, "expected_hostname: required"),
        (CtRebootRequest(200, expected_hostname="ct", skip_hostname_check=True), "root@pam", False, "contradict"),
        (CtRebootRequest(200, skiplock=True), "root@pam", False, "skiplock: true needs method=stop_start"),
        (CtRebootRequest(200, method="stop_start", skiplock=True), "ops@pve", False, "only allowed to root@pam"),
        (CtRebootRequest(200, method="stop_start", skiplock=True), "root@pam", True, "only allowed to root@pam"),
        (CtRebootRequest(200, expected_hostname=" "), "root@pam", False, "expected_hostname: must not be empty"),
    ],
)
def test_bad_requests_are_named(request_, user, token, fragment):
    assert any(fragment in problem for problem in request_problems(request_, user, token))


def test_a_nan_wait_timeout_is_named_once_not_compared_with_timeout():
    problems = request_problems(CtRebootRequest(200, expected_hostname="ct", wait_timeout=float("nan")), "root@pam", False)
    assert problems == ["wait_timeout: must be a finite number of seconds, got nan"]


def test_a_request_takes_each_field_from_the_option_of_its_name_and_nothing_else():
    params = {"vmid": 201, "node": "pve2", "expected_hostname": "gpu-train-02", "method": "stop_start", "timeout": 30,
              "wait_timeout": 120.0, "force": True, "lock_timeout": 5.0, "skiplock": True, "skip_hostname_check": True,
              "node_slots": 2, "slot_dir": "/run/slots", "slot_timeout": 60.0, "api_host": "pve.example", "api_user": "root@pam"}
    request = CtRebootRequest.from_params(params)
    assert request == CtRebootRequest(**{name: value for name, value in params.items() if not name.startswith("api_")})


def test_a_good_request_has_no_problems():
    good = CtRebootRequest(200, expected_hostname="gpu-train-01", method="stop_start", skiplock=True)
    assert request_problems(good, "root@pam", False) == []
    assert request_problems(CtRebootRequest(200, skip_hostname_check=True), "root@pam", False) == []
    a_day = CtRebootRequest(200, expected_hostname="ct", wait_timeout=86400, lock_timeout=86400)
    assert request_problems(a_day, "root@pam", False) == []


def test_restart_is_seen_in_a_new_init_pid_or_else_in_the_uptime():
    before = CtState("running", 5000, 4242, None, "ct")
    assert CtState("running", 9000, 4343, None, "ct").restarted_since(before, 10)
    assert not CtState("running", 0, 4242, None, "ct").restarted_since(before, 10)
    assert not CtState("stopped", 0, None, None, "ct").restarted_since(before, 10)
    no_pid = CtState("running", 5000, None, None, "ct")
    assert CtState("running", 3, None, None, "ct").restarted_since(no_pid, 2.5)
    assert not CtState("running", 5003, None, None, "ct").restarted_since(no_pid, 2.5)


# ----------------------------------------------------------------------------- against a server


@pytest.fixture
def pve_retry() -> RetryPolicy:
    return RetryPolicy(attempts=4, first_delay=0.2, factor=2, max_delay=1.0)


def test_find_node_names_what_is_wrong(api, server):
    server.call(server.pve.add_vm, 300, "a-vm", node="pve2")
    assert find_node(api, 200) == "pve1"
    with pytest.raises(CtRebootRefused, match="300 is a qemu VM, not an LXC container"):
        find_node(api, 300)
    with pytest.raises(CtRebootRefused, match="no guest with vmid 404"):
        find_node(api, 404)


def test_check_mode_mentions_the_lock_and_sends_nothing(api, server):
    server.call(server.pve.snapshot_lock, 200, "backup")
    result = CtRebooter(api, CtRebootRequest(200, expected_hostname="GPU-TRAIN-01")).run(check_mode=True)
    assert result.changed and result.actions == ["reboot(timeout=60)"]
    assert any("locked (backup)" in warning for warning in result.warnings)
    assert server.requests("POST", "/lxc/") == []


def test_start_refused_for_lost_quorum_is_sent_again_until_quorum_returns(api, server):
    # Quorum goes between the shutdown and the start, and comes back 0.5 s later: the start was
    # refused (nothing done), so it is sent again, and the container ends up running.
    def quorum_goes(pve) -> None:
        pve.lose_quorum()
        server.loop.call_later(0.5, pve.regain_quorum)

    server.before_request("POST", "/status/start", quorum_goes)
    result = CtRebooter(api, CtRebootRequest(200, expected_hostname="gpu-train-01", method="stop_start")).run()
    assert [task.type for task in result.tasks] == ["vzshutdown", "vzstart"]
    assert result.status == "running"
    assert len(server.requests("POST", "/status/start")) >= 2
    assert len(server.tasks(200, "vzstart")) == 1


def test_a_container_that_never_comes_back_fails_naming_its_state(api, server):
    ct = server.pve.ct(200)
    server.call(setattr, ct, "start_error", "unable to mount rootfs")
    with pytest.raises(ProxmoxError, match="unable to mount rootfs.*CT 200 is now stopped"):
        CtRebooter(api, CtRebootRequest(200, expected_hostname="gpu-train-01", method="stop_start")).run()


def test_a_request_without_expected_hostname_is_refused_by_the_rebooter_itself(api, server):
    # check_options() says so first; the rebooter holds the line on its own for any other caller.
    for check_mode in (True, False):
        with pytest.raises(CtRebootRefused, match="expected_hostname: required.*nothing was changed"):
            CtRebooter(api, CtRebootRequest(200)).run(check_mode=check_mode)
    assert server.requests("POST", "/lxc/") == []


def test_skip_hostname_check_reboots_whatever_the_hostname(api, server):
    result = CtRebooter(api, CtRebootRequest(200, skip_hostname_check=True)).run()
    assert result.hostname == "gpu-train-01" and [task.type for task in result.tasks] == ["vzreboot"]
    assert len(server.requests("POST", "/status/reboot")) == 1


# ----------------------------------------------------------------- the privileges it needs


def token_client(server, pve_retry: RetryPolicy, grants: list[tuple[str, str]]) -> ProxmoxClient:
    """A client of an API token (privilege separated) holding exactly `grants` (path, privilege)."""
    server.add_user("ops@pve")
    secret = server.add_token("ops@pve", "relaunch")
    for path, privilege in grants:
        server.call(server.pve.grant, "ops@pve!relaunch", path, privilege)
    conn = ProxmoxConnection(host=server.host, port=server.port, user="ops@pve", token_id="relaunch",
                             token_secret=secret, ca_path=server.pki.ca_path, timeout=2)
    return ProxmoxClient(conn, retry=pve_retry)


# What guide_proxmox lists: VM.Audit and VM.PowerMgmt on the container, Sys.Audit on /.
DOCUMENTED = [("/vms/200", "VM.Audit"), ("/vms/200", "VM.PowerMgmt"), ("/", "Sys.Audit")]


@pytest.mark.parametrize("method", ["reboot", "stop_start"])
def test_the_documented_privileges_are_enough(server, pve_retry, tmp_path, method):
    # The node looked up (cluster/resources), the hostname read, the tasks followed, the quorum and the
    # cluster's name read: every call of a reboot, nothing refused and nothing warned about. (fakepve
    # checks the two VM privileges; /cluster/status's Sys.Audit is test_node_slots' injected 403.)
    api = token_client(server, pve_retry, DOCUMENTED)
    result = CtRebooter(api, CtRebootRequest(200, expected_hostname="gpu-train-01", method=method,
                                             slot_dir=str(tmp_path))).run()
    assert result.status == "running" and result.node == "pve1" and result.warnings == []


@pytest.mark.parametrize("missing", DOCUMENTED[:2])
def test_without_a_documented_vm_privilege_nothing_is_done(server, pve_retry, tmp_path, missing):
    api = token_client(server, pve_retry, [grant for grant in DOCUMENTED if grant != missing])
    with pytest.raises(ProxmoxError):
        CtRebooter(api, CtRebootRequest(200, expected_hostname="gpu-train-01", slot_dir=str(tmp_path))).run()
    assert server.tasks(200, "vzreboot") == []
