# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The per-job supervisor, and how the module daemonizes it.

This file is two things at once:

* a standalone program (standard library only, no collection imports) that ``train_launch``
  copies into the job's state directory and runs with the module's Python interpreter. The module's
  own files are temporary (Ansible deletes them when the task ends), so the supervisor must not
  import anything from there; running a private copy keeps it working for as long as the job runs;
* the functions the module uses to write that copy, spawn it detached, and read and write the state
  files atomically (the same code the supervisor uses, so both sides agree on the format).

The supervisor (``python3 supervisor.py run JOB_DIR``):

* makes itself the child subreaper (``PR_SET_CHILD_SUBREAPER``), so every process the job orphans
  becomes its child and is reaped here instead of piling up under a container init that never reaps;
* starts the job from ``launch.json`` in a process group of its own (stdin from /dev/null, stdout
  and stderr inherited: the job log), as the requested user and group, with the run's mark
  (``GPUOPS_RELAUNCH_RUN=JOB_DIR:RUN_ID``) in its environment: every process of the job inherits
  it, and the module signals only processes that carry it (or descend from this supervisor, which
  carries ``GPUOPS_RELAUNCH_SUPERVISOR=JOB_DIR``);
* writes ``run.json`` (its own and the job's pid, start time and process group) once the job runs;
* forwards SIGTERM/SIGINT it receives to the job's process group member by member: each process in
  the group that descends from it, by (pid, start time), pinned by a pidfd where there is one;
* writes ``exit.json`` (exit code or signal, end time) the moment the job's leader ends;
* exits when it has no child left, i.e. when the job's whole tree is gone - unless its parent can
  never reap it (a container init that neither catches nor ignores SIGCHLD): exiting there would
  leave the supervisor itself as a zombie for ever, so it writes ``idle.json`` and waits, and the
  next start of the same job hands it the new run (``launch.json`` + SIGUSR1) instead of starting
  another supervisor.

``python3 supervisor.py exec JOB_DIR RUN_ID`` is the systemd backend's main process: it opens the
log as the supervisor does (walked from /, ``O_NOFOLLOW``, a regular file with one link), drops to
the job's user and group, and becomes the job (exec: the unit's main process keeps its pid). systemd
itself never opens the log: ``StandardOutput=append:PATH`` would have PID 1 open it by path, as root,
after our checks, through whatever symlink the job's user put there meanwhile.

``python3 supervisor.py record-exit JOB_DIR RUN_ID`` writes ``exit.json`` from systemd's
``$EXIT_CODE``/``$EXIT_STATUS``/``$SERVICE_RESULT``; the systemd backend runs it as ``ExecStopPost``.

The records' names and the helpers that read and write them are in ``jobfiles.py``, shared with the
module. Every file is reached through ``_base/safepath.py`` (copies of both lie next to the private
copy of this program): paths are walked from /, never through a symlink another user can change.

With a live file (train_launch's ``metrics_dir``, see ``live.py``) the supervisor keeps the job's
health current in it: every ``live.PERIOD`` seconds beside its wait, and at once when the job's
leader ends. The wait stays a wait: SIGCHLD wakes it (``signal.set_wakeup_fd``), so a child is
reaped the moment it ends, whatever the period. ``live.py`` judges with ``_launch/health.py`` and
writes with ``_metrics/textfile.py``: copies of them, and of the standard-library files they import,
lie next to this program's too (``PRIVATE_COPIES``).
"""

from __future__ import annotations

import ctypes
import grp
import json
import os
import pwd
import select
import signal
import stat
import subprocess
import sys

if __name__ == "__main__":
    # The private copy, run as a program (with -I, which keeps its own directory off sys.path): the
    # copies of safepath.py and jobfiles.py lie next to it, in the job's directory that only root may write.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import safepath  # pylint: disable=import-error
    import jobfiles  # pylint: disable=import-error
    import live  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import options as _options
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import polling as _polling
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import terminal as _terminal
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import verdict as _verdict
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import checkpoints as _checkpoints
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import health as _health
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import jobfiles
    from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import live
    from ansible_collections.gpuops.relaunch.plugins.module_utils._metrics import textfile as _textfile
    # The live look at the job's GPUs (metrics_gpus): copied next to the supervisor, run by the live file.
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import health_judge as _health_judge
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import health_reads as _health_reads
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import live_gpus as _live_gpus
    from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import xid as _xid

PR_SET_CHILD_SUBREAPER = 36
# The records' names, the marks and the file helpers are the module's too (see jobfiles.py): the
# family imports them from there; these names keep this program's code (and its callers) short.
LAUNCH_FILE = jobfiles.LAUNCH_FILE
RUN_FILE = jobfiles.RUN_FILE
EXIT_FILE = jobfiles.EXIT_FILE
SUPERVISOR_FILE = jobfiles.SUPERVISOR_FILE
SAFEPATH_FILE = jobfiles.SAFEPATH_FILE
JOBFILES_FILE = jobfiles.JOBFILES_FILE
IDLE_FILE = jobfiles.IDLE_FILE
FAILED_START_FILE = jobfiles.FAILED_START_FILE
STATE_FILE_MODE = jobfiles.STATE_FILE_MODE
RUN_MARK = jobfiles.RUN_MARK
SUPERVISOR_MARK = jobfiles.SUPERVISOR_MARK
run_mark = jobfiles.run_mark
NotRegularFile = jobfiles.NotRegularFile
open_regular = jobfiles.open_regular
utc_now = jobfiles.utc_now
write_json_atomic = jobfiles.write_json_atomic
load_json = jobfiles.load_json
read_json = jobfiles.read_json
process_stat = jobfiles.process_stat
process_starttime = jobfiles.process_starttime


def group_members_below(group: int, ancestor: int, proc_root: str = "/proc") -> list:
    """(pid, starttime) of the processes in process group `group` that descend from `ancestor`."""
    table = {}
    for name in os.listdir(proc_root):
        if name.isdigit():
            fields = process_stat(int(name), proc_root)
            if fields is not None:
                table[int(name)] = fields
    members = []
    for pid, (parent, pgid, starttime) in table.items():
        if pgid != group or pid == ancestor:
            continue
        hops = 0
        while parent not in (0, ancestor) and parent in table and hops < len(table):
            parent, hops = table[parent][0], hops + 1
        if parent == ancestor:
            members.append((pid, starttime))
    return members


def signal_identity(pid: int, starttime: int, signum: int, proc_root: str = "/proc") -> bool:
    """Send `signum` to `pid` only if it still has `starttime`: pinned by a pidfd where there is one.

    The collection's signal gate (plugins/module_utils/_base/signal_gate.py) does the same; this
    program runs alone with the standard library, so it keeps this small copy. As the gate does, a
    SIGTERM or SIGINT is followed by SIGCONT: a stopped member runs its handler only when continued.
    """
    resume = signum in (signal.SIGTERM, signal.SIGINT)
    try:
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            handle = os.pidfd_open(pid)  # pylint: disable=no-member
            try:
                if process_starttime(pid, proc_root) != starttime:
                    return False
                signal.pidfd_send_signal(handle, signum)  # pylint: disable=no-member
                if resume:
                    signal.pidfd_send_signal(handle, signal.SIGCONT)  # pylint: disable=no-member
            finally:
                os.close(handle)
            return True
        if process_starttime(pid, proc_root) != starttime:
            return False
        os.kill(pid, signum)
        if resume and process_starttime(pid, proc_root) == starttime:
            os.kill(pid, signal.SIGCONT)
        return True
    except OSError:
        return False  # it ended meanwhile


def job_credentials(launch: dict) -> tuple:
    """(uid, gid, supplementary gids) the job runs with; None where it keeps ours."""
    user = launch.get("user")
    group = launch.get("group")
    if user is not None:
        entry = pwd.getpwnam(user)
        gid = grp.getgrnam(group).gr_gid if group is not None else entry.pw_gid
        return entry.pw_uid, gid, sorted({g.gr_gid for g in grp.getgrall() if user in g.gr_mem} | {gid})
    if group is not None:
        return None, grp.getgrnam(group).gr_gid, None
    return None, None, None


def take_job_identity(uid, gid, extra_groups) -> None:
    """Become the job's groups and user for good (groups first: only root may set them)."""
    if gid is not None:
        if extra_groups is not None:
            os.setgroups(extra_groups)
        os.setresgid(gid, gid, gid)
    if uid is not None:
        os.setresuid(uid, uid, uid)


def enter_working_directory(chdir) -> None:
    """Make `chdir` (or /) the working directory, with the rights this process has now.

    Called once the job's user and groups are taken (take_job_identity, or Popen's user=): a job of
    another user enters its directory with that user's rights, so the kernel follows only the links
    that user could follow anyway, and a directory the user swapped for a link into a place only root
    may reach (between two runs) is Permission denied, never entered. Root entering it first would
    leave the job a working directory it could never have reached, and every name the job opens
    relative to it would be looked up from there. A job that runs as root is walked as the log is
    (_base/safepath.py: no symlink another user can change) and entered by its descriptor.
    """
    if not chdir:
        os.chdir("/")
    elif os.geteuid() != 0:
        os.chdir(chdir)
    else:
        with safepath.walk(chdir) as found:
            os.fchdir(found.fd)


def account_name(user) -> str:
    """The job's user as a message names it (ours where the job keeps our uid)."""
    if user is not None:
        return user
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def working_directory_error(chdir: str, user, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "the working directory %r does not exist (for user %s)" % (chdir, account_name(user))
    return "the working directory %r cannot be entered as user %s: %s" % (
        chdir, account_name(user), exc.strerror or exc)


def find_program(program: str, search_path: str):
    """The file the job's exec would run, as this process (the job's user, in its working directory) finds it.

    As execvpe looks: a name with a slash as it is (relative to the working directory), any other on
    the PATH. (None, why) where none can be executed.
    """
    candidates = [program] if "/" in program else [
        os.path.join(directory, program) for directory in search_path.split(":")]
    why = "not found"
    for candidate in candidates:
        try:
            info = os.stat(candidate)
        except OSError as exc:
            why = exc.strerror or str(exc)
            continue
        if not stat.S_ISREG(info.st_mode):
            why = "not a regular file"
        elif not os.access(candidate, os.X_OK):
            why = "Permission denied"
        else:
            return candidate, ""
    return None, why


def _start_check(launch: dict) -> dict:
    """In the child of check_as_job_user: become the job's user, enter chdir, find the program."""
    user = launch.get("user")
    try:
        uid, gid, extra_groups = job_credentials(launch)
    except KeyError as exc:
        return {"option": "group" if user is None or launch.get("group") else "user",
                "reason": "no such account: %s" % exc}
    try:
        take_job_identity(uid, gid, extra_groups)
    except OSError as exc:
        return {"option": "user", "reason": "cannot become user %s from uid %d: %s"
                % (account_name(user), os.geteuid(), exc.strerror or exc)}
    chdir = launch.get("chdir")
    try:
        enter_working_directory(chdir)
    except OSError as exc:
        return {"option": "chdir", "reason": working_directory_error(chdir, user, exc)}
    program = launch["argv"][0]
    search_path = (launch.get("env") or {}).get("PATH", DEFAULT_PATH)
    found, why = find_program(program, search_path)
    if found is None:
        if "/" not in program:
            where = " on PATH %s" % search_path
        else:
            where = "" if program.startswith("/") else " in %s" % (chdir or "/")
        return {"option": "command", "reason": "%r is not an executable file%s for user %s (%s)"
                % (program, where, account_name(user), why)}
    return {"program": found}


# How long the check as the job's user may take (a hung network file system on chdir or PATH).
CHECK_TIMEOUT = 30.0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def check_as_job_user(launch: dict, timeout: float = CHECK_TIMEOUT) -> dict:
    """Whether the start of `launch` can work, asked by a child that has become the job's user.

    Root can reach what the job's user cannot (a program below a directory only root may pass, a
    working directory swapped for a link), so the check is made as the start makes it: a forked child
    takes the job's groups and user (take_job_identity), enters chdir (enter_working_directory) and
    looks the program up with access() from there. {"program": path} where it can;
    {"option", "reason"} naming what stands in the way where not. The module's preflight asks this
    before anything is stopped; the systemd unit's main process asks it again while it is still root,
    so that what it finds is recorded (after dropping root it could no longer write the record).
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked child, which never returns
        try:
            # Nothing of ours (the job's lock, Ansible's pipes, the log) stays open in a process of the job's user.
            top = os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 65536
            os.closerange(3, write_fd)
            os.closerange(write_fd + 1, top)
            answer = _start_check(launch)
        except BaseException as exc:  # pylint: disable=broad-except
            answer = {"internal": "%s: %s" % (type(exc).__name__, exc)}
        try:
            os.write(write_fd, json.dumps(answer).encode("utf-8")[:60000])
        finally:
            os._exit(0)  # pylint: disable=protected-access
    os.close(write_fd)
    data = b""
    try:
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        while True:
            if not poller.poll(timeout * 1000):
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_fd)
        if not data:
            os.kill(pid, signal.SIGKILL)  # our own child, not reaped yet: its pid is still its own
        os.waitpid(pid, 0)
    if not data:
        return {"option": "chdir" if launch.get("chdir") else "command",
                "reason": "the check as the job's user did not answer within %gs (a hung file system?)" % timeout}
    answer = json.loads(data.decode("utf-8"))
    if "internal" in answer:
        raise RuntimeError("the check as the job's user failed: %s" % answer["internal"])
    return answer


def job_environment(launch: dict, job_dir: str) -> dict:
    """The job's environment: launch.json's, and the run's mark that every process of the run inherits."""
    env = dict(launch.get("env") or {})
    env[RUN_MARK] = run_mark(job_dir, launch.get("run_id"))
    return env


def record_exit(job_dir: str, run_id: str, fields: dict) -> None:
    """exit.json: how the run `run_id` ended (exit_code, exit_signal, or the error that kept it from starting)."""
    record = {"run_id": run_id, "ended_at": utc_now(), "exit_code": None, "exit_signal": None}
    record.update(fields)
    write_json_atomic(os.path.join(job_dir, EXIT_FILE), record)


def exit_fields(status: int) -> dict:
    """exit_code / exit_signal from a waitpid status."""
    if os.WIFSIGNALED(status):
        return {"exit_code": None, "exit_signal": signal.Signals(os.WTERMSIG(status)).name}
    return {"exit_code": os.WEXITSTATUS(status), "exit_signal": None}


# --- the supervisor program ------------------------------------------------------------------


class Supervisor:
    """Runs one job to the end of its whole process tree."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.launch = read_json(os.path.join(job_dir, LAUNCH_FILE)) or {}
        self.run_id = self.launch.get("run_id")
        self.job_pid = 0
        self.pending_signal = 0

    def forward(self, signum: int, _frame: object) -> None:
        """Pass a stop signal on to the job's group, member by member, each by its identity.

        job_pid is set only while the leader is our unreaped child, so the group id is the job's;
        a member must also descend from us (the subreaper), and is signalled only if its pid still
        has the start time just read.
        """
        if not self.job_pid:
            self.pending_signal = signum
            return
        forwarded = signal.SIGTERM if signum == signal.SIGINT else signum
        for pid, starttime in group_members_below(self.job_pid, os.getpid()):
            signal_identity(pid, starttime, forwarded)

    def record_exit(self, fields: dict) -> None:
        record_exit(self.job_dir, self.run_id, fields)

    def start_job(self) -> subprocess.Popen:
        launch = self.launch
        uid, gid, extra_groups = job_credentials(launch)
        kwargs = {}
        if uid is not None:
            kwargs["user"] = uid
        if gid is not None:
            kwargs["group"] = gid
        if extra_groups is not None:
            kwargs["extra_groups"] = extra_groups
        chdir = launch.get("chdir")
        # This program's own umask (0077, see spawn_detached) is not the job's.
        umask = jobfiles.job_umask(launch)
        # Why the working directory could not be entered, from the child (non-inheritable: exec closes it).
        reason_read, reason_write = os.pipe()

        def become_job() -> None:
            # Popen calls this in the child after it took the job's groups and user (setgroups,
            # setregid, setreuid come before preexec_fn), never cwd=, which changes directory as root.
            # A group of its own: the job and every child that stays in it are found by group id.
            os.setpgrp()
            os.umask(umask)
            try:
                enter_working_directory(chdir)
            except OSError as exc:
                os.write(reason_write, working_directory_error(chdir, launch.get("user"), exc).encode("utf-8")[:4000])
                raise

        try:
            return subprocess.Popen(  # pylint: disable=consider-using-with
                launch["argv"],
                env=job_environment(launch, self.job_dir),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                preexec_fn=become_job,  # pylint: disable=subprocess-popen-preexec-fn
                **kwargs
            )
        except subprocess.SubprocessError:
            # Popen says only "Exception occurred in preexec_fn"; the child said why.
            os.close(reason_write)
            reason_write = -1
            reason = os.read(reason_read, 4096).decode("utf-8", "replace")
            if reason:
                raise OSError(reason) from None
            raise
        finally:
            os.close(reason_read)
            if reason_write >= 0:
                os.close(reason_write)

    def run(self, linger: str = "auto") -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            sys.stderr.write("gpuops supervisor: PR_SET_CHILD_SUBREAPER failed: errno %d\n" % ctypes.get_errno())
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.forward)
        # A byte in this pipe for every signal that arrives: the wait for children (and the live
        # file's period) is a select on it, which a SIGCHLD ends at once. Both ends close on exec.
        self.wake_read, wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
        # Handlers, not SIG_IGN: exec resets handlers to default but would keep an ignore for the job.
        signal.signal(signal.SIGHUP, lambda _signum, _frame: None)
        signal.signal(signal.SIGUSR1, lambda _signum, _frame: None)
        while True:
            code = self.run_job()
            if linger == "never" or (linger == "auto" and parent_reaps()):
                return code
            if not self.wait_for_next_launch():
                return code

    def run_job(self) -> int:
        """Start the job of launch.json and supervise it until its whole tree is gone."""
        self.job_pid = 0
        self.pending_signal = 0
        try:
            job = self.start_job()
        except (OSError, KeyError, ValueError, subprocess.SubprocessError) as exc:
            self.record_exit({"error": "cannot start %r: %s" % (self.launch.get("argv"), exc)})
            return 1
        self.job_pid = job.pid
        write_json_atomic(os.path.join(self.job_dir, RUN_FILE), {
            "run_id": self.run_id,
            "spec_hash": self.launch.get("spec_hash"),
            "backend": "supervisor",
            "supervisor_pid": os.getpid(),
            "supervisor_starttime": process_starttime(os.getpid()),
            "pid": job.pid,
            "pgid": job.pid,
            "starttime": process_starttime(job.pid),
            "started_at": utc_now(),
            "log_path": self.launch.get("log_path"),
        })
        if self.pending_signal:
            self.forward(self.pending_signal, None)
        monitor = live.Monitor.of_launch(self.job_dir, self.launch)
        while True:
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return 0  # no child left: the job's whole tree is gone
                if pid == 0:
                    break
                if pid == job.pid:
                    job.returncode = status  # keeps Popen from waiting on a pid we reaped
                    self.job_pid = 0  # reaped: its pid and group id are free for anyone now
                    self.record_exit(exit_fields(status))
                    if monitor is not None:
                        monitor.refresh(alive=False)  # the live file says so at once
            if monitor is not None and self.job_pid and monitor.due():
                monitor.refresh(alive=True)  # the leader is our child, not reaped yet: alive
            timeout = monitor.seconds_to_next() if monitor is not None and self.job_pid else None
            select.select([self.wake_read], [], [], timeout)
            try:
                while os.read(self.wake_read, 4096):
                    pass
            except BlockingIOError:
                pass

    def reopen_log(self) -> None:
        """Point our stdout/stderr (which the job inherits) at the log of the new run.

        The module rotated the previous log by renaming it: the old descriptors still write there.
        """
        log_fd = open_regular(self.launch["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)

    def wait_for_next_launch(self) -> bool:
        """Idle until the module hands over the next run (SIGUSR1); False when told to end.

        Only where our parent never reaps: exiting there would leave this process as a zombie that
        nothing clears, so it stays, idle, and the next start of the same job reuses it.
        """
        idle_path = os.path.join(self.job_dir, IDLE_FILE)
        waited_for = {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
        # Blocked before idle.json appears, so a SIGUSR1 sent after reading it stays pending.
        signal.pthread_sigmask(signal.SIG_BLOCK, waited_for)
        write_json_atomic(idle_path, {
            "supervisor_pid": os.getpid(),
            "supervisor_starttime": process_starttime(os.getpid()),
            "last_run_id": self.run_id,
            "since": utc_now(),
        })
        try:
            while True:
                if signal.sigwait(waited_for) != signal.SIGUSR1:
                    return False
                launch = read_json(os.path.join(self.job_dir, LAUNCH_FILE)) or {}
                if launch.get("run_id") and launch.get("run_id") != self.run_id:
                    self.launch = launch
                    self.run_id = launch["run_id"]
                    try:
                        self.reopen_log()
                    except OSError as exc:
                        # Not a regular file any more (a symlink or FIFO planted there): this run
                        # cannot start, and says why; we stay idle for the next one.
                        self.record_exit({"error": "cannot open log_path: %s" % exc})
                        continue
                    return True
        finally:
            try:
                os.unlink(idle_path)
            except OSError:
                pass
            signal.pthread_sigmask(signal.SIG_UNBLOCK, waited_for)


def parent_reaps(proc_root: str = "/proc") -> bool:
    """Whether our parent handles or ignores SIGCHLD, i.e. can reap us when we exit.

    A container init such as ``sleep`` neither catches nor ignores it and never calls wait().
    An init that polls wait() without a handler is taken for one that does not reap: then we
    merely stay idle, which costs one sleeping process per job name.
    """
    masks = {}
    try:
        with open("%s/%d/status" % (proc_root, os.getppid()), encoding="ascii", errors="replace") as handle:
            for line in handle:
                key, _sep, value = line.partition(":")
                if key in ("SigCgt", "SigIgn"):
                    masks[key] = int(value.strip(), 16)
    except (OSError, ValueError):
        return True
    return bool((masks.get("SigCgt", 0) | masks.get("SigIgn", 0)) & (1 << (signal.SIGCHLD - 1)))


# Where the systemd unit's main process says why it could not become the job once it no longer is
# root (see exec_job); ExecStopPost moves it into exit.json.
START_ERROR_FILE = "start_error.txt"


def open_start_error(job_dir: str, run_id: str) -> int:
    """START_ERROR_FILE, emptied and opened for writing, O_CLOEXEC: the exec that becomes the job closes it.

    Opened while we are root, so that after taking the job's user we can still say why an exec failed
    - and only we: the job never holds the descriptor, and the file lies in the job's directory that
    only root may enter. The run id comes first, so that the record is never taken for another run's.
    """
    with safepath.walk(job_dir) as found:
        fd = safepath.open_regular_at(found.fd, START_ERROR_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                      STATE_FILE_MODE)
    os.write(fd, ("%s\n" % run_id).encode("utf-8"))
    return fd


def take_start_error(job_dir: str, run_id: str):
    """What the unit's main process of `run_id` wrote into START_ERROR_FILE (None if nothing); the file is removed."""
    try:
        with safepath.walk(job_dir) as found:
            try:
                fd = safepath.open_regular_at(found.fd, START_ERROR_FILE, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                data = os.read(fd, 8192).decode("utf-8", "replace")
            finally:
                os.close(fd)
                os.unlink(START_ERROR_FILE, dir_fd=found.fd)
    except OSError:
        return None
    recorded_run, _sep, error = data.partition("\n")
    if recorded_run != run_id:
        return None
    return error.strip() or None


def record_systemd_exit(job_dir: str, run_id: str, environ: dict) -> None:
    """exit.json from the variables systemd passes to ExecStopPost.

    An error that ``exec`` recorded for this run (it could not become the job) is kept: it says more
    than the exit status it ended with; so is one it could only write into START_ERROR_FILE, having
    taken the job's user already.
    """
    code = environ.get("EXIT_CODE", "")
    status = environ.get("EXIT_STATUS", "")
    fields = {"exit_code": None, "exit_signal": None, "service_result": environ.get("SERVICE_RESULT")}
    if code == "exited" and status.isdigit():
        fields["exit_code"] = int(status)
    elif code in ("killed", "dumped") and status:
        fields["exit_signal"] = status if status.startswith("SIG") else "SIG" + status
    earlier = read_json(os.path.join(job_dir, EXIT_FILE)) or {}
    after_drop = take_start_error(job_dir, run_id)
    if earlier.get("run_id") == run_id and earlier.get("error"):
        fields["error"] = earlier["error"]
    elif after_drop:
        fields["error"] = after_drop
    record_exit(job_dir, run_id, fields)
    # The live file says so at once, not at the live unit's next look (it never raises).
    live.refresh_once(job_dir, run_id, alive=False)


def exec_job(job_dir: str, run_id: str) -> int:
    """Become the job of launch.json (the systemd backend's main process); returns only on failure.

    The log is opened here, as root, the way the supervisor's is (see safepath: walked from /, no
    symlink another user can change, O_NOFOLLOW, a regular file with one link), and handed to the
    job as its stdout and stderr; then the job's groups and user are taken, and exec keeps the pid.
    """
    launch = read_json(os.path.join(job_dir, LAUNCH_FILE)) or {}
    try:
        if launch.get("run_id") != run_id:
            raise ValueError("launch.json is not the launch of run %s" % run_id)
        try:
            log_fd = open_regular(launch["log_path"], os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise OSError("cannot open log_path %s: %s (a symlink, FIFO or hard link there is refused)"
                          % (launch["log_path"], exc.strerror or exc)) from None
        uid, gid, extra_groups = job_credentials(launch)
        null_fd = os.open(os.devnull, os.O_RDONLY | os.O_NOFOLLOW)
        # Asked while we are still root, so that what stands in the way is recorded: once we are
        # the job's user we can no longer write the record.
        found = check_as_job_user(launch)
        if "program" not in found:
            raise ValueError("%s: %s" % (found.get("option"), found.get("reason")))
        error_fd = open_start_error(job_dir, run_id)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        why = "cannot start %r: %s" % (launch.get("argv"), exc)
        record_exit(job_dir, run_id, {"error": why})
        sys.stderr.write("gpuops exec: %s\n" % why)
        return 1
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null_fd)
    os.close(log_fd)
    argv = launch["argv"]
    try:
        take_job_identity(uid, gid, extra_groups)
        os.umask(jobfiles.job_umask(launch))
        # As the job's user, never as root (see enter_working_directory); systemd's WorkingDirectory=
        # would have PID 1 change into it as root, following whatever link the job's user put there.
        enter_working_directory(launch.get("chdir"))
        # The program as the job's PATH finds it (checked just now, as the job's user).
        os.execvpe(argv[0], argv, job_environment(launch, job_dir))
    except OSError as exc:
        why = "cannot start %r: %s" % (argv, exc)
        sys.stderr.write("gpuops exec: %s\n" % why)
        try:
            os.write(error_fd, why.encode("utf-8")[:4000])
        except OSError:
            pass
    return 127


def main(argv: list) -> int:
    if len(argv) >= 2 and argv[0] == "run":
        linger = argv[2] if len(argv) >= 3 and argv[2] in ("auto", "never", "always") else "auto"
        return Supervisor(argv[1]).run(linger)
    if len(argv) >= 3 and argv[0] == "record-exit":
        record_systemd_exit(argv[1], argv[2], dict(os.environ))
        return 0
    if len(argv) >= 3 and argv[0] == "exec":
        return exec_job(argv[1], argv[2])
    sys.stderr.write("usage: supervisor.py run JOB_DIR [auto|never|always] | exec JOB_DIR RUN_ID"
                     " | record-exit JOB_DIR RUN_ID\n")
    return 2


# --- used by the module ----------------------------------------------------------------------


def module_source(module) -> str:
    """A module's source, wherever Ansible loaded it from (a file or the AnsiballZ zip)."""
    loader = getattr(module, "__loader__", None)
    get_source = getattr(loader, "get_source", None)
    if get_source is not None:
        try:
            source = get_source(module.__name__)
        except ImportError:
            source = None
        if source:
            return source
    with open(module.__file__, encoding="utf-8") as handle:
        return handle.read()


def supervisor_source() -> str:
    """This file's source."""
    return module_source(sys.modules[__name__])


def private_copies() -> tuple:
    """(file name, module) of every file the private copy imports from beside itself: each is standard
    library only but for its neighbours here (it imports them by bare name when it has no package)."""
    return ((SAFEPATH_FILE, safepath), (JOBFILES_FILE, jobfiles), ("options.py", _options), ("terminal.py", _terminal),
            ("verdict.py", _verdict), ("polling.py", _polling), ("health.py", _health), ("textfile.py", _textfile), (live.LIVE_FILE, live),
            ("xid.py", _xid), ("health_reads.py", _health_reads), ("health_judge.py", _health_judge), ("live_gpus.py", _live_gpus),
            ("checkpoints.py", _checkpoints))


def install_supervisor(job_dir: str) -> str:
    """Write the private copy of this program, and of the files it imports (private_copies) next to it,
    into `job_dir`; return its path."""
    for name, module in private_copies():
        safepath.write_atomic(os.path.join(job_dir, name), module_source(module).encode("utf-8"), STATE_FILE_MODE)
    path = os.path.join(job_dir, SUPERVISOR_FILE)
    safepath.write_atomic(path, supervisor_source().encode("utf-8"), STATE_FILE_MODE)
    return path


def spawn_detached(argv: list, log_path: str, log_mode: int = 0o640, env: dict | None = None) -> None:
    """Start `argv` fully detached: double fork, setsid, stdio to the log, every other fd closed.

    Returns once the intermediate child has exited (it is reaped here, so it leaves no zombie);
    the grandchild then belongs to no session of ours and outlives the Ansible connection, a kill
    of the launcher's process group, and the deletion of the module's temporary files.
    """
    log_fd = open_regular(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, log_mode)
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the forked child, which never returns
            status = 127
            try:
                os.setsid()
                if os.fork() == 0:
                    null_fd = os.open(os.devnull, os.O_RDONLY | os.O_NOFOLLOW)
                    os.dup2(null_fd, 0)
                    os.dup2(log_fd, 1)
                    os.dup2(log_fd, 2)
                    os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 65536)
                    os.chdir("/")
                    os.umask(0o077)
                    os.execve(argv[0], argv, dict(os.environ) if env is None else env)
                status = 0
            finally:
                os._exit(status)  # pylint: disable=protected-access
        _pid, status = os.waitpid(child, 0)
        if status != 0:
            raise OSError("the detaching child failed with wait status %d" % status)
    finally:
        os.close(log_fd)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
