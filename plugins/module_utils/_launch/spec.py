# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What to launch (the job spec), its hash, and the checks on user input.

Every check runs before anything is changed, and every problem names the option and what is wrong
with it, so a bad task fails with one clear message and leaves the machine as it was. That includes
what would only fail at the start itself - a program that is missing or not executable for the
job's user, a NUL byte in an argument or a variable, a symlink or FIFO at log_path - because a
start that cannot work must not first stop the running job and rotate its log.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import BoundsError, check_timeout

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHELL = "/bin/sh"
MAX_KEEP_LOGS = 1000
MAX_LOG_TAIL_LINES = 10000


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


def _no_nul(argv: tuple[str, ...], env: Mapping[str, str]) -> None:
    for number, arg in enumerate(argv):
        if "\0" in arg:
            raise SpecError(f"command: argument {number} contains a NUL byte, which no program can receive")
    for key, value in env.items():
        if not key or "=" in key or "\0" in key:
            raise SpecError(f"env: {key!r} is not a valid variable name")
        if "\0" in value:
            raise SpecError(f"env: the value of {key} contains a NUL byte, which no environment can hold")


def _account_ids(user: str | None, group: str | None) -> tuple[int, set[int], str]:
    """The uid, the gids and the name the job runs with (checked accounts)."""
    if user is None:
        uid, gids = os.getuid(), {os.getgid(), *os.getgroups()}
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
    else:
        entry = pwd.getpwnam(user)
        uid, name = entry.pw_uid, user
        gids = {entry.pw_gid} | {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}
    if group is not None:
        gids.add(grp.getgrnam(group).gr_gid)
    return uid, gids, name


def _executable_by(path: str, uid: int, gids: set[int]) -> bool:
    """Whether `path` is a regular file that `uid` (with `gids`) may execute, by its mode bits."""
    try:
        info = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    if uid == 0:
        return bool(info.st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH))
    if info.st_uid == uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid in gids:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def resolve_program(program: str, search_path: str, chdir: str | None, user: str | None, group: str | None) -> str:
    """The file the job's first argument names, as the job's user would find it; SpecError if none.

    A name without a slash is looked up on the job's PATH (its `env` PATH, or the default), a
    relative path from `chdir` (the job's working directory; / without one).
    """
    uid, gids, name = _account_ids(user, group)
    if "/" in program:
        candidates = [program if os.path.isabs(program) else os.path.join(chdir or "/", program)]
        where = "" if os.path.isabs(program) else f" in {chdir or '/'}"
    else:
        candidates = [os.path.join(directory, program) for directory in search_path.split(":") if directory]
        where = f" on PATH {search_path}"
    for candidate in candidates:
        if _executable_by(candidate, uid, gids):
            return candidate
    raise SpecError(f"command: {program!r} is not an executable file{where} for user {name} "
                    "(checked before anything was stopped or rotated)")


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


def _check_log_path(log_path: str, check_mode: bool) -> None:
    if os.path.islink(log_path):
        raise SpecError(f"log_path: {log_path!r} is a symbolic link; the log must be a regular file "
                        "(links are never followed)")
    if os.path.lexists(log_path) and not os.path.isdir(log_path) and not os.path.isfile(log_path):
        raise SpecError(f"log_path: {log_path!r} exists and is not a regular file (a FIFO, socket or device)")
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
        env = {str(k): str(v) for k, v in (params.get("env") or {}).items()}
        _no_nul(argv, env)
        chdir = _absolute("chdir", params.get("chdir"))
        if chdir is not None and not os.path.isdir(chdir):
            raise SpecError(f"chdir: the directory {chdir!r} does not exist")
        _check_account(params.get("user"), params.get("group"))
        resolve_program(argv[0], env.get("PATH", DEFAULT_PATH), chdir, params.get("user"), params.get("group"))
        _check_log_path(log_path, check_mode)
        spec = JobSpec(
            argv=argv,
            env=tuple(sorted(env.items())),
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
    try:
        startup_timeout = check_timeout("startup_timeout", params["startup_timeout"])
        min_uptime = check_timeout("min_uptime", params["min_uptime"])
        stop_timeout = check_timeout("stop_timeout", params["stop_timeout"])
    except BoundsError as exc:
        raise SpecError(str(exc)) from None
    if min_uptime > startup_timeout:
        raise SpecError(
            f"min_uptime: {min_uptime:g}s is longer than startup_timeout {startup_timeout:g}s, "
            "so the start could never be proven"
        )
    keep_logs = int(params["keep_logs"])
    if not 1 <= keep_logs <= MAX_KEEP_LOGS:
        raise SpecError(f"keep_logs: must be between 1 and {MAX_KEEP_LOGS} (got {keep_logs}); "
                        "earlier logs are never overwritten")
    log_tail_lines = 20 if params.get("log_tail_lines") is None else int(params["log_tail_lines"])
    if not 0 <= log_tail_lines <= MAX_LOG_TAIL_LINES:
        raise SpecError(f"log_tail_lines: must be between 0 and {MAX_LOG_TAIL_LINES} (got {log_tail_lines})")
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
        log_tail_lines=log_tail_lines,
    )
