"""gpuops.relaunch.proxmox_ct_reboot through ansible-playbook, against fakepve over real HTTPS.

The API is fakepve (an independent fake of PVE, used as a test dependency) with a certificate
signed by a test CA that the module checks (validate_certs=true, ca_path). Its container 200 is a
real LXC container: an API reboot really kills every process in it, so a zombie that its
non-reaping init would keep for ever is gone afterwards.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.fakepve_lxc import ProxmoxLab, expire_tickets, make_pki, proxmox_lab
from tests.harness.playbook import run_playbook
from tests.harness.procstates import state_of, wait_until

pytestmark = [
    pytest.mark.lxc,
    pytest.mark.skipif(shutil.which("lxc-start") is None, reason="lxc-start is missing (make apt installs lxc)"),
]

MODULE = "gpuops.relaunch.proxmox_ct_reboot"
HOSTNAME = "gpu-train-01"
# PVE seconds to real ones: tasks really run asynchronously and are polled, but briefly.
TIME_SCALE = 0.01


def local_play(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One play on the controller, with the Python that has proxmoxer."""
    return [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {"ansible_python_interpreter": sys.executable},
            "tasks": tasks,
        }
    ]


def reboot(args: dict[str, Any], check: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the module once on the controller and return its result."""
    run = run_playbook(local_play([{"name": "reboot", MODULE: args, "ignore_errors": True}]), check=check, env=env,
                       timeout=300)
    return run.result("reboot")


@pytest.fixture
def lab(tmp_path) -> Iterator[ProxmoxLab]:
    with proxmox_lab(tmp_path, vmid=200, hostname=HOSTNAME, time_scale=TIME_SCALE) as running:
        yield running


def posts(lab: ProxmoxLab, action: str | None = None) -> list[str]:
    """Paths of the POSTs that change a container (login tickets left out)."""
    return [path for _method, path in lab.server.requests("POST", "/lxc/") if action is None or path.endswith(action)]


def assert_restarted(lab: ProxmoxLab, old_init, zombie=None) -> None:
    assert lab.container.running()
    assert lab.container.init_id != old_init, "the real container was not restarted"
    if zombie is not None:
        assert not lab.container.exists(zombie), "the zombie survived the reboot"


# ----------------------------------------------------------------------------------- the happy paths


def test_reboot_with_token_clears_a_zombie_nothing_inside_could_clear(lab):
    zombie = lab.container.make_zombie()
    old_init = lab.container.init_id
    secret = lab.server.add_token("root@pam", "relaunch")
    args = lab.module_args(vmid=200, expected_hostname=HOSTNAME, api_token_id="relaunch", api_token_secret=secret)
    del args["api_password"]

    result = reboot(args)

    assert not result.get("failed"), result.get("msg")
    assert result["changed"] is True
    assert result["node"] == "pve1" and result["vmid"] == 200 and result["hostname"] == HOSTNAME
    assert result["method"] == "reboot" and result["status"] == "running"
    assert [(t["type"], t["exitstatus"]) for t in result["tasks"]] == [("vzreboot", "OK")]
    assert result["tasks"][0]["upid"].startswith("UPID:pve1:")
    # elapsed is the collection's one name for the seconds, of the module and of each task.
    assert result["elapsed"] >= result["tasks"][0]["elapsed"] > 0
    assert "waited_s" not in result and "duration" not in result["tasks"][0]
    assert result["node_slot"]["node"] == "pve1" and result["node_slot"]["slot"] == 0  # one reboot per node at once
    assert_restarted(lab, old_init, zombie)
    assert lab.server.requests("POST", "/access/ticket") == []  # a token needs no login
    assert secret not in str(result)


def test_stop_start_with_ticket_login_from_environment(lab):
    zombie = lab.container.make_zombie()
    sleeper = lab.container.start_process(["/usr/bin/sleep", "1000"])
    old_init = lab.container.init_id

    result = reboot({"vmid": 200, "expected_hostname": HOSTNAME, "method": "stop_start", "api_timeout": 5},
                    env=lab.environment())

    assert not result.get("failed"), result.get("msg")
    assert [(t["type"], t["exitstatus"]) for t in result["tasks"]] == [("vzshutdown", "OK"), ("vzstart", "OK")]
    assert result["actions"] == ["shutdown(timeout=60)", "start"]
    assert_restarted(lab, old_init, zombie)
    assert not lab.container.exists(sleeper), "a process inside survived the stop"
    assert len(lab.server.requests("POST", "/access/ticket")) == 1


def test_node_is_found_through_cluster_resources(lab):
    other = lab.add_container(201, "gpu-train-02", node="pve2")
    old_init = other.container.init_id
    first_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=201, expected_hostname="gpu-train-02"))

    assert not result.get("failed"), result.get("msg")
    assert result["node"] == "pve2"
    assert posts(lab) == ["/api2/json/nodes/pve2/lxc/201/status/reboot"]
    assert other.container.init_id != old_init and other.container.running()
    assert lab.container.init_id == first_init, "the other container was touched"


def test_a_stopped_container_is_started(tmp_path):
    with proxmox_lab(tmp_path, hostname=HOSTNAME, time_scale=TIME_SCALE, running=False) as stopped:
        result = reboot(stopped.module_args(vmid=200, node="pve1", expected_hostname=HOSTNAME))
        assert not result.get("failed"), result.get("msg")
        assert result["status_before"] == "stopped" and result["actions"] == ["start"]
        assert [t["type"] for t in result["tasks"]] == ["vzstart"]
        assert stopped.container.running()


# -------------------------------------------------------------------------------------- the guards


def test_hostname_mismatch_is_refused_without_any_post(lab):
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname="gpu-train-99"))

    assert result["failed"]
    assert "'gpu-train-01', not the expected 'gpu-train-99'" in result["msg"]
    assert posts(lab) == []
    assert lab.container.init_id == old_init


def test_check_mode_reports_the_plan_and_sends_no_post(lab):
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, method="stop_start", force=True), check=True)

    assert not result.get("failed"), result.get("msg")
    assert result["changed"] is True
    assert result["node"] == "pve1" and result["status"] == "running" and result["status_before"] == "running"
    assert result["actions"] == ["shutdown(forceStop=1, timeout=60)", "start"]
    assert result["tasks"] == []
    assert posts(lab) == []
    assert lab.container.init_id == old_init


def test_lost_quorum_refuses_to_stop_the_container(lab):
    lab.server.call(lab.pve.lose_quorum)
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, method="stop_start"))

    assert result["failed"]
    assert "no quorum" in result["msg"]
    assert posts(lab) == []
    assert lab.container.init_id == old_init


def test_wrong_ca_is_a_clear_tls_error(lab, tmp_path):
    stranger = make_pki(tmp_path / "other-pki", name="other")

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, ca_path=stranger.ca_path))

    assert result["failed"]
    assert "TLS certificate verification failed" in result["msg"]
    assert stranger.ca_path in result["msg"] and "CERTIFICATE_VERIFY_FAILED" in result["msg"]
    assert "Traceback" not in result["msg"]
    assert lab.server.requests() == []


def test_bad_options_fail_clearly_before_any_request(lab):
    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, skiplock=True, timeout=400))

    assert result["failed"]
    assert "skiplock: true needs method=stop_start" in result["msg"]
    assert "wait_timeout: (300.0) must be greater than timeout (400)" in result["msg"]
    # Every problem at once, each naming its option, also as data.
    assert [p["option"] for p in result["option_problems"]] == ["wait_timeout", "skiplock"]
    assert lab.server.requests() == []


UNBOUNDED = [
    ("NaN wait_timeout", {"wait_timeout": "nan"}, "wait_timeout: must be a finite number of seconds, got nan"),
    ("infinite wait_timeout", {"wait_timeout": "inf"}, "wait_timeout: must be a finite number of seconds, got inf"),
    ("huge wait_timeout", {"wait_timeout": 1e12}, "wait_timeout: must be at least 0 and at most 86400 seconds"),
    ("NaN lock_timeout", {"lock_timeout": "nan"}, "lock_timeout: must be a finite number of seconds, got nan"),
    ("huge lock_timeout", {"lock_timeout": 1e12}, "lock_timeout: must be at least 0 and at most 86400 seconds"),
    ("huge timeout", {"timeout": 10**12}, "timeout: must be at least 0 and at most 86400 seconds"),
    ("zero api_timeout", {"api_timeout": 0}, "api_timeout: must be more than 0 and at most 86400 seconds, got 0"),
    ("huge api_timeout", {"api_timeout": 10**12}, "api_timeout: must be more than 0 and at most 86400 seconds"),
]


def test_unbounded_seconds_fail_naming_the_option_and_change_nothing(lab):
    old_init = lab.container.init_id
    tasks = [{"name": name, MODULE: lab.module_args(vmid=200, expected_hostname=HOSTNAME, **args), "ignore_errors": True}
             for name, args, _words in UNBOUNDED]

    run = run_playbook(local_play(tasks), timeout=300)

    for name, _args, words in UNBOUNDED:
        result = run.result(name)
        assert result.get("failed") is True, (name, result)
        assert words in result["msg"], (name, result["msg"])
        assert "Traceback" not in json.dumps(result), name
        assert result["tasks"] == [], name
    assert lab.server.requests() == []  # not even a login
    assert lab.container.init_id == old_init


# -------------------------------------------------------------------------------- the hostname guard


def test_missing_expected_hostname_is_refused_without_any_request(lab):
    old_init = lab.container.init_id

    for check in (False, True):
        result = reboot(lab.module_args(vmid=200), check=check)

        assert result["failed"]
        assert "expected_hostname: required" in result["msg"] and "skip_hostname_check=true" in result["msg"]
    assert lab.server.requests() == []
    assert lab.container.init_id == old_init


def test_skip_hostname_check_together_with_expected_hostname_is_refused(lab):
    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, skip_hostname_check=True))

    assert result["failed"] and "contradict" in result["msg"]
    assert lab.server.requests() == []


def test_skip_hostname_check_reboots_without_the_guard(lab):
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, skip_hostname_check=True))

    assert not result.get("failed"), result.get("msg")
    assert result["hostname"] == HOSTNAME and [t["type"] for t in result["tasks"]] == ["vzreboot"]
    assert_restarted(lab, old_init)


# -------------------------------------------------------------------------------------------- secrets


def secret_play(tmp_path, module_args: str) -> str:
    """A playbook file whose task takes `module_args` as written (YAML, so that a | block is one)."""
    playbook = tmp_path / "secret.yml"
    playbook.write_text(
        "- hosts: localhost\n"
        "  connection: local\n"
        "  gather_facts: false\n"
        f"  vars: {{ansible_python_interpreter: {sys.executable}}}\n"
        "  tasks:\n"
        "    - name: reboot\n"
        f"      {MODULE}:\n"
        + "".join(f"        {line}\n" for line in module_args.strip("\n").splitlines()),
        encoding="utf-8",
    )
    return str(playbook)


@pytest.mark.parametrize("option", ["api_token_secret", "api_password"])
def test_a_secret_with_a_trailing_newline_is_refused_and_never_shown(lab, tmp_path, option):
    old_init = lab.container.init_id
    secret = lab.server.add_token("root@pam", "relaunch") if option == "api_token_secret" else lab.password
    token = "api_token_id: relaunch\n" if option == "api_token_secret" else ""
    playbook = secret_play(tmp_path, (
        f"api_host: {lab.server.host}\napi_port: {lab.server.port}\napi_user: root@pam\n{token}"
        f"ca_path: {lab.pki.ca_path}\nvmid: 200\nexpected_hostname: {HOSTNAME}\n"
        f"{option}: |\n  {secret}\n"  # a YAML block scalar: the value ends with a newline
    ))

    # The default output at -v, as an operator sees it; and the JSON result.
    for env, args in (({"ANSIBLE_STDOUT_CALLBACK": "default"}, ["-v"]), ({}, [])):
        run = run_playbook(playbook, env=env, extra_args=args, timeout=300)
        output = run.stdout + run.stderr

        assert run.rc != 0
        assert secret not in output, output
        assert f"{option}: contains a control character" in output, output
        assert "Traceback" not in output
    assert lab.server.requests() == []
    assert lab.container.init_id == old_init


def test_a_newline_in_the_token_secret_from_the_environment_is_never_shown(lab):
    secret = lab.server.add_token("root@pam", "relaunch")
    env = dict(lab.environment(), PROXMOX_TOKEN_ID="relaunch", PROXMOX_TOKEN_SECRET=secret + "\n",
               ANSIBLE_STDOUT_CALLBACK="default")
    del env["PROXMOX_PASSWORD"]
    plays = local_play([{"name": "reboot", MODULE: {"vmid": 200, "expected_hostname": HOSTNAME}}])

    run = run_playbook(plays, env=env, extra_args=["-v"], timeout=300)

    assert run.rc != 0
    assert secret not in run.stdout + run.stderr
    assert "api_token_secret: contains a control character" in run.stdout
    assert lab.server.requests() == []


# ---------------------------------------------------------------------------- shutdowns and locks


def test_shutdown_outlasting_its_timeout_fails_without_force(lab):
    lab.server.call(setattr, lab.ct, "shutdown_secs", 1000)
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, method="stop_start", timeout=5))

    assert result["failed"]
    assert "container did not stop" in result["msg"] and "is now running" in result["msg"]
    assert [(t["type"], t["exitstatus"]) for t in result["tasks"]] == [("vzshutdown", "container did not stop")]
    assert posts(lab, "/start") == []
    assert lab.container.init_id == old_init


def test_shutdown_outlasting_its_timeout_is_forced_with_force(lab):
    lab.server.call(setattr, lab.ct, "shutdown_secs", 1000)
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, method="stop_start", timeout=5, force=True))

    assert not result.get("failed"), result.get("msg")
    assert [(t["type"], t["exitstatus"]) for t in result["tasks"]] == [("vzshutdown", "OK"), ("vzstart", "OK")]
    assert_restarted(lab, old_init)


def test_failed_shutdown_task_is_overruled_with_force(lab):
    lab.server.call(lab.pve.fail, "POST", "/nodes/pve1/lxc/200/status/shutdown", error="did_not_stop", times=1)
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, method="stop_start", force=True))

    assert not result.get("failed"), result.get("msg")
    assert [(t["type"], t["exitstatus"]) for t in result["tasks"]] == [
        ("vzshutdown", "container did not stop"), ("vzstop", "OK"), ("vzstart", "OK")]
    assert_restarted(lab, old_init)


def test_lock_that_clears_in_time_is_waited_for(lab):
    # A backup takes the lock just as the module first reads the config, and ends 1.5 s later.
    def backup_starts(pve) -> None:
        pve.snapshot_lock(200, "backup")
        asyncio.get_running_loop().call_later(1.5, pve.unlock, 200)

    lab.server.before_request("GET", "/lxc/200/config", backup_starts)
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, lock_timeout=60))

    assert not result.get("failed"), result.get("msg")
    assert result["lock_waited_s"] > 0
    assert [t["type"] for t in result["tasks"]] == ["vzreboot"]
    assert_restarted(lab, old_init)


def test_lock_that_outlasts_lock_timeout_fails_naming_it(lab):
    lab.server.call(lab.pve.snapshot_lock, 200, "backup")
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, lock_timeout=1))

    assert result["failed"]
    assert "locked (backup)" in result["msg"] and "lock_timeout" in result["msg"]
    assert posts(lab) == []
    assert lab.container.init_id == old_init


def test_skiplock_as_root_stops_and_starts_a_locked_container(lab):
    lab.server.call(lab.pve.snapshot_lock, 200, "backup")
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, method="stop_start", skiplock=True,
                                    lock_timeout=0))

    assert not result.get("failed"), result.get("msg")
    assert [t["type"] for t in result["tasks"]] == ["vzstop", "vzstart"]
    assert posts(lab) == ["/api2/json/nodes/pve1/lxc/200/status/stop", "/api2/json/nodes/pve1/lxc/200/status/start"]
    assert_restarted(lab, old_init)


def test_task_ending_in_error_fails_at_once_with_pves_message(lab):
    lab.server.call(setattr, lab.ct, "start_error", "startup for container '200' failed")

    # A long wait_timeout: only reading the exit status ends this run early.
    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, wait_timeout=3600))

    assert result["failed"]
    assert "startup for container '200' failed" in result["msg"]
    assert "is now stopped" in result["msg"]
    assert result["tasks"][-1]["type"] == "vzreboot"
    assert result["tasks"][-1]["exitstatus"] == "startup for container '200' failed"
    assert not lab.container.running()
    assert len(posts(lab)) == 1


# ------------------------------------------------------------------------ auth, permissions, network


def test_expired_ticket_is_renewed_and_the_post_sent_once(lab):
    lab.server.before_request("POST", "/lxc/200/status/reboot", expire_tickets)
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME))

    assert not result.get("failed"), result.get("msg")
    assert len(lab.server.requests("POST", "/access/ticket")) == 2
    assert len(posts(lab)) == 2  # the first was refused with 401, so nothing ran
    assert len(lab.server.tasks(200, "vzreboot")) == 1
    assert_restarted(lab, old_init)


def test_permission_denied_fails_with_pves_message_and_no_retry(lab):
    password = lab.server.add_user("ops@pve")
    lab.server.call(lab.pve.grant, "ops@pve", "/vms/200", "VM.Audit")
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, api_user="ops@pve", api_password=password))

    assert result["failed"]
    assert "403" in result["msg"] and "Permission check failed (/vms/200, VM.PowerMgmt)" in result["msg"]
    assert len(posts(lab)) == 1
    assert lab.container.init_id == old_init


def test_flaky_network_still_reboots_exactly_once(lab):
    # A quarter of all requests are reset unanswered; with this seed, the reboot POST among them.
    lab.server.flaky_network(drop_rate=0.25, seed=5)
    zombie = lab.container.make_zombie()
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, api_timeout=2))

    assert not result.get("failed"), result.get("msg")
    assert len(lab.server.received()) > len(lab.server.requests()), "no request was dropped"
    assert len(posts(lab, "/status/reboot")) == 1  # only the one that got through was carried out
    assert len(lab.server.tasks(200, "vzreboot")) == 1
    assert lab.container.starts == 2  # started by the lab, once more by the one reboot
    assert_restarted(lab, old_init, zombie)


def test_lost_answer_to_the_reboot_is_found_in_the_task_list_not_repeated(lab):
    lab.server.drop_answer("POST", "/lxc/200/status/reboot")
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, api_timeout=2))

    assert not result.get("failed"), result.get("msg")
    assert lab.pve.dropped == [("POST", "/api2/json/nodes/pve1/lxc/200/status/reboot")]
    assert len(posts(lab)) == 1
    assert len(lab.server.tasks(200, "vzreboot")) == 1
    assert result["tasks"][0]["upid"] == lab.server.tasks(200, "vzreboot")[0]["upid"]
    assert lab.container.starts == 2
    assert_restarted(lab, old_init)


def test_proxy_error_on_the_post_is_checked_then_sent_again(lab):
    lab.server.call(lab.pve.fail, "POST", "/nodes/pve1/lxc/200/status/reboot", 595, "No route to host", times=1)
    old_init = lab.container.init_id

    result = reboot(lab.module_args(vmid=200, expected_hostname=HOSTNAME, api_timeout=1))

    assert not result.get("failed"), result.get("msg")
    assert len(posts(lab)) == 2
    assert len(lab.server.tasks(200, "vzreboot")) == 1
    assert lab.container.starts == 2
    assert_restarted(lab, old_init)


# ------------------------------------------------------------------------------ the harness itself


@pytest.mark.parametrize("init, reaped", [("non-reaping", False), ("reaping", True)])
def test_the_containers_init_reaps_only_when_asked_to(tmp_path, init, reaped):
    with proxmox_lab(tmp_path, init=init) as lab:
        orphan = lab.container.start_process(["/usr/bin/sleep", "1"])
        # A reaping init takes the zombie away a moment after it appears: wait for what this init should do.
        wait_until(lambda: not lab.container.exists(orphan) or (not reaped and state_of(orphan.pid) == "Z"), timeout=30,
                   what="the orphan to end")
        if reaped:
            assert not lab.container.exists(orphan)
        else:
            assert state_of(orphan.pid) == "Z" and orphan in lab.container.zombies()
