"""gpuops.relaunch.pct_ssh for real: the system OpenSSH client, a real sshd, a real LXC container.

The node is the test sshd of tests/harness/pct_sshd.py (key login on 127.0.0.1; every session runs
``/usr/sbin/pct ...`` through a ``pct`` shim that runs ``lxc-attach`` as pct does, and counts its
calls). The container is one real LXC container behind fakepve (tests/harness/fakepve_lxc.py),
shared by every test of this module; the relaunch at the end reboots it through the fake's API.

Each test has its own private control socket directory, and ends the shared connections it
left there with ``ssh -O exit`` through their sockets (never a signal by name).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.fakepve_lxc import ProxmoxLab, proxmox_lab
# pct_ssh is a pytest fixture: importing it is what makes it available to the tests here.
from tests.harness.pct_sshd import (  # pylint: disable=unused-import
    SSHD,
    PctSshd,
    pct_ssh,
    shared_connections,
    stop_shared_connections,
)
from tests.harness.playbook import PlaybookRun, run_playbook
from tests.integration.test_relaunch_e2e import (
    HOSTNAME,
    IN_CT_LOG,
    RELAUNCH,
    REBOOT,
    install_demo_files,
    job_processes,
    posts,
    relaunch_vars,
    running_job,
    start_stale_run,
)

pytestmark = [
    pytest.mark.lxc,
    pytest.mark.skipif(shutil.which("lxc-start") is None, reason="lxc-start is missing (make apt installs lxc)"),
    pytest.mark.skipif(
        not Path(SSHD).exists() or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None,
        reason="sshd, ssh or ssh-keygen is missing (make apt installs openssh-server)",
    ),
]

# Not the relaunch e2e tests' 200: the session's sshd serves both modules' containers by vmid.
VMID = 210
UNKNOWN_VMID = 299


# ------------------------------------------------------------------------------------ set-up


@pytest.fixture(scope="module")
def ct_lab(tmp_path_factory) -> Iterator[ProxmoxLab]:
    """One real container (gpu-train-01, vmid 210, non-reaping init) behind fakepve for the module."""
    with proxmox_lab(tmp_path_factory.mktemp("pct-ssh-lab"), vmid=VMID, hostname=HOSTNAME, time_scale=0.01) as lab:
        install_demo_files(lab.container)
        yield lab


@pytest.fixture(scope="module")
def node(ct_lab: ProxmoxLab, pct_ssh: PctSshd) -> Iterator[PctSshd]:  # pylint: disable=redefined-outer-name
    """The session's test sshd, with `pct exec 210` reaching the module's container."""
    pct_ssh.register(VMID, ct_lab.container.lxcpath)
    try:
        yield pct_ssh
    finally:
        pct_ssh.unregister(VMID)


@pytest.fixture
def control_dir() -> Iterator[Path]:
    """A private (0700) control socket directory, short enough for a socket path; every shared
    connection left in it is ended with ``ssh -O exit`` when the test ends."""
    directory = Path(tempfile.mkdtemp(prefix="pct-ssh-cp-", dir="/tmp"))
    try:
        yield directory
    finally:
        stop_shared_connections(directory)
        shutil.rmtree(directory, ignore_errors=True)


def inventory(path: Path, host_vars: dict[str, Any]) -> str:
    path.write_text(json.dumps({"all": {"hosts": {HOSTNAME: host_vars}}}), encoding="utf-8")
    return str(path)


def play(*tasks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"hosts": "all", "gather_facts": False, "tasks": list(tasks)}]


def explain(run: PlaybookRun) -> str:
    return f"rc={run.rc}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"


def logins(sshd: PctSshd) -> int:
    """SSH logins the test sshd accepted so far (it logs each at LogLevel VERBOSE)."""
    return len(re.findall(r"Accepted publickey for root", sshd.log()))


HOSTNAME_TASK = {"name": "hostname", "ansible.builtin.command": "hostname", "changed_when": False}
FACTS_TASK = {"name": "facts", "gpuops.relaunch.zombie_facts": {}}
PING_TASK = {"name": "ping", "ansible.builtin.ping": {}}


# ------------------------------------------------------------------------------------- tests


def test_a_pipelined_module_task_is_one_pct_exec_over_one_login(node, tmp_path, control_dir):
    inv = inventory(tmp_path / "inv.json", node.pct_ssh_host_vars(VMID, control_dir))
    calls, logged_in = node.pct_calls(vmid=VMID), logins(node)

    one = run_playbook(play(HOSTNAME_TASK), inventory=inv)

    assert one.rc == 0, explain(one)
    assert one.result("hostname")["stdout"] == HOSTNAME  # it ran inside the container
    assert node.pct_calls(vmid=VMID) - calls == 1, node.pct_call_log()

    calls = node.pct_calls(vmid=VMID)
    three = run_playbook(play(HOSTNAME_TASK, FACTS_TASK, PING_TASK), inventory=inv)

    assert three.rc == 0, explain(three)
    assert three.result("facts")["ansible_facts"]["zombie_facts"]["escalation"] == "none"
    assert three.result("ping")["ping"] == "pong"
    assert node.pct_calls(vmid=VMID) - calls == 3, node.pct_call_log()
    # Both playbooks went through one shared connection: one login, one control socket.
    assert logins(node) - logged_in == 1, node.log()[-3000:]
    assert len(shared_connections(control_dir)) == 1


def test_hosts_on_one_node_run_at_once_and_end_up_sharing_one_connection(node, tmp_path, control_dir):
    """Four inventory hosts (the same container, as four containers of one node would be), forks 4,
    no shared connection yet: the first tasks race to start one; every task still runs once."""
    hosts = {f"ct{n}": node.pct_ssh_host_vars(VMID, control_dir) for n in range(4)}
    inv = tmp_path / "inv.json"
    inv.write_text(json.dumps({"all": {"hosts": hosts}}), encoding="utf-8")
    calls = node.pct_calls(vmid=VMID)

    run = run_playbook(play(HOSTNAME_TASK, PING_TASK), inventory=str(inv), extra_args=["--forks", "4"])

    assert run.rc == 0, explain(run)
    assert sorted(r["_host"] for r in run.tasks["hostname"]) == sorted(hosts)
    assert {r["stdout"] for r in run.tasks["hostname"]} == {HOSTNAME}
    assert node.pct_calls(vmid=VMID) - calls == 8, node.pct_call_log()
    assert len(shared_connections(control_dir)) == 1


def test_copy_template_and_fetch_work_inside_the_container(node, ct_lab, tmp_path, control_dir):
    template = tmp_path / "train.env.j2"
    template.write_text("JOB={{ job_name }}\nVMID={{ proxmox_vmid }}\n", encoding="utf-8")
    fetched = tmp_path / "fetched"
    inv = inventory(tmp_path / "inv.json", node.pct_ssh_host_vars(VMID, control_dir))
    tasks = [
        {"name": "dir", "ansible.builtin.file": {"path": "/root/pct-ssh", "state": "directory", "mode": "0750"}},
        {"name": "copy", "ansible.builtin.copy": {"content": "hello from the controller\n",
                                                  "dest": "/root/pct-ssh/copied.txt", "mode": "0640"}},
        {"name": "template", "ansible.builtin.template": {"src": str(template), "dest": "/root/pct-ssh/train.env",
                                                          "mode": "0600"}},
        {"name": "fetch", "ansible.builtin.fetch": {"src": "/root/pct-ssh/train.env", "dest": str(fetched) + "/",
                                                    "flat": True}},
    ]

    run = run_playbook(play(*tasks), inventory=inv, extra_vars={"job_name": "demo-train"})

    assert run.rc == 0, explain(run)
    inside = ct_lab.container.rootfs / "root" / "pct-ssh"
    copied, rendered = inside / "copied.txt", inside / "train.env"
    assert copied.read_text(encoding="utf-8") == "hello from the controller\n"
    assert (copied.stat().st_mode & 0o7777, rendered.stat().st_mode & 0o7777) == (0o640, 0o600)
    assert rendered.read_text(encoding="utf-8") == f"JOB=demo-train\nVMID={VMID}\n"
    assert (fetched / "train.env").read_text(encoding="utf-8") == rendered.read_text(encoding="utf-8")
    assert run.result("copy")["changed"] and run.result("template")["changed"]

    again = run_playbook(play(*tasks[:3]), inventory=inv, extra_vars={"job_name": "demo-train"})

    assert again.rc == 0, explain(again)
    assert not any(again.result(name)["changed"] for name in ("dir", "copy", "template")), explain(again)


def test_an_unknown_host_key_is_refused_by_default(node, tmp_path, control_dir):
    """ansible.cfg here says host_key_checking = False: the plugin's own default still checks."""
    empty = tmp_path / "known_hosts"
    empty.write_text("", encoding="utf-8")
    host_vars = {**node.pct_ssh_host_vars(VMID, control_dir), "ansible_pct_ssh_known_hosts_file": str(empty)}
    calls, logged_in = node.pct_calls(), logins(node)

    run = run_playbook(play(PING_TASK), inventory=inventory(tmp_path / "inv.json", host_vars))

    assert run.rc != 0
    result = run.result("ping")
    assert result.get("unreachable"), explain(run)
    assert "Host key verification failed" in result["msg"]
    assert f"container {VMID} through root@127.0.0.1:{node.port}" in result["msg"]
    assert node.pct_calls() == calls and logins(node) == logged_in
    assert shared_connections(control_dir) == []
    assert empty.read_text(encoding="utf-8") == ""  # nothing recorded either

    # accept-new through ssh_extra_args (ssh keeps their value): the unknown key is accepted and recorded.
    accepted = run_playbook(
        play(PING_TASK),
        inventory=inventory(tmp_path / "inv2.json",
                            {**host_vars, "ansible_ssh_extra_args": "-o StrictHostKeyChecking=accept-new"}),
    )

    assert accepted.rc == 0, explain(accepted)
    server_key = node.known_hosts.read_text(encoding="utf-8").split()[2]
    assert server_key in empty.read_text(encoding="utf-8")  # (the name may be hashed: HashKnownHosts)

    # Switched off for this host, an unknown key is accepted too.
    stop_shared_connections(control_dir)
    other = tmp_path / "other_known_hosts"
    other.write_text("", encoding="utf-8")
    allowed = run_playbook(
        play(PING_TASK),
        inventory=inventory(tmp_path / "inv3.json", {**host_vars, "ansible_pct_ssh_known_hosts_file": str(other),
                                                     "ansible_pct_ssh_host_key_checking": False}),
    )

    assert allowed.rc == 0, explain(allowed)


def test_a_wrong_vmid_fails_with_pct_s_reason(node, tmp_path, control_dir):
    host_vars = {**node.pct_ssh_host_vars(VMID, control_dir), "proxmox_vmid": UNKNOWN_VMID}

    run = run_playbook(play(PING_TASK), inventory=inventory(tmp_path / "inv.json", host_vars))

    assert run.rc != 0
    result = run.result("ping")
    assert result.get("unreachable"), explain(run)
    assert f"could not run pct exec in container {UNKNOWN_VMID}" in result["msg"]
    assert f"Configuration file 'nodes/localhost/lxc/{UNKNOWN_VMID}.conf' does not exist" in result["msg"]


def test_verbose_output_names_neither_the_key_file_nor_a_password_nor_a_no_log_command(node, tmp_path, control_dir):
    canary = "pct-ssh-canary-password-4711"
    hidden = "pct-ssh-canary-no-log-0815"  # in the very command line of a raw task with no_log
    host_vars = {**node.pct_ssh_host_vars(VMID, control_dir), "ansible_password": canary}
    tasks = [HOSTNAME_TASK, {"name": "copy", "ansible.builtin.copy": {"content": "x\n", "dest": "/root/verbose.txt"}},
             {"name": "raw", "ansible.builtin.raw": f"echo {hidden} >/dev/null", "no_log": True}]

    run = run_playbook(play(*tasks), inventory=inventory(tmp_path / "inv.json", host_vars), extra_args=["-vvvv"],
                       env={"ANSIBLE_STDOUT_CALLBACK": "default"})

    output = run.stdout + run.stderr
    assert run.rc == 0, output[-6000:]
    assert "ESTABLISH PCT_SSH CONNECTION TO CONTAINER 210" in output  # -vvvv really logged the plugin
    assert "<private key file>" in output and "IdentityFile" in output
    assert str(node.client_key) not in output and node.client_key.name not in output
    assert canary not in output and hidden not in output
    assert "<command hidden: no_log>" in output


def test_reset_connection_stops_the_shared_connection(node, tmp_path, control_dir):
    inv = inventory(tmp_path / "inv.json", node.pct_ssh_host_vars(VMID, control_dir))
    logged_in = logins(node)

    run = run_playbook(play(PING_TASK, {"name": "reset", "ansible.builtin.meta": "reset_connection"},
                            {"name": "ping again", "ansible.builtin.ping": {}}), inventory=inv)

    assert run.rc == 0, explain(run)
    assert logins(node) - logged_in == 2  # the reset ended the first connection; the next task logged in anew


def test_the_relaunch_runs_end_to_end_through_it(node, ct_lab, tmp_path, control_dir):
    """playbooks/relaunch.yml the production way: a stale run whose zombies only a reboot clears,
    a reboot through the API, the demo job launched; then a second run with nothing to do, on the
    shared connection the first one left."""
    stale = start_stale_run(ct_lab.container)
    starts = ct_lab.container.starts
    host_vars = {**node.pct_ssh_host_vars(VMID, control_dir), **relaunch_vars(ct_lab, reset_allowed=True)}
    inv = inventory(tmp_path / "inv.json", host_vars)

    run = run_playbook(RELAUNCH, inventory=inv, timeout=400)

    assert run.rc == 0, explain(run)
    assert posts(ct_lab) == [("POST", f"/api2/json/nodes/{ct_lab.node}/lxc/{VMID}/status/reboot")]
    assert run.result(REBOOT)["changed"]
    assert ct_lab.container.starts == starts + 1
    assert not any(ct_lab.container.exists(ident) for ident in stale.all())
    launch = run.step("launch")
    assert launch["changed"] and launch["ready_line"].startswith("step 1 "), explain(run)
    job = running_job(ct_lab.container, launch)
    assert "step 1 " in (ct_lab.container.rootfs / IN_CT_LOG.lstrip("/")).read_text(encoding="utf-8")
    logged_in = logins(node)

    again = run_playbook(RELAUNCH, inventory=inv, timeout=400)

    assert again.rc == 0, explain(again)
    assert json.loads(again.stdout)["stats"][HOSTNAME]["changed"] == 0, explain(again)
    assert again.summary()["relaunched"] is False
    assert ct_lab.container.exists(job) and job in job_processes(ct_lab.container)
    assert len(posts(ct_lab)) == 1
    # (wait_for_connection after the reboot resets the connection, so the first run logged in twice.)
    assert logins(node) == logged_in, node.log()[-3000:]
