"""train_launch run by a user who may not use state_dir or the log directory (the defaults are root's).

The module runs for real as nobody (setpriv), its arguments on stdin as AnsiballZ gives them: the
failure names the option and the role variable to set, and no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[5]
# No argument: AnsibleModule reads its arguments from stdin then.
RUN_MODULE = (f"import sys; sys.path.insert(0, {str(REPO / '.build' / 'collections')!r}); "
              "from ansible_collections.gpuops.relaunch.plugins.modules import train_launch; train_launch.main()")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to run the module as nobody")


def as_nobody(**args: Any) -> dict[str, Any]:
    """The module's result, run as nobody."""
    ran = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", RUN_MODULE],
        input=json.dumps({"ANSIBLE_MODULE_ARGS": {"name": "job", **args}}), capture_output=True, text=True,
        timeout=60, check=False, cwd="/")
    assert "Traceback" not in ran.stderr + ran.stdout, ran.stderr
    return json.loads(ran.stdout)


@pytest.fixture(name="roots")
def roots_fixture() -> Iterator[Path]:
    """A directory every user may enter but only root may write (as /var/lib and /var/log are)."""
    directory = Path(tempfile.mkdtemp(prefix="gpuops-roots-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(name="writable")
def writable_fixture() -> Iterator[Path]:
    """A directory nobody may write."""
    directory = Path(tempfile.mkdtemp(prefix="gpuops-nobody-", dir="/tmp"))
    os.chown(directory, 65534, 65534)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def problem(result: dict[str, Any], option: str) -> str:
    return next(entry["reason"] for entry in result["option_problems"] if entry["option"] == option)


@pytest.mark.parametrize("state", ["started", "probe", "stopped"])
def test_a_state_dir_it_may_not_create_names_the_option_and_the_role_variable(roots, writable, state) -> None:
    result = as_nobody(state=state, command=["/bin/true"], log_path=str(writable / "train.log"),
                       state_dir=str(roots / "gpuops"))
    assert result["failed"] is True
    assert result["msg"].startswith("state_dir: ") and "set state_dir (role variable job_launch_state_dir)" in result["msg"]
    assert "uid 65534" in problem(result, "state_dir")
    assert not (roots / "gpuops").exists()


@pytest.mark.parametrize("state", ["health", "probe"])
def test_records_it_may_not_read_are_not_taken_for_no_records(roots, writable, state) -> None:
    job_dir = roots / "gpuops" / "job"
    job_dir.mkdir(parents=True)
    job_dir.chmod(0o700)
    (job_dir / "run.json").write_text("{}")
    result = as_nobody(state=state, command=["/bin/true"], log_path=str(writable / "train.log"),
                       state_dir=str(roots / "gpuops"))
    assert result["failed"] is True and "health" not in result
    assert result["msg"] == ("state_dir: " + problem(result, "state_dir"))
    assert problem(result, "state_dir").startswith(f"cannot read the job's records in {job_dir}: Permission denied; "
                                                   "set state_dir (role variable job_launch_state_dir)")


def test_a_log_directory_it_may_not_create_names_the_option_and_the_role_variable(roots, writable) -> None:
    result = as_nobody(state="started", command=["/bin/true"], log_path=str(roots / "log" / "train.log"),
                       state_dir=str(writable))
    assert result["failed"] is True and [entry["option"] for entry in result["option_problems"]] == ["log_path"]
    assert "set log_path (role variable job_launch_log_path) to a directory uid 65534 may write" in result["msg"]
    assert not (roots / "log").exists() and not (writable / "job").exists()
