"""The per-node reboot slots: real flocks on real files, and two rebooters against fakepve at once.

A flock belongs to an open file description, so two opens in one process conflict exactly as two
processes do; the child-process test shows the kernel dropping the lock with its holder.
"""

from __future__ import annotations

import os
import stat
import threading

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import ProxmoxClient
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.ct_power import CtRebooter, CtRebootRequest
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.node_slots import (
    NoFreeSlot,
    SlotError,
    slot_prefix,
    take_slot,
)

API = "https://pve.example:8006"


def now() -> Deadline:
    """A deadline that has passed: one look at the slots, no waiting."""
    return Deadline(0)


def test_one_slot_per_node_is_held_until_released(tmp_path):
    first = take_slot(str(tmp_path), API, "pve1", 1, now())
    with pytest.raises(NoFreeSlot, match="all 1 reboot slot.*node pve1.*slot_timeout.*nothing was changed"):
        take_slot(str(tmp_path), API, "pve1", 1, now())
    first.release()
    again = take_slot(str(tmp_path), API, "pve1", 1, now())
    assert (again.node, again.index, again.waited) == ("pve1", 0, 0.0)  # free at once: no wait, no second look
    again.release()


def test_n_slots_admit_n_reboots_and_nodes_and_clusters_do_not_share(tmp_path):
    held = [take_slot(str(tmp_path), API, "pve1", 2, now()), take_slot(str(tmp_path), API, "pve1", 2, now())]
    assert sorted(slot.index for slot in held) == [0, 1]
    with pytest.raises(NoFreeSlot):
        take_slot(str(tmp_path), API, "pve1", 2, now())
    other_node = take_slot(str(tmp_path), API, "pve2", 1, now())
    other_cluster = take_slot(str(tmp_path), "https://other:8006", "pve1", 1, now())
    for slot in [*held, other_node, other_cluster]:
        slot.release()


def test_the_kernel_drops_a_slot_with_the_process_that_held_it(tmp_path):
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's side
        os.close(go_w)  # or its own copy would keep the pipe open and the read below would never end
        os.close(ready_r)
        take_slot(str(tmp_path), API, "pve1", 1, now())
        os.write(ready_w, b"x")
        os.read(go_r, 1)  # returns when the parent closes its end
        os._exit(0)  # pylint: disable=protected-access
    os.close(ready_w)
    os.close(go_r)
    assert os.read(ready_r, 1) == b"x"
    with pytest.raises(NoFreeSlot):
        take_slot(str(tmp_path), API, "pve1", 1, now())
    os.close(go_w)
    os.waitpid(child, 0)
    take_slot(str(tmp_path), API, "pve1", 1, now()).release()


def test_the_directory_is_made_private(tmp_path):
    directory = tmp_path / "a" / "slots"
    take_slot(str(directory), API, "pve1", 1, now()).release()
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
    with pytest.raises(SlotError, match="slot_dir"):
        take_slot(str(target), API, "pve1", 1, now())


@pytest.mark.parametrize("make", ["symlink", "fifo"])
def test_a_slot_file_that_is_not_a_regular_file_is_refused(tmp_path, make):
    directory = tmp_path / "slots"
    directory.mkdir(mode=0o700)
    slot_file = directory / f"{slot_prefix(API, 'pve1')}.0.lock"
    if make == "symlink":
        slot_file.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(slot_file)
    with pytest.raises(SlotError, match="slot_dir: .*slot file"):
        take_slot(str(directory), API, "pve1", 1, now())
    assert not (tmp_path / "elsewhere").exists()


def test_the_prefix_keeps_a_hostile_node_name_inside_the_directory():
    prefix = slot_prefix(API, "../../etc/passwd")
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
    held = take_slot(str(tmp_path), API, "pve1", 1, now())
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
