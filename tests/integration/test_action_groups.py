"""meta/runtime.yml's action group: module_defaults for group/gpuops.relaunch.proxmox reach
proxmox_ct_reboot; community.proxmox's own group does not (a collection cannot join another's).

No API is needed: the defaults carry an invalid api_timeout, so the module stops at its option check,
before any request, and says so naming the option that only the group gave it.
"""

from __future__ import annotations

import sys

from tests.harness.playbook import run_playbook

CONNECTION = {
    "api_host": "pve.invalid",
    "api_user": "ops@pve",
    "api_token_id": "relaunch",
    "api_token_secret": "not-a-secret",
    "api_timeout": 0,
}
TASK = {"gpuops.relaunch.proxmox_ct_reboot": {"vmid": 200, "expected_hostname": "gpu-train-01"}, "ignore_errors": True}


def test_module_defaults_reach_the_module_through_the_group(monkeypatch) -> None:
    # No PROXMOX_* fallbacks from the caller's environment.
    for name in ("PROXMOX_HOST", "PROXMOX_USER", "PROXMOX_TOKEN_ID", "PROXMOX_TOKEN_SECRET", "PROXMOX_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    plays = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {"ansible_python_interpreter": sys.executable},
            "tasks": [
                {"name": "ours", "module_defaults": {"group/gpuops.relaunch.proxmox": CONNECTION}, **TASK},
                {"name": "theirs", "module_defaults": {"group/community.proxmox.proxmox": CONNECTION}, **TASK},
            ],
        }
    ]
    run = run_playbook(plays, timeout=120)

    ours = run.result("ours")
    assert ours["failed"]
    assert [p["option"] for p in ours["option_problems"]] == ["api_timeout"], ours
    assert "api_timeout" in ours["msg"]

    theirs = run.result("theirs")
    assert theirs["failed"]
    assert "missing required arguments" in theirs["msg"] and "api_host" in theirs["msg"], theirs
