"""The relaunch role's variables checked inside the decision (plugin_utils/role_spec) against the role's own
argument spec, the shipped meta/argument_specs.yml, templated by a real Ansible templar."""

from __future__ import annotations

from typing import Any

from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar

try:
    # ansible-core 2.19 and later template only trusted strings (those of inventories, vars files, playbooks).
    from ansible.template import trust_as_template
except ImportError:
    def trust_as_template(value: str) -> str:
        return value

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_spec import OPTIONS, role_variable_errors

JOB = {"job_launch_name": "llm", "job_launch_command": ["python3", "train.py"]}


def errors(variables: dict[str, Any]) -> list[str]:
    """The check of `variables` as an inventory would give them (strings trusted as templates)."""
    task_vars = {name: trust_as_template(value) if isinstance(value, str) else value for name, value in variables.items()}
    # Before ansible-core 2.19 "{{ omit }}" renders the play's omit token, a variable of every task.
    task_vars["omit"] = "__omit_place_holder__test"
    return role_variable_errors(task_vars, Templar(loader=DataLoader(), variables=task_vars).template)


def test_the_shipped_spec_is_the_roles_main_entry_point():
    assert OPTIONS["job_launch_name"].get("required") is True and OPTIONS["job_launch_command"].get("required") is True
    assert OPTIONS["gpu_drain_timeout"]["type"] == "float"
    assert {"relaunch_force", "process_cleanup_match", "container_reset_allowed"} <= set(OPTIONS)


def test_a_job_with_its_name_and_command_passes_and_other_variables_are_not_its_business():
    assert errors(dict(JOB, gpu_drain_timeout=30, inventory_hostname="gpu1", some_other_var={"a": 1})) == []


def test_a_missing_name_or_command_and_a_wrong_type_are_named():
    assert errors({"job_launch_command": ["python3", "t.py"]}) == ["missing required arguments: job_launch_name"]
    found = errors(dict(JOB, gpu_drain_timeout="soon", process_cleanup_term_timeout="{{ 'x' * 2 }}"))
    assert len(found) == 2 and any("gpu_drain_timeout" in e and "float" in e for e in found), found
    assert any("process_cleanup_term_timeout" in e and "float" in e for e in found), found


def test_a_template_that_gives_the_values_is_what_is_checked():
    assert errors(dict(JOB, job_launch_min_uptime="{{ 2 * 3 }}", job_launch_backend="{{ 'supervisor' }}")) == []
    assert any("job_launch_backend" in e for e in errors(dict(JOB, job_launch_backend="{{ 'cron' }}")))


def test_omit_counts_as_unset():
    assert errors(dict(JOB, gpu_drain_timeout="{{ omit }}")) == []
    assert errors(dict(JOB, job_launch_name="{{ omit }}")) == ["missing required arguments: job_launch_name"]


def test_a_variable_that_does_not_template_is_named_and_control_characters_are_escaped():
    found = errors(dict(JOB, job_launch_log_path="{{ no_such_variable }}"))
    assert found and found[0].startswith("job_launch_log_path does not template: "), found
    # A choice's message quotes the value given.
    escaped = errors(dict(JOB, job_launch_backend="cron\x1b[2J"))
    assert len(escaped) == 1 and "\x1b" not in escaped[0] and "got: cron\\x1b[2J" in escaped[0], escaped


def test_a_number_that_is_not_finite_is_refused_before_its_step_would_refuse_it():
    found = errors(dict(JOB, gpu_drain_timeout=float("nan"), process_cleanup_term_timeout="inf", job_launch_min_uptime=2))
    assert sorted(found) == ["gpu_drain_timeout must be a finite number, got nan",
                             "process_cleanup_term_timeout must be a finite number, got inf"], found


def test_a_drain_environment_name_that_is_no_variable_name_is_refused_before_it_reaches_a_command_line():
    assert errors(dict(JOB, gpu_drain_environment={"PYTHONPATH": "/opt/nvml", "_X1": "a b;c"})) == []
    found = errors(dict(JOB, gpu_drain_environment={"X;touch /tmp/p;Y": "1", "1A": "x", "A=B": "x", "OK\x1b": "x",
                                                    "NUL": "a\0b"}))
    assert found == [
        "gpu_drain_environment: 'X;touch /tmp/p;Y' is not an environment variable name (letters, digits and _, not "
        "starting with a digit)",
        "gpu_drain_environment: '1A' is not an environment variable name (letters, digits and _, not starting with a digit)",
        "gpu_drain_environment: 'A=B' is not an environment variable name (letters, digits and _, not starting with a digit)",
        "gpu_drain_environment: 'OK\\x1b' is not an environment variable name (letters, digits and _, not starting with a "
        "digit)",
        "gpu_drain_environment: the value of NUL contains a NUL byte"], found


def test_what_ansible_would_convert_instead_of_refusing_is_refused_naming_the_variable():
    """Ansible's own check turns [[node1], node2] into ["['node1']", "node2"], [null, node1] into ["", "node1"] and
    ["x"] for a string into "['x']": each is refused, naming the variable, before anything runs."""
    found = errors(dict(JOB, job_launch_ranks=[["node1"], "node2"], job_launch_master_addr=["x"],
                        job_launch_resume_args=[None, "--resume"], job_launch_log_path={"a": 1},
                        gpu_drain_devices=["0", [1]], job_launch_remove_paths=["/tmp/x", ["/y"]]))
    assert found[:6] == [
        "job_launch_log_path must be a string, not a mapping: {'a': 1}",
        "job_launch_remove_paths must be a list of strings, and its item 1 is a list: ['/tmp/x', ['/y']]",
        "job_launch_resume_args must be a list of strings, and its item 0 is null: [None, '--resume']",
        "job_launch_ranks must be a list of strings, and its item 0 is a list: [['node1'], 'node2']",
        "job_launch_master_addr must be a string, not a list: ['x']",
        "gpu_drain_devices must be a list of strings, and its item 1 is a list: ['0', [1]]",
    ], found
    # A null for the whole variable means the module's default; numbers are text enough (Ansible's conversion).
    assert errors(dict(JOB, job_launch_master_addr=None, job_launch_ranks=["node1", 7], job_launch_user=1000)) == []
