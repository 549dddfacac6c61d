"""zombie_facts and zombie_reap as Ansible runs them, in this process: one snapshot per run (issue 17,
item 13), a look that never refuses (item 12), and one string that is one pattern (item 14).

Run through AnsibleModule with `_ANSIBLE_ARGS` (ansible-core 2.19 also wants the legacy profile);
the integration tests run the same modules through ansible-playbook and `ansible` for real.
"""

from __future__ import annotations

import json

import pytest
from ansible.module_utils import basic

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.modules import zombie_facts, zombie_reap
from tests.harness.fakeproc import FakeProc

PYTHON = "/usr/bin/python3.11"
TRAIN = ["python3", "/w/run/train_7.py", "--lr", "3e-4"]


def run_module(module, monkeypatch, capsys, **args) -> dict:
    monkeypatch.setattr(basic, "_ANSIBLE_ARGS", json.dumps({"ANSIBLE_MODULE_ARGS": args}).encode())
    monkeypatch.setattr(basic, "_ANSIBLE_PROFILE", "legacy", raising=False)
    with pytest.raises(SystemExit):
        module.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def host(tmp_path) -> str:
    """A /proc of another namespace (zombie_reap only looks there, in check mode) with a job and a
    controller worker whose command line carries the pattern."""
    proc = FakeProc(tmp_path)
    proc.add(1, "init", ppid=0, cmdline=["/sbin/init"])
    proc.add(10, "python3", cmdline=TRAIN, exe=PYTHON)
    proc.add(11, "python3", ppid=10, pgid=10, cmdline=["python3", "-c", "worker"], exe=PYTHON)
    proc.add(220, "ansible", cmdline=["/opt/venv/bin/python3", "/opt/venv/bin/ansible", "all", "-a", "match=train"], exe=PYTHON)
    return str(tmp_path)


@pytest.fixture
def scans(monkeypatch) -> list[str]:
    seen: list[str] = []
    real_scan = ProcessTable.scan.__func__

    def counting(cls, proc_root="/proc"):
        seen.append(proc_root)
        return real_scan(cls, proc_root)

    monkeypatch.setattr(ProcessTable, "scan", classmethod(counting))
    return seen


def test_zombie_facts_reads_the_process_table_once(host, scans, monkeypatch, capsys):
    result = run_module(zombie_facts, monkeypatch, capsys, match=[r"/w/run/train_\d\.py"], proc_root=host, orphan_grace=0)
    assert "failed" not in result, result
    assert [p["pid"] for p in result["ansible_facts"]["zombie_facts"]["job_processes"]] == [10, 11]
    assert scans == [host]


def test_zombie_reap_plans_from_the_snapshot_it_judged(host, scans, monkeypatch, capsys):
    result = run_module(zombie_reap, monkeypatch, capsys, match=[r"/w/run/train_\d\.py"], proc_root=host, _ansible_check_mode=True)
    assert "failed" not in result, result
    assert {entry["pid"] for entry in result["job"]} == {10, 11}
    # found judges the plan's own scan; in check mode left is found: no second scan.
    assert result["found"]["escalation"] == "signals" and result["left"] == result["found"]
    assert result["found"]["findings"][0]["kind"] == "running" and result["escalation"] == "signals"
    assert scans == [host]
    refused = run_module(zombie_reap, monkeypatch, capsys, match=["train"], proc_root=host, _ansible_check_mode=True)
    assert refused["failed"] and refused["refused"] == [
        "match: 'train' selects pid 220 (ansible), which runs Ansible (a controller, one of its workers or a module)"]
    assert scans == [host, host]


def test_zombie_facts_never_refuses_it_reports(host, monkeypatch, capsys):
    result = run_module(zombie_facts, monkeypatch, capsys, match=["train"], proc_root=host, orphan_grace=0)
    assert "failed" not in result, result
    facts = result["ansible_facts"]["zombie_facts"]
    assert facts["too_broad"] == [
        "match: 'train' selects pid 220 (ansible), which runs Ansible (a controller, one of its workers or a module)"]
    assert [p["pid"] for p in facts["job_processes"]] == [10, 11]
    assert 220 in {p["pid"] for p in facts["protected"]}


@pytest.mark.parametrize("module", [zombie_facts, zombie_reap])
def test_a_string_is_one_pattern_however_many_commas_it_holds(module, host, monkeypatch, capsys):
    args = {"match": r"train_\d{1,3}\.py", "protected": r"\bx{1,2}y\b", "proc_root": host}
    if module is zombie_reap:
        args["_ansible_check_mode"] = True
    result = run_module(module, monkeypatch, capsys, **args)
    assert "failed" not in result, result
    job = result["ansible_facts"]["zombie_facts"]["job_processes"] if module is zombie_facts else result["job"]
    assert {entry["pid"] for entry in job} == {10, 11}


@pytest.mark.parametrize("module", [zombie_facts, zombie_reap])
def test_a_pattern_option_that_is_neither_a_string_nor_a_list_names_the_option(module, host, monkeypatch, capsys):
    result = run_module(module, monkeypatch, capsys, match={"train": 1}, protected=[True], proc_root=host,
                        _ansible_check_mode=True)
    assert result["failed"]
    assert [p["option"] for p in result["option_problems"]][:2] == ["match", "protected"]
    assert "must be a string or a list of strings" in result["msg"]
