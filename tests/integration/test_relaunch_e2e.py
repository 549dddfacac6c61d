"""End to end, the production way: playbooks/relaunch.yml against a real LXC container.

The host is a real LXC container behind fakepve (tests/harness/fakepve_lxc.py), reached the way
a Proxmox node is reached: community.proxmox.proxmox_pct_remote logs in to a real sshd on
127.0.0.1 (tests/harness/pct_sshd.py) and runs ``/usr/sbin/pct exec 200 -- ...``, which the test
sshd hands to a ``pct`` shim that runs ``lxc-attach`` as pct does. The container reset goes to the
fake's API over HTTPS, the certificate checked against its CA, and the fake really restarts the
container.

Inside, the container's init never reaps, and the demo job's last run died badly
(playbooks/files/demo_stale_run.py): a hung main process, a zombie worker and a zombie leader with
a live thread. Ending that run orphans its zombies to the non-reaping init, where only a reboot
clears them; the relaunch sees that, reboots through the API, and starts the demo job
(playbooks/files/demo_train.py, copied into the container's rootfs) under the supervisor.

The scenario that needs no API call (a host not allowed to reset) reaches the same kind of
container the lighter way, with community.docker.nsenter.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
import pytest

from tests.harness.fakepve_lxc import LxcContainer, ProcId, ProxmoxLab, proc_id, proxmox_lab
# pct_ssh is a pytest fixture: importing it is what makes it available to the tests here.
from tests.harness.pct_sshd import SSHD, PctSshd, pct_ssh  # pylint: disable=unused-import
from tests.harness.playbook import REPO, PlaybookRun, run_playbook
from tests.harness.procstates import host_pid, state_of

pytestmark = [
    pytest.mark.lxc,
    pytest.mark.skipif(shutil.which("lxc-start") is None, reason="lxc-start is missing (make apt installs lxc)"),
]

needs_sshd = pytest.mark.skipif(
    not Path(SSHD).exists() or shutil.which("ssh-keygen") is None,
    reason="sshd or ssh-keygen is missing (make apt installs openssh-server)",
)

HOSTNAME = "gpu-train-01"
VMID = 200
RELAUNCH = str(REPO / "playbooks" / "relaunch.yml")
DEMO_FILES = REPO / "playbooks" / "files"
# Where the demo files sit inside the container (its rootfs is a directory of the lab).
IN_CT_FILES = "/opt/gpuops-demo/playbooks/files"
IN_CT_LOG_DIR = "/var/log/gpuops"
IN_CT_LOG = IN_CT_LOG_DIR + "/train.log"

SUMMARY = "Summarize"
# The relaunch role's steps (tests/harness/playbook.py finds "ROLE : NAME" by NAME).
PROBE = "Look at the job, decide, and relaunch a job of one host"
REBOOT = "gpuops.relaunch.container_reset : Reboot the container through the Proxmox API"
RESET_BLOCK = "Reboot the container, where only that helps and the inventory allows it"  # the include
DRAIN_AGAIN = "Wait again for the GPUs"


# ------------------------------------------------------------------------------------ set-up


def install_demo_files(container: LxcContainer) -> None:
    """Put the demo job where the container sees it (its log directory is left to the relaunch)."""
    target = container.rootfs / IN_CT_FILES.lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("demo_train.py", "demo_stale_run.py"):
        shutil.copy2(DEMO_FILES / name, target / name)


@pytest.fixture
def lab(tmp_path) -> Iterator[ProxmoxLab]:
    """fakepve over HTTPS with container 200 (gpu-train-01, non-reaping init) bridged to real LXC."""
    with proxmox_lab(tmp_path / "lab", vmid=VMID, hostname=HOSTNAME, time_scale=0.01) as running:
        install_demo_files(running.container)
        yield running


@pytest.fixture
def pct_host(lab: ProxmoxLab, pct_ssh: PctSshd) -> Iterator[PctSshd]:  # pylint: disable=redefined-outer-name
    """The session's test sshd, with `pct exec 200` reaching the lab's container."""
    pct_ssh.register(VMID, lab.container.lxcpath)
    try:
        yield pct_ssh
    finally:
        pct_ssh.unregister(VMID)


def relaunch_vars(lab: ProxmoxLab, reset_allowed: bool) -> dict[str, Any]:
    """The relaunch's inventory variables for the container: the demo job, and the fake's API."""
    api = lab.module_args()
    return {
        "job_launch_name": "demo-train",
        "job_launch_command": ["python3", IN_CT_FILES + "/demo_train.py", "--workers", "2"],
        "job_launch_backend": "supervisor",
        "job_launch_log_path": IN_CT_LOG,
        "job_launch_state_dir": "/var/lib/gpuops",
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 1,
        "job_launch_startup_timeout": 60,
        "job_launch_term_timeout": 5,
        "process_cleanup_match": [r"/playbooks/files/demo_train\.py\b"],
        "process_cleanup_term_timeout": 5,
        # The container's init never reaps: no need to watch its orphans for long.
        "process_cleanup_orphan_grace": 1.0,
        "process_cleanup_reap_timeout": 2,
        "gpu_drain_gpus_required": False,
        "gpu_drain_timeout": 10,
        "container_reset_allowed": reset_allowed,
        "container_reset_vmid": lab.vmid,
        "container_reset_api_host": api["api_host"],
        "container_reset_api_port": str(api["api_port"]),
        "container_reset_api_user": api["api_user"],
        "container_reset_api_password": api["api_password"],
        "container_reset_validate_certs": True,
        "container_reset_ca_path": api["ca_path"],
        "container_reset_api_timeout": 5,
        "container_reset_timeout": 10,
        "container_reset_wait_timeout": 60,
        "container_reset_connect_timeout": 60,
    }


def write_inventory(path: Path, connection_vars: dict[str, Any], lab: ProxmoxLab, reset_allowed: bool) -> str:
    """A YAML (here JSON) inventory with the container as its one host, named as its PVE hostname."""
    host = {**connection_vars, **relaunch_vars(lab, reset_allowed)}
    path.write_text(json.dumps({"all": {"hosts": {HOSTNAME: host}}}), encoding="utf-8")
    return str(path)


@dataclass(frozen=True)
class StaleRun:
    """The processes a badly dead run of the demo job left in the container (host pids)."""

    main: ProcId
    zombie: ProcId
    zombie_leader: ProcId
    ns_main: int  # the main process's pid inside the container

    def all(self) -> list[ProcId]:
        return [self.main, self.zombie, self.zombie_leader]


def start_stale_run(container: LxcContainer) -> StaleRun:
    """Run demo_stale_run.py inside, the way a hand-launched run was started with pct exec."""
    proc = container.attach(["/usr/bin/python3", IN_CT_FILES + "/demo_stale_run.py", IN_CT_FILES + "/demo_train.py"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    init = container.init_pid
    assert init is not None
    found = {key: proc_id(host_pid(init, report[key])) for key in ("main", "zombie", "zombie_leader")}
    assert all(found.values()), found
    stale = StaleRun(**found, ns_main=report["main"])  # type: ignore[arg-type]
    assert state_of(stale.zombie.pid) == "Z" and state_of(stale.zombie_leader.pid) == "Z"
    return stale


# ------------------------------------------------------------------------------------ reading


def summary(run: PlaybookRun) -> dict[str, Any]:
    return run.summary()


def stats(run: PlaybookRun) -> dict[str, int]:
    return json.loads(run.stdout)["stats"][HOSTNAME]


def explain(run: PlaybookRun) -> str:
    return f"rc={run.rc}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"


def posts(lab: ProxmoxLab) -> list[tuple[str, str]]:
    return lab.server.requests("POST", "/lxc/")


def job_processes(container: LxcContainer) -> list[ProcId]:
    """Processes inside whose command line names the demo job."""
    found = []
    for ident in container.processes():
        try:
            cmdline = Path(f"/proc/{ident.pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"demo_train.py" in cmdline:
            found.append(ident)
    return found


def running_job(container: LxcContainer, result: dict[str, Any]) -> ProcId:
    """The job the relaunch reported (its pid is the container's), checked to run the demo trainer."""
    init = container.init_pid
    assert init is not None
    ident = proc_id(host_pid(init, int(result["pid"])))
    assert ident is not None and state_of(ident.pid) not in (None, "Z")
    cmdline = Path(f"/proc/{ident.pid}/cmdline").read_bytes().split(b"\0")
    assert (IN_CT_FILES + "/demo_train.py").encode() in cmdline
    return ident


# ------------------------------------------------------------------------------------- tests


@needs_sshd
def test_relaunch_reboots_the_container_through_the_api_and_starts_the_job(lab, pct_host, tmp_path):
    stale = start_stale_run(lab.container)
    first_init = lab.container.init_id
    inventory = write_inventory(tmp_path / "inv.json", pct_host.host_vars(VMID), lab, reset_allowed=True)

    run = run_playbook(RELAUNCH, inventory=inventory, env=pct_host.environment(), timeout=400)

    assert run.rc == 0, explain(run)
    # The clean-up ended the stale run, and said that only a reboot clears its zombies.
    first_look = run.step("cleanup")
    assert first_look["escalation"] == "container_reboot", explain(run)
    # One reboot, through the API, of the container whose configured hostname was checked first.
    assert posts(lab) == [("POST", f"/api2/json/nodes/{lab.node}/lxc/{VMID}/status/reboot")]
    seen = lab.server.requests()
    config_read = seen.index(("GET", f"/api2/json/nodes/{lab.node}/lxc/{VMID}/config"))
    assert config_read < seen.index(posts(lab)[0])
    reboot = run.result(REBOOT)
    # After the reboot: looked again, and waited for the GPUs again.
    assert run.ran_step("drain") and not run.result(DRAIN_AGAIN).get("skipped"), explain(run)
    assert reboot["changed"] and reboot["hostname"] == HOSTNAME
    assert reboot["invocation"]["module_args"]["expected_hostname"] == HOSTNAME
    assert reboot["invocation"]["module_args"]["validate_certs"] is True
    # The container really restarted: the stale run and its zombies are gone for good.
    assert lab.container.starts == 2 and lab.container.init_id != first_init
    assert not any(lab.container.exists(ident) for ident in stale.all())
    # The job runs under the supervisor, proven ready; its log says so.
    launch = run.step("launch")
    assert launch["changed"] and launch["backend"] == "supervisor"
    assert launch["ready_line"].startswith("step 1 ")
    job = running_job(lab.container, launch)
    log = (lab.container.rootfs / IN_CT_LOG.lstrip("/")).read_text(encoding="utf-8")
    assert "step 1 " in log
    assert lab.container.zombies() == []
    report = summary(run)
    assert report["relaunched"] is True and report["container_reset"] is True
    # What the first look found, not the clean container the look after the reboot saw.
    assert report["found"] == first_look["found"]["escalation"] != "none", report
    assert stale.ns_main in report["ended"] and report["reasons"], report
    assert int(report["job"]["pid"]) == int(launch["pid"])
    # No stop: no supervised run of the job was found (the stale run is no supervised run).
    assert set(report["seconds"]) == {"cleanup", "drain", "container_reset", "launch"}, report

    # Once more: the job runs with the same spec, so nothing changes.
    again = run_playbook(RELAUNCH, inventory=inventory, env=pct_host.environment(), timeout=400)

    assert again.rc == 0, explain(again)
    assert stats(again)["changed"] == 0, explain(again)
    assert summary(again)["relaunched"] is False and summary(again)["container_reset"] is False
    assert summary(again)["found"].startswith("not looked") and summary(again)["ended"] == []
    assert len(posts(lab)) == 1 and lab.container.starts == 2
    assert lab.container.exists(job)
    assert job in job_processes(lab.container)


@needs_sshd
def test_check_mode_sends_no_post_and_starts_nothing(lab, pct_host, tmp_path):
    stale = start_stale_run(lab.container)
    before = set(lab.container.processes())
    inventory = write_inventory(tmp_path / "inv.json", pct_host.host_vars(VMID), lab, reset_allowed=True)

    run = run_playbook(RELAUNCH, inventory=inventory, env=pct_host.environment(), check=True, timeout=400)

    assert run.rc == 0, explain(run)
    # The reboot is announced (the hostname is read), never asked for: the only POST is the login.
    assert run.result(REBOOT)["changed"], explain(run)
    assert lab.server.requests("POST") == [("POST", "/api2/json/access/ticket")]
    assert lab.container.starts == 1
    assert set(lab.container.processes()) == before
    assert all(lab.container.exists(ident) for ident in stale.all())
    assert not (lab.container.rootfs / IN_CT_LOG_DIR.lstrip("/")).exists()  # not even the log directory
    assert run.step("launch")["msg"] == "would start the job with backend supervisor"
    report = summary(run)
    assert report["relaunched"] is False and report["would_relaunch"] is True and report["check_mode"] is True
    assert report["found"] == "container_reboot" and report["job"]["pid"] is None


@needs_sshd
def test_the_test_sshd_serves_pct_exec_only_as_a_node_does(lab, pct_host):
    """The way in the tests above rely on: `pct exec` reaches the container, the rest is refused."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(pct_host.home / ".ssh" / "known_hosts"))  # an unknown key fails the connect
    client.connect("127.0.0.1", port=pct_host.port, username="root", key_filename=str(pct_host.client_key),
                   look_for_keys=False, allow_agent=False, timeout=30)
    try:
        def run(command: str) -> tuple[int, str, str]:
            _stdin, stdout, stderr = client.exec_command(command, timeout=60)
            code = stdout.channel.recv_exit_status()
            return code, stdout.read().decode(), stderr.read().decode()

        code, out, _err = run(f"/usr/sbin/pct exec {VMID} -- /bin/sh -c 'hostname; echo \"$container\"'")
        assert (code, out.split()) == (0, [HOSTNAME, "lxc"])
        code, _out, err = run(f"/usr/sbin/pct stop {VMID}")
        assert code != 0 and "only 'pct exec VMID -- CMD...' is implemented" in err
        code, _out, err = run("/usr/sbin/pct exec 201 -- true")
        assert code != 0 and "201.conf' does not exist" in err
        code, _out, err = run("id")
        assert code != 0 and "runs only /usr/sbin/pct commands" in err
    finally:
        client.close()
    assert lab.container.starts == 1 and lab.server.requests() == []


# ----------------------------------------------------- the lighter way in: community.docker.nsenter
# The same kind of container, entered through its init's namespaces (no sshd, no pct): about three
# times faster per task, so the scenario that needs no API call at all runs this way.


def test_a_host_not_allowed_to_reset_stops_with_the_reason_and_sends_nothing(lab, tmp_path):
    stale = start_stale_run(lab.container)
    first_init = lab.container.init_id
    inventory = write_inventory(tmp_path / "inv.json", lab.container.nsenter_host_vars(), lab, reset_allowed=False)

    run = run_playbook(RELAUNCH, inventory=inventory, timeout=400)

    assert run.rc != 0, explain(run)
    blocked = run.step("clearance")
    assert blocked["blocked"] and not blocked["reset"], explain(run)
    assert "Only a container reboot helps (container_reset_allowed is false for this host)" in blocked["blocked"]
    assert summary(run)["failed"] == f"Check that nothing left blocks the launch: {blocked['blocked']}"
    assert RESET_BLOCK not in run.tasks and REBOOT not in run.tasks, explain(run)
    # The only train_launch that ran is the probe, which said what a start would do.
    assert run.result(PROBE)["probe"]["msg"] == "would start the job with backend supervisor" and not run.ran_step("launch")
    assert lab.server.requests() == []  # not even a login
    assert lab.container.init_id == first_init
    # The stale run was ended (the hung main process, the zombie leader's live thread), and what is
    # left are zombies of the non-reaping init, which only a reboot clears.
    assert all(lab.container.exists(ident) and state_of(ident.pid) == "Z" for ident in stale.all())
    assert os.listdir(f"/proc/{stale.zombie_leader.pid}/task") == [str(stale.zombie_leader.pid)]
    assert job_processes(lab.container) == []
