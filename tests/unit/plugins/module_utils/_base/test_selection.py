"""The floor under a job selection: what names more than a job is refused, unless allow_broad.

Tables are built by hand as the kernel shows them to the module in each connection: over ssh
(sshd session, ``sh -c``, the module), and with ``ansible_connection=local`` (ansible-playbook,
its workers, each a session leader since WorkerProcess calls setsid, and their ``sh -c``).
"""

from __future__ import annotations

import re

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    BroadSelectionError,
    JOB_SELECTION_SPEC,
    job_selection_from_params,
    own_pid_in,
    refuse_broad_selection,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import Process, ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    DEFAULT_PROTECTED,
    JobSelector,
    Protection,
    is_ansible_process,
    own_chain,
    selection_floor,
    without_typed_arguments,
)
from tests.harness.fakeproc import FakeProc

MODULE_CMDLINE = "/usr/bin/python3 /root/.ansible/tmp/ansible-tmp-1718-77-1234/AnsiballZ_zombie_reap.py"
PLAYBOOK_CMDLINE = "/opt/venv/bin/python3 /opt/venv/bin/ansible-playbook -i hosts -e job=train relaunch.yml"
TRAIN = "python3 /w/run/train.py --lr 3e-4"


# What /proc/PID/exe names for the programs of these tables: the kernel's word, not the process's.
EXE_OF_COMM = {
    "python3": "/usr/bin/python3.11", "ansible-playboo": "/usr/bin/python3.11", "ansible-pull": "/usr/bin/python3.11",
    "ansible-runner": "/usr/bin/python3.11", "systemd": "/usr/lib/systemd/systemd", "sshd": "/usr/sbin/sshd",
    "sh": "/usr/bin/dash", "bash": "/usr/bin/bash", "sleep": "/usr/bin/sleep", "vim": "/usr/bin/vim.basic",
}


def proc(pid: int, ppid: int, cmdline: str, comm: str = "python3", pgid: int | None = None, sid: int | None = None,
         state: str = "S", kernel: bool = False, exe: str | None = None) -> Process:
    group = pid if pgid is None else pgid
    return Process(pid=pid, starttime=1000 + pid, ppid=ppid, pgid=group, sid=group if sid is None else sid,
                   state=state, comm=comm, threads=1, is_kernel_thread=kernel, cmdline=cmdline,
                   exe="" if kernel else (EXE_OF_COMM.get(comm, "") if exe is None else exe))


def table_of(*processes: Process) -> ProcessTable:
    return ProcessTable({p.pid: p for p in processes}, "/nonexistent-test-proc")


def ssh_host(*extra: Process) -> tuple[ProcessTable, int]:
    """A host reached over ssh; the module is pid 900."""
    return table_of(
        proc(1, 0, "/sbin/init", comm="systemd"),
        proc(2, 0, "", comm="kthreadd", kernel=True),
        proc(5, 1, "/usr/sbin/sshd -D", comm="sshd"),
        proc(800, 5, "sshd: root@notty", comm="sshd"),
        proc(850, 800, f"/bin/sh -c {MODULE_CMDLINE} && sleep 0", comm="sh", pgid=850),
        proc(900, 850, MODULE_CMDLINE, pgid=850, sid=850),
        proc(10, 1, TRAIN, pgid=10),
        proc(11, 10, "python3 -c from multiprocessing.spawn import spawn_main", pgid=10),
        proc(20, 1, "python3 /w/run/train_eval.py", pgid=20),
        proc(30, 1, "sleep 1000", comm="sleep"),
        *extra,
    ), 900


def local_controller(*extra: Process, playbook_leads_group: bool = True) -> tuple[ProcessTable, int]:
    """ansible-playbook (200) run from a shell (100), with a worker (210) running this module (212)
    and a worker (220) serving another host, whose module (222) is pipelined."""
    group = 200 if playbook_leads_group else 100
    return table_of(
        proc(1, 0, "/sbin/init", comm="systemd"),
        proc(100, 1, "-bash", comm="bash"),
        proc(200, 100, PLAYBOOK_CMDLINE, comm="ansible-playboo", pgid=group, sid=100),
        proc(210, 200, PLAYBOOK_CMDLINE, comm="ansible-playboo"),
        proc(211, 210, f"/bin/sh -c '{MODULE_CMDLINE} && sleep 0'", comm="sh", pgid=210, sid=210),
        proc(212, 211, MODULE_CMDLINE, pgid=210, sid=210),
        proc(220, 200, PLAYBOOK_CMDLINE, comm="ansible-playboo"),
        proc(221, 220, "/bin/sh -c '/usr/bin/python3 && sleep 0'", comm="sh", pgid=220, sid=220),
        proc(222, 221, "/usr/bin/python3", pgid=220, sid=220),
        proc(10, 1, TRAIN, pgid=10),
        proc(11, 10, "python3 -c from multiprocessing.spawn import spawn_main", pgid=10),
        *extra,
    ), 212


def floor(table: ProcessTable, own: int, match=(), pids=(), descendants=True, protected=DEFAULT_PROTECTED) -> list[str]:
    selector = JobSelector.from_options(list(match), list(pids), descendants)
    protection = Protection(table, [re.compile(p) for p in protected], own_pid=own)
    return selection_floor(selector, table, protection, own)


# --- patterns that match the empty string ------------------------------------------------------

@pytest.mark.parametrize("pattern", [".*", "", "x?", "(|train)", "^", "$", r"\s*", "(?:)"])
def test_a_pattern_that_matches_the_empty_string_is_refused_by_name(pattern):
    table, own = ssh_host()
    reasons = floor(table, own, match=[r"/w/run/train\.py\b", pattern])
    assert reasons, pattern
    assert reasons[0] == f"match: {pattern!r} matches the empty string, so it selects every process"


def test_the_empty_string_rule_needs_no_module_process_in_the_table():
    table, _own = ssh_host()
    reasons = floor(table, 4242, match=[".*"])
    assert reasons[0] == "match: '.*' matches the empty string, so it selects every process"
    assert not any("matches the command line" in r for r in reasons)
    # A /proc of another namespace: no chain to judge a pattern by; what it selects is still judged.
    assert floor(table, 4242, match=["spawn_main|sleep 1000"]) == []
    assert floor(table, 4242, match=["python"]) == [
        "match: 'python' selects pid 900 (python3), which runs Ansible (a controller, one of its workers or a module)"]


# --- patterns that match the module's own command line or its connection ------------------------

@pytest.mark.parametrize("pattern", ["python", r"\.py\b", "/usr/bin", ".", ".+", r"\S", "AnsiballZ", "ansible", "tmp"])
def test_a_pattern_that_matches_the_module_itself_is_refused(pattern):
    table, own = ssh_host()
    reasons = floor(table, own, match=[pattern])
    assert reasons[0].startswith(f"match: {pattern!r} matches the command line of this module's own process")
    assert "and so every process like it" in reasons[0]


@pytest.mark.parametrize("pattern,ancestor", [("sshd", "pid 800 (sshd)"), ("sleep 0", "pid 850 (sh)"), ("^/bin/sh", "pid 850 (sh)")])
def test_a_pattern_that_matches_the_connection_chain_is_refused(pattern, ancestor):
    table, own = ssh_host()
    # The ancestors themselves are always protected; what the pattern would end is their like.
    for protected in (DEFAULT_PROTECTED, ()):
        reasons = floor(table, own, match=[pattern], protected=protected)
        assert len(reasons) == 1, reasons
        assert reasons[0].startswith(f"match: {pattern!r} matches the command line of {ancestor}, an ancestor of this module")


@pytest.mark.parametrize("pattern", [r"/w/run/train\.py\b", r"train\.py", "spawn_main", r"^sleep 1000$", "train_eval"])
def test_patterns_that_name_a_job_pass(pattern):
    table, own = ssh_host()
    assert floor(table, own, match=[pattern]) == []


def test_pid_1_running_the_job_itself_does_not_make_its_workers_unselectable():
    # A container whose init is the trainer: PID 1 has no siblings a pattern could reach through it.
    table = table_of(
        proc(1, 0, TRAIN),
        proc(7, 1, TRAIN, pgid=1),
        proc(50, 1, f"/bin/sh -c {MODULE_CMDLINE}", comm="sh"),
        proc(51, 50, MODULE_CMDLINE, pgid=50),
    )
    assert own_chain(table, 51) == [51, 50]
    assert floor(table, 51, match=[r"/w/run/train\.py\b"]) == []


# --- selections that take in Ansible itself -----------------------------------------------------

def test_a_pattern_on_the_playbook_command_line_is_refused_and_names_the_other_worker():
    # The playbook's own name is on the command line of ansible-playbook and of every worker.
    table, own = local_controller()
    reasons = floor(table, own, match=["relaunch"])
    assert reasons[0].startswith("match: 'relaunch' matches the command line of pid 210 (ansible-playboo), an ancestor")
    assert "match: 'relaunch' selects pid 220 (ansible-playboo), which runs Ansible (a controller, one of its workers or a module)" in reasons
    # ...and what that worker started, through include_descendants.
    assert any(r.startswith("include_descendants: selects pid 222 (python3), which was started by the Ansible process pid 200")
               for r in reasons)


def test_a_pattern_typed_as_extra_vars_is_not_the_ancestor_s_but_the_other_worker_it_selects_is_refused():
    # `-e job=train` puts "train" on the command line of ansible-playbook and of every worker; it was
    # typed there. Judged without it, the ancestors do not make the pattern broad; the other worker,
    # whose command line carries it too, is still refused (and with it what it started).
    table, own = local_controller()
    reasons = floor(table, own, match=["train"])
    assert not any("an ancestor of this module" in r for r in reasons), reasons
    assert "match: 'train' selects pid 220 (ansible-playboo), which runs Ansible (a controller, one of its workers or a module)" in reasons
    # With one host (no other worker) nothing is left to refuse: the job alone is selected.
    alone = table_of(*(p for pid, p in table.processes.items() if pid not in (220, 221, 222)))
    assert floor(alone, own, match=["train"]) == []
    assert JobSelector.from_options(["train"], [], True).select(alone, Protection(alone, (), own_pid=own)) == {10, 11}


@pytest.mark.parametrize("args,kept", [
    (["ansible", "localhost", "-m", "x.y.zombie_facts", "-a", '{"match": ["train"]}'],
     ["ansible", "localhost", "-m", "x.y.zombie_facts", "-a"]),
    (["ansible", "all", "--args=match=train", "-i", "hosts"], ["ansible", "all", "--args", "-i", "hosts"]),
    (["ansible-playbook", "-ematch=train", "-e", "@vars.yml", "--extra-vars", "x=1", "site.yml"],
     ["ansible-playbook", "-e", "-e", "--extra-vars", "site.yml"]),
    (["ansible-playbook", "--extra-vars=x=train", "-v", "site.yml"], ["ansible-playbook", "--extra-vars", "-v", "site.yml"]),
])
def test_without_typed_arguments(args, kept):
    assert without_typed_arguments(args) == kept


def test_listing_another_worker_or_its_module_is_refused():
    table, own = local_controller()
    assert floor(table, own, pids=[220], descendants=False) == [
        "pids: lists pid 220 (ansible-playboo), which runs Ansible (a controller, one of its workers or a module)"]
    # The other host's pipelined module is only "/usr/bin/python3": its descent gives it away.
    (reason,) = floor(table, own, pids=[222], descendants=False)
    assert reason == "pids: lists pid 222 (python3), which was started by the Ansible process pid 200 (ansible-playboo) that runs this module"


def test_what_the_controller_started_and_left_behind_in_its_group_or_session_is_refused():
    left_in_group = proc(300, 1, "python3 /w/run/train.py", pgid=200, sid=100)
    left_in_session = proc(310, 1, "python3 /w/sess/train.py", pgid=310, sid=210)
    table, own = local_controller(left_in_group, left_in_session)
    assert floor(table, own, match=[r"/w/run/train\.py"]) == [
        "match: '/w/run/train\\\\.py' selects pid 300 (python3), which is in the process group of the Ansible process "
        "pid 200 (ansible-playboo) that runs this module",
    ]
    (reason,) = floor(table, own, match=[r"/w/sess/train\.py"])
    assert "in the session of the Ansible process pid 210 (ansible-playboo)" in reason


def test_a_job_from_an_earlier_task_or_beside_a_non_ansible_group_leader_passes():
    # Started by an earlier task's worker (session 230, that worker has exited), and one started by
    # the shell script that also runs ansible-playbook (group 100, led by bash).
    earlier = proc(300, 1, "python3 /w/run/train.py", pgid=300, sid=230)
    beside = proc(310, 100, "python3 /w/run/train.py --resume", pgid=100, sid=100)
    table, own = local_controller(earlier, beside, playbook_leads_group=False)
    assert floor(table, own, match=[r"/w/run/train\.py\b"]) == []
    assert floor(table, own, pids=[300, 310]) == []


def test_a_descendant_that_runs_ansible_is_refused_through_include_descendants():
    nested = proc(12, 10, "/usr/bin/python3 /usr/local/bin/ansible-pull -U repo", comm="ansible-pull", pgid=10)
    table, own = ssh_host(nested)
    (reason,) = floor(table, own, match=[r"/w/run/train\.py\b"])
    assert reason.startswith("include_descendants: selects pid 12 (ansible-pull), which runs Ansible")
    assert floor(table, own, match=[r"/w/run/train\.py\b"], descendants=False) == []


PYTHON_EXE = "/usr/bin/python3.11"


@pytest.mark.parametrize("cmdline,exe,expected", [
    (PLAYBOOK_CMDLINE, PYTHON_EXE, True),
    (PLAYBOOK_CMDLINE, "/usr/bin/perl", False),
    (PLAYBOOK_CMDLINE, "/root/.pyenv/versions/3.11.7/bin/python3.11 (deleted)", True),
    ("/usr/bin/python3 -u /usr/bin/ansible-playbook site.yml", PYTHON_EXE, True),
    ("/usr/bin/python3 -W ignore -X dev /usr/bin/ansible-pull -U repo", PYTHON_EXE, True),
    ("python3 -m ansible playbook site.yml", PYTHON_EXE, True),
    ("/usr/bin/python3 /usr/local/bin/ansible-runner run /srv/runner", PYTHON_EXE, True),
    (MODULE_CMDLINE, PYTHON_EXE, True),
    ("/usr/bin/python3", PYTHON_EXE, False),
    (TRAIN, PYTHON_EXE, False),
    ("python3 /w/ansible_train.py", PYTHON_EXE, False),
    ("python3 -m torch.distributed.run /w/run/train.py", PYTHON_EXE, False),
    ("python3 -c import ansible; train()", PYTHON_EXE, False),
    ("vim ansible-playbook.yml", "/usr/bin/vim.basic", False),
    # What a process says about itself: argv[0] (exec -a) and words among its arguments.
    ("ansible-playbook /w/run/train.py", PYTHON_EXE, False),
    ("ansible-playbook site.yml", "/usr/bin/sleep", False),
    ("/usr/bin/python3 /usr/bin/ansible-playbook site.yml", "/usr/bin/sleep", False),
    ("python3 /w/run/train.py --note ansible-playbook", PYTHON_EXE, False),
    (MODULE_CMDLINE, "", False),  # unknown executable (another user's process, a kernel thread)
])
def test_is_ansible_process_by_its_executable_and_the_program_it_runs(cmdline, exe, expected):
    assert is_ansible_process(proc(40, 1, cmdline), exe) is expected


# --- allow_broad ---------------------------------------------------------------------------------

def test_allow_broad_lifts_the_floor_but_not_the_protection():
    table, own = ssh_host()
    protection = Protection(table, [re.compile(p) for p in DEFAULT_PROTECTED], own_pid=own)
    refused = JobSelector.from_options([".*"], [], True)
    allowed = JobSelector.from_options([".*"], [], True, allow_broad=True)
    assert refused.too_broad(table, protection, own)
    assert allowed.too_broad(table, protection, own) == []
    # Everything with a command line except PID 1, the kernel thread, sshd and the module's chain.
    assert allowed.select(table, protection) == {10, 11, 20, 30}


def test_a_selector_built_without_options_is_not_broad_by_default():
    assert JobSelector().allow_broad is False
    assert JobSelector.from_options([r"train\.py"], [], True).allow_broad is False


# --- the module-facing check ---------------------------------------------------------------------

def params(**overrides):
    values = {name: spec.get("default") for name, spec in JOB_SELECTION_SPEC.items()}
    values.update(overrides)
    return values


def fake_host(tmp_path):
    fake = FakeProc(tmp_path)
    fake.add(1, "systemd", cmdline=["/sbin/init"])
    fake.add(850, "sh", ppid=1, cmdline=["/bin/sh", "-c", MODULE_CMDLINE])
    fake.add(900, "python3", ppid=850, pgid=850, cmdline=MODULE_CMDLINE.split(" "))
    fake.add(10, "python3", ppid=1, cmdline=TRAIN.split(" "))
    fake.add(30, "sleep", ppid=1, cmdline=["sleep", "1000"])
    (tmp_path / "self").symlink_to("900")
    return str(tmp_path)


def refuse_in(root: str, selector: JobSelector, protected) -> None:
    """What zombie_reap does with its one snapshot of `root`."""
    table = ProcessTable.scan(root)
    refuse_broad_selection(selector, table, Protection(table, protected, own_pid_in(root)), own_pid_in(root))


def test_allow_broad_is_a_shared_selection_option_and_reaches_the_selector():
    assert JOB_SELECTION_SPEC["allow_broad"] == {"type": "bool", "default": False}
    selector, _protected = job_selection_from_params(params(match=[".*"], allow_broad=True))
    assert selector.allow_broad is True
    selector, _protected = job_selection_from_params(params(match=[".*"]))
    assert selector.allow_broad is False


def test_refusal_names_the_option_and_pattern_and_returns_what_it_would_select(tmp_path):
    root = fake_host(tmp_path)
    assert own_pid_in(root) == 900
    selector, protected = job_selection_from_params(params(match=["python3"], proc_root=root))
    with pytest.raises(BroadSelectionError) as caught:
        refuse_in(root, selector, protected)
    error = caught.value
    assert isinstance(error, ValueError)
    assert str(error).startswith("match: 'python3' matches the command line of this module's own process")
    assert "Refused; nothing was touched" in str(error) and "allow_broad: true" in str(error)
    assert error.reasons and all(r.startswith("match: 'python3'") for r in error.reasons)
    assert 10 in {entry["pid"] for entry in error.job}
    assert set(error.job[0]) == {"pid", "starttime", "comm"}


def test_allowed_and_narrow_selections_pass_the_module_check(tmp_path):
    root = fake_host(tmp_path)
    for options in ({"match": [r"/w/run/train\.py\b"]}, {"match": ["python3"], "allow_broad": True}, {"pids": [10]}, {}):
        selector, protected = job_selection_from_params(params(proc_root=root, **options))
        refuse_in(root, selector, protected)


def test_a_long_list_of_reasons_is_cut_in_the_message_but_kept_whole():
    error = BroadSelectionError([f"pids: lists pid {n} (x), which runs Ansible" for n in range(8)], [])
    assert "(and 3 more)" in str(error) and len(error.reasons) == 8


def test_own_pid_in_a_foreign_root_is_none(tmp_path):
    assert own_pid_in(str(tmp_path)) == 0


def test_every_selection_problem_is_noted_at_once_and_nothing_else():
    checks = OptionChecks()
    job_selection_from_params(params(match=["ok", "(", "["], pids=[0, 5, -2], protected=["[z-a]"], gpu_device_glob=""), checks)
    found = {problem.option: problem.reason for problem in checks.problems}
    assert list(found) == ["pids", "gpu_device_glob", "match", "protected"]
    assert found["pids"] == "process IDs must be positive integers, got [0, -2]"
    # every bad pattern of one option, in one reason
    assert "'(' is not a valid regular expression" in found["match"] and "'[' is not a valid" in found["match"]
    with pytest.raises(OptionsInvalid) as caught:
        job_selection_from_params(params(match=["("], pids=[-1]))
    assert caught.value.options == ["pids", "match"]


def test_an_internal_error_in_the_selection_is_not_a_bad_option(monkeypatch):
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import selection

    def broken(*_args):
        raise ValueError("a bug, not the user's pattern")

    monkeypatch.setattr(selection, "compile_patterns", broken)
    with pytest.raises(ValueError, match="a bug") as caught:
        job_selection_from_params(params(match=["ok"]), OptionChecks())
    assert not isinstance(caught.value, BadOption)


# --- built-in protection: what a process cannot claim (issue 17, item 9) ---------------------------

def protection_of(*processes: Process, patterns=()) -> Protection:
    table = table_of(proc(1, 0, "/sbin/init", comm="systemd"), *processes)
    return Protection(table, [re.compile(p) for p in patterns], own_pid=4242)


def with_uid(process: Process, uid: int) -> Process:
    process.uid = uid
    return process


@pytest.mark.parametrize("process", [
    proc(40, 1, "python3 /w/run/train.py --logs /var/log/sshd --note systemd lxc-start"),  # words among its arguments
    proc(41, 1, "sshd: root@pts/0", comm="sshd", exe="/usr/bin/python3.11"),  # exec -a, PR_SET_NAME: argv[0], comm
    proc(42, 1, "/usr/sbin/sshd -D", comm="sshd", exe="/home/ops/bin/sshd"),   # a copy named sshd, outside /usr
    proc(43, 1, "/usr/sbin/sshd -D", comm="sshd", exe="/tmp/../usr/sbin/sshd"),
    proc(44, 1, "/usr/sbin/sshd -D", comm="sshd", exe=""),         # exe unreadable: nothing to judge by
    proc(45, 1, "/lib/systemd/systemd --user", comm="systemd", exe="/opt/venv/bin/python3.11"),
    with_uid(proc(46, 1, "pvedaemon", comm="pvedaemon", exe="/usr/bin/perl"), 1000),  # not as root
    with_uid(proc(47, 1, "pvedaemon", comm="train", exe="/usr/bin/perl"), 0),
])
def test_a_process_cannot_claim_the_built_in_protection(process):
    assert protection_of(process).reason(process.pid) is None


@pytest.mark.parametrize("process,reason", [
    (proc(50, 1, "sshd: ops [priv]", comm="sshd", exe="/usr/sbin/sshd"), "runs /usr/sbin/sshd, a protected program"),
    (proc(51, 1, "anything at all", comm="x", exe="/usr/sbin/sshd (deleted)"), "runs /usr/sbin/sshd, a protected program"),
    (proc(52, 1, "sshd-session", comm="sshd-session", exe="/usr/lib/openssh/sshd-session"), "runs /usr/lib/openssh/sshd-session, a protected program"),
    (proc(53, 1, "/lib/systemd/systemd-journald", comm="systemd-journal", exe="/usr/lib/systemd/systemd-journald"),
     "runs /usr/lib/systemd/systemd-journald, a protected program"),
    (proc(54, 1, "[lxc monitor] /var/lib/lxc 200", comm="lxc-start", exe="/usr/bin/lxc-start"), "runs /usr/bin/lxc-start, a protected program"),
    (proc(55, 1, "containerd-shim", comm="containerd-shim", exe="/usr/bin/containerd-shim-runc-v2"),
     "runs /usr/bin/containerd-shim-runc-v2, a protected program"),
    (with_uid(proc(56, 1, "pvedaemon worker", comm="pvedaemon worke", exe="/usr/bin/perl"), 0),
     "runs the Proxmox daemon pvedaemon (perl, as root)"),
    (proc(57, 2, "", comm="kworker/0:1", kernel=True), "kernel thread"),
])
def test_built_in_protection_judges_the_executable(process, reason):
    assert protection_of(process).reason(process.pid) == reason


def test_user_patterns_stay_command_line_patterns():
    spoofed = proc(40, 1, "python3 /w/run/train.py --note sshd")
    protection = protection_of(spoofed, patterns=[r"\bsshd\b"])
    assert protection.reason(40) == "matches protected pattern '\\\\bsshd\\\\b'"
    assert DEFAULT_PROTECTED == () and JOB_SELECTION_SPEC["protected"]["default"] == []


def test_the_executable_is_read_from_proc_and_a_zombie_leader_s_from_a_live_thread(tmp_path):
    fake = FakeProc(tmp_path)
    fake.add(1, "systemd", ppid=0, cmdline=["/sbin/init"], exe="/usr/lib/systemd/systemd")
    fake.add(10, "sshd", cmdline=["sshd: root@pts/0"], exe="/usr/bin/python3.11")
    fake.add(11, "python3", state="Z", threads=2, cmdline=[])
    fake.add_thread(11, 11, "python3", state="Z")
    fake.add_thread(11, 12, "python3", exe="/usr/sbin/sshd")
    fake.add(12, "python3", state="Z")
    table = ProcessTable.scan(str(tmp_path))
    assert table.executable(10) == "/usr/bin/python3.11"
    assert table.executable(11) == "/usr/sbin/sshd"
    assert table.executable(12) == ""
    protection = Protection(table, (), own_pid=0)
    assert protection.reason(10) is None
    assert protection.reason(11) == "runs /usr/sbin/sshd, a protected program"


def test_the_real_uid_comes_from_status_not_from_the_owner_of_the_proc_directory(tmp_path):
    fake = FakeProc(tmp_path)
    fake.add(20, "pvedaemon", cmdline=["pvedaemon"], exe="/usr/bin/perl", uid=1000)
    fake.add(21, "pvedaemon", cmdline=["pvedaemon"], exe="/usr/bin/perl", uid=0)
    table = ProcessTable.scan(str(tmp_path))
    # The fixture directories belong to whoever runs the test (root here): that says nothing.
    assert table.load_uid(20) == 1000 and table.load_uid(21) == 0
    protection = Protection(table, (), own_pid=0)
    assert protection.reason(20) is None
    assert protection.reason(21) == "runs the Proxmox daemon pvedaemon (perl, as root)"
