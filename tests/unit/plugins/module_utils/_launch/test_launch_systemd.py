"""_launch/systemd.py: the transient unit the module asks systemd for (properties checked offline)."""

from __future__ import annotations

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
        "argv": ["/usr/bin/python3", "/w/train.py", "--lr", "1e-4"],
        "env": {"HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1"},
        "log_path": "/w/train.log",
        "chdir": "/w",
        "user": None,
        "group": None,
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
    assert "--property=StandardOutput=append:/w/train.log" in cmd
    assert "--property=StandardError=append:/w/train.log" in cmd
    assert "--property=WorkingDirectory=/w" in cmd
    assert "--setenv=CUDA_VISIBLE_DEVICES=0,1" in cmd
    assert cmd[cmd.index("--") + 1:] == ["/usr/bin/python3", "/w/train.py", "--lr", "1e-4"]
    assert not any(arg.startswith("--property=User=") for arg in cmd)


def test_exit_status_is_recorded_by_a_privileged_exec_stop_post() -> None:
    # --collect makes a finished unit vanish, so the status must be written by the unit itself.
    (stop_post,) = [arg for arg in build() if arg.startswith("--property=ExecStopPost=")]
    assert stop_post == ('--property=ExecStopPost=+"/usr/bin/python3" "/var/lib/gpuops/llm/supervisor.py" '
                         '"record-exit" "/var/lib/gpuops/llm" "abc"')


def test_user_group_and_default_directory() -> None:
    cmd = build(user="trainer", group="gpu", chdir=None)
    assert "--property=User=trainer" in cmd and "--property=Group=gpu" in cmd
    assert "--property=WorkingDirectory=/" in cmd


def test_exec_quoting_escapes_specifiers_and_variables() -> None:
    assert quote_exec_arg('/st ate/%i/$HOME/"q"\\') == '"/st ate/%%i/$$HOME/\\"q\\"\\\\"'


def test_parse_show() -> None:
    shown = parse_show("LoadState=loaded\nActiveState=active\nMainPID=42\nInvocationID=ab=cd\n")
    assert shown == {"LoadState": "loaded", "ActiveState": "active", "MainPID": "42", "InvocationID": "ab=cd"}
    assert unit_active(shown) and main_pid(shown) == 42
    gone = parse_show("LoadState=not-found\nActiveState=inactive\nMainPID=0\n")
    assert not unit_active(gone) and main_pid(gone) == 0
    assert main_pid({}) == 0
