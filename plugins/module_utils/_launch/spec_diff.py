# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a start changes in the job's spec, for ``--diff``: the recorded run's launch beside this task's.

Only the fields that differ are shown, one line each (``command``, ``env.KEY``, ``chdir``, ``user``,
``group``, ``log_path``, ``backend``), so a user sees what a restart is for before it happens. Every
value is escaped (a command or an env value may hold control characters that would drive the
operator's terminal), and the values of env keys that look secret are masked: a changed secret says
that it changed, never what it was or is.
"""

from __future__ import annotations

import re
import shlex
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls

# Env keys whose values are never shown (API keys, tokens, passwords, cloud credentials).
SECRET_KEY = re.compile(r"TOKEN|PASSW(?:OR)?D|SECRET|KEY|CREDENTIAL", re.IGNORECASE)
MASK = "********"
# The fields besides env, in the order shown.
FIELDS = ("command", "chdir", "user", "group", "log_path", "backend")


def spec_fields(launch: Mapping[str, Any] | None, backend: str | None) -> dict[str, Any]:
    """The fields --diff compares of a launch (launch.json's, or the one a start would write); {} for none."""
    if launch is None:
        return {}
    env = launch.get("env")
    return {"command": launch.get("argv"), "env": dict(env) if isinstance(env, Mapping) else {},
            "chdir": launch.get("chdir"), "user": launch.get("user"), "group": launch.get("group"),
            "log_path": launch.get("log_path"), "backend": backend}


def shown(value: Any) -> str:
    """One value as a line of text: a command shell-quoted, everything escaped."""
    if isinstance(value, (list, tuple)):
        return escape_controls(shlex.join(str(arg) for arg in value))
    return escape_controls(str(value))


def _env_lines(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    old_lines: list[str] = []
    new_lines: list[str] = []
    for key in sorted(set(before) | set(after), key=str):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        secret = SECRET_KEY.search(str(key)) is not None
        name = "env." + escape_controls(str(key))
        if key in before:
            old_lines.append(f"{name}: {MASK if secret else shown(old)}")
        if key in after:
            new_lines.append(f"{name}: " + ((MASK + (" (changed)" if key in before else "")) if secret else shown(new)))
    return old_lines, new_lines


def spec_diff(before: Mapping[str, Any], after: Mapping[str, Any], before_header: str,
              after_header: str) -> dict[str, str]:
    """Ansible's diff (``before``, ``after`` as text, with headers) of two spec_fields, differing fields only.

    A field that is unset (None) on one side has no line there; ``before`` is empty for a first start.
    """
    old_lines: list[str] = []
    new_lines: list[str] = []
    for field in FIELDS:
        old, new = before.get(field), after.get(field)
        if old == new:
            continue
        if old is not None:
            old_lines.append(f"{field}: {shown(old)}")
        if new is not None:
            new_lines.append(f"{field}: {shown(new)}")
    old_env, new_env = _env_lines(before.get("env") or {}, after.get("env") or {})
    return {
        "before": "".join(line + "\n" for line in _ordered(old_lines, old_env)),
        "after": "".join(line + "\n" for line in _ordered(new_lines, new_env)),
        "before_header": before_header,
        "after_header": after_header,
    }


def _ordered(fields: list[str], env_lines: list[str]) -> list[str]:
    """The field lines with the env lines after the command's (or first, without one)."""
    at = 1 if fields[:1] and fields[0].startswith("command: ") else 0
    return fields[:at] + env_lines + fields[at:]
