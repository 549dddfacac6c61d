# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""What to launch (the job spec), its hash, and the checks on user input.

Every check runs before anything is changed, and every problem names the option and what is wrong
with it; all of them are gathered (``_base.options``), so a bad task fails once, listing each
problem, and leaves the machine as it was. ``options_from_params`` checks what the user wrote;
``preflight_start`` checks what a start needs from the machine - chdir and the program, asked as
the job's user (a forked child that becomes that user, see ``resolve_program``), a log directory
that exists or can be created and can be written, a log_path that is no symlink, FIFO or hard
link, a state directory the records can be kept in, remove_paths and
log_path reached without a symlink another user can change (see ``_base/safepath.py``), and the
backend - because a start that cannot work must not first stop the running job and rotate its log.
The probe (check mode) and the real start call the same ``preflight_start``, so a relaunch that
the probe lets through does not fail after the stop for a reason the probe could have seen.
"""

from __future__ import annotations

import errno
import grp
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import MAX_TIMEOUT, check_seconds, check_timeout
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import HEALTH_WORDS
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.decision import PLANNING_STATES, LaunchState
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.guard import CAUSE_UNKNOWN, CAUSES
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import JOB_UMASK
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import check_expect_run_id

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHELL = "/bin/sh"
# Where bash is looked for (a merged /usr has both); the first one that can be executed runs shell=true.
BASH_CANDIDATES = ("/bin/bash", "/usr/bin/bash")
# How long asking /bin/sh whether it knows pipefail may take.
SHELL_PROBE_TIMEOUT = 10.0
MAX_KEEP_LOGS = 1000
MAX_LOG_TAIL_LINES = 10000
MAX_RELAUNCHES = 1000
MAX_RELAUNCH_WINDOW = 30 * 86400.0
# The growing delay's bounds: a first delay of at most an hour, a cap of at most a day.
MAX_RELAUNCH_DELAY = 3600.0
MAX_RELAUNCH_MAX_DELAY = 86400.0
# The role variable (job_launch and relaunch roles) of each path option whose directory a run may be
# denied: a non-root run that cannot use /var/lib/gpuops or the log directory is told what to set.
PATH_ROLE_VARIABLES = {"state_dir": "job_launch_state_dir", "log_path": "job_launch_log_path"}
# The errors that mean this user may not use a directory (not that it is unsafe, absent or read-only).
DENIED_ERRNOS = (errno.EACCES, errno.EPERM)


def denied(exc: OSError) -> bool:
    """Whether `exc` says this user may not use a path (not that it is unsafe, or missing)."""
    return exc.errno in DENIED_ERRNOS and not isinstance(exc, safepath.UnsafePath)


def what_to_set(option: str) -> str:
    """The advice that ends the reason of a path option whose directory this user may not use."""
    return (f"; set {option} (role variable {PATH_ROLE_VARIABLES[option]}) to a directory "
            f"uid {os.geteuid()} may write")


@dataclass(frozen=True)
class JobSpec:
    """What identifies one way of running the job: a change to any of these restarts it."""

    # What runs; with shell=true: the shell (see shell_launcher), -c and the command line.
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    chdir: str | None = None
    user: str | None = None
    group: str | None = None
    # With shell=true: the command line as the task gave it.
    shell_command: str | None = None

    @property
    def hashed_argv(self) -> tuple[str, ...]:
        """The argv the hash covers: a command line is hashed as ``/bin/sh -c COMMAND`` whatever shell runs it,
        so the hash stays what it was before shell=true ran under bash, and an upgrade restarts no running job."""
        return (SHELL, "-c", self.shell_command) if self.shell_command is not None else self.argv

    @property
    def spec_hash(self) -> str:
        """sha256 over a canonical JSON of the spec (stable across runs and Python versions)."""
        canonical = json.dumps(
            {"argv": list(self.hashed_argv), "env": [list(kv) for kv in self.env], "chdir": self.chdir,
             "user": self.user, "group": self.group},
            sort_keys=True, separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def argv_with(self, extra: tuple[str, ...]) -> list[str]:
        """The argv with `extra` appended (resume_args); with a shell, appended to the command line, quoted.

        The spec hash never includes them: a resumed run is the same job, and the next
        state=started must find it running with its spec.
        """
        if not extra:
            return list(self.argv)
        if self.shell_command is not None:
            return [*self.argv[:-1], self.argv[-1] + " " + " ".join(shlex.quote(arg) for arg in extra)]
        return [*self.argv, *extra]

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
    term_timeout: float
    remove_paths: tuple[str, ...] = field(default_factory=tuple)
    log_tail_lines: int = 20
    progress_regex: Pattern[str] | None = None
    stall_after: float | None = None
    resume_args: tuple[str, ...] = field(default_factory=tuple)
    # auto: resume after a crashed, stalled or missing run; always: whenever the job ran before
    # (the other ranks of a multi-rank job one of whose ranks failed); never.
    resume: str = "auto"
    max_relaunches: int | None = None
    relaunch_window: float = 3600.0
    # The growing delay of a job that keeps failing (guard.RelaunchDelay): 0, none.
    relaunch_delay: float = 0.0
    relaunch_max_delay: float = 600.0
    # What caused the failure a relaunch now follows (guard.CAUSES): hardware is not counted.
    failure_cause: str = "unknown"
    # Changes only the decision: a job left alone (finished, or running with this spec) is relaunched.
    force: bool = False
    # Clear the job's relaunch history before deciding (the crash-loop guard's documented reset).
    reset_guard: bool = False
    # The job's live textfile (see _launch/live.py): node_exporter's directory, and the inventory
    # hostnames for its gpuops_host and gpuops_rank0 labels. None: the node keeps no live file.
    metrics_dir: str | None = None
    metrics_host: str | None = None
    metrics_rank0: str | None = None
    # The job's GPUs (indices or UUIDs) whose health the live file also reports; () for none.
    metrics_gpus: tuple[str, ...] = ()
    # state=stopped only: the run the caller's look saw ("" for none); a newer live run is left alone
    # (the run-id fence, tree.supersedes). None: no fence.
    expect_run_id: str | None = None
    # Resume from the newest complete checkpoint (checkpoints.py, resume.py): where the job saves, in which
    # layout, the marker file of the custom layout, what a resume does when none is complete (fresh: start
    # without resume_args; refuse), the step the ranks agreed on, and whether torn ones are renamed aside.
    checkpoint_dir: str | None = None
    checkpoint_format: str = "auto"
    checkpoint_marker: str = "COMPLETE"
    checkpoint_missing: str = "fresh"
    checkpoint_step: int | None = None
    checkpoint_rename_torn: bool = False
    # The file mode creation mask the job starts with (systemd's default for services); not part of
    # the spec: a new umask takes effect at the next start and never restarts a job by itself.
    umask: int = JOB_UMASK
    # state=health only: ask again until the verdict is one of these (a poll with wait_timeout as its
    # deadline, in the module, not Ansible retries); empty: answer at once.
    wait_for: tuple[str, ...] = ()
    wait_timeout: float = 60.0
    # state=stopped only: end the job's idle supervisor too (as state=absent does), keeping the records.
    end_supervisor: bool = False

    def launch_fields(self, resume: bool) -> dict[str, Any]:
        """What a start writes to launch.json besides its run id (`resume`: with resume_args appended)."""
        spec = self.spec
        if spec is None:
            raise ValueError("no command: nothing to launch")
        return {
            # resume_args after a failure; the spec hash stays the job's own (see JobSpec.argv_with).
            "argv": spec.argv_with(self.resume_args if resume else ()),
            "resumed": resume,
            "env": spec.job_environment(),
            "chdir": spec.chdir,
            "user": spec.user,
            "group": spec.group,
            "spec_hash": spec.spec_hash,
            "log_path": self.log_path,
            "umask": self.umask,
            # Not part of the spec: a new stall rule or metrics_dir takes effect at the next start
            # and never restarts a job by itself.
            **self.stored_health(),
        }

    def stored_health(self) -> dict[str, Any]:
        """What a start stores in launch.json for the node and for later tasks: the stall rule (a bare
        state=health judges stalls by it) and, with metrics_dir, where the live file goes."""
        stored: dict[str, Any] = {"health": {
            "progress_regex": self.progress_regex.pattern if self.progress_regex is not None else None,
            "stall_after": self.stall_after,
        }}
        if self.metrics_dir is not None:
            stored["live"] = {"dir": self.metrics_dir, "job": self.name, "host": self.metrics_host,
                              "rank0": self.metrics_rank0}
            if self.metrics_gpus:
                # pylint: disable-next=import-outside-toplevel
                from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import live_gpus
                gpus = live_gpus.gpu_settings(list(self.metrics_gpus), live_gpus.nvml_path_here())
                stored["live"][live_gpus.GPUS_KEY] = gpus
        if self.checkpoint_dir is not None:
            # The live file's newest complete checkpoint step (live.py) is resolved by the same rule.
            stored["checkpoint"] = {"dir": self.checkpoint_dir, "format": self.checkpoint_format,
                                    "marker": self.checkpoint_marker}
        return stored

    @property
    def job_dir(self) -> str:
        return os.path.join(self.state_dir, self.name)


def _sh_knows_pipefail(sh: str) -> bool:
    """Whether `sh` takes ``-o pipefail`` (busybox sh does; dash 0.5.12, Debian 12's /bin/sh, ends at once)."""
    try:
        return subprocess.run([sh, "-o", "pipefail", "-c", ":"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={"PATH": DEFAULT_PATH}, timeout=SHELL_PROBE_TIMEOUT,
                              check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def shell_launcher(bash_candidates: tuple[str, ...] = BASH_CANDIDATES, sh: str = SHELL) -> tuple[str, ...]:
    """The shell (and its options) that runs a command line of shell=true.

    With pipefail wherever the machine has it: in ``train | tee`` a plain pipeline's status is tee's,
    so a trainer killed by SIGKILL (the OOM killer) would end with 0 and be judged finished; with
    pipefail it ends with 128+9 and is judged crashed. bash has it; /bin/sh only in some shells.
    """
    for bash in bash_candidates:
        if os.path.isfile(bash) and os.access(bash, os.X_OK):
            return (bash, "-o", "pipefail")
    return (sh, "-o", "pipefail") if _sh_knows_pipefail(sh) else (sh,)


def _command_argv(command: Any, shell: bool) -> tuple[str, ...]:
    if shell:
        if not isinstance(command, str) or not command.strip():
            raise BadOption("command", "with shell=true, command must be a non-empty string")
        argv: tuple[str, ...] = (*shell_launcher(), "-c", command)
    elif isinstance(command, str):
        raise BadOption(
            "command", "a string is only accepted with shell=true; give an argv list "
            "(for example ['python3', 'train.py']) or set shell: true explicitly"
        )
    elif not isinstance(command, (list, tuple)) or not command:
        raise BadOption("command", "must be a non-empty list of arguments")
    else:
        argv = tuple(str(arg) for arg in command)
        if not argv[0]:
            raise BadOption("command", "the program (first element) must not be empty")
    for number, arg in enumerate(argv):
        if "\0" in arg:
            raise BadOption("command", f"argument {number} contains a NUL byte, which no program can receive")
    return argv


def _job_env(env: Mapping[Any, Any] | None) -> dict[str, str]:
    checked = {str(k): str(v) for k, v in (env or {}).items()}
    for key, value in checked.items():
        if not key or "=" in key or "\0" in key:
            raise BadOption("env", f"{key!r} is not a valid variable name")
        if "\0" in value:
            raise BadOption("env", f"the value of {key} contains a NUL byte, which no environment can hold")
    return checked


def resolve_program(program: str, search_path: str, chdir: str | None, user: str | None, group: str | None) -> str:
    """The file the job's first argument names, as the job's user would find it; BadOption if none.

    Asked as the job's user (supervisor.check_as_job_user: a forked child that takes the job's
    groups and user, enters chdir as the start does, and calls access()), since root reaches what
    the user cannot: a program below a directory only root may pass, a working directory swapped for
    a link. BadOption names chdir when the working directory cannot be entered (the program is looked
    up from there: a relative path from it, a name on the job's PATH), command when no program is found.
    """
    # Imported here (supervisor.py is the start path's; a probe of a healthy job never gets this far).
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.supervisor import (  # pylint: disable=import-outside-toplevel
        check_as_job_user)
    found = check_as_job_user({"argv": [program], "env": {"PATH": search_path}, "chdir": chdir,
                               "user": user, "group": group})
    if "program" in found:
        return str(found["program"])
    reason = str(found.get("reason"))
    if found.get("option") == "command":
        reason += " (checked before anything was stopped or rotated)"
    raise BadOption(str(found.get("option")), reason)


def _absolute(option: str, path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isabs(path):
        raise BadOption(option, f"{path!r} is not an absolute path")
    return os.path.normpath(path)


def check_remove_paths(paths: list[str] | None) -> tuple[str, ...]:
    """Absolute, normalised paths; refuses '/' and anything relative."""
    checked: list[str] = []
    for path in paths or []:
        if not isinstance(path, str) or not path:
            raise BadOption("remove_paths", f"{path!r} is not a path")
        if not os.path.isabs(path):
            raise BadOption("remove_paths", f"{path!r} is not an absolute path")
        normal = os.path.normpath(path)
        if normal.startswith("//"):
            normal = "/" + normal.lstrip("/")
        if normal == "/":
            raise BadOption("remove_paths", f"refusing to remove {path!r} (the root directory)")
        checked.append(normal)
    return tuple(checked)


def _writable_directory(option: str, directory: str, what: str) -> None:
    """`directory` exists and can be written, or can be created; walked without following a symlink
    another user can change. BadOption naming the component that is in the way."""
    try:
        with safepath.walk(directory, stop_at_missing=True) as found:
            why_not = safepath.why_not_writable(found.fd)
            if why_not is None:
                return
            # A read-only file system is no matter of who runs the module: no advice on whom to be.
            advice = "" if os.statvfs(found.fd).f_flag & os.ST_RDONLY else what_to_set(option)
            if found.missing:
                raise BadOption(option, f"cannot create the {what} {directory!r}: {found.reached} {why_not}" + advice)
            raise BadOption(option, f"the {what} {directory!r} {why_not}" + advice)
    except OSError as exc:
        advice = what_to_set(option) if denied(exc) else ""
        raise BadOption(option, f"the {what} {directory!r} cannot be reached safely: {exc.strerror or exc}"
                        + advice) from None


def _check_log_path(log_path: str) -> None:
    directory, name = os.path.split(log_path)
    _writable_directory("log_path", directory, "log directory")
    try:
        with safepath.walk(directory, stop_at_missing=True) as found:
            info = safepath.lstat_at(found.fd, name) if not found.missing else None
    except OSError as exc:
        raise BadOption("log_path", f"{log_path!r} cannot be reached safely: {exc.strerror or exc}") from None
    if info is None:
        return
    if stat.S_ISLNK(info.st_mode):
        raise BadOption("log_path", f"{log_path!r} is a symbolic link; the log must be a regular file "
                        "(links are never followed)")
    if stat.S_ISDIR(info.st_mode):
        raise BadOption("log_path", f"{log_path!r} is a directory")
    if not stat.S_ISREG(info.st_mode):
        raise BadOption("log_path", f"{log_path!r} exists and is not a regular file (a FIFO, socket or device)")
    if info.st_nlink > 1:
        raise BadOption("log_path", f"{log_path!r} has other hard links (it could be another user's file "
                        "linked in); the log must be a file of its own")


def _check_job_dir(job_dir: str) -> None:
    """Where the records go: state_dir/NAME, a directory of its own that can be written or created."""
    _writable_directory("state_dir", job_dir, "job's state directory")


def _check_remove_path_parent(path: str) -> None:
    """A path to remove is reached without a symlink another user can change (the removal walks it too)."""
    try:
        safepath.walk(os.path.dirname(path), stop_at_missing=True).close()
    except OSError as exc:
        raise BadOption("remove_paths", f"{path!r} cannot be reached safely: {exc.strerror or exc}") from None


# The longest inventory hostname the gpuops_host label takes (a DNS name's limit).
MAX_HOST_NAME = 253


def _hostname_label(option: str, host: Any, what: str) -> str:
    """An inventory hostname for a label of the live file (`what` says which, when `host` is none)."""
    if not isinstance(host, str) or not host:
        raise BadOption(option, what)
    if len(host) > MAX_HOST_NAME:
        raise BadOption(option, f"is {len(host)} characters long; at most {MAX_HOST_NAME}")
    return host


def _metrics_host(metrics_dir: str | None, host: Any) -> str | None:
    """The inventory hostname for the live file's gpuops_host label: needed with metrics_dir."""
    if metrics_dir is None:
        return None
    return _hostname_label("metrics_host", host, "required with metrics_dir: the inventory hostname, for the "
                           "gpuops_host label (the roles pass inventory_hostname)")


def _metrics_rank0(metrics_host: str | None, rank0: Any) -> str | None:
    """The inventory hostname of the job's rank 0 for the live file's gpuops_rank0 label (unset: the job
    is one host's, metrics_host): the alerts of all the ranks of one job share it, so that one
    notification and one event-driven run cover them all."""
    if metrics_host is None or rank0 is None or rank0 == "":
        return metrics_host
    return _hostname_label("metrics_rank0", rank0, "must be the inventory hostname of the job's rank 0")


MAX_METRICS_GPUS = 64
_GPU_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,95}")


def _metrics_gpus(metrics_dir: str | None, gpus: Any) -> tuple[str, ...]:
    """The job's GPUs for the live file's GPU series (indices or UUIDs, as gpu_mem_wait's devices): only
    with metrics_dir, at most MAX_METRICS_GPUS, each a GPU's index or UUID."""
    if not gpus:
        return ()
    if metrics_dir is None:
        raise BadOption("metrics_gpus", "needs metrics_dir: the GPUs' health goes into the job's live file")
    names = tuple(str(gpu).strip() for gpu in gpus)
    if len(names) > MAX_METRICS_GPUS:
        raise BadOption("metrics_gpus", f"names {len(names)} GPUs; at most {MAX_METRICS_GPUS}")
    bad = [name for name in names if not _GPU_NAME.fullmatch(name)]
    if bad:
        raise BadOption("metrics_gpus", f"entries must be GPU indices or UUIDs, got {bad[0][:40]!r}")
    return names


def _check_metrics_dir(metrics_dir: str) -> None:
    """node_exporter's directory: it exists (it is not created: a typo must not make a directory nobody
    reads) and can be written, reached without a symlink another user can change."""
    try:
        with safepath.walk(metrics_dir, listable=True) as found:
            why_not = safepath.why_not_writable(found.fd)
    except FileNotFoundError:
        raise BadOption("metrics_dir", f"{metrics_dir!r} does not exist (it is the textfile collector's "
                        "directory: it is not created here)") from None
    except OSError as exc:
        raise BadOption("metrics_dir", f"{metrics_dir!r} cannot be reached safely: {exc.strerror or exc}") from None
    if why_not:
        raise BadOption("metrics_dir", f"{metrics_dir!r} {why_not}")


def _check_backend(backend: str) -> None:
    if backend != "systemd":
        return
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import systemd  # pylint: disable=import-outside-toplevel
    if not (systemd.systemd_is_init() and shutil.which(systemd.SYSTEMD_RUN)):
        raise BadOption("backend", "systemd is not PID 1 here (or systemd-run is missing); "
                        "use backend=supervisor or auto")


def _check_account(option: str, name: str | None, lookup: Callable[[str], Any]) -> None:
    """BadOption naming `option` when `name` is given and `lookup` (``pwd.getpwnam``, ``grp.getgrnam``) does not know it."""
    if name is not None:
        try:
            lookup(name)
        except KeyError:
            raise BadOption(option, f"no such {option} {name!r}") from None


def _job_name(name: str | None) -> str:
    if not NAME_PATTERN.match(name or ""):
        raise BadOption(
            "name", f"{name!r} is not a safe job name (letters, digits, '.', '_', '-'; "
            "first a letter or digit; at most 64 characters)"
        )
    return str(name)


def _ready_regex(pattern: str | None) -> Pattern[str] | None:
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise BadOption("ready_regex", f"{pattern!r} is not a valid regular expression: {exc}") from None


def _progress_regex(pattern: str | None) -> Pattern[str] | None:
    if pattern is None or pattern == "":
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise BadOption("progress_regex", f"{pattern!r} is not a valid regular expression: {exc}") from None


def _stall_after(value: Any, progress_regex: Any) -> float | None:
    """Seconds without a progress line before a live job counts as stalled; None: never."""
    if value is None:
        return None
    seconds = check_seconds("stall_after", value, 0.0, MAX_TIMEOUT, allow_minimum=False)
    if not progress_regex:
        raise BadOption("stall_after", "needs progress_regex: progress is a new log line matching it")
    return seconds


def _wait_for(words: Any, state: str) -> tuple[str, ...]:
    """The health verdicts state=health waits for (HEALTH_WORDS)."""
    if not words:
        return ()
    if state != LaunchState.HEALTH.value:
        raise BadOption("wait_for", f"only with state=health (a verdict to wait for), not with state={state}")
    checked = tuple(str(word) for word in words)
    unknown = [word for word in checked if word not in HEALTH_WORDS]
    if unknown:
        raise BadOption("wait_for", f"{', '.join(map(repr, unknown))}: not a health verdict "
                        f"(one of {', '.join(HEALTH_WORDS)})")
    return checked


def _umask(value: Any) -> int:
    """The umask option: a string of three or four octal digits, 0000 to 0777."""
    text = "" if value is None else str(value)
    if not re.fullmatch(r"[0-7]{3,4}", text) or int(text, 8) > 0o777:
        why = ""
        if isinstance(value, int):
            why = " (an unquoted YAML number such as 0022 is read as another number: quote it, '0022')"
        raise BadOption("umask", f"must be a string of 3 or 4 octal digits from 0000 to 0777, like '0022' "
                        f"(got {text!r}){why}")
    return int(text, 8)


def _resume_args(args: Any) -> tuple[str, ...]:
    if args is None:
        return ()
    if not isinstance(args, (list, tuple)):
        raise BadOption("resume_args", "must be a list of arguments")
    checked = tuple(str(arg) for arg in args)
    for number, arg in enumerate(checked):
        if "\0" in arg:
            raise BadOption("resume_args", f"argument {number} contains a NUL byte, which no program can receive")
    return checked


def _checkpoint_marker(marker: Any) -> str:
    """The custom layout's marker: a plain file name (it is looked up inside each checkpoint directory)."""
    if marker is None or marker == "":
        return "COMPLETE"
    if not isinstance(marker, str) or "/" in marker or marker in (".", "..") or "\0" in marker:
        raise BadOption("checkpoint_marker", f"{marker!r} is not a plain file name")
    return marker


def _checkpoint_placeholders(resume_args: tuple[str, ...] | None, checkpoint_dir: str | None) -> None:
    """{checkpoint} and {step} need checkpoint_dir: without it nothing could fill them in."""
    if checkpoint_dir is not None or not resume_args:
        return
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.checkpoints import has_placeholder  # pylint: disable=import-outside-toplevel
    if has_placeholder(resume_args):
        raise BadOption("resume_args", "{checkpoint} and {step} need checkpoint_dir (where the job saves its checkpoints)")


def _count(option: str, value: Any, low: int, high: int, why: str = "") -> int:
    number = int(value)
    if not low <= number <= high:
        raise BadOption(option, f"must be between {low} and {high} (got {number}){why}")
    return number


def _job_spec(checks: OptionChecks, params: Mapping[str, Any]) -> JobSpec | None:
    """The spec of a start, or None when a problem with it was noted in `checks`."""
    state = params["state"]
    command = params.get("command")
    argv = None
    if command is None:
        checks.add("command", f"required with state={state}")
    else:
        argv = checks.check(_command_argv, command, bool(params.get("shell")))
    if params.get("log_path") is None:
        checks.add("log_path", f"required with state={state}")
    env = checks.check(_job_env, params.get("env"))
    chdir = checks.check(_absolute, "chdir", params.get("chdir"))
    user, group = params.get("user"), params.get("group")
    checks.check(_check_account, "user", user, pwd.getpwnam)
    checks.check(_check_account, "group", group, grp.getgrnam)
    if checks.failed() or argv is None or env is None:
        return None
    shell_command = command if params.get("shell") else None
    return JobSpec(argv=argv, env=tuple(sorted(env.items())), chdir=chdir, user=user, group=group,
                   shell_command=shell_command)


def options_from_params(params: Mapping[str, Any]) -> LaunchOptions:
    """Check the module's parameters; OptionsInvalid listing every problem found.

    What a start needs from the machine is checked by preflight_start, right before a start.
    """
    checks = OptionChecks()
    name = checks.check(_job_name, params["name"])
    state = params["state"]
    state_dir = checks.check(_absolute, "state_dir", params["state_dir"])
    log_path = checks.check(_absolute, "log_path", params.get("log_path"))
    spec = None
    if state in PLANNING_STATES:
        spec = _job_spec(checks, params)
    ready_regex = checks.check(_ready_regex, params.get("ready_regex"))
    startup_timeout = checks.check(check_timeout, "startup_timeout", params["startup_timeout"])
    min_uptime = checks.check(check_timeout, "min_uptime", params["min_uptime"])
    term_timeout = checks.check(check_timeout, "term_timeout", params["term_timeout"])
    if startup_timeout is not None and min_uptime is not None and min_uptime > startup_timeout:
        checks.add("min_uptime", f"{min_uptime:g}s is longer than startup_timeout {startup_timeout:g}s, "
                   "so the start could never be proven")
    keep_logs = checks.check(_count, "keep_logs", params["keep_logs"], 1, MAX_KEEP_LOGS,
                             "; earlier logs are never overwritten")
    log_tail_lines = checks.check(_count, "log_tail_lines", 20 if params.get("log_tail_lines") is None
                                  else params["log_tail_lines"], 0, MAX_LOG_TAIL_LINES)
    remove_paths = checks.check(check_remove_paths, params.get("remove_paths"))
    progress_regex = checks.check(_progress_regex, params.get("progress_regex"))
    stall_after = checks.check(_stall_after, params.get("stall_after"), params.get("progress_regex"))
    resume_args = checks.check(_resume_args, params.get("resume_args"))
    wait_for = checks.check(_wait_for, params.get("wait_for"), state)
    wait_timeout = checks.check(check_timeout, "wait_timeout",
                                60.0 if params.get("wait_timeout") is None else params["wait_timeout"])
    if params.get("end_supervisor") and state != LaunchState.STOPPED.value:
        checks.add("end_supervisor", f"only with state=stopped (state=absent ends it anyway), not with state={state}")
    umask = checks.check(_umask, f"{JOB_UMASK:04o}" if params.get("umask") is None else params["umask"])
    metrics_dir = checks.check(_absolute, "metrics_dir", params.get("metrics_dir") or None)
    metrics_host = checks.check(_metrics_host, metrics_dir, params.get("metrics_host"))
    metrics_rank0 = checks.check(_metrics_rank0, metrics_host, params.get("metrics_rank0"))
    metrics_gpus = checks.check(_metrics_gpus, metrics_dir, params.get("metrics_gpus"))
    max_relaunches = None
    if params.get("max_relaunches") is not None:
        max_relaunches = checks.check(_count, "max_relaunches", params["max_relaunches"], 0, MAX_RELAUNCHES,
                                      "; 0 refuses every relaunch after a failure")
    relaunch_window = checks.check(check_seconds, "relaunch_window",
                                   3600.0 if params.get("relaunch_window") is None else params["relaunch_window"],
                                   0.0, MAX_RELAUNCH_WINDOW, allow_minimum=False)
    relaunch_delay = checks.check(check_seconds, "relaunch_delay", params.get("relaunch_delay") or 0.0,
                                  0.0, MAX_RELAUNCH_DELAY)
    relaunch_max_delay = checks.check(check_seconds, "relaunch_max_delay",
                                      600.0 if params.get("relaunch_max_delay") is None else params["relaunch_max_delay"],
                                      0.0, MAX_RELAUNCH_MAX_DELAY)
    if relaunch_delay is not None and relaunch_max_delay is not None and relaunch_max_delay < relaunch_delay:
        checks.add("relaunch_max_delay", f"{relaunch_max_delay:g}s is less than relaunch_delay {relaunch_delay:g}s "
                   "(the cap of a delay that starts there)")
    failure_cause = params.get("failure_cause") or CAUSE_UNKNOWN
    if failure_cause not in CAUSES:
        checks.add("failure_cause", f"must be one of {', '.join(CAUSES)} (got {failure_cause!r})")
    expect_run_id = checks.check(check_expect_run_id, params.get("expect_run_id"))
    checkpoint_dir = checks.check(_absolute, "checkpoint_dir", params.get("checkpoint_dir") or None)
    checkpoint_marker = checks.check(_checkpoint_marker, params.get("checkpoint_marker"))
    checks.check(_checkpoint_placeholders, resume_args, checkpoint_dir)
    checkpoint_step = None
    if params.get("checkpoint_step") is not None:
        checkpoint_step = checks.check(_count, "checkpoint_step", params["checkpoint_step"], -1, 2**62,
                                       "; -1: the ranks share no complete step")
    if params.get("expect_run_id") is not None and state != LaunchState.STOPPED.value:
        checks.add("expect_run_id", f"only with state=stopped (the run a stop is for), not with state={state}")
    checks.raise_if_any()
    return LaunchOptions(
        name=str(name),
        state=state,
        spec=spec,
        log_path=log_path,
        state_dir=state_dir or "",
        backend=params["backend"],
        keep_logs=int(keep_logs or 0),
        startup_timeout=float(startup_timeout or 0.0),
        min_uptime=float(min_uptime or 0.0),
        ready_regex=ready_regex,
        term_timeout=float(term_timeout or 0.0),
        remove_paths=remove_paths or (),
        log_tail_lines=int(log_tail_lines or 0),
        progress_regex=progress_regex,
        stall_after=stall_after,
        resume_args=resume_args or (),
        resume=params.get("resume") or "auto",
        max_relaunches=max_relaunches,
        relaunch_window=float(relaunch_window or 3600.0),
        relaunch_delay=float(relaunch_delay or 0.0),
        relaunch_max_delay=float(600.0 if relaunch_max_delay is None else relaunch_max_delay),
        failure_cause=str(failure_cause),
        force=bool(params.get("force")),
        reset_guard=bool(params.get("reset_guard")),
        metrics_dir=metrics_dir,
        metrics_host=metrics_host,
        metrics_rank0=metrics_rank0,
        metrics_gpus=metrics_gpus or (),
        expect_run_id=expect_run_id,
        checkpoint_dir=checkpoint_dir,
        checkpoint_format=params.get("checkpoint_format") or "auto",
        checkpoint_marker=checkpoint_marker or "COMPLETE",
        checkpoint_missing=params.get("checkpoint_missing") or "fresh",
        checkpoint_step=checkpoint_step,
        checkpoint_rename_torn=bool(params.get("checkpoint_rename_torn")),
        umask=JOB_UMASK if umask is None else int(umask),
        wait_for=wait_for or (),
        end_supervisor=bool(params.get("end_supervisor")),
        wait_timeout=float(60.0 if wait_timeout is None else wait_timeout),
    )


def preflight_start(options: LaunchOptions) -> None:
    """Whether a start of `options` can work on this machine; OptionsInvalid listing every reason not.

    The one check before a start, in check mode (the probe) and for real, before anything is stopped,
    rotated or removed. It only looks: nothing is created.
    """
    checks = OptionChecks()
    spec = options.spec
    if spec is None:
        checks.add("command", f"required with state={options.state}")
        checks.raise_if_any()
    checks.check(_check_backend, options.backend)
    # As the job's user meets them: chdir entered as the start enters it, the program looked up from there.
    checks.check(resolve_program, spec.argv[0], dict(spec.env).get("PATH", DEFAULT_PATH), spec.chdir,
                 spec.user, spec.group)
    if options.log_path is None:
        checks.add("log_path", f"required with state={options.state}")
    else:
        checks.check(_check_log_path, options.log_path)
    checks.check(_check_job_dir, options.job_dir)
    if options.metrics_dir is not None:
        checks.check(_check_metrics_dir, options.metrics_dir)
    for path in options.remove_paths:
        checks.check(_check_remove_path_parent, path)
    checks.raise_if_any()
