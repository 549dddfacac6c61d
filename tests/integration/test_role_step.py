"""The step roles through gpuops.relaunch.role_step, in one ansible-playbook run: a misspelt variable is refused
before any module runs, as a host variable and as a play variable, naming the variable meant; a bad value is
refused naming the role variable the user set, not the module option."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.harness.playbook import run_playbook

TYPO_HOST, CLEAN_HOST = "typo-host", "clean-host"
JOB_STEP = "gpuops.relaunch.job_launch : Launch the job and prove it started"
CLEANUP_STEP = "gpuops.relaunch.process_cleanup : End the job and clear its zombies with the least force that works"
REFUSED = "job_launch_ready_regx is not a variable of gpuops.relaunch (did you mean job_launch_ready_regex?)"


def include(role: str, **role_vars) -> dict:
    # ignore_errors (applied to the role's tasks) lets the next play run after a refusal.
    return {"name": f"include {role}", "ansible.builtin.include_role": {
        "name": f"gpuops.relaunch.{role}", "apply": {"ignore_errors": True, "check_mode": True}}, "vars": role_vars}


def test_a_typo_is_refused_before_any_module_runs_and_a_bad_value_names_its_variable(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    job = {"job_launch_name": "step-job", "job_launch_command": [sys.executable, "-c", "pass"],
           "job_launch_state_dir": str(state_dir), "job_launch_log_path": str(tmp_path / "logs" / "step.log")}
    inventory = tmp_path / "inventory"
    marker = tmp_path / "injected"
    inventory.write_text(
        f"{TYPO_HOST} ansible_connection=local ansible_python_interpreter={sys.executable} job_launch_ready_regx='^step 1 '\n"
        f"{CLEAN_HOST} ansible_connection=local ansible_python_interpreter={sys.executable}\n", encoding="utf-8")
    plays = [
        {"name": "host variable", "hosts": TYPO_HOST, "gather_facts": False, "tasks": [include("job_launch", **job)]},
        {"name": "play variable", "hosts": CLEAN_HOST, "gather_facts": False, "vars": {"job_launch_ready_regx": "^step 1 "},
         "tasks": [include("job_launch", **job), include("process_cleanup", process_cleanup_match=["step-job-nothing"])]},
        {"name": "bad value", "hosts": CLEAN_HOST, "gather_facts": False,
         "tasks": [include("job_launch", **job, job_launch_min_uptime=-1, job_launch_ready_regex="{{ omit }}",
                           job_launch_term_timeout="{{ 7 }}"),
                   # A drain environment name that would run as shell text on the module's command line.
                   include("gpu_drain", gpu_drain_environment={f"X;touch {marker};Y": "1"}, gpu_drain_gpus_required=False)]},
    ]
    run = run_playbook(plays, inventory=str(inventory))

    launches = run.tasks[JOB_STEP]
    for host, result in ((TYPO_HOST, launches[0]), (CLEAN_HOST, launches[1])):
        assert result["_host"] == host and result["failed"] is True, result
        assert result["msg"] == REFUSED and result["unknown_variables"] == [REFUSED], result
        assert "invocation" not in result  # refused on the controller: no module ran
    cleanup = run.result(CLEANUP_STEP, CLEAN_HOST)
    assert cleanup["failed"] is True and cleanup["msg"] == REFUSED and "invocation" not in cleanup, cleanup

    bad = launches[2]
    assert bad["failed"] is True and "invocation" in bad, bad.get("msg")
    assert bad["msg"].startswith("job_launch_min_uptime: "), bad["msg"]
    assert [problem["option"] for problem in bad["option_problems"]] == ["min_uptime"]
    # ... and so does the error ansible-core prints, which 2.19 and later take from the module's own message
    # unless the action drops it (seen with the default output, not the JSON the harness reads).
    printed = run_playbook(plays[2:], inventory=str(inventory), env={"ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default"})
    assert "job_launch_min_uptime: must be" in printed.stdout + printed.stderr, printed.stdout
    assert ": min_uptime: must be" not in printed.stdout + printed.stderr, printed.stdout + printed.stderr
    # The role defaults reached the module with the variables set.
    assert bad["invocation"]["module_args"]["max_relaunches"] == 3
    assert bad["invocation"]["module_args"]["name"] == "step-job"
    # Each variable is templated; one whose value is omit is left out, as an unset one.
    assert float(bad["invocation"]["module_args"]["term_timeout"]) == 7
    assert bad["invocation"]["module_args"]["ready_regex"] is None  # the module's default: not passed
    assert not state_dir.exists()
    drain = run.result("gpuops.relaunch.gpu_drain : Wait until the GPUs are released", CLEAN_HOST)
    assert drain["failed"] is True and "invocation" not in drain and not marker.exists(), drain
    assert drain["msg"] == (f"gpu_drain_environment: 'X;touch {marker};Y' is not an environment variable name (letters, "
                            f"digits and _, not starting with a digit)"), drain["msg"]
