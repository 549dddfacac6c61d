"""Shared pieces of the train_launch integration tests: targets, plays, process checks, clean-up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.pidns import PidNamespace, pid_namespace, process_starttime
from tests.harness.playbook import REPO, PlaybookRun, run_playbook

DEMO = str(REPO / "playbooks" / "files" / "demo_train.py")
PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    stat: str
    args: str

    @property
    def zombie(self) -> bool:
        return self.stat.startswith("Z")


@dataclass
class Target:
    """Where the job runs: this machine (local connection) or a PID-namespace container (nsenter)."""

    kind: str
    inventory: str
    work: Path
    namespace: PidNamespace | None = None
    started_runs: list[dict] = field(default_factory=list)

    @property
    def state_dir(self) -> str:
        return str(self.work / "state")

    def log(self, name: str = "train.log") -> str:
        return str(self.work / name)

    def play(self, tasks: list[dict[str, Any]], check: bool = False, timeout: float = 180) -> PlaybookRun:
        run = run_playbook(
            [{"hosts": "all", "gather_facts": False, "tasks": tasks}],
            inventory=self.inventory, check=check, timeout=timeout,
        )
        for name in run.tasks:
            for result in run.tasks[name]:
                self.remember(result)
        return run

    def demo(self, *args: str, script: str = DEMO) -> list[str]:
        """The demo job's argv, tagged with this target's work directory (see mine()).

        `script`: another copy of the demo (see readable_by_all, for a job run as another user)."""
        return [PYTHON, script, "--tag", str(self.work), *args]

    def mine(self, proc: Proc) -> bool:
        """Whether `proc` is a demo job started by this test (other tests may run the demo too)."""
        return f"--tag {self.work} " in proc.args + " "

    def launch_task(self, name: str = "job", task_name: str = "launch", **options: Any) -> dict[str, Any]:
        args: dict[str, Any] = {
            "name": name,
            "command": self.demo(),
            "log_path": self.log(),
            "state_dir": self.state_dir,
            "ready_regex": "^step 1 ",
            "min_uptime": 0.5,
            "startup_timeout": 20,
            "term_timeout": 5,
        }
        args.update(options)
        return {"name": task_name, "gpuops.relaunch.train_launch": args}

    def remember(self, result: dict[str, Any]) -> None:
        """Keep what a task said it started, so clean-up can end it even if an assertion fails."""
        if result.get("supervisor_pid") or result.get("pid"):
            self.started_runs.append(dict(result))

    def processes(self) -> dict[int, Proc]:
        argv = ["ps", "-ww", "-eo", "pid=,ppid=,pgid=,stat=,args="]
        if self.namespace is not None:
            out = self.namespace.run_inside(argv).stdout
        else:
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        table: dict[int, Proc] = {}
        for line in out.splitlines():
            parts = line.split(None, 4)
            if len(parts) >= 4:
                pid, ppid, pgid = int(parts[0]), int(parts[1]), int(parts[2])
                table[pid] = Proc(pid, ppid, pgid, parts[3], parts[4] if len(parts) > 4 else "")
        return table

    def read_state(self, name: str, file: str) -> dict | None:
        try:
            return json.loads(Path(self.state_dir, name, file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def host_pid(self, pid: int) -> int | None:
        """The host pid of a pid as the target sees it."""
        if self.namespace is None:
            return pid
        for host_pid in self.namespace.host_pids():
            try:
                status = Path(f"/proc/{host_pid}/status").read_text(encoding="utf-8")
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:") and int(line.split()[-1]) == pid:
                    return host_pid
        return None

    def clean_up(self) -> None:
        """End whatever the tests started here (the namespace ends with its init anyway)."""
        if self.namespace is not None:
            return
        end_recorded_runs(self.state_dir, self.started_runs)


@contextmanager
def readable_by_all(*files: str | Path) -> Iterator[dict[str, str]]:
    """Copies of `files` that any user can read: {original: copy}, removed with the block.

    A job run as another user (nobody) must read what it runs, wherever the checkout or pytest's
    tmp_path lie (a `mktemp -d` folder is 0700): the copies go into a fresh directory under /tmp
    made 0755, each file 0644."""
    directory = Path(tempfile.mkdtemp(prefix="gpuops-readable-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        copies: dict[str, str] = {}
        for original in files:
            copy = directory / Path(original).name
            shutil.copyfile(original, copy)
            copy.chmod(0o644)
            copies[str(original)] = str(copy)
        yield copies
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def on_localhost(work: Path) -> Iterator[Target]:
    """This machine over the local connection; the runs the tests started end with the block."""
    inventory = work / "inventory"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={PYTHON}\n")
    where = Target("localhost", str(inventory), work)
    try:
        yield where
    finally:
        where.clean_up()


@contextmanager
def in_pid_namespace(work: Path) -> Iterator[Target]:
    """A never-reaping PID namespace over nsenter; everything inside ends with the block."""
    inventory = work / "inventory"
    with pid_namespace() as namespace:
        namespace.write_inventory(inventory)
        yield Target("pidns", str(inventory), work, namespace)


def end_recorded_runs(state_dir: str | Path, started_runs: list[dict[str, Any]] | None = None) -> None:
    """SIGKILL the supervisors and jobs that task results or the state directory record.

    Only recorded (pid, starttime) identities are signalled. The state directory also names a
    supervisor waiting idle after a stop or a failed start, which appears in no task result.
    """
    runs = list(started_runs or [])
    for records in Path(state_dir).glob("*/*.json"):
        if records.name in ("run.json", "idle.json"):
            try:
                runs.append(json.loads(records.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue
    for run in runs:
        for pid_key, start_key in (("supervisor_pid", "supervisor_starttime"), ("pid", "starttime")):
            pid = run.get(pid_key)
            if not pid:
                continue
            if start_key in run and process_starttime(pid) != run.get(start_key):
                continue
            try:
                if pid_key == "pid" and os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def playbook_popen(target: Target, tasks: list[dict], out: Path) -> subprocess.Popen:
    """ansible-playbook in a session of its own (so the test can kill that whole session)."""
    play = out.with_suffix(".yml")
    play.write_text(json.dumps([{"hosts": "all", "gather_facts": False, "tasks": tasks}]), encoding="utf-8")
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    with open(out, "w", encoding="utf-8") as handle:
        return subprocess.Popen(  # pylint: disable=consider-using-with
            [str(Path(sys.executable).parent / "ansible-playbook"), "-i", target.inventory, str(play)],
            cwd=str(REPO), env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )
