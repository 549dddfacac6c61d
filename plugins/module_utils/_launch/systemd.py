# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The systemd backend: the job as a transient unit (``systemd-run --collect -p KillMode=mixed``).

With ``--collect`` a finished unit vanishes at once, and ``systemctl show`` on a vanished unit
reads ``LoadState=not-found`` with ``ExecMainStatus=0`` - the same as a success. So the exit status
is recorded by the unit itself: an ``ExecStopPost=`` (run with full privileges, ``+``) hands
systemd's ``$EXIT_CODE``/``$EXIT_STATUS``/``$SERVICE_RESULT`` to the supervisor program's
``record-exit`` mode, which writes ``exit.json`` atomically into the state directory.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Mapping, Sequence

SYSTEMD_RUN = "systemd-run"
SYSTEMCTL = "systemctl"
SHOW_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "Result", "InvocationID")
ACTIVE_STATES = ("active", "activating", "reloading")


def unit_name(job_name: str) -> str:
    return f"gpuops-{job_name}.service"


def systemd_is_init(run_dir: str = "/run/systemd/system") -> bool:
    """sd_booted(): PID 1 is systemd exactly when this directory exists."""
    return os.path.isdir(run_dir)


def quote_exec_arg(arg: str) -> str:
    """One argument of a unit-file Exec line: quoted, with %-specifiers and $-variables escaped."""
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def systemd_run_argv(
    unit: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: str,
    chdir: str | None,
    user: str | None,
    group: str | None,
    term_timeout: float,
    record_exit: Sequence[str],
    description: str,
) -> list[str]:
    """The systemd-run command line that starts the job as transient unit `unit`."""
    cmd = [
        SYSTEMD_RUN,
        f"--unit={unit}",
        "--collect",
        "--quiet",
        f"--description={description}",
        "--property=KillMode=mixed",
        f"--property=TimeoutStopSec={max(term_timeout, 0.001):g}s",
        "--property=StandardInput=null",
        f"--property=StandardOutput=append:{log_path}",
        f"--property=StandardError=append:{log_path}",
        f"--property=WorkingDirectory={chdir or '/'}",
        "--property=ExecStopPost=+" + " ".join(quote_exec_arg(arg) for arg in record_exit),
    ]
    if user is not None:
        cmd.append(f"--property=User={user}")
    if group is not None:
        cmd.append(f"--property=Group={group}")
    for key, value in sorted(env.items()):
        cmd.append(f"--setenv={key}={value}")
    cmd.append("--")
    cmd.extend(argv)
    return cmd


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show -p ...` output (KEY=VALUE lines) as a dict."""
    shown: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            shown[key] = value
    return shown


def show(unit: str) -> dict[str, str]:
    """The unit's properties; a vanished (collected) unit reads LoadState=not-found."""
    proc = subprocess.run(
        [SYSTEMCTL, "show", unit, "-p", ",".join(SHOW_PROPERTIES)],
        capture_output=True, text=True, check=False, timeout=30,
    )
    return parse_show(proc.stdout)


def unit_active(shown: Mapping[str, str]) -> bool:
    return shown.get("ActiveState") in ACTIVE_STATES


def main_pid(shown: Mapping[str, str]) -> int:
    value = shown.get("MainPID", "0")
    return int(value) if re.fullmatch(r"\d+", value) else 0


def start_unit(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    if proc.returncode != 0:
        raise OSError(f"systemd-run failed (rc {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")


def stop_unit(unit: str, timeout: float) -> None:
    """systemctl stop: SIGTERM to the main process, SIGKILL to the rest after TimeoutStopSec."""
    proc = subprocess.run(
        [SYSTEMCTL, "stop", unit], capture_output=True, text=True, check=False, timeout=timeout
    )
    if proc.returncode != 0:
        raise OSError(f"systemctl stop {unit} failed (rc {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
