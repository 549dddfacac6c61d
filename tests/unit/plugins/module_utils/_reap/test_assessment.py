"""Classification and escalation on fixture /proc trees.

The states that cannot be made for real on a machine without a GPU (a thread asleep in the NVIDIA
driver) are covered here; every other state is also made for real in tests/integration.
"""

from __future__ import annotations

import os
import re
import stat

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.assessment import (
    AssessmentOptions,
    assess,
    options_from_params,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import DEFAULT_DRIVER_WCHAN, ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import JOB_SELECTION_SPEC, JobSelector
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation
from tests.harness.clock import FakeClock
from tests.harness.fakeproc import FakeProc


def run(root, match=(), pids=(), **kwargs):
    clock = FakeClock()
    options = AssessmentOptions(selector=JobSelector.from_options(list(match), list(pids), True), **kwargs)
    return assess(options, proc_root=str(root), clock=clock, sleep=clock.sleep), clock


@pytest.fixture(name="proc")
def proc_fixture(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(1, "init", cmdline=["/sbin/init"])
    proc.add(5, "sshd", cmdline=["/usr/sbin/sshd", "-D"])
    return proc


def test_nothing_of_the_job_is_clean(proc):
    proc.add(40, "python3", cmdline=["python3", "notebook.py"])
    result, _clock = run(proc.root, match=[r"train\.py"])
    assert result.escalation == Escalation.NONE
    assert result.job_processes == []


def test_running_job_with_descendants_is_reapable(proc):
    proc.add(10, "python3", cmdline=["python3", "/w/train.py"])
    proc.add(11, "python3", ppid=10, cmdline=["python3", "-c", "worker"])
    proc.add(12, "pt_data_worker", ppid=11, cmdline=["python3", "-c", "loader"])
    proc.add(20, "python3", cmdline=["python3", "/w/train_eval.py"])
    result, _clock = run(proc.root, match=[r"/w/train\.py\b"])
    assert [p["pid"] for p in result.job_processes] == [10, 11, 12]
    assert result.escalation == Escalation.SIGNALS
    assert any("10, 11, 12" in reason for reason in result.reasons)


def test_protected_process_is_left_out_of_the_job(proc):
    proc.add(10, "python3", cmdline=["python3", "/w/train.py"])
    result, _clock = run(proc.root, match=[r"sshd|train"], protected=(re.compile(r"\bsshd\b"),))
    assert [p["pid"] for p in result.job_processes] == [10]
    assert [(p["pid"], p["comm"]) for p in result.protected] == [(5, "sshd")]


def test_pid_1_is_never_part_of_the_job(proc):
    result, _clock = run(proc.root, match=[r"init"], pids=[1])
    assert result.job_processes == []
    assert result.protected[0]["reason"] == "PID 1 of this namespace"


def test_zombie_leader_with_live_thread(proc):
    proc.add(10, "python3", cmdline=["python3", "/w/train.py"])
    proc.add(30, "python3", state="Z", ppid=10, threads=2)
    proc.add_thread(30, 30, "python3", state="Z")
    proc.add_thread(30, 31, "pt_autograd_0", state="S", wchan="futex_wait_queue")
    result, _clock = run(proc.root, match=[r"/w/train\.py"])
    (zombie,) = result.zombies
    assert zombie["kind"] == "zombie_leader"
    assert zombie["live_threads"] == [{"tid": 31, "state": "S", "wchan": "futex_wait_queue", "comm": "pt_autograd_0"}]
    assert zombie["parent"] == {"pid": 10, "comm": "python3", "state": "S", "is_namespace_init": False, "job": True}
    assert zombie["parent_chain"] == [10, 1]
    assert result.escalation == Escalation.SIGNALS


def test_unrelated_zombie_leader_without_a_gpu_does_not_block(proc):
    proc.add(70, "java", cmdline=["java", "-jar", "agent.jar"])
    proc.add(71, "java", state="Z", ppid=70, threads=2)
    proc.add_thread(71, 71, "java", state="Z")
    proc.add_thread(71, 72, "gc", state="S", wchan="futex_wait_queue")
    result, _clock = run(proc.root, match=[r"train"])
    assert result.zombies[0]["kind"] == "zombie_leader" and result.zombies[0]["blocking"] is False
    assert result.escalation == Escalation.NONE


def char_node(path, major, minor):
    """A real character device node: what counts is the kernel's major:minor of the opened file."""
    if os.geteuid() != 0:
        pytest.skip("a stand-in device node (mknod of a character device) needs root")
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
    return str(path)


def test_only_a_gpus_own_device_file_makes_an_unrelated_zombie_leader_a_gpu_holder(proc, tmp_path):
    """/dev/nvidiactl, -modeset and -uvm (every GPU user's), a regular file and a FIFO named like a
    device hold no GPU: another program's Zl holding only those does not block, nor is it listed in
    gpu_holders; one whose live thread holds /dev/nvidia3 (195:3) does, and says which device."""
    dev = tmp_path / "dev"
    dev.mkdir()
    shared = [char_node(dev / "nvidiactl", 195, 255), char_node(dev / "nvidia-modeset", 195, 254),
              char_node(dev / "nvidia-uvm", 511, 0)]
    (dev / "nvidia0").write_text("", encoding="ascii")  # a regular file where a device file would be
    os.mkfifo(dev / "nvidia1")
    gpu3 = char_node(dev / "nvidia3", 195, 3)
    for leader, files in ((71, [*shared, str(dev / "nvidia0"), str(dev / "nvidia1")]), (81, [shared[0], gpu3])):
        proc.add(leader - 1, "java", cmdline=["java", "-jar", f"agent{leader}.jar"])
        proc.add(leader, "java", state="Z", ppid=leader - 1, threads=2)
        proc.add_thread(leader, leader, "java", state="Z")
        proc.add_thread(leader, leader + 1, "gc", state="S", wchan="futex_wait_queue")
        for fd, path in enumerate(files, start=3):
            proc.add_fd(leader, str(fd), path, tid=leader + 1)
    result, _clock = run(proc.root, match=[r"train"], device_glob=str(dev / "nvidia*"))
    blocking = {z["pid"]: z["blocking"] for z in result.zombies}
    assert blocking == {71: False, 81: True}
    assert result.gpu_holders == [{"pid": 81, "tid": 82, "comm": "gc", "state": "S", "device": gpu3, "device_number": "195:3"}]
    assert result.escalation == Escalation.SIGNALS and any("81" in reason for reason in result.reasons)


def test_unrelated_plain_zombie_does_not_block(proc):
    proc.add(70, "cron", cmdline=["cron"])
    proc.add(71, "sh", state="Z", ppid=70)
    result, clock = run(proc.root, match=[r"train"])
    assert result.zombies[0]["blocking"] is False
    assert result.escalation == Escalation.NONE
    assert clock.sleeps == []  # not orphaned to PID 1: nothing to watch

    strict, _clock = run(proc.root, match=[r"train"], require_no_zombies=True)
    assert strict.escalation == Escalation.SIGNALS


def test_orphaned_zombie_that_init_never_reaps_needs_reboot(proc):
    proc.add(80, "python3", state="Z", ppid=1)
    result, clock = run(proc.root, match=[r"train"], orphan_grace=2.0)
    assert result.escalation == Escalation.CONTAINER_REBOOT
    assert result.zombies[0]["unreaped_orphan"] is True
    assert "did not reap them within 2s" in result.reasons[0]
    assert clock.now >= 2.0  # it watched for the whole grace, polling


def test_orphaned_zombie_reaped_during_grace_is_not_a_reboot(proc):
    proc.add(80, "python3", state="Z", ppid=1)
    clock = FakeClock()

    def init_reaps(now: float) -> None:
        stat = proc.root / "80" / "stat"
        if now >= 0.3 and stat.exists():
            stat.unlink()

    clock.on_sleep.append(init_reaps)
    options = AssessmentOptions(selector=JobSelector(), orphan_grace=5.0)
    result = assess(options, proc_root=str(proc.root), clock=clock, sleep=clock.sleep)
    # It was there at the snapshot, and init took it while it was watched: nothing is left to clear
    # (a passing orphan must not make zombie_reap's `left` ask for signals).
    assert result.escalation == Escalation.NONE, result.reasons
    assert result.zombies[0]["unreaped_orphan"] is False and result.zombies[0]["blocking"] is False
    assert clock.now < 1.0


def test_thread_asleep_in_the_gpu_driver_needs_host_action(proc):
    proc.add(10, "python3", cmdline=["python3", "/w/train.py"], threads=2, state="D")
    proc.add_thread(10, 10, "python3", state="D", wchan="uvm_va_space_destroy")
    proc.add_thread(10, 12, "python3", state="S", wchan="futex_wait_queue")
    result, _clock = run(proc.root, match=[r"train\.py"])
    assert result.escalation == Escalation.HOST_ACTION
    assert result.uninterruptible == [{"pid": 10, "tid": 10, "comm": "python3", "wchan": "uvm_va_space_destroy"}]
    assert "uvm_va_space_destroy" in result.reasons[0]
    facts = result.as_dict()
    assert facts["escalation"] == "host_action" and "verdict" not in facts  # one name: escalation
    assert facts["findings"][0] == {"kind": "uninterruptible", "escalation": "host_action", "pids": [10],
                                    "why": result.reasons[0]}


def test_d_state_outside_the_driver_is_waited_out(proc):
    proc.add(10, "python3", cmdline=["python3", "/w/train.py"], state="D")
    proc.add_thread(10, 10, "python3", state="D", wchan="do_freezer_trap")
    result, _clock = run(proc.root, match=[r"train\.py"])
    assert result.escalation == Escalation.SIGNALS
    assert any("do_freezer_trap" in reason for reason in result.reasons)


def test_unrelated_d_state_does_not_block(proc):
    proc.add(90, "jbd2", cmdline=["backup"], state="D")
    proc.add_thread(90, 90, "backup", state="D", wchan="io_schedule")
    result, _clock = run(proc.root, match=[r"train\.py"])
    assert result.uninterruptible[0]["pid"] == 90
    assert result.escalation == Escalation.NONE


def test_missing_pids_are_reported(proc):
    result, _clock = run(proc.root, pids=[4242])
    assert result.missing_pids == [4242]
    assert result.escalation == Escalation.NONE


# --- zombie_facts' options -----------------------------------------------------------------------

def facts_params(**overrides):
    values = {name: spec.get("default") for name, spec in JOB_SELECTION_SPEC.items()}
    values.update(orphan_grace=2.0, driver_wchan=DEFAULT_DRIVER_WCHAN, require_no_zombies=False)
    values.update(overrides)
    return values


def test_every_bad_option_is_reported_at_once():
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(facts_params(match=["("], protected=["[z-a]"], pids=[-3], orphan_grace=601,
                                         driver_wchan="(("))
    assert caught.value.options == ["pids", "match", "protected", "orphan_grace", "driver_wchan"]
    result = caught.value.as_result()
    assert "orphan_grace: must be at least 0 and at most 600 seconds, got 601" in result["msg"]
    assert [p["option"] for p in result["option_problems"]] == caught.value.options


def test_good_options_become_the_assessment_options():
    options = options_from_params(facts_params(match=["train"], orphan_grace=0, driver_wchan="^uvm_"))
    assert options.orphan_grace == 0.0 and options.driver_wchan.pattern == "^uvm_" and options.selector.patterns


def test_an_internal_error_is_not_reported_as_a_bad_option(monkeypatch):
    from ansible_collections.gpuops.relaunch.plugins.module_utils._reap import assessment

    def broken(*_args, **_kwargs):
        raise ValueError("a bug, not the user's number")

    monkeypatch.setattr(assessment, "check_timeout", broken)
    with pytest.raises(ValueError, match="a bug") as caught:
        options_from_params(facts_params())
    assert not isinstance(caught.value, (BadOption, OptionsInvalid))


# --- a look never refuses, and looks once (issue 17, items 12 and 13) ------------------------------

AD_HOC = ["/opt/venv/bin/python3", "/opt/venv/bin/ansible", "localhost", "-m", "gpuops.relaunch.zombie_facts",
          "-a", '{"match": ["train"]}']
MODULE = ["/usr/bin/python3", "/root/.ansible/tmp/ansible-tmp-1/AnsiballZ_zombie_facts.py"]
PYTHON = "/usr/bin/python3.11"


def ad_hoc_host(proc: FakeProc, other_worker: bool = False) -> None:
    """`ansible localhost -m zombie_facts -a '{"match": ["train"]}'` over a local connection: the
    controller (200), its worker (210), the worker's sh -c (211) and the module (212, this process)."""
    proc.add(200, "ansible", cmdline=AD_HOC, exe=PYTHON)
    proc.add(210, "ansible", ppid=200, cmdline=AD_HOC, exe=PYTHON)
    proc.add(211, "sh", ppid=210, pgid=210, cmdline=["/bin/sh", "-c", " ".join(MODULE) + " && sleep 0"], exe="/usr/bin/dash")
    proc.add(212, "python3", ppid=211, pgid=210, cmdline=MODULE, exe=PYTHON)
    if other_worker:
        proc.add(220, "ansible", ppid=200, cmdline=AD_HOC, exe=PYTHON)
    proc.add(10, "python3", cmdline=["python3", "/w/train.py"], exe=PYTHON)
    (proc.root / "self").symlink_to("212")


def test_a_pattern_typed_on_the_ad_hoc_command_line_is_neither_refused_nor_broad(proc):
    ad_hoc_host(proc)
    result, _clock = run(proc.root, match=["train"])
    assert result.too_broad == []
    assert [p["pid"] for p in result.job_processes] == [10]
    assert {p["pid"] for p in result.protected} == {200, 210}  # the controller and the worker: ancestors


def test_a_look_reports_what_zombie_reap_would_refuse_and_leaves_ansible_out_of_the_job(proc):
    ad_hoc_host(proc, other_worker=True)
    result, _clock = run(proc.root, match=["train"])
    assert result.too_broad == [
        "match: 'train' selects pid 220 (ansible), which runs Ansible (a controller, one of its workers or a module)"]
    assert [p["pid"] for p in result.job_processes] == [10]
    assert {"pid": 220, "comm": "ansible",
            "reason": "a process of Ansible: it runs Ansible (a controller, one of its workers or a module)"} in result.protected
    everything, _clock = run(proc.root, match=[".*"])
    assert everything.too_broad[0] == "match: '.*' matches the empty string, so it selects every process"
    assert 220 not in {p["pid"] for p in everything.job_processes}
    # allow_broad: zombie_reap would act on the other worker, so the look says so.
    allowed = AssessmentOptions(selector=JobSelector.from_options(["train"], [], True, allow_broad=True))
    assert {p["pid"] for p in assess(allowed, proc_root=str(proc.root)).job_processes} == {10, 220}


def test_the_look_scans_the_process_table_once(proc, monkeypatch):
    ad_hoc_host(proc, other_worker=True)
    scans = []
    real_scan = ProcessTable.scan.__func__

    def counting(cls, proc_root="/proc"):
        scans.append(proc_root)
        return real_scan(cls, proc_root)

    monkeypatch.setattr(ProcessTable, "scan", classmethod(counting))
    run(proc.root, match=["train"])
    assert scans == [str(proc.root)]


def test_a_job_process_named_with_control_characters_is_reported_escaped(proc):
    # The scan keeps what a process wrote about itself as bytes; the result shows it escaped.
    proc.add(10, "\x1b]0;x\x07", cmdline=["python3", "/w/train.py", "\x1b[2J\x9b"])
    proc.add(11, "\x07worker", ppid=10, state="Z")
    result, _clock = run(proc.root, match=[r"/w/train\.py\b"])
    assert [(p["pid"], p["comm"], p["cmdline"]) for p in result.job_processes] == [
        (10, "\\x1b]0;x\\x07", "python3 /w/train.py \\x1b[2J\\x9b"), (11, "\\x07worker", "")]
    assert [z["comm"] for z in result.zombies] == ["\\x07worker"]
    assert not any(re.search("[\x00-\x08\x0a-\x1f\x7f-\x9f]", text) for text in result.reasons)
