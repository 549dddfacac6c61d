"""The support matrix of `make test`: the installed tarball's relaunch on the oldest and the newest ansible-core.

Each entry of ENTRIES gets a venv of its own under .build/matrix/<entry>/ with only ansible-core (the
exact pins of requirements/matrix-<core>.txt), created once and kept while a stamp file matches the
requirements and the interpreter. Every run then:

1. builds the collection tarball from this checkout with the main venv's ansible-galaxy (.build/dist),
2. installs it with the entry's own ansible-galaxy into the entry's collections dir,
3. runs `ansible-playbook gpuops.relaunch.relaunch` of the entry's venv with ANSIBLE_COLLECTIONS_PATH
   naming only that dir (no ansible.cfg of the checkout, no sys.path scan: the tarball is what runs)
   against localhost, the target's interpreter the entry's Python, with a job of the entry's own (its
   name, a copy of the installed demo trainer in a temporary dir, its own log and state dirs, a
   clean-up pattern anchored to that copy's path, no GPU required): a launch, then a no-op that
   changes nothing and keeps the same pid (read from relaunch_summary_dir: localhost@JOB.json, fleet.json),
4. stops the job with train_launch state=stopped through the same venv, and checks that nothing is
   left running.

Everything that runs a module runs inside a private PID namespace (tests/harness/pidns.py) whose init
reaps, as a host's init does: the stop must leave only that init, and the namespace ends by a SIGKILL
to its recorded init (checked by start time) whatever happened. Entries run in parallel (separate
names, dirs and namespaces). One line per entry; the exit status is non-zero when any entry failed.

    .venv/bin/python tools/matrix.py            # every entry
    .venv/bin/python tools/matrix.py 2.16       # the entries whose name contains "2.16"
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# tests.harness and the collection's module_utils (by FQCN, through the link `make collection` makes),
# as tests/conftest.py makes them importable.
for _path in (str(REPO / ".build" / "collections"), str(REPO)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# pylint: disable=wrong-import-position
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline  # noqa: E402
from tests.harness.pidns import PidNamespace, pid_namespace  # noqa: E402

MATRIX_DIR = REPO / ".build" / "matrix"
DIST_DIR = REPO / ".build" / "dist"
MAIN_BIN = Path(sys.executable).parent
VERSION = yaml.safe_load((REPO / "galaxy.yml").read_text(encoding="utf-8"))["version"]
PYENV = Path.home() / ".pyenv" / "versions"
# A playbook run, the tarball install and the venv creation each get this long at most.
STEP_TIMEOUT = 600
# PID 1 of each namespace: reaps every child, reparented orphans included (a host's init does), so
# that a stopped job leaves no zombie behind and "nothing left" means only this init.
REAPING_INIT = (
    "import os, signal\n"
    "def reap(*_):\n"
    "    try:\n"
    "        while os.waitpid(-1, os.WNOHANG)[0] > 0:\n"
    "            pass\n"
    "    except ChildProcessError:\n"
    "        pass\n"
    "signal.signal(signal.SIGCHLD, reap)\n"
    "reap()\n"
    "while True:\n"
    "    signal.pause()\n"
)
RECAP = re.compile(r"^localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)


@dataclass(frozen=True)
class Entry:
    """One cell of the matrix: an ansible-core series on one Python (controller and target alike)."""

    core: str  # the series, e.g. "2.16": requirements/matrix-<core>.txt pins it exactly
    python: str  # a pyenv version, e.g. "3.11.7"

    @property
    def name(self) -> str:
        return f"core{self.core}-py{self.python.rsplit('.', 1)[0]}"

    @property
    def interpreter(self) -> Path:
        # By full path, never a pyenv shim: the shim's choice depends on the caller's directory.
        return PYENV / self.python / "bin" / f"python{self.python.rsplit('.', 1)[0]}"

    @property
    def requirements(self) -> Path:
        return REPO / "requirements" / f"matrix-{self.core}.txt"

    @property
    def root(self) -> Path:
        return MATRIX_DIR / self.name

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def collections(self) -> Path:
        return self.root / "collections"


# The oldest ansible-core that meta/runtime.yml claims (requires_ansible), on the oldest Python it is
# tested with here, and the newest ansible-core, on the newest Python it supports here.
ENTRIES = (Entry("2.16", "3.11.7"), Entry("2.21", "3.13.0"))


class MatrixFailure(Exception):
    """An entry failed; the message says at which step and why."""


def _run(argv: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = STEP_TIMEOUT) -> str:
    """Run `argv`, keep its output in `log`, and return stdout; a failure raises with the output's tail.

    The step is named after the log (launch, noop, stop, install, pip...) and the program run (the
    one after nsenter's "--" when the command enters a namespace)."""
    program = argv[argv.index("--") + 1] if argv[0] == "nsenter" and "--" in argv else argv[0]
    step = f"{log.stem} ({Path(program).name})"
    try:
        proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise MatrixFailure(f"{step} ran past {timeout} s") from None
    except OSError as exc:
        raise MatrixFailure(f"{step}: cannot run {program}: {exc}") from None
    log.write_text(f"$ {' '.join(argv)}\nrc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}",
                   encoding="utf-8")
    if proc.returncode != 0:
        # Ansible's own "fatal:" lines say why; the tail says where.
        fatal = [line for line in proc.stdout.splitlines() if line.startswith("fatal:")]
        tail = "\n".join([*fatal, proc.stdout[-800:], proc.stderr[-800:]]).strip()
        raise MatrixFailure(f"{step} exited {proc.returncode} (see {log}):\n{tail}")
    return proc.stdout


def ensure_venv(entry: Entry) -> None:
    """Create the entry's venv unless its stamp says it was made from the same requirements and interpreter."""
    if not entry.interpreter.is_file():
        raise MatrixFailure(f"{entry.interpreter} is missing (pyenv install {entry.python})")
    wanted = hashlib.sha256(entry.requirements.read_bytes() + str(entry.interpreter).encode()).hexdigest()
    stamp = entry.venv / ".installed"
    if stamp.is_file() and stamp.read_text(encoding="utf-8").strip() == wanted:
        return
    shutil.rmtree(entry.venv, ignore_errors=True)
    entry.root.mkdir(parents=True, exist_ok=True)
    _run([str(entry.interpreter), "-m", "venv", str(entry.venv)], entry.root / "venv.log")
    _run([str(entry.venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
          "-r", str(entry.requirements)], entry.root / "pip.log")
    stamp.write_text(wanted + "\n", encoding="utf-8")


def build_tarball() -> Path:
    """The collection as users get it, built from this checkout with the main venv's ansible-galaxy."""
    DIST_DIR.mkdir(parents=True, exist_ok=True)
    _run([str(MAIN_BIN / "ansible-galaxy"), "collection", "build", str(REPO), "--output-path", str(DIST_DIR),
          "--force"], DIST_DIR / "build.log", cwd=DIST_DIR)
    return DIST_DIR / f"gpuops-relaunch-{VERSION}.tar.gz"


def _write_config(entry: Entry, directory: Path) -> None:
    """An ansible.cfg in `directory` (the commands' cwd) naming only the entry's collections dir."""
    (directory / "ansible.cfg").write_text(
        f"[defaults]\ncollections_path = {entry.collections}\nretry_files_enabled = False\n", encoding="utf-8")


def _entry_env(entry: Entry, work: Path) -> dict[str, str]:
    """The environment of the entry's Ansible commands: none of the checkout's Ansible settings, only
    the installed copy on the collections path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(
        ANSIBLE_CONFIG=str(work / "ansible.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(entry.collections),
        ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false",
        ANSIBLE_LOCAL_TEMP=str(work / "local-tmp"),
        ANSIBLE_REMOTE_TEMP=str(work / "remote-tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_STDOUT_CALLBACK="default",
        PATH=f"{entry.venv / 'bin'}:{os.environ.get('PATH', '')}",
    )
    return env


def _inventory(entry: Entry, work: Path, script: Path) -> dict:
    """demo.yml's localhost with a job of the entry's own."""
    python = str(entry.venv / "bin" / "python")
    return {"all": {"hosts": {"localhost": {
        "ansible_connection": "local",
        "ansible_python_interpreter": python,
        "job_launch_name": f"matrix-{entry.name}",
        "job_launch_command": [python, str(script), "--workers", "2"],
        "job_launch_log_path": str(work / "train.log"),
        "job_launch_state_dir": str(work / "state"),
        "job_launch_ready_regex": "^step 1 ",
        "job_launch_min_uptime": 2,
        "job_launch_startup_timeout": 60,
        # Only this entry's copy of the trainer: the other entry and `make demo` run the same script
        # name elsewhere.
        "process_cleanup_match": re.escape(str(script)) + r"\b",
        "process_cleanup_term_timeout": 5,
        # No GPU here, and no pynvml in the venv: gpu_mem_wait must say so and go on.
        "gpu_drain_gpus_required": False,
        "gpu_drain_timeout": 30,
        "container_reset_allowed": False,
    }}}}


def _relaunch(entry: Entry, ns: PidNamespace, work: Path, env: dict[str, str], label: str) -> tuple[dict, dict, int]:
    """One run of the installed relaunch.yml inside `ns`: (localhost@JOB.json, fleet.json, changed count)."""
    summaries = work / f"summary-{label}"
    inside = ["nsenter", f"--target={ns.init_pid}", "--pid", "--mount", "--"]
    out = _run([*inside, str(entry.venv / "bin" / "ansible-playbook"), "gpuops.relaunch.relaunch",
                "-i", str(work / "inventory.yml"), "-e", f"relaunch_summary_dir={summaries}"],
               work / f"{label}.log", env=env, cwd=work)
    recap = RECAP.search(out)
    if recap is None:
        raise MatrixFailure(f"{label}: no PLAY RECAP for localhost (see {work / f'{label}.log'})")
    # One summary file per host and job (HOST@JOB.json, names percent-encoded); this inventory has one of each.
    host_files = sorted(summaries.glob("localhost@*.json"))
    if len(host_files) != 1:
        raise MatrixFailure(f"{label}: not one localhost@JOB.json in {summaries}: {[p.name for p in host_files]}")
    host = json.loads(host_files[0].read_text(encoding="utf-8"))
    fleet = json.loads((summaries / "fleet.json").read_text(encoding="utf-8"))
    if "localhost" not in fleet.get("hosts", {}):
        raise MatrixFailure(f"{label}: fleet.json has no localhost: {fleet}")
    return host, fleet, int(recap.group(2))


def _left_in(ns: PidNamespace) -> list[int]:
    """Host pids in the namespace other than its init."""
    return [pid for pid in ns.host_pids() if pid != ns.init_pid]


def run_entry(entry: Entry, tarball: Path) -> str:
    """The whole check of one entry; returns its result line, raises MatrixFailure."""
    ensure_venv(entry)
    versions = _run([str(entry.venv / "bin" / "python"), "-c",
                     "import platform, ansible.release as r; print(r.__version__, platform.python_version())"],
                    entry.root / "versions.log").split()
    shutil.rmtree(entry.collections, ignore_errors=True)
    _write_config(entry, entry.root)
    _run([str(entry.venv / "bin" / "ansible-galaxy"), "collection", "install", str(tarball), "-p",
          str(entry.collections), "--no-deps", "--force"], entry.root / "install.log",
         env=_entry_env(entry, entry.root), cwd=entry.root)
    installed = entry.collections / "ansible_collections" / "gpuops" / "relaunch"
    # The installed copy is the only gpuops.relaunch this venv's Ansible sees (not the checkout's link).
    listed = json.loads(_run([str(entry.venv / "bin" / "ansible-galaxy"), "collection", "list", "gpuops.relaunch",
                              "--format", "json"], entry.root / "list.log", env=_entry_env(entry, entry.root),
                             cwd=entry.root))
    seen = sorted(path for path, collections in listed.items() if "gpuops.relaunch" in collections)
    if seen != [str(entry.collections / "ansible_collections")]:
        raise MatrixFailure(f"gpuops.relaunch is seen at {seen}, not only at {entry.collections}")

    work = Path(tempfile.mkdtemp(prefix=f"gpuops-matrix-{entry.name}-"))
    try:
        script = work / "demo_train.py"
        shutil.copyfile(installed / "playbooks" / "files" / "demo_train.py", script)
        _write_config(entry, work)
        (work / "inventory.yml").write_text(yaml.safe_dump(_inventory(entry, work, script)), encoding="utf-8")
        env = _entry_env(entry, work)
        with pid_namespace([str(entry.venv / "bin" / "python"), "-c", REAPING_INIT]) as ns:
            first, fleet, first_changed = _relaunch(entry, ns, work, env, "launch")
            if first.get("status") != "relaunched" or fleet["counts"].get("relaunched") != 1:
                raise MatrixFailure(f"launch: not relaunched: {first}")
            # The drain ran too: gpu_mem_wait with gpus_required false, and no pynvml in the venv.
            if not {"cleanup", "drain", "launch"} <= set(first["seconds"]) or \
                    not str(first["job"].get("ready_line") or "").startswith("step 1 "):
                raise MatrixFailure(f"launch: a step did not run, or the job was not proven started: {first}")
            pid = int(first["job"]["pid"])
            second, fleet, second_changed = _relaunch(entry, ns, work, env, "noop")
            if second.get("status") != "unchanged" or fleet["counts"].get("unchanged") != 1 or second_changed != 0:
                raise MatrixFailure(f"no-op: changed={second_changed}, summary {second}")
            if int(second["job"]["pid"]) != pid:
                raise MatrixFailure(f"no-op: the pid went from {pid} to {second['job']['pid']}")
            stop_args = json.dumps({"name": f"matrix-{entry.name}", "state": "stopped", "state_dir": str(work / "state")})
            stop = _run(["nsenter", f"--target={ns.init_pid}", "--pid", "--mount", "--",
                         str(entry.venv / "bin" / "ansible"), "localhost", "-i", str(work / "inventory.yml"),
                         "-m", "gpuops.relaunch.train_launch", "-a", stop_args], work / "stop.log", env=env, cwd=work)
            if "CHANGED" not in stop:
                raise MatrixFailure(f"stop: the job was not stopped (see {work / 'stop.log'})")
            # The module waits until the job's tree is gone; the init reaps what it inherited.
            Deadline(30).poll(lambda: not _left_in(ns), 0.05)
            left = _left_in(ns)
            if left:
                raise MatrixFailure(f"stop: left running in the namespace (host pids): {left}")
    except BaseException:
        print(f"matrix {entry.name}: the run's files are kept in {work}", flush=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return (f"ansible-core {versions[0]} on Python {versions[1]}: launch pid {pid} (changed={first_changed}), "
            f"no-op (changed=0, same pid), stopped, nothing left")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("select", nargs="*", help="run only the entries whose name contains one of these")
    args = parser.parse_args(argv)
    entries = [e for e in ENTRIES if not args.select or any(s in e.name for s in args.select)]
    if not entries:
        parser.error(f"no entry matches {args.select}; entries: {', '.join(e.name for e in ENTRIES)}")
    MATRIX_DIR.mkdir(parents=True, exist_ok=True)
    with open(MATRIX_DIR / ".lock", "w", encoding="utf-8") as lock:
        # Two `make matrix` of one checkout would share the venvs, the tarball and the collections dirs.
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _run_matrix(entries)


def _run_matrix(entries: list[Entry]) -> int:
    """Build the tarball, run `entries` in parallel, print one line each; 0 when every one passed."""
    try:
        tarball = build_tarball()
    except MatrixFailure as exc:
        print(f"matrix: FAILED to build the tarball: {exc}")
        return 1

    def one(entry: Entry) -> tuple[bool, str]:
        started = time.monotonic()
        try:
            ok, line = True, "ok " + run_entry(entry, tarball)
        except MatrixFailure as exc:
            ok, line = False, f"FAILED: {exc}"
        except Exception as exc:  # pylint: disable=broad-exception-caught  # a summary without a key, a bad JSON file
            ok, line = False, f"FAILED: {type(exc).__name__}: {exc}"
        return ok, f"matrix {entry.name}: {line} [{time.monotonic() - started:.0f} s]"

    with ThreadPoolExecutor(max_workers=len(entries)) as pool:
        results = list(pool.map(one, entries))
    for _ok, line in results:
        print(line, flush=True)
    return 0 if all(ok for ok, _line in results) else 1


if __name__ == "__main__":
    sys.exit(main())
