"""The per-node reboot slots: real flocks on real files, and two rebooters against fakepve at once.

A flock belongs to an open file description, so two opens in one process conflict exactly as two
processes do; the child-process test shows the kernel dropping the lock with its holder.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import ProxmoxClient, ProxmoxConnection
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.ct_power import (
    CtRebooter,
    CtRebootRequest,
    read_cluster_status,
    slot_scope,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.node_slots import (
    NoFreeSlot,
    SlotError,
    SlotScope,
    slot_prefix,
    take_slot,
)
from tests.harness.procstates import wait_until

API = "https://pve.example:8006"
# fakepve's cluster (its /cluster/status names it "fakecluster").
CLUSTER = SlotScope("cluster", "fakecluster")


def now() -> Deadline:
    """A deadline that has passed: one look at the slots, no waiting."""
    return Deadline(0)


def test_one_slot_per_node_is_held_until_released(tmp_path):
    first = take_slot(str(tmp_path), CLUSTER, "pve1", 1, now())
    with pytest.raises(NoFreeSlot, match="all 1 reboot slot.*node pve1.*slot_timeout.*nothing was changed"):
        take_slot(str(tmp_path), CLUSTER, "pve1", 1, now())
    first.release()
    again = take_slot(str(tmp_path), CLUSTER, "pve1", 1, now())
    assert (again.node, again.index, again.waited) == ("pve1", 0, 0.0)  # free at once: no wait, no second look
    again.release()


def test_n_slots_admit_n_reboots_and_nodes_and_clusters_do_not_share(tmp_path):
    held = [take_slot(str(tmp_path), CLUSTER, "pve1", 2, now()), take_slot(str(tmp_path), CLUSTER, "pve1", 2, now())]
    assert sorted(slot.index for slot in held) == [0, 1]
    with pytest.raises(NoFreeSlot):
        take_slot(str(tmp_path), CLUSTER, "pve1", 2, now())
    other_node = take_slot(str(tmp_path), CLUSTER, "pve2", 1, now())
    other_cluster = take_slot(str(tmp_path), SlotScope("cluster", "other"), "pve1", 1, now())
    for slot in [*held, other_node, other_cluster]:
        slot.release()


def test_the_kernel_drops_a_slot_with_the_process_that_held_it(tmp_path):
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's side
        os.close(go_w)  # or its own copy would keep the pipe open and the read below would never end
        os.close(ready_r)
        take_slot(str(tmp_path), CLUSTER, "pve1", 1, now())
        os.write(ready_w, b"x")
        os.read(go_r, 1)  # returns when the parent closes its end
        os._exit(0)  # pylint: disable=protected-access
    os.close(ready_w)
    os.close(go_r)
    assert os.read(ready_r, 1) == b"x"
    with pytest.raises(NoFreeSlot):
        take_slot(str(tmp_path), CLUSTER, "pve1", 1, now())
    os.close(go_w)
    os.waitpid(child, 0)
    take_slot(str(tmp_path), CLUSTER, "pve1", 1, now()).release()


def test_the_directory_is_made_private(tmp_path):
    directory = tmp_path / "a" / "slots"
    take_slot(str(directory), CLUSTER, "pve1", 1, now()).release()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


@pytest.mark.parametrize("make", ["group_writable", "symlink"])
def test_an_unsafe_directory_is_refused_naming_slot_dir(tmp_path, make):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    target = real
    if make == "group_writable":
        real.chmod(0o770)
    else:
        target = tmp_path / "link"
        target.symlink_to(real)
        if os.geteuid() == 0:
            os.lchown(target, 65534, 65534)  # another user's link (root's own would be followed)
    with pytest.raises(SlotError, match="slot_dir"):
        take_slot(str(target), CLUSTER, "pve1", 1, now())


@pytest.mark.parametrize("make", ["parent_symlink", "parent_writable_by_all"])
def test_a_directory_above_slot_dir_that_others_control_is_refused(tmp_path, make):
    parent = tmp_path / "parent"
    (parent / "slots").mkdir(parents=True, mode=0o700)
    if make == "parent_symlink":
        (tmp_path / "link").symlink_to(parent)
        if os.geteuid() == 0:
            os.lchown(tmp_path / "link", 65534, 65534)  # another user's link (root's own would be followed)
        slot_dir = tmp_path / "link" / "slots"
    else:
        parent.chmod(0o777)
        slot_dir = parent / "slots"
    with pytest.raises(SlotError, match=r"slot_dir: .*(is a symbolic link|writable by other users without the sticky bit).*nothing was changed"):
        take_slot(str(slot_dir), CLUSTER, "pve1", 1, now())
    assert list((parent / "slots").iterdir()) == []


@pytest.mark.parametrize("make", ["symlink", "fifo"])
def test_a_slot_file_that_is_not_a_regular_file_is_refused(tmp_path, make):
    directory = tmp_path / "slots"
    directory.mkdir(mode=0o700)
    slot_file = directory / f"{slot_prefix(CLUSTER, 'pve1')}.0.lock"
    if make == "symlink":
        slot_file.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(slot_file)
    with pytest.raises(SlotError, match="slot_dir: .*slot file"):
        take_slot(str(directory), CLUSTER, "pve1", 1, now())
    assert not (tmp_path / "elsewhere").exists()


def test_the_prefix_keeps_a_hostile_node_name_inside_the_directory():
    prefix = slot_prefix(CLUSTER, "../../etc/passwd")
    assert "/" not in prefix and prefix.startswith(".._.._etc_passwd-")


@pytest.mark.parametrize(
    "field, value, option",
    [("node_slots", -1, "node_slots"), ("node_slots", 65, "node_slots"), ("slot_timeout", float("nan"), "slot_timeout"),
     ("slot_timeout", 1e9, "slot_timeout"), ("slot_dir", " ", "slot_dir")],
)
def test_bad_slot_options_name_the_option(field, value, option):
    checks = OptionChecks()
    CtRebootRequest(200, expected_hostname="gpu-train-01", **{field: value}).check_options(checks, "root@pam", False)
    assert [problem.option for problem in checks.problems] == [option]


# ------------------------------------------------------------------------------ against fakepve


def client_of(api: ProxmoxClient) -> ProxmoxClient:
    """A client of its own for a thread (same server, same credentials)."""
    return ProxmoxClient(api.connection, retry=api.retry)


def test_a_taken_slot_keeps_the_rebooter_from_sending_anything(api, server, tmp_path):
    held = take_slot(str(tmp_path), CLUSTER, "pve1", 1, now())
    request = CtRebootRequest(200, expected_hostname="gpu-train-01", slot_dir=str(tmp_path), slot_timeout=0.3)
    with pytest.raises(NoFreeSlot, match="node pve1"):
        CtRebooter(api, request, api=API).run()
    assert server.requests("POST", "/lxc/") == []
    held.release()
    result = CtRebooter(api, request, api=API).run()
    assert result.node_slot is not None and result.as_dict()["node_slot"]["slot"] == 0
    assert len(server.requests("POST", "/status/reboot")) == 1


def test_one_slot_per_node_reboots_two_containers_of_a_node_one_after_the_other(api, server, tmp_path):
    server.call(server.pve.add_ct, 201, "gpu-train-02", status="running")
    outcomes: dict[int, object] = {}

    def reboot(vmid: int, hostname: str) -> None:
        request = CtRebootRequest(vmid, expected_hostname=hostname, slot_dir=str(tmp_path), node_slots=1)
        try:
            outcomes[vmid] = CtRebooter(client_of(api), request, api=API).run()
        except Exception as exc:  # pylint: disable=broad-except
            outcomes[vmid] = exc

    threads = [threading.Thread(target=reboot, args=args) for args in ((200, "gpu-train-01"), (201, "gpu-train-02"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(getattr(outcome, "status", None) == "running" for outcome in outcomes.values()), outcomes

    seen = [path for _method, path in server.requests()]
    reboots = [i for i, path in enumerate(seen) if path.endswith("/status/reboot")]
    assert len(reboots) == 2
    first_vmid = seen[reboots[0]].split("/lxc/")[1].split("/")[0]
    # Everything the first reboot asked about its container (the task, the restart) came before
    # the second reboot was sent: the two never overlapped.
    assert not [path for path in seen[reboots[1]:] if f"/lxc/{first_vmid}/" in path or f":{first_vmid}:" in path]


# ------------------------------------------- one node's slots, whichever address of its API (issue 17, item 11)


def client_through(server, host: str, retry) -> ProxmoxClient:
    """A client of `server` through another name of the same address (the certificate holds both)."""
    return ProxmoxClient(ProxmoxConnection(host=host, port=server.port, user="root@pam", password=server.password,
                                           ca_path=server.pki.ca_path, timeout=2), retry=retry)


def standalone(answer):
    """/cluster/status of a node in no cluster: its own entry only, no entry of type cluster."""
    return [entry for entry in answer if entry.get("type") != "cluster"]


def hold_slot_through(client: ProxmoxClient, request: CtRebootRequest, server) -> tuple[threading.Thread, dict]:
    """A reboot through `client` that takes node pve1's slot and then waits for CT 200's config lock
    (held by a snapshot) to clear; returns once it waits there, holding the slot."""
    outcome: dict[str, object] = {}
    config_reads = len(server.requests("GET", "/lxc/200/config"))

    def reboot() -> None:
        try:
            outcome["result"] = CtRebooter(client, request, api=client.connection.url).run()
        except Exception as exc:  # pylint: disable=broad-except
            outcome["error"] = exc

    thread = threading.Thread(target=reboot)
    thread.start()
    # One config read before the slot, then the lock wait's: a second one means it holds the slot.
    wait_until(lambda: len(server.requests("GET", "/lxc/200/config")) >= config_reads + 2 or not thread.is_alive(),
               timeout=30, what="the first reboot to wait for the lock with its slot")
    assert thread.is_alive(), outcome
    return thread, outcome


@pytest.mark.parametrize("cluster", ["cluster", "standalone"])
def test_two_api_addresses_of_one_node_share_its_slots(api, server, pve_retry, tmp_path, cluster):
    """127.0.0.1 and localhost are two URLs of one API: the second reboot of node pve1 waits for the
    first one's slot instead of getting a slot set of its own (it used to: slots were keyed by URL)."""
    if cluster == "standalone":
        server.rewrite_answer("GET", "/cluster/status", standalone)
    through_localhost = client_through(server, "localhost", pve_retry)
    assert through_localhost.connection.url != api.connection.url
    server.call(server.pve.snapshot_lock, 200)
    first = CtRebootRequest(200, expected_hostname="gpu-train-01", slot_dir=str(tmp_path), lock_timeout=60)
    thread, outcome = hold_slot_through(api, first, server)
    try:
        second = CtRebootRequest(200, expected_hostname="gpu-train-01", slot_dir=str(tmp_path), slot_timeout=0.5,
                                 lock_timeout=0.5)
        with pytest.raises(NoFreeSlot, match="all 1 reboot slot.*node pve1"):
            CtRebooter(through_localhost, second, api=through_localhost.connection.url).run()
    finally:
        server.call(server.pve.unlock, 200)
        thread.join(60)
    assert getattr(outcome.get("result"), "status", None) == "running", outcome
    assert len(server.requests("POST", "/status/reboot")) == 1


def test_two_reboots_of_one_node_through_two_addresses_never_overlap(api, server, pve_retry, tmp_path):
    server.call(server.pve.add_ct, 201, "gpu-train-02", status="running")
    clients = {200: api, 201: client_through(server, "localhost", pve_retry)}
    outcomes: dict[int, object] = {}

    def reboot(vmid: int, hostname: str) -> None:
        client = clients[vmid]
        request = CtRebootRequest(vmid, expected_hostname=hostname, slot_dir=str(tmp_path), node_slots=1)
        try:
            outcomes[vmid] = CtRebooter(client, request, api=client.connection.url).run()
        except Exception as exc:  # pylint: disable=broad-except
            outcomes[vmid] = exc

    threads = [threading.Thread(target=reboot, args=args) for args in ((200, "gpu-train-01"), (201, "gpu-train-02"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(getattr(outcome, "status", None) == "running" for outcome in outcomes.values()), outcomes
    seen = [path for _method, path in server.requests()]
    reboots = [i for i, path in enumerate(seen) if path.endswith("/status/reboot")]
    assert len(reboots) == 2
    first_vmid = seen[reboots[0]].split("/lxc/")[1].split("/")[0]
    assert not [path for path in seen[reboots[1]:] if f"/lxc/{first_vmid}/" in path or f":{first_vmid}:" in path]


LYING_NAMES = ["../../../../tmp/escaped", "/", "..", "", "x" * 1_000_000, "a/b\0c\x1b[31m"]


@pytest.mark.parametrize("name", LYING_NAMES, ids=["dotdot-path", "slash", "dotdot", "empty", "huge", "controls"])
def test_a_cluster_name_that_lies_keeps_the_slot_files_inside_slot_dir(api, server, pve_retry, tmp_path, name):
    slot_dir = tmp_path / "slots"
    server.call(setattr, server.pve, "cluster_name", name)
    server.call(server.pve.snapshot_lock, 200)
    first = CtRebootRequest(200, expected_hostname="gpu-train-01", slot_dir=str(slot_dir), lock_timeout=60)
    thread, outcome = hold_slot_through(api, first, server)
    try:
        through_localhost = client_through(server, "localhost", pve_retry)
        second = CtRebootRequest(200, expected_hostname="gpu-train-01", slot_dir=str(slot_dir), slot_timeout=0.3,
                                 lock_timeout=0.3)
        with pytest.raises(NoFreeSlot):  # still one node, whatever its cluster is called
            CtRebooter(through_localhost, second, api=through_localhost.connection.url).run()
    finally:
        server.call(server.pve.unlock, 200)
        thread.join(60)
    assert getattr(outcome.get("result"), "status", None) == "running", outcome
    assert sorted(path.name for path in tmp_path.iterdir()) == ["slots"]  # nothing beside it
    assert not Path("/tmp/escaped").exists()
    files = list(slot_dir.iterdir())
    assert len(files) == 1 and files[0].is_file() and not files[0].is_symlink()
    assert files[0].name.startswith("pve1-") and len(files[0].name) < 64


@pytest.mark.parametrize("answer", [{"type": "cluster", "name": "fakecluster"}, [["cluster"]], [{"type": "cluster", "name": 42}]],
                         ids=["not-a-list", "entries-not-objects", "name-not-text"])
def test_a_cluster_status_of_the_wrong_shape_is_a_node_in_no_cluster(api, server, answer):
    server.rewrite_answer("GET", "/cluster/status", lambda _data: answer)

    status = read_cluster_status(api)

    assert status.readable and status.name is None
    assert slot_scope(api, status, api.connection.url, "pve1").kind == "standalone"


def test_a_node_in_no_cluster_is_told_apart_by_its_certificate(api, server):
    """Separate machines in no cluster are often all called pve: the fingerprint keeps their slots apart."""
    server.rewrite_answer("GET", "/cluster/status", standalone)
    fingerprint = next(node["ssl_fingerprint"] for node in api.get("nodes") if node["node"] == "pve1")

    scope = slot_scope(api, read_cluster_status(api), api.connection.url, "pve1")

    assert scope == SlotScope("standalone", fingerprint) and fingerprint
    assert slot_prefix(scope, "pve") != slot_prefix(SlotScope("standalone", "another certificate"), "pve")
    assert slot_prefix(scope, "pve") != slot_prefix(SlotScope("cluster", fingerprint), "pve")


def test_without_sys_audit_the_slots_fall_back_to_the_api_url_and_say_so(api, server, tmp_path):
    server.call(server.pve.fail, "GET", "/cluster/status", 403, "Permission check failed (/, Sys.Audit)")
    assert not read_cluster_status(api).readable

    request = CtRebootRequest(200, expected_hostname="gpu-train-01", slot_dir=str(tmp_path))
    result = CtRebooter(api, request, api=api.connection.url).run()

    assert result.status == "running" and result.node_slot is not None
    assert any("may not read /cluster/status (Sys.Audit on /)" in warning for warning in result.warnings)
    assert [path.name for path in tmp_path.iterdir()] == [f"{slot_prefix(SlotScope('api', api.connection.url), 'pve1')}.0.lock"]
