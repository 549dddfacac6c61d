# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What to launch (the job spec), its hash, and the checks on user input.

Every check runs before anything is changed, and every problem names the option and what is wrong
with it, so a bad task fails with one clear message and leaves the machine as it was.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Pattern

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHELL = "/bin/sh"


class SpecError(ValueError):
    """Bad module input: the message names the option and what was wrong."""


@dataclass(frozen=True)
class JobSpec:
    """What identifies one way of running the job: a change to any of these restarts it."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    chdir: str | None = None
    user: str | None = None
    group: str | None = None

    @property
    def spec_hash(self) -> str:
        """sha256 over a canonical JSON of the spec (stable across runs and Python versions)."""
        canonical = json.dumps(
            {"argv": list(self.argv), "env": [list(kv) for kv in self.env], "chdir": self.chdir,
             "user": self.user, "group": self.group},
            sort_keys=True, separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def job_environment(self) -> dict[str, str]:
        """The job's environment: a clean login-like base plus `env` (never the connection's)."""
        home = "/"
        user = self.user
        if user is not None:
            home = pwd.getpwnam(user).pw_dir
        else:
            try:
                entry = pwd.getpwuid(os.getuid())
                home, user = entry.pw_dir, entry.pw_name
            except KeyError:
                user = str(os.getuid())
        base = {"PATH": DEFAULT_PATH, "HOME": home, "USER": user, "LOGNAME": user, "LANG": "C.UTF-8"}
        base.update(dict(self.env))
        return base


@dataclass(frozen=True)
class LaunchOptions:
    """Everything train_launch was asked to do, checked."""

    name: str
    state: str
    spec: JobSpec | None
    log_path: str | None
    state_dir: str
    backend: str
    keep_logs: int
    startup_timeout: float
    min_uptime: float
    ready_regex: Pattern[str] | None
    stop_timeout: float
    remove_paths: tuple[str, ...] = field(default_factory=tuple)
    log_tail_lines: int = 20

    @property
    def job_dir(self) -> str:
        return os.path.join(self.state_dir, self.name)


def _command_argv(command: Any, shell: bool) -> tuple[str, ...]:
    if shell:
        if not isinstance(command, str) or not command.strip():
            raise SpecError("command: with shell=true, command must be a non-empty string")
        return (SHELL, "-c", command)
    if isinstance(command, str):
        raise SpecError(
            "command: a string is only accepted with shell=true; give an argv list "
            "(for example ['python3', 'train.py']) or set shell: true explicitly"
        )
    if not isinstance(command, (list, tuple)) or not command:
        raise SpecError("command: must be a non-empty list of arguments")
    argv = tuple(str(arg) for arg in command)
    if not argv[0]:
        raise SpecError("command: the program (first element) must not be empty")
    return argv


def _absolute(option: str, path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isabs(path):
        raise SpecError(f"{option}: {path!r} is not an absolute path")
    return os.path.normpath(path)


def check_remove_paths(paths: list[str] | None) -> tuple[str, ...]:
    """Absolute, normalised paths; refuses '/' and anything relative."""
    checked: list[str] = []
    for path in paths or []:
        if not isinstance(path, str) or not path:
            raise SpecError(f"remove_paths: {path!r} is not a path")
        if not os.path.isabs(path):
            raise SpecError(f"remove_paths: {path!r} is not an absolute path")
        normal = os.path.normpath(path)
        if normal.startswith("//"):
            normal = "/" + normal.lstrip("/")
        if normal == "/":
            raise SpecError(f"remove_paths: refusing to remove {path!r} (the root directory)")
        checked.append(normal)
    return tuple(checked)


def _check_log_dir(log_path: str, check_mode: bool) -> None:
    directory = os.path.dirname(log_path)
    if not os.path.isdir(directory):
        if check_mode:
            return  # an earlier task (say, the job_launch role's) would have created it
        raise SpecError(f"log_path: the directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SpecError(f"log_path: the directory {directory!r} is not writable")
    if os.path.isdir(log_path):
        raise SpecError(f"log_path: {log_path!r} is a directory")


def _check_account(user: str | None, group: str | None) -> None:
    if user is not None:
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise SpecError(f"user: no such user {user!r}") from None
    if group is not None:
        try:
            grp.getgrnam(group)
        except KeyError:
            raise SpecError(f"group: no such group {group!r}") from None


def options_from_params(params: Mapping[str, Any], check_mode: bool = False) -> LaunchOptions:
    """Check the module's parameters; raise SpecError on the first problem found.

    In check mode a missing log directory is accepted: a task before this one may create it.
    """
    name = params["name"]
    if not NAME_PATTERN.match(name or ""):
        raise SpecError(
            f"name: {name!r} is not a safe job name (letters, digits, '.', '_', '-'; "
            "first a letter or digit; at most 64 characters)"
        )
    state = params["state"]
    state_dir = _absolute("state_dir", params["state_dir"]) or ""
    log_path = _absolute("log_path", params.get("log_path"))
    spec = None
    if state in ("started", "restarted"):
        if params.get("command") is None:
            raise SpecError(f"command: required with state={state}")
        if log_path is None:
            raise SpecError(f"log_path: required with state={state}")
        argv = _command_argv(params["command"], bool(params.get("shell")))
        env = params.get("env") or {}
        for key in env:
            if not key or "=" in key or "\0" in key:
                raise SpecError(f"env: {key!r} is not a valid variable name")
        chdir = _absolute("chdir", params.get("chdir"))
        if chdir is not None and not os.path.isdir(chdir):
            raise SpecError(f"chdir: the directory {chdir!r} does not exist")
        _check_account(params.get("user"), params.get("group"))
        _check_log_dir(log_path, check_mode)
        spec = JobSpec(
            argv=argv,
            env=tuple(sorted((str(k), str(v)) for k, v in env.items())),
            chdir=chdir,
            user=params.get("user"),
            group=params.get("group"),
        )
    ready_regex = None
    if params.get("ready_regex"):
        try:
            ready_regex = re.compile(params["ready_regex"])
        except re.error as exc:
            raise SpecError(f"ready_regex: {params['ready_regex']!r} is not a valid regular expression: {exc}") from None
    startup_timeout = float(params["startup_timeout"])
    min_uptime = float(params["min_uptime"])
    stop_timeout = float(params["stop_timeout"])
    for option, value in (("startup_timeout", startup_timeout), ("min_uptime", min_uptime),
                          ("stop_timeout", stop_timeout)):
        if value < 0:
            raise SpecError(f"{option}: must not be negative (got {value:g})")
    if min_uptime > startup_timeout:
        raise SpecError(
            f"min_uptime: {min_uptime:g}s is longer than startup_timeout {startup_timeout:g}s, "
            "so the start could never be proven"
        )
    keep_logs = int(params["keep_logs"])
    if keep_logs < 1:
        raise SpecError(f"keep_logs: must be at least 1 (got {keep_logs}); earlier logs are never overwritten")
    return LaunchOptions(
        name=name,
        state=state,
        spec=spec,
        log_path=log_path,
        state_dir=state_dir,
        backend=params["backend"],
        keep_logs=keep_logs,
        startup_timeout=startup_timeout,
        min_uptime=min_uptime,
        ready_regex=ready_regex,
        stop_timeout=stop_timeout,
        remove_paths=check_remove_paths(params.get("remove_paths")),
        log_tail_lines=int(params.get("log_tail_lines") or 20),
    )
