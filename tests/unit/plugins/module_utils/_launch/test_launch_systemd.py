"""_launch/systemd.py: the transient unit the module asks systemd for (properties checked offline)."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import systemd
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import NAME_PATTERN
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.systemd import (
    main_pid,
    parse_show,
    quote_exec_arg,
    systemd_run_argv,
    unit_active,
    unit_name,
)


def build(**overrides):
    args = {
        "unit": unit_name("llm"),
        "exec_job": ["/usr/bin/python3", "-I", "/var/lib/gpuops/llm/supervisor.py", "exec", "/var/lib/gpuops/llm", "abc"],
        "mark": {"GPUOPS_RELAUNCH_RUN": "/var/lib/gpuops/llm:abc"},
        "term_timeout": 30,
        "record_exit": ["/usr/bin/python3", "/var/lib/gpuops/llm/supervisor.py", "record-exit",
                        "/var/lib/gpuops/llm", "abc"],
        "description": "gpuops.relaunch job llm",
    }
    args.update(overrides)
    return systemd_run_argv(**args)


def test_unit_properties() -> None:
    cmd = build()
    assert cmd[0] == "systemd-run"
    assert "--unit=gpuops-llm.service" in cmd and "--collect" in cmd
    assert "--property=KillMode=mixed" in cmd
    assert "--property=TimeoutStopSec=30s" in cmd
    assert "--property=StandardInput=null" in cmd
    assert "--setenv=GPUOPS_RELAUNCH_RUN=/var/lib/gpuops/llm:abc" in cmd
    # The main process is the supervisor program's exec mode, which opens the log and becomes the job.
    assert cmd[cmd.index("--") + 1:] == ["/usr/bin/python3", "-I", "/var/lib/gpuops/llm/supervisor.py", "exec",
                                         "/var/lib/gpuops/llm", "abc"]


def test_systemd_never_opens_the_log_and_never_holds_the_environment() -> None:
    # StandardOutput=append:PATH has PID 1 open the path as root after our checks (a symlink the
    # job's user swapped in meanwhile is followed); Environment= is readable by every user.
    cmd = build()
    assert not [arg for arg in cmd if arg.startswith(("--property=StandardOutput", "--property=StandardError"))]
    assert not [arg for arg in cmd if arg.startswith(("--property=User=", "--property=Group=",
                                                      "--property=WorkingDirectory="))]
    assert [arg for arg in cmd if arg.startswith("--setenv=")] == ["--setenv=GPUOPS_RELAUNCH_RUN=/var/lib/gpuops/llm:abc"]


def test_exit_status_is_recorded_by_a_privileged_exec_stop_post() -> None:
    # --collect makes a finished unit vanish, so the status must be written by the unit itself.
    (stop_post,) = [arg for arg in build() if arg.startswith("--property=ExecStopPost=")]
    assert stop_post == ('--property=ExecStopPost=+"/usr/bin/python3" "/var/lib/gpuops/llm/supervisor.py" '
                         '"record-exit" "/var/lib/gpuops/llm" "abc"')


def test_exec_quoting_escapes_specifiers_and_variables() -> None:
    assert quote_exec_arg('/st ate/%i/$HOME/"q"\\') == '"/st ate/%%i/$$HOME/\\"q\\"\\\\"'


def test_parse_show() -> None:
    shown = parse_show("LoadState=loaded\nActiveState=active\nMainPID=42\nInvocationID=ab=cd\n")
    assert shown == {"LoadState": "loaded", "ActiveState": "active", "MainPID": "42", "InvocationID": "ab=cd"}
    assert unit_active(shown) and main_pid(shown) == 42
    gone = parse_show("LoadState=not-found\nActiveState=inactive\nMainPID=0\n")
    assert not unit_active(gone) and main_pid(gone) == 0
    assert main_pid({}) == 0


@pytest.mark.parametrize("name", ["a", "a-live", "live", "x.y_z-1"])
def test_the_live_unit_is_never_another_jobs_unit(name) -> None:
    """The start stops an earlier live unit of the job first: its name must never be a job's own unit
    ("gpuops-a-live.service" is the job "a-live"'s)."""
    live = systemd.live_unit_name(name)
    assert live == f"gpuops-live:{name}.service"
    for other in ("a", "a-live", "live", "live:a", "x.y_z-1", name):
        if NAME_PATTERN.match(other):
            assert systemd.unit_name(other) != live
    argv = systemd.live_unit_argv("gpuops-a.service", live, ["/usr/bin/python3", "-I", "/s/live.py", "watch", "/s", "r"],
                                  "d")
    assert "--property=BindsTo=gpuops-a.service" in argv and argv[argv.index("--") + 1:][0] == "/usr/bin/python3"
