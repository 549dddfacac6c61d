"""_launch/spec.py: the spec hash, the checks on user input, and the preflight of a start."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import (
    JobSpec,
    check_remove_paths,
    options_from_params,
    preflight_start,
    shell_launcher,
)


def params(tmp_path, **overrides):
    base = {
        "name": "job", "state": "started", "command": ["python3", "train.py"], "shell": False,
        "chdir": None, "env": {}, "user": None, "group": None, "log_path": str(tmp_path / "train.log"),
        "keep_logs": 5, "state_dir": str(tmp_path / "state"), "backend": "auto", "startup_timeout": 60,
        "min_uptime": 5, "ready_regex": None, "term_timeout": 30, "remove_paths": [], "log_tail_lines": 20,
    }
    base.update(overrides)
    return base


def checked(parameters):
    """The options, after the preflight a start runs (in check mode and for real alike)."""
    options = options_from_params(parameters)
    preflight_start(options)
    return options


def test_hash_is_stable_and_sees_every_part() -> None:
    spec = JobSpec(argv=("python3", "train.py"), env=(("A", "1"),), chdir="/w", user="root", group="root")
    assert spec.spec_hash == JobSpec(argv=("python3", "train.py"), env=(("A", "1"),), chdir="/w",
                                     user="root", group="root").spec_hash
    variants = [
        JobSpec(argv=("python3", "train.py", "--x"), env=(("A", "1"),), chdir="/w", user="root", group="root"),
        JobSpec(argv=("python3", "train.py"), env=(("A", "2"),), chdir="/w", user="root", group="root"),
        JobSpec(argv=("python3", "train.py"), env=(("A", "1"),), chdir="/v", user="root", group="root"),
        JobSpec(argv=("python3", "train.py"), env=(("A", "1"),), chdir="/w", user=None, group="root"),
        JobSpec(argv=("python3", "train.py"), env=(("A", "1"),), chdir="/w", user="root", group=None),
    ]
    assert len({spec.spec_hash} | {v.spec_hash for v in variants}) == 6


def test_the_umask_goes_to_the_launch_but_not_into_the_hash(tmp_path) -> None:
    default = options_from_params(params(tmp_path))
    private = options_from_params(params(tmp_path, umask="0077"))
    assert default.launch_fields(False)["umask"] == 0o022 and private.launch_fields(False)["umask"] == 0o077
    assert options_from_params(params(tmp_path, umask="027")).umask == 0o027
    assert default.spec.spec_hash == private.spec.spec_hash


def test_env_order_does_not_change_the_hash(tmp_path) -> None:
    one = options_from_params(params(tmp_path, env={"A": "1", "B": "2"}))
    two = options_from_params(params(tmp_path, env={"B": "2", "A": "1"}))
    assert one.spec.spec_hash == two.spec.spec_hash


def test_shell_wraps_the_string(tmp_path) -> None:
    options = options_from_params(params(tmp_path, command="echo hi | cat", shell=True))
    assert options.spec.argv == (*shell_launcher(), "-c", "echo hi | cat")
    assert options.job_dir == str(tmp_path / "state" / "job")
    # The hash is the one earlier versions gave (/bin/sh -c COMMAND): a new shell restarts no running job.
    assert options.spec.spec_hash == JobSpec(argv=("/bin/sh", "-c", "echo hi | cat")).spec_hash


HAS_BASH = any(os.access(path, os.X_OK) for path in ("/bin/bash", "/usr/bin/bash"))


@pytest.mark.skipif(not HAS_BASH, reason="bash is not installed")
def test_a_shell_command_runs_under_bash_with_pipefail(tmp_path) -> None:
    options = options_from_params(params(tmp_path, command="echo hi | cat", shell=True))
    assert options.spec.argv[0] in ("/bin/bash", "/usr/bin/bash")
    assert options.spec.argv[1:] == ("-o", "pipefail", "-c", "echo hi | cat")


@pytest.mark.skipif(not HAS_BASH, reason="bash is not installed")
def test_a_process_killed_inside_a_shell_pipeline_is_not_hidden(tmp_path) -> None:
    """`train | tee`: the pipeline's status is the killed process's (128+9), not tee's 0."""
    killed = f"{shlex.quote(sys.executable)} -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)' | cat"
    options = options_from_params(params(tmp_path, command=killed, shell=True))
    ended = subprocess.run(options.spec.argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False)
    assert ended.returncode == 128 + signal.SIGKILL, ended


def test_the_shell_falls_back_to_sh_with_pipefail_only_where_it_has_it(tmp_path) -> None:
    # dash before 0.5.13 refuses `-o pipefail` (its shell then would end at once): plain sh -c there.
    no_pipefail = tmp_path / "sh-without-pipefail"
    no_pipefail.write_text('#!/bin/sh\nfor arg; do [ "$arg" = pipefail ] && exit 2; done\nexit 0\n')
    no_pipefail.chmod(0o755)
    assert shell_launcher(bash_candidates=(), sh=str(no_pipefail)) == (str(no_pipefail),)
    with_pipefail = tmp_path / "sh-with-pipefail"
    with_pipefail.write_text("#!/bin/sh\nexit 0\n")
    with_pipefail.chmod(0o755)
    assert shell_launcher(bash_candidates=(), sh=str(with_pipefail)) == (str(with_pipefail), "-o", "pipefail")
    assert shell_launcher(bash_candidates=(str(tmp_path / "no-bash"), str(with_pipefail)),
                          sh=str(no_pipefail)) == (str(with_pipefail), "-o", "pipefail")


def test_job_environment_is_clean_plus_env(tmp_path) -> None:
    env = options_from_params(params(tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"})).spec.job_environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["PATH"].startswith("/usr/local/sbin")
    assert "PYTHONPATH" not in env and "ANSIBLE_MODULE_ARGS" not in env


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"command": []}, "command: must be a non-empty list"),
        ({"command": ""}, "command: a string is only accepted with shell=true"),
        ({"command": "x y"}, "shell=true"),
        ({"command": [""]}, "command: the program"),
        ({"command": ["a"], "shell": True}, "with shell=true, command must be a non-empty string"),
        ({"command": None}, "command: required with state=started"),
        ({"log_path": None}, "log_path: required"),
        ({"log_path": "rel/train.log"}, "log_path: 'rel/train.log' is not an absolute path"),
        ({"log_path": "/dev/null/logs/train.log"}, "log_path: the log directory '/dev/null/logs' cannot be reached safely: /dev/null is not a directory"),
        ({"state_dir": "state"}, "state_dir:"),
        ({"chdir": "/nonexistent-dir-gpuops"}, "chdir:"),
        ({"user": "no-such-user-gpuops"}, "user: no such user"),
        ({"group": "no-such-group-gpuops"}, "group: no such group"),
        ({"ready_regex": "("}, "ready_regex: '(' is not a valid regular expression"),
        ({"name": "a/b"}, "name:"),
        ({"name": ""}, "name:"),
        ({"env": {"A=B": "1"}}, "env:"),
        ({"min_uptime": 10, "startup_timeout": 5}, "min_uptime:"),
        ({"term_timeout": -1}, "term_timeout: must be at least 0"),
        ({"term_timeout": float("nan")}, "term_timeout: must be a finite number"),
        ({"startup_timeout": float("inf")}, "startup_timeout: must be a finite number"),
        ({"startup_timeout": 1e12}, "startup_timeout: must be at least 0 and at most 86400"),
        ({"min_uptime": float("nan")}, "min_uptime: must be a finite number"),
        ({"keep_logs": 0}, "keep_logs:"),
        ({"keep_logs": 10 ** 6}, "keep_logs: must be between 1 and 1000"),
        ({"log_tail_lines": -1}, "log_tail_lines:"),
        ({"command": ["python3", "a\0b"]}, "command: argument 1 contains a NUL byte"),
        ({"env": {"A": "x\0y"}}, "env: the value of A contains a NUL byte"),
        ({"command": ["no-such-program-gpuops"]}, "command: 'no-such-program-gpuops' is not an executable file on PATH"),
        ({"command": ["python3"], "env": {"PATH": "/nonexistent-dir-gpuops"}}, "on PATH /nonexistent-dir-gpuops"),
        ({"command": ["./train.sh"], "chdir": "/tmp"}, "command: './train.sh' is not an executable file in /tmp"),
        ({"command": ["/etc/passwd"]}, "command: '/etc/passwd' is not an executable file for user"),
        ({"umask": 18}, "umask: must be a string of 3 or 4 octal digits from 0000 to 0777, like '0022' (got '18') "
                        "(an unquoted YAML number"),
        ({"umask": "1777"}, "umask: must be a string of 3 or 4 octal digits"),
        ({"umask": "0o22"}, "umask: must be a string of 3 or 4 octal digits"),
        ({"umask": "08"}, "umask: must be a string of 3 or 4 octal digits"),
    ],
)
def test_bad_input_names_the_option(tmp_path, overrides, message) -> None:
    with pytest.raises(OptionsInvalid) as caught:
        checked(params(tmp_path, **overrides))
    assert message in str(caught.value)


def test_a_log_directory_that_can_be_created_is_accepted(tmp_path) -> None:
    # The start creates it, so the probe and the start agree: both accept it.
    later = params(tmp_path, log_path=str(tmp_path / "logs" / "deeper" / "train.log"))
    assert checked(later).log_path == str(tmp_path / "logs" / "deeper" / "train.log")
    assert not (tmp_path / "logs").exists()  # the preflight only looks


def test_a_log_directory_that_cannot_be_created_names_what_is_in_the_way(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OptionsInvalid, match=r"^log_path: the log directory '.*/file/logs' cannot be reached "
                                             r"safely: .*/file is not a directory"):
        checked(params(tmp_path, log_path=str(tmp_path / "file" / "logs" / "train.log")))


def test_a_state_dir_that_cannot_hold_the_records_is_refused_before_a_start(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OptionsInvalid, match=r"^state_dir: .*/file is not a directory"):
        checked(params(tmp_path, state_dir=str(tmp_path / "file" / "state")))


def test_a_log_with_another_hard_link_is_refused(tmp_path) -> None:
    (tmp_path / "other").write_text("someone else's")
    os.link(tmp_path / "other", tmp_path / "train.log")
    with pytest.raises(OptionsInvalid, match="^log_path: .*has other hard links"):
        checked(params(tmp_path))


def test_a_running_job_is_not_asked_for_what_only_a_start_needs(tmp_path) -> None:
    # options_from_params checks what the user wrote; the machine is the preflight's (run only
    # before a start), so a job found running with this spec is reported as such.
    options = options_from_params(params(tmp_path, command=["no-such-program-gpuops"]))
    with pytest.raises(OptionsInvalid, match="^command: 'no-such-program-gpuops'"):
        preflight_start(options)


@pytest.fixture(name="open_dir")
def open_dir_fixture():
    """A directory under /tmp that every user may pass (pytest's tmp_path lies below a 0700 one)."""
    base = Path(tempfile.mkdtemp(prefix="gpuops-spec-", dir="/tmp"))
    try:
        base.chmod(0o755)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_program_is_resolved_as_the_jobs_user(tmp_path, open_dir) -> None:
    script = open_dir / "train.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o700)  # root may run it; nobody may not
    assert checked(params(tmp_path, command=["./train.sh"], chdir=str(open_dir))).spec.argv[0] == "./train.sh"
    with pytest.raises(OptionsInvalid, match="command: './train.sh' is not an executable file in .* for user nobody"):
        checked(params(tmp_path, command=["./train.sh"], chdir=str(open_dir), user="nobody"))
    script.chmod(0o755)
    assert checked(params(tmp_path, command=[str(script)], user="nobody")).spec.user == "nobody"


def test_the_program_and_chdir_are_checked_as_the_jobs_user_would_reach_them(tmp_path, open_dir) -> None:
    """Mode bits say nobody may run the program, but nobody cannot pass the directory above it: the
    preflight asks as nobody (a child that became nobody), so the start is refused before any stop."""
    base = open_dir
    (base / "closed").mkdir(mode=0o700)  # root's, 0700: nobody may not pass
    script = base / "closed" / "train.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert checked(params(tmp_path, command=[str(script)])).spec.user is None  # root may
    with pytest.raises(OptionsInvalid) as caught:
        checked(params(tmp_path, command=[str(script)], user="nobody"))
    assert caught.value.options == ["command"]
    assert f"command: '{script}' is not an executable file for user nobody (Permission denied)" in str(caught.value)
    # A working directory nobody cannot enter: named as chdir, the program not looked up from it.
    with pytest.raises(OptionsInvalid) as caught:
        checked(params(tmp_path, command=["./train.sh"], chdir=str(base / "closed"), user="nobody"))
    assert caught.value.options == ["chdir"]
    assert f"chdir: the working directory '{base}/closed' cannot be entered as user nobody: Permission denied" \
        in str(caught.value)
    # A working directory nobody swapped for a link into root's directory: entered as nobody, refused.
    home = base / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    os.symlink(base / "closed", home / "work")
    os.lchown(home / "work", 65534, 65534)
    with pytest.raises(OptionsInvalid, match="^chdir: .* cannot be entered as user nobody: Permission denied"):
        checked(params(tmp_path, command=["./train.sh"], chdir=str(home / "work"), user="nobody"))
    # A job of root's: the same link is never followed (walked as the log is).
    with pytest.raises(OptionsInvalid, match=f"^chdir: .*{home}/work is a symbolic link that a user other than root"):
        checked(params(tmp_path, command=["./train.sh"], chdir=str(home / "work")))
    assert checked(params(tmp_path, command=["./train.sh"], chdir=str(base / "closed"))).spec.chdir == str(base / "closed")


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_symlink_or_fifo_at_log_path_is_refused(tmp_path, kind) -> None:
    log = tmp_path / "train.log"
    if kind == "symlink":
        (tmp_path / "secret").write_text("root only")
        log.symlink_to(tmp_path / "secret")
    else:
        os.mkfifo(log)
    with pytest.raises(OptionsInvalid, match="^log_path: .*(symbolic link|not a regular file)"):
        checked(params(tmp_path))


def test_log_path_that_is_a_directory(tmp_path) -> None:
    (tmp_path / "train.log").mkdir()
    with pytest.raises(OptionsInvalid, match="is a directory"):
        checked(params(tmp_path))


def test_stopped_needs_no_command(tmp_path) -> None:
    options = options_from_params(params(tmp_path, state="stopped", command=None, log_path=None))
    assert options.spec is None and options.state == "stopped"


@pytest.mark.parametrize("path", ["/", "//", "/tmp/..", "/./", "relative", "", "./x"])
def test_remove_paths_refuses_root_and_relative(path) -> None:
    with pytest.raises(BadOption, match="remove_paths:"):
        check_remove_paths([path])


def test_remove_paths_are_normalised() -> None:
    assert check_remove_paths(["/tmp/torchinductor_root/", "/tmp/a/../b"]) == ("/tmp/torchinductor_root", "/tmp/b")


def test_every_problem_is_reported_at_once_naming_each_option(tmp_path) -> None:
    bad = params(tmp_path, name="a/b", ready_regex="(", term_timeout=float("nan"), keep_logs=0,
                 env={"A": "x\0y"}, user="no-such-user-gpuops")
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(bad)
    assert caught.value.options == ["name", "env", "user", "ready_regex", "term_timeout", "keep_logs"]
    assert len(caught.value.problems) == 6


def test_the_program_is_looked_up_only_with_the_options_it_needs_sound(tmp_path) -> None:
    # Looking up a program for a user that does not exist would only repeat that problem.
    with pytest.raises(OptionsInvalid) as caught:
        checked(params(tmp_path, command=["no-such-program-gpuops"], user="no-such-user-gpuops"))
    assert caught.value.options == ["user"]


def test_an_internal_error_is_not_reported_as_a_bad_option(tmp_path, monkeypatch) -> None:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import spec

    def broken(*_args):
        raise ValueError("a bug, not the user's value")

    monkeypatch.setattr(spec, "resolve_program", broken)
    with pytest.raises(ValueError, match="a bug") as caught:
        checked(params(tmp_path))
    assert not isinstance(caught.value, BadOption)


# --- the run-id fence: expect_run_id, state=stopped only ------------------------------------------------------------

def test_expect_run_id_is_a_run_id_or_empty_and_only_for_a_stop(tmp_path) -> None:
    stop = {"state": "stopped", "command": None}
    assert options_from_params(params(tmp_path, **stop)).expect_run_id is None
    assert options_from_params(params(tmp_path, expect_run_id="", **stop)).expect_run_id == ""
    assert options_from_params(params(tmp_path, expect_run_id="3f2a9c0e", **stop)).expect_run_id == "3f2a9c0e"
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(params(tmp_path, expect_run_id="../x\x1b", **stop))
    assert caught.value.options == ["expect_run_id"] and "'../x\\x1b' is not a run id" in str(caught.value)
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(params(tmp_path, expect_run_id="3f2a9c0e"))
    assert caught.value.options == ["expect_run_id"]
    assert "expect_run_id: only with state=stopped (the run a stop is for), not with state=started" in str(caught.value)


def test_the_jobs_gpus_go_into_the_live_settings_with_where_pynvml_was_found(tmp_path) -> None:
    options = options_from_params(params(tmp_path, metrics_dir=str(tmp_path), metrics_host="h", metrics_gpus=["0", "GPU-a"]))
    stored = options.stored_health()["live"]["gpus"]
    assert stored["devices"] == ["0", "GPU-a"] and ("nvml_path" in stored)
    assert "gpus" not in options_from_params(params(tmp_path, metrics_dir=str(tmp_path), metrics_host="h")).stored_health()["live"]


@pytest.mark.parametrize("extra, why", [
    ({"metrics_gpus": ["0"]}, "needs metrics_dir"),
    ({"metrics_dir": "/m", "metrics_host": "h", "metrics_gpus": ["0", "{{ x }}"]}, "GPU indices or UUIDs"),
    ({"metrics_dir": "/m", "metrics_host": "h", "metrics_gpus": [str(i) for i in range(65)]}, "at most 64"),
])
def test_metrics_gpus_that_cannot_work_are_named(tmp_path, extra, why) -> None:
    with pytest.raises(OptionsInvalid, match=f"^metrics_gpus: .*{why}"):
        options_from_params(params(tmp_path, **extra))


def test_checkpoint_options_are_checked_and_stored_for_the_live_file(tmp_path) -> None:
    with pytest.raises(OptionsInvalid, match=r"resume_args: \{checkpoint\} and \{step\} need checkpoint_dir"):
        options_from_params(params(tmp_path, resume_args=["--resume", "{checkpoint}"]))
    with pytest.raises(OptionsInvalid) as caught:
        options_from_params(params(tmp_path, checkpoint_dir="ckpt", checkpoint_marker="../x", checkpoint_step=-2))
    assert {problem["option"] for problem in caught.value.as_result()["option_problems"]} == {
        "checkpoint_dir", "checkpoint_marker", "checkpoint_step"}
    options = options_from_params(params(tmp_path, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_format="dcp",
                                         resume_args=["--resume", "{checkpoint}"], checkpoint_step=200))
    assert options.checkpoint_step == 200 and options.checkpoint_missing == "fresh"
    assert options.launch_fields(True)["checkpoint"] == {"dir": str(tmp_path / "ckpt"), "format": "dcp",
                                                         "marker": "COMPLETE"}
    assert "checkpoint" not in options_from_params(params(tmp_path)).launch_fields(False)


def test_the_resume_fills_the_placeholders_or_starts_fresh_or_refuses(tmp_path) -> None:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.resume import choose  # pylint: disable=import-outside-toplevel
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):
        (ckpt / f"run-{step}").mkdir(parents=True)
    (ckpt / "run-1" / "COMPLETE").write_text("")

    def options(**more):
        return options_from_params(params(tmp_path, checkpoint_dir=str(ckpt), checkpoint_format="marker",
                                          resume_args=["--from", "{checkpoint}", "--step={step}"], **more))

    chosen = choose(options(), True)
    assert chosen.resume and chosen.resume_args == ("--from", str(ckpt / "run-1"), "--step=1")
    assert chosen.as_result()["torn_skipped"] == 1 and chosen.as_result()["resumed"] is True
    assert not choose(options(), False).resume  # a start that does not resume only reports
    assert choose(options(checkpoint_step=-1), True).resume_args == ()  # the ranks share none: fresh
    (ckpt / "run-1" / "COMPLETE").unlink()
    fresh = choose(options(), True)
    assert not fresh.resume and fresh.resume_args == () and fresh.refusal is None
    refused = choose(options(checkpoint_missing="refuse"), True)
    assert refused.refusal.startswith("checkpoint_missing=refuse and no complete checkpoint in")
    (ckpt / "run-1" / "COMPLETE").write_text("")
    assert choose(options(checkpoint_rename_torn=True), True).as_result()["renamed"] == []  # only once stopped
    renamed = choose(options(checkpoint_rename_torn=True), True, rename=True)
    assert renamed.as_result()["renamed"] == [str(ckpt / "run-2.torn")] and (ckpt / "run-1").is_dir()
