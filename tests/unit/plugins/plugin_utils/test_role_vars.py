"""The one declaration of the roles' variables (plugin_utils/role_vars): the map to module options, the defaults,
the fallbacks, the failure messages and the refusal of unknown names."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import (
    PREFIXES, VARIABLES, known_names, module_args, name_the_variables, role_var, unknown_variables, variables,
)


def lookup_in(values: dict):
    """lookup() over a dict of set variables: a missing one raises KeyError, as an unset variable does."""
    def lookup(name: str):
        return values[name]
    return lookup


def test_a_job_with_only_its_name_and_command_gets_the_role_defaults():
    args = module_args("train_launch", lookup_in({"job_launch_name": "llm", "job_launch_command": ["python3", "t.py"],
                                                  "inventory_hostname": "gpu1"}))
    assert args == {"name": "llm", "command": ["python3", "t.py"], "state": "started",
                    "log_path": "/var/log/gpuops/llm.log", "metrics_host": "gpu1",
                    "max_relaunches": 3, "relaunch_window": 3600, "reset_guard": False}


def test_set_variables_win_over_the_role_defaults_and_each_goes_to_its_option():
    args = module_args("train_launch", lookup_in({
        "job_launch_name": "llm", "job_launch_log_path": "/data/llm.log", "job_launch_max_relaunches": 7,
        "job_launch_ready_regex": "^ready", "job_launch_term_timeout": 5, "job_launch_state": "restarted"}))
    assert args["log_path"] == "/data/llm.log"
    assert args["max_relaunches"] == 7
    assert args["ready_regex"] == "^ready"
    assert args["term_timeout"] == 5
    assert args["state"] == "restarted"


def test_an_unset_variable_without_role_default_is_left_to_the_module():
    args = module_args("train_launch", lookup_in({"job_launch_name": "llm"}))
    for option in ("command", "shell", "chdir", "env", "ready_regex", "term_timeout", "state_dir", "metrics_dir"):
        assert option not in args


def test_null_is_the_modules_default_even_where_the_role_has_one():
    """max_relaunches: null turns the crash-loop guard off, as the module's own default (no limit) does."""
    args = module_args("train_launch", lookup_in({"job_launch_name": "llm", "job_launch_max_relaunches": None,
                                                  "job_launch_term_timeout": None}))
    assert "max_relaunches" not in args
    assert "term_timeout" not in args


def test_the_log_path_follows_the_name_and_is_left_out_without_one():
    assert "log_path" not in module_args("train_launch", lookup_in({}))
    assert "log_path" not in module_args("train_launch", lookup_in({"job_launch_name": None}))


def test_an_empty_metrics_dir_keeps_none_but_an_empty_ready_regex_is_passed():
    args = module_args("train_launch", lookup_in({"job_launch_metrics_dir": "", "job_launch_ready_regex": ""}))
    assert "metrics_dir" not in args
    assert args["ready_regex"] == ""


def test_the_cleanup_takes_the_jobs_name_and_state_dir_unless_it_has_its_own():
    job = {"job_launch_name": "llm", "job_launch_state_dir": "/srv/gpuops"}
    assert module_args("zombie_reap", lookup_in(job)) == {
        "match": [], "pids": [], "job_name": "llm", "job_state_dir": "/srv/gpuops"}
    own = module_args("zombie_reap", lookup_in({**job, "process_cleanup_job_name": "other",
                                               "process_cleanup_job_state_dir": "/var/x"}))
    assert (own["job_name"], own["job_state_dir"]) == ("other", "/var/x")
    assert module_args("zombie_reap", lookup_in({})) == {"match": [], "pids": []}


def test_protected_null_or_empty_keeps_the_modules_default():
    for value in (None, ""):
        assert "protected" not in module_args("zombie_reap", lookup_in({"process_cleanup_protected": value}))
    assert module_args("zombie_reap", lookup_in({"process_cleanup_protected": ["x"]}))["protected"] == ["x"]


def test_the_drain_passes_only_what_is_set():
    assert module_args("gpu_mem_wait", lookup_in({"gpu_drain_max_used_mib": None})) == {}
    assert module_args("gpu_mem_wait", lookup_in({"gpu_drain_timeout": 9, "gpu_drain_environment": {"A": "1"}})) == {
        "timeout": 9}


def test_the_container_reset_treats_empty_api_values_as_unset():
    args = module_args("proxmox_ct_reboot", lookup_in({"container_reset_vmid": 101, "container_reset_api_host": "",
                                                       "inventory_hostname": "gpu1", "container_reset_method": "reboot"}))
    assert args == {"vmid": 101, "expected_hostname": "gpu1", "method": "reboot"}


def test_a_module_without_role_variables_is_an_error():
    with pytest.raises(ValueError, match="relaunch_summary"):
        module_args("relaunch_summary", lookup_in({}))


def test_role_var_names_the_variable_of_an_option():
    assert role_var("train_launch", "command") == "job_launch_command"
    assert role_var("zombie_reap", "term_timeout") == "process_cleanup_term_timeout"
    assert role_var("gpu_mem_wait", "max_used_mib") == "gpu_drain_max_used_mib"
    assert role_var("train_launch", "force") is None
    assert role_var("zombie_reap", "fail_on_escalation") is None


def test_each_variable_is_declared_once_and_each_option_has_one_variable():
    names = [var.name for var in VARIABLES]
    assert len(names) == len(set(names))
    options = [(var.module, var.option) for var in VARIABLES if var.module]
    assert len(options) == len(set(options))
    for var in VARIABLES:
        assert var.name.startswith(PREFIXES)


def test_failure_messages_name_the_role_variable_and_keep_the_reason():
    message = "command: must be a list unless shell is true; term_timeout: must be 0 or more, got -1"
    problems = [{"option": "command", "reason": "must be a list unless shell is true"},
                {"option": "term_timeout", "reason": "must be 0 or more, got -1"}]
    assert name_the_variables("train_launch", message, problems) == (
        "job_launch_command: must be a list unless shell is true; job_launch_term_timeout: must be 0 or more, got -1")


def test_an_option_the_task_gave_itself_or_without_variable_keeps_its_name():
    problems = [{"option": "state", "reason": "r1"}, {"option": "force", "reason": "r2"}]
    assert name_the_variables("train_launch", "state: r1; force: r2", problems, explicit=["state"]) == "state: r1; force: r2"


def test_a_problem_the_message_does_not_quote_is_added():
    problems = [{"option": "match", "reason": "not a regular expression"}]
    assert name_the_variables("zombie_reap", "bad options", problems) == (
        "bad options; process_cleanup_match: not a regular expression")


def test_an_option_name_inside_a_longer_name_is_not_rewritten():
    problems = [{"option": "timeout", "reason": "must be more than 0"}]
    message = "query_timeout: must be more than 0; timeout: must be more than 0"
    assert name_the_variables("gpu_mem_wait", message, problems) == (
        "query_timeout: must be more than 0; gpu_drain_timeout: must be more than 0")


def test_a_typo_is_refused_with_the_closest_known_name():
    assert unknown_variables(["job_launch_ready_regx", "process_cleanup_term_timout", "job_launch_name"]) == [
        "job_launch_ready_regx is not a variable of gpuops.relaunch (did you mean job_launch_ready_regex?)",
        "process_cleanup_term_timout is not a variable of gpuops.relaunch (did you mean process_cleanup_term_timeout?)"]


def test_a_name_close_to_nothing_gets_no_suggestion_and_other_names_pass():
    assert unknown_variables(["relaunch_zzz_qqq", "ansible_host", "my_job_launch_x"]) == [
        "relaunch_zzz_qqq is not a variable of gpuops.relaunch"]


def test_facts_and_registered_names_are_known():
    for name in ("relaunch_probe", "relaunch_summary", "process_cleanup_result", "job_launch_result",
                 "gpu_drain_released", "container_reset_result", "relaunch_hosts", "relaunch_serial"):
        assert name in known_names()
    assert unknown_variables(["relaunch_probe", "job_launch_result", "gpu_drain_needs_reboot"]) == []


def test_the_relaunch_role_lists_every_variable_of_the_steps_it_runs():
    listed = {var.name for var in variables(role="relaunch")}
    for module in ("train_launch", "zombie_reap", "gpu_mem_wait", "proxmox_ct_reboot"):
        assert {var.name for var in variables(module=module) if var.name != "job_launch_state"} <= listed
    assert "relaunch_force" in listed and "job_launch_ranks" in listed
