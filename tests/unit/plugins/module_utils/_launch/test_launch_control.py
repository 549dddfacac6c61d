"""_launch/control.py: the log is created and given to the job's user only as a regular file of its own."""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.control import LaunchController, LaunchError
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import options_from_params


@pytest.fixture
def controller(tmp_path) -> LaunchController:
    params = {
        "name": "job", "state": "started", "command": ["python3", "train.py"], "shell": False,
        "chdir": None, "env": {}, "user": "nobody", "group": None, "log_path": str(tmp_path / "train.log"),
        "keep_logs": 5, "state_dir": str(tmp_path / "state"), "backend": "supervisor", "startup_timeout": 60,
        "min_uptime": 5, "ready_regex": None, "term_timeout": 30, "remove_paths": [], "log_tail_lines": 20,
    }
    return LaunchController(options_from_params(params), check_mode=False)


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("root only\n")
    path.chmod(0o600)
    return path


def test_the_log_is_created_for_the_jobs_user(controller, tmp_path) -> None:
    controller._create_log("nobody", None)  # pylint: disable=protected-access
    assert (tmp_path / "train.log").stat().st_uid == 65534


def test_a_symlink_swapped_in_after_the_checks_is_not_followed(controller, tmp_path, secret) -> None:
    # The options were checked with no link there; the attacker swaps one in before the open.
    (tmp_path / "train.log").symlink_to(secret)
    with pytest.raises(LaunchError, match="^log_path: cannot open .* as a regular file"):
        controller._create_log("nobody", None)  # pylint: disable=protected-access
    assert secret.stat().st_uid == 0 and secret.read_text() == "root only\n"


def test_a_fifo_swapped_in_does_not_block(controller, tmp_path) -> None:
    os.mkfifo(tmp_path / "train.log")
    with pytest.raises(LaunchError, match="^log_path: "):
        controller._create_log("nobody", None)  # pylint: disable=protected-access


def test_a_hard_link_to_another_file_is_never_chowned(controller, tmp_path, secret) -> None:
    os.link(secret, tmp_path / "train.log")
    with pytest.raises(LaunchError, match="^log_path: .* has other hard links"):
        controller._create_log("nobody", None)  # pylint: disable=protected-access
    assert secret.stat().st_uid == 0
