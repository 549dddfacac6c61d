"""The container_reset role: the API reboot delegated to the controller, then back into the container.

The host is the real LXC container behind fakepve, reached with community.docker.nsenter. Its init
pid changes with every start, so the inventory looks it up (lxc-info) each time the connection is
made: after the reboot, wait_for_connection really reaches the new container.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.fakepve_lxc import ProxmoxLab, proxmox_lab
from tests.harness.playbook import PlaybookRun, run_playbook

pytestmark = [
    pytest.mark.lxc,
    pytest.mark.skipif(shutil.which("lxc-start") is None, reason="lxc-start is missing (make apt installs lxc)"),
]

HOSTNAME = "gpu-train-01"
ROLE_TASK = "gpuops.relaunch.container_reset : "


@pytest.fixture
def lab(tmp_path) -> Iterator[ProxmoxLab]:
    with proxmox_lab(tmp_path, vmid=200, hostname=HOSTNAME, time_scale=0.01) as running:
        yield running


def write_inventory(lab: ProxmoxLab, path, host: str = HOSTNAME) -> str:
    """A YAML (here JSON) inventory whose host is the container, found afresh at every connection."""
    path.write_text(json.dumps({"all": {"hosts": {host: lab.container.nsenter_host_vars()}}}), encoding="utf-8")
    return str(path)


def reset_play(lab: ProxmoxLab, **role_vars: Any) -> list[dict[str, Any]]:
    api = lab.module_args()
    role_vars = {
        "container_reset_vmid": lab.vmid,
        "container_reset_api_host": api["api_host"],
        "container_reset_api_port": str(api["api_port"]),
        "container_reset_api_user": api["api_user"],
        "container_reset_api_password": api["api_password"],
        "container_reset_ca_path": api["ca_path"],
        "container_reset_controller_python": sys.executable,
        "container_reset_connect_timeout": 60,
        **role_vars,
    }
    return [
        {
            "hosts": "all",
            "gather_facts": False,
            "tasks": [
                {"name": "Reset", "ansible.builtin.include_role": {"name": "gpuops.relaunch.container_reset"},
                 "vars": role_vars},
                {"name": "Hostname inside", "ansible.builtin.command": "hostname", "changed_when": False},
            ],
        }
    ]


def reboot_result(run: PlaybookRun) -> dict[str, Any]:
    return run.result(ROLE_TASK + "Reboot the container through the Proxmox API")


def test_reset_reboots_the_container_and_reaches_it_again(lab, tmp_path):
    zombie = lab.container.make_zombie()
    old_init = lab.container.init_id

    run = run_playbook(reset_play(lab, container_reset_allowed=True), inventory=write_inventory(lab, tmp_path / "inv.json"),
                       timeout=300)

    assert run.rc == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = reboot_result(run)
    assert result["changed"] and result["hostname"] == HOSTNAME
    assert result["invocation"]["module_args"]["expected_hostname"] == HOSTNAME
    assert not run.result(ROLE_TASK + "Wait until the host answers again").get("failed")
    assert run.result("Hostname inside")["stdout"] == HOSTNAME
    assert lab.container.init_id != old_init
    assert not lab.container.exists(zombie)


def test_reset_does_nothing_unless_allowed(lab, tmp_path):
    old_init = lab.container.init_id

    run = run_playbook(reset_play(lab), inventory=write_inventory(lab, tmp_path / "inv.json"), timeout=300)

    assert run.rc == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert reboot_result(run).get("skipped")
    assert lab.server.requests() == []
    assert lab.container.init_id == old_init


def test_reset_refuses_a_container_that_is_not_this_host(lab, tmp_path):
    old_init = lab.container.init_id
    inventory = write_inventory(lab, tmp_path / "inv.json", host="gpu-train-02")

    run = run_playbook(reset_play(lab, container_reset_allowed=True), inventory=inventory, timeout=300)

    assert run.rc != 0
    result = reboot_result(run)
    assert result["failed"] and "not the expected 'gpu-train-02'" in result["msg"]
    assert lab.server.requests("POST", "/lxc/") == []
    assert lab.container.init_id == old_init


def test_reset_without_an_expected_hostname_stops_before_the_module(lab, tmp_path):
    old_init = lab.container.init_id

    run = run_playbook(reset_play(lab, container_reset_allowed=True, container_reset_expected_hostname=""),
                       inventory=write_inventory(lab, tmp_path / "inv.json"), timeout=300)

    assert run.rc != 0
    check = run.result(ROLE_TASK + "Check that the container to reset is named")
    assert check["failed"] and "container_reset_expected_hostname is empty" in check["msg"]
    assert ROLE_TASK + "Reboot the container through the Proxmox API" not in run.tasks
    assert lab.server.requests() == []
    assert lab.container.init_id == old_init


def test_reset_with_a_newline_in_the_password_fails_without_showing_it(lab, tmp_path):
    old_init = lab.container.init_id
    play = reset_play(lab, container_reset_allowed=True, container_reset_api_password=lab.password + "\n")

    run = run_playbook(play, inventory=write_inventory(lab, tmp_path / "inv.json"), timeout=300,
                       env={"ANSIBLE_STDOUT_CALLBACK": "default"}, extra_args=["-v"])

    assert run.rc != 0
    assert lab.password not in run.stdout + run.stderr
    assert "api_password: contains a control character" in run.stdout
    assert lab.server.requests() == []
    assert lab.container.init_id == old_init
