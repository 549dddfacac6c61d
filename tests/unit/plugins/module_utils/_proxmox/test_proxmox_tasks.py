"""UPIDs, exit statuses, polls with deadlines, and tasks followed on a real fakepve server."""

from __future__ import annotations

import asyncio

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline
from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.tasks import (
    TaskFailed,
    TaskTimeout,
    Upid,
    poll,
    start_ct_task,
    task_succeeded,
    wait_for_task,
)
from tests.harness.clock import FakeClock

# ------------------------------------------------------------------------------- pure parts


def test_upid_parts():
    upid = Upid.parse("UPID:pve1:000003E8:00001B58:6B103E86:vzreboot:200:root@pam!relaunch:")
    assert (upid.node, upid.pid, upid.type, upid.id, upid.user) == ("pve1", 1000, "vzreboot", "200", "root@pam!relaunch")
    assert upid.starttime == 0x6B103E86


@pytest.mark.parametrize("text", ["", "UPID:pve1", "TASK:pve1:1:2:3:vzstart:200:root@pam:", "UPID:n:xx:1:2:t:1:u:"])
def test_upid_rejects_what_is_not_one(text):
    with pytest.raises(ValueError, match="UPID"):
        Upid.parse(text)


@pytest.mark.parametrize(
    "exitstatus, ok",
    [("OK", True), ("WARNINGS: 3", True), ("WARNINGS: x", False), ("container did not stop", False),
     ("ok", False), ("", False), (None, False), ("OK but not really", False)],
)
def test_only_ok_and_warnings_are_success(exitstatus, ok):
    assert task_succeeded(exitstatus) is ok


def test_poll_stops_at_the_deadline_and_never_sleeps_past_it():
    clock = FakeClock(1000.0)
    probes = []
    deadline = Deadline(2.0, clock, clock.sleep)
    assert poll(lambda: probes.append(clock()), deadline, interval=0.3, max_interval=1.0) is None
    assert clock.now == pytest.approx(1002.0)
    assert clock.sleeps[:2] == pytest.approx([0.3, 0.45])  # it backs off ...
    assert max(clock.sleeps) <= 1.0  # ... up to max_interval
    assert probes[-1] == pytest.approx(1002.0)  # one last look at the deadline


def test_poll_returns_as_soon_as_the_condition_holds():
    clock = FakeClock(1000.0)
    deadline = Deadline(60, clock, clock.sleep)
    assert poll(lambda: "done" if clock() >= 1001 else None, deadline, interval=0.5) == "done"
    assert clock.now < 1003


# ----------------------------------------------------------------------------- against a server


def test_successful_task_is_followed_to_its_end(api, server):
    upid = start_ct_task(api, "pve1", 200, "reboot", settle=1, timeout=30)
    outcome = wait_for_task(api, upid, Deadline(30))
    assert (outcome.type, outcome.exitstatus, outcome.ok) == ("vzreboot", "OK", True)
    assert outcome.as_dict()["upid"] == upid


def test_failed_task_fails_at_once_with_its_exit_status_and_log(api, server):
    server.call(server.pve.fail, "POST", "/nodes/pve1/lxc/200/status/shutdown", error="did_not_stop")
    upid = start_ct_task(api, "pve1", 200, "shutdown", settle=1, timeout=30)
    deadline = Deadline(3600)
    with pytest.raises(TaskFailed, match="container did not stop") as caught:
        wait_for_task(api, upid, deadline)
    assert deadline.elapsed() < 3600
    assert caught.value.outcome.exitstatus == "container did not stop"
    assert any("TASK ERROR" in line for line in caught.value.outcome.log_tail)


def test_a_failed_tasks_status_and_log_reach_the_message_escaped(api, server):
    # What PVE quotes comes from the container (a hook script's output): no terminal control.
    ct = server.pve.ct(200)
    server.call(setattr, ct, "status", "stopped")
    server.call(setattr, ct, "start_error", "hook said \x1b]0;owned\x07\x1b[2J\x9b31m")
    upid = start_ct_task(api, "pve1", 200, "start", settle=1)
    with pytest.raises(TaskFailed) as caught:
        wait_for_task(api, upid, Deadline(30))
    message = str(caught.value)
    assert "hook said \\x1b]0;owned\\x07\\x1b[2J\\x9b31m" in message
    assert not any(char in message for char in "\x1b\x07\x9b")
    assert not any(char in line for line in caught.value.outcome.log_tail for char in "\x1b\x07\x9b")


def test_task_ending_with_warnings_is_a_success(api, server):
    ct = server.pve.ct(200)
    server.call(setattr, ct, "status", "stopped")
    server.call(setattr, ct, "start_error", "WARNINGS: 2")
    upid = start_ct_task(api, "pve1", 200, "start", settle=1)
    outcome = wait_for_task(api, upid, Deadline(30))
    assert outcome.ok and outcome.exitstatus == "WARNINGS: 2"


def test_task_still_running_at_the_deadline_times_out(api, server):
    ct = server.pve.ct(200)
    server.call(setattr, ct, "shutdown_secs", 100_000)
    upid = start_ct_task(api, "pve1", 200, "shutdown", settle=1, timeout=100_000)
    with pytest.raises(TaskTimeout, match="still running") as caught:
        wait_for_task(api, upid, Deadline(0.3))
    assert caught.value.outcome.exitstatus is None


def test_lost_answer_is_found_in_the_task_list_not_sent_again(api, server):
    server.drop_answer("POST", "/status/reboot")
    upid = start_ct_task(api, "pve1", 200, "reboot", settle=2, timeout=30)
    assert [t["upid"] for t in server.tasks(200, "vzreboot")] == [upid]
    assert len(server.requests("POST", "/status/reboot")) == 1


def test_post_that_never_arrived_is_sent_again_after_looking(api, server):
    server.call(server.pve.fail, "POST", "/nodes/pve1/lxc/200/status/reboot", 595, "No route to host", times=1)
    upid = start_ct_task(api, "pve1", 200, "reboot", settle=0.3, timeout=30)
    assert [t["upid"] for t in server.tasks(200, "vzreboot")] == [upid]
    assert len(server.requests("POST", "/status/reboot")) == 2


def test_someone_elses_task_is_not_mistaken_for_ours(api, server):
    # Our reboot gets a proxy error (nothing done) while another user's reboot starts: that task
    # is not ours, so ours is sent again after looking.
    async def nothing() -> None:
        return None

    def theirs_starts(pve) -> None:
        asyncio.ensure_future(pve.task("pve1", "vzreboot", 200, "ops@pve", nothing))

    server.before_request("POST", "/status/reboot", theirs_starts)
    server.call(server.pve.fail, "POST", "/nodes/pve1/lxc/200/status/reboot", 502, "Bad Gateway", times=1)

    ours = start_ct_task(api, "pve1", 200, "reboot", settle=0.5)

    tasks = {t["user"]: t["upid"] for t in server.tasks(200, "vzreboot")}
    assert sorted(tasks) == ["ops@pve", "root@pam"]
    assert ours == tasks["root@pam"]
    assert len(server.requests("POST", "/status/reboot")) == 2
