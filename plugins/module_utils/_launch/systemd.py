# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The systemd backend: the job as a transient unit (``systemd-run --collect -p KillMode=mixed``).

With ``--collect`` a finished unit vanishes at once, and ``systemctl show`` on a vanished unit
reads ``LoadState=not-found`` with ``ExecMainStatus=0`` - the same as a success. So the exit status
is recorded by the unit itself: an ``ExecStopPost=`` (run with full privileges, ``+``) hands
systemd's ``$EXIT_CODE``/``$EXIT_STATUS``/``$SERVICE_RESULT`` to the supervisor program's
``record-exit`` mode, which writes ``exit.json`` atomically into the state directory.

The unit's main process is the supervisor program's ``exec`` mode, which opens the log, takes the
job's user and group, and becomes the job (see _launch/supervisor.py). The unit names no log path:
``StandardOutput=append:PATH`` would have PID 1 open it as root, by path, after every check of ours,
through whatever symlink the job's user put there meanwhile. Nor does it hold the job's environment
(``systemctl show`` lets every user read a unit's ``Environment=``): that stays in launch.json
(0600); the unit carries only the run's mark. Nor a ``WorkingDirectory=``: PID 1 would change into
it as root, following whatever link the job's user put on the way; the main process enters it after
it took the job's user (see ``enter_working_directory``).
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
    exec_job: Sequence[str],
    mark: Mapping[str, str],
    term_timeout: float,
    record_exit: Sequence[str],
    description: str,
) -> list[str]:
    """The systemd-run command line that starts the job as transient unit `unit`.

    `exec_job` is the main process (the supervisor program's exec mode, which becomes the job);
    `mark` the run's mark, so that the main process carries it before the exec too.
    """
    cmd = [
        SYSTEMD_RUN,
        f"--unit={unit}",
        "--collect",
        "--quiet",
        f"--description={description}",
        "--property=KillMode=mixed",
        f"--property=TimeoutStopSec={max(term_timeout, 0.001):g}s",
        "--property=StandardInput=null",
        "--property=ExecStopPost=+" + " ".join(quote_exec_arg(arg) for arg in record_exit),
    ]
    for key, value in sorted(mark.items()):
        cmd.append(f"--setenv={key}={value}")
    cmd.append("--")
    cmd.extend(exec_job)
    return cmd


def live_unit_name(job_name: str) -> str:
    """The unit that keeps the job's live file (see _launch/live.py).

    A ':' no job name holds (names are [A-Za-z0-9_.-]): "gpuops-NAME-live" would be the main unit of
    the job named "NAME-live", and the stop before a start would stop that job.
    """
    return f"gpuops-live:{job_name}.service"


def live_unit_argv(unit: str, live_unit: str, watch: Sequence[str], description: str) -> list[str]:
    """The systemd-run command line of the live unit: `watch` (live.py watch JOB_DIR RUN_ID), bound to
    the job's unit `unit` (BindsTo=: it stops when the job's unit does; After=: it starts after it)."""
    return [
        SYSTEMD_RUN,
        f"--unit={live_unit}",
        "--collect",
        "--quiet",
        f"--description={description}",
        f"--property=BindsTo={unit}",
        f"--property=After={unit}",
        "--property=StandardInput=null",
        "--",
        *watch,
    ]


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


def stop_if_loaded(unit: str, timeout: float = 30) -> None:
    """systemctl stop, for a unit that may not exist (then there is nothing to stop, and no error)."""
    subprocess.run([SYSTEMCTL, "stop", unit], capture_output=True, text=True, check=False, timeout=timeout)


def stop_unit(unit: str, timeout: float) -> None:
    """systemctl stop: SIGTERM to the main process, SIGKILL to the rest after TimeoutStopSec."""
    proc = subprocess.run(
        [SYSTEMCTL, "stop", unit], capture_output=True, text=True, check=False, timeout=timeout
    )
    if proc.returncode != 0:
        raise OSError(f"systemctl stop {unit} failed (rc {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
