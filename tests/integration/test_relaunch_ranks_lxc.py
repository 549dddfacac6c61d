"""A multi-rank job in two real LXC containers behind fakepve, reached with gpuops.relaunch.pct_ssh.

Two containers of one node (pve1) are the two ranks of one job, reached the production way: the
collection's pct_ssh connection to the test sshd (tests/harness/pct_sshd.py), which runs
``pct exec VMID`` for each. Rank 0's container holds a stale run whose zombies only a reboot clears
(its init never reaps): the relaunch ends the run, reboots that container through the API (and only
that one), and only then launches both ranks, each with its rank environment. Then rank 1's new
spec cannot start, and no rank is left running, while an independent job in a third container of
the same node relaunches all the same.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# Fixtures and set-up of the single-container end-to-end test, shared rather than copied: the
# lab (fakepve + CT 200) and the session's test sshd.
from tests.integration.test_relaunch_e2e import (  # pylint: disable=unused-import
    HOSTNAME,
    RELAUNCH,
    VMID,
    explain,
    install_demo_files,
    job_processes,
    lab,
    needs_sshd,
    pct_host,
    pct_ssh,
    posts,
    relaunch_vars,
    running_job,
    start_stale_run,
)
from tests.harness.playbook import run_playbook
from tests.harness.procstates import wait_until

pytestmark = [
    pytest.mark.lxc,
    pytest.mark.skipif(shutil.which("lxc-start") is None, reason="lxc-start is missing (make apt installs lxc)"),
]

RANK1 = "gpu-train-02"
RANK1_VMID = 201
RANKS = [HOSTNAME, RANK1]
SOLO = "gpu-train-03"  # an independent job in a third container of the node
SOLO_VMID = 202


def environ(container, pid: int) -> dict[str, str]:
    del container
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@needs_sshd
def test_two_containers_as_one_job_one_reboot_then_both_ranks_launch(lab, pct_host, tmp_path):  # pylint: disable=redefined-outer-name
    second = lab.add_container(RANK1_VMID, RANK1, node=lab.node)
    solo = lab.add_container(SOLO_VMID, SOLO, node=lab.node)
    for bridged, vmid in ((second, RANK1_VMID), (solo, SOLO_VMID)):
        install_demo_files(bridged.container)
        pct_host.register(vmid, bridged.container.lxcpath)
    # A short directory: a Unix socket's path is limited to 107 bytes, and pytest's tmp_path is long.
    control = Path(tempfile.mkdtemp(prefix="cp-"))
    try:
        hosts = {}
        for name, vmid in ((HOSTNAME, VMID), (RANK1, RANK1_VMID)):
            hosts[name] = {
                **pct_host.pct_ssh_host_vars(vmid, control),
                **relaunch_vars(lab, reset_allowed=True),
                "container_reset_vmid": vmid,
                "job_launch_ranks": RANKS,
            }
        hosts[HOSTNAME]["job_launch_master_addr"] = "10.10.0.1"
        hosts[SOLO] = {**pct_host.pct_ssh_host_vars(SOLO_VMID, control), **relaunch_vars(lab, reset_allowed=False),
                       "container_reset_vmid": SOLO_VMID}
        inventory = tmp_path / "inv.json"

        def relaunch(**extra) -> tuple:
            inventory.write_text(json.dumps({"all": {"hosts": hosts}}), encoding="utf-8")
            run = run_playbook(RELAUNCH, inventory=str(inventory), env=pct_host.environment(), timeout=600,
                               extra_vars={"relaunch_summary_dir": str(tmp_path), **extra})
            fleet_file = tmp_path / "fleet.json"
            assert fleet_file.exists(), explain(run)
            return run, json.loads(fleet_file.read_text(encoding="utf-8"))

        stale = start_stale_run(lab.container)
        rank0_init, rank1_init = lab.container.init_id, second.container.init_id
        pct_calls = pct_host.pct_calls() if hasattr(pct_host, "pct_calls") else None

        run, fleet = relaunch()

        assert run.rc == 0, explain(run)
        # Only rank 0's container needed the reboot, and only it was rebooted, through the API.
        assert posts(lab) == [("POST", f"/api2/json/nodes/{lab.node}/lxc/{VMID}/status/reboot")]
        assert lab.container.init_id != rank0_init and second.container.init_id == rank1_init
        assert not any(lab.container.exists(ident) for ident in stale.all())
        # Both ranks launched after it, each with its rank environment.
        for index, (name, container) in enumerate(((HOSTNAME, lab.container), (RANK1, second.container))):
            report = run.summary(name)
            assert report["relaunched"] is True and report["rank"]["index"] == index, report
            job = running_job(container, report["job"])
            env = environ(container, job.pid)
            assert (env["MASTER_ADDR"], env["NODE_RANK"], env["NNODES"]) == ("10.10.0.1", str(index), "2")
        assert fleet["jobs"][HOSTNAME] == {"ranks": RANKS, "relaunched": RANKS, "failed": []}
        assert fleet["hosts"][HOSTNAME]["container_reset"] is True and fleet["hosts"][RANK1]["container_reset"] is False
        assert fleet["hosts"][SOLO]["status"] == "relaunched" and fleet["hosts"][SOLO]["rank"] is None
        solo_job = running_job(solo.container, run.summary(SOLO)["job"])
        if pct_calls is not None:
            assert pct_host.pct_calls() > pct_calls

        # Rank 1's new spec ends before it is ready: rank 0, started, is stopped again. The
        # independent job, forced too, relaunches all the same: one failed job stops no other.
        hosts[RANK1]["job_launch_command"] = hosts[RANK1]["job_launch_command"] + [
            "--ready-after", "5", "--exit-after", "0.2", "--exit-code", "3"]
        run, fleet = relaunch(relaunch_force=True, relaunch_hosts="all")

        assert run.rc != 0
        for container in (lab.container, second.container):
            wait_until(lambda c=container: job_processes(c) == [], what="no rank's job to be left running")
        assert [fleet["hosts"][name]["status"] for name in RANKS] == ["failed", "failed"]
        assert fleet["hosts"][SOLO]["status"] == "relaunched" and fleet["counts"]["failed"] == 2
        assert running_job(solo.container, run.summary(SOLO)["job"]) != solo_job
        assert len(posts(lab)) == 1  # nothing called for another reboot
    finally:
        pct_host.unregister(RANK1_VMID)
        pct_host.unregister(SOLO_VMID)
        for socket in control.iterdir():  # the connection's masters persist: ask each to exit
            subprocess.run(["ssh", "-S", str(socket), "-O", "exit", "ignored"], capture_output=True, timeout=30, check=False)
        shutil.rmtree(control, ignore_errors=True)
