"""_launch/spec.py: the health options are checked like every other, and resume_args never change the spec."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import JobSpec, options_from_params


def params(tmp_path, **overrides):
    base = {
        "name": "job", "state": "started", "command": ["python3", "train.py"], "shell": False,
        "chdir": None, "env": {}, "user": None, "group": None, "log_path": str(tmp_path / "train.log"),
        "keep_logs": 5, "state_dir": str(tmp_path / "state"), "backend": "auto", "startup_timeout": 60,
        "min_uptime": 5, "ready_regex": None, "term_timeout": 30, "remove_paths": [], "log_tail_lines": 20,
        "progress_regex": r"^step (\d+)", "stall_after": 60, "resume_args": ["--resume"],
        "max_relaunches": 3, "relaunch_window": 600,
    }
    base.update(overrides)
    return base


def test_good_options(tmp_path) -> None:
    options = options_from_params(params(tmp_path))
    assert options.progress_regex.pattern == r"^step (\d+)" and options.stall_after == 60.0
    assert options.resume_args == ("--resume",) and options.max_relaunches == 3 and options.relaunch_window == 600.0


def test_health_needs_no_command(tmp_path) -> None:
    options = options_from_params(params(tmp_path, state="health", command=None, log_path=None))
    assert options.state == "health" and options.spec is None


def test_unset_means_no_stall_detection_and_no_limit(tmp_path) -> None:
    options = options_from_params(params(tmp_path, progress_regex=None, stall_after=None, max_relaunches=None,
                                         relaunch_window=None, resume_args=None))
    assert options.stall_after is None and options.max_relaunches is None and options.relaunch_window == 3600.0
    assert options.resume_args == ()
    # The restart budget's defaults: no delay, the cause unknown (counted unless the run progressed).
    assert options.relaunch_delay == 0.0 and options.relaunch_max_delay == 600.0 and options.failure_cause == "unknown"


@pytest.mark.parametrize("overrides, named", [
    ({"stall_after": float("nan")}, ["stall_after"]),
    ({"stall_after": float("inf")}, ["stall_after"]),
    ({"stall_after": 0}, ["stall_after"]),
    ({"stall_after": 86401}, ["stall_after"]),
    ({"stall_after": "soon"}, ["stall_after"]),
    ({"progress_regex": "("}, ["progress_regex"]),
    ({"progress_regex": None}, ["stall_after"]),
    ({"resume_args": ["a\0b"]}, ["resume_args"]),
    ({"resume_args": "--resume"}, ["resume_args"]),
    ({"max_relaunches": -1}, ["max_relaunches"]),
    ({"max_relaunches": 1001}, ["max_relaunches"]),
    ({"relaunch_window": 0}, ["relaunch_window"]),
    ({"relaunch_window": float("nan")}, ["relaunch_window"]),
    ({"relaunch_delay": float("nan")}, ["relaunch_delay"]),
    ({"relaunch_delay": -1}, ["relaunch_delay"]),
    ({"relaunch_delay": 3601}, ["relaunch_delay"]),
    ({"relaunch_max_delay": float("inf")}, ["relaunch_max_delay"]),
    ({"relaunch_max_delay": 86401}, ["relaunch_max_delay"]),
    ({"relaunch_delay": 60, "relaunch_max_delay": 30}, ["relaunch_max_delay"]),
    ({"failure_cause": "cosmic rays"}, ["failure_cause"]),
])
def test_bad_options_are_named(tmp_path, overrides, named) -> None:
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(params(tmp_path, **overrides))
    assert caught.value.options == named


def test_resume_args_are_appended_but_not_hashed() -> None:
    spec = JobSpec(argv=("python3", "train.py"))
    assert spec.argv_with(("--resume", "a b")) == ["python3", "train.py", "--resume", "a b"]
    assert spec.argv_with(()) == ["python3", "train.py"]
    shell = JobSpec(argv=("/bin/bash", "-o", "pipefail", "-c", "./run.sh"), shell_command="./run.sh")
    assert shell.argv_with(("--resume", "a b")) == ["/bin/bash", "-o", "pipefail", "-c", "./run.sh --resume 'a b'"]
    assert shell.spec_hash == JobSpec(argv=("/bin/sh", "-c", "./run.sh")).spec_hash
