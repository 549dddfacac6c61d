"""Run ansible-playbook for real and return each task's result.

Tests describe a play as Python data; this writes it to a temporary playbook, runs the real
``ansible-playbook`` of the virtualenv with the ``ansible.posix.json`` callback and returns the
parsed per-task results, so a test asserts on what the module really returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


class TaskResults(dict):
    """Results by task name. A role's task is named "ROLE : NAME" and is found by NAME too (lookups
    only: iterating sees each task once, under its full name)."""

    def _full(self, name: Any) -> Any:
        if dict.__contains__(self, name) or not isinstance(name, str):
            return name
        return next((key for key in self if key.endswith(" : " + name)), name)

    def __getitem__(self, name: Any) -> Any:
        return dict.__getitem__(self, self._full(name))

    def __contains__(self, name: Any) -> bool:
        return dict.__contains__(self, self._full(name))

    def get(self, name: Any, default: Any = None) -> Any:
        return dict.get(self, self._full(name), default)


@dataclass
class PlaybookRun:
    """What one ansible-playbook run produced."""

    rc: int
    stdout: str
    stderr: str
    tasks: dict[str, list[dict[str, Any]]] = field(default_factory=TaskResults)
    # The play recap per host: ok (changed included), changed, skipped, failures, ...
    stats: dict[str, dict[str, int]] = field(default_factory=dict)

    def tasks_run(self, host: str) -> int:
        """How many tasks ran on `host` (ok, which counts changed, skipped and failed): the cost of a run."""
        counts = self.stats.get(host, {})
        return counts.get("ok", 0) + counts.get("skipped", 0) + counts.get("failures", 0)

    def result(self, task_name: str, host: str | None = None) -> dict[str, Any]:
        """The result of the named task (on `host`, or the only host that ran it)."""
        hosts = self.tasks.get(task_name)
        if not hosts:
            raise KeyError(f"task {task_name!r} did not run; ran: {sorted(self.tasks)}\n{self.stderr}")
        for entry in hosts:
            if host is None or entry["_host"] == host:
                return entry
        raise KeyError(f"task {task_name!r} did not run on {host!r}")

    def step(self, name: str, host: str | None = None) -> dict[str, Any]:
        """The result of one step of a relaunch (a key of STEP_TASKS) on `host` (or the only host): from the
        decision's task where it ran the step, else from the role's task for it (the last run of it)."""
        for entry in self.tasks.get(DECIDE_TASK, []):
            if host is None or entry["_host"] == host:
                ran = (entry.get("steps") or {}).get(name)
                if ran is not None:
                    return ran
        self.result(STEP_TASKS[name], host)  # a clear KeyError when it never ran
        return [entry for entry in self.tasks[STEP_TASKS[name]] if host is None or entry["_host"] == host][-1]

    def ran_step(self, name: str, host: str | None = None) -> bool:
        """Whether a relaunch ran the step (see step())."""
        try:
            return not self.step(name, host).get("skipped")
        except KeyError:
            return False

    def summary(self, host: str | None = None) -> dict[str, Any]:
        """The relaunch summary of `host` (or of the only host summarized)."""
        found = summaries(self)
        if host is None and len(found) == 1:
            return next(iter(found.values()))
        if host not in found:
            raise KeyError(f"no relaunch summary for {host!r}; have {sorted(found)}\n{self.stdout[-3000:]}\n{self.stderr}")
        return found[host]


DECIDE_TASK = "Look at the job, decide, and relaunch a job of one host"
SUMMARY_TASKS = (DECIDE_TASK, "Summarize")
# The relaunch role's task for each step. A job of one host runs its steps in the decision's task (its result's
# `steps`); the ranks of a multi-rank job, and a job of one host after a container reboot, in these tasks.
STEP_TASKS = {
    "stop": "Stop the job and wait until its whole process tree is gone",
    "cleanup": "End what the last run left behind with the least force that works",
    "drain": "Wait until the GPUs are released",
    "clearance": "Check that nothing left blocks the launch",
    "launch": "Launch the job and prove it started",
}


def summaries(run: PlaybookRun) -> dict[str, dict[str, Any]]:
    """Each host's relaunch summary (the fact relaunch_summary), from whichever task of the relaunch role
    made it: the decision, for a host that needed nothing more, else the Summarize task."""
    found: dict[str, dict[str, Any]] = {}
    for name in SUMMARY_TASKS:
        for entry in run.tasks.get(name, []):
            summary = (entry.get("ansible_facts") or {}).get("relaunch_summary")
            if summary is not None:
                found[entry["_host"]] = summary
    return found


def run_playbook(
    plays: list[dict[str, Any]] | str,
    inventory: str = "localhost,",
    extra_vars: dict[str, Any] | None = None,
    check: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    extra_args: list[str] | None = None,
    wrapper: list[str] | None = None,
) -> PlaybookRun:
    """Run `plays` (data, or the path of a playbook file) and collect per-task results.

    `wrapper` is put in front of the ansible-playbook command line, for example ``unshare ...`` to
    run the whole controller inside a PID namespace of its own."""
    with tempfile.TemporaryDirectory(prefix="gpuops-play-") as tmp:
        if isinstance(plays, str):
            playbook = plays
        else:
            playbook = os.path.join(tmp, "play.yml")
            with open(playbook, "w", encoding="utf-8") as handle:
                json.dump(plays, handle)  # JSON is YAML
        cmd = [str(BIN / "ansible-playbook"), "-i", inventory, playbook]
        if extra_vars:
            vars_file = os.path.join(tmp, "vars.json")
            with open(vars_file, "w", encoding="utf-8") as handle:
                json.dump(extra_vars, handle)
            cmd += ["-e", "@" + vars_file]
        if check:
            cmd.append("--check")
        cmd += extra_args or []
        cmd = [*(wrapper or []), *cmd]
        run_env = dict(os.environ)
        run_env.update(
            ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
            ANSIBLE_STDOUT_CALLBACK="ansible.posix.json",
            ANSIBLE_LOCAL_TEMP=os.path.join(tmp, "local-tmp"),
            ANSIBLE_NOCOLOR="1",
            PATH=f"{BIN}:{run_env.get('PATH', '')}",
        )
        run_env.update(env or {})
        proc = subprocess.run(
            cmd, cwd=str(REPO), env=run_env, capture_output=True, text=True, timeout=timeout, check=False
        )
    run = PlaybookRun(rc=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return run
    run.stats = report.get("stats", {})
    for play in report.get("plays", []):
        for task in play.get("tasks", []):
            name = task["task"]["name"]
            for host, result in task.get("hosts", {}).items():
                run.tasks.setdefault(name, []).append(dict(result, _host=host))
    return run
