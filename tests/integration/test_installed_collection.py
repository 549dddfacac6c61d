"""The collection as its users get it: a built tarball, installed, run by FQCN, packed into an EE.

One tarball is built from this checkout and installed (``--no-deps``: Galaxy is not reachable here)
into an empty collections path. Every Ansible command then runs from a temporary directory with an
``ansible.cfg`` of its own that names only that path, so the checkout (``.build/collections``) is not
on the collections path; community.* collections come from the ``ansible`` package in the virtualenv
(sys.path scan), as they would from a user's ``collections/requirements.yml``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.harness.pidns import pid_namespace

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
VERSION = yaml.safe_load((REPO / "galaxy.yml").read_text(encoding="utf-8"))["version"]
EE_PACKAGES = ("proxmoxer", "requests", "nvidia-ml-py")

# Development files that must not ship (galaxy.yml's build_ignore).
DEV_FILES = (
    "Makefile",
    "ansible.cfg",
    "pytest.ini",
    "tools/",
    "bench/",
    ".ci/",
    ".gitignore",
    ".ansible-lint",
    ".pytest_cache/",
    ".hypothesis/",
    ".venv/",
    ".build/",
    "tests/output/",
    "requirements/test.txt",
    "requirements/constraints.txt",
)


class Installed:
    """A built and installed copy of the collection and the environment that sees only it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tarball = root / "dist" / f"gpuops-relaunch-{VERSION}.tar.gz"
        self.colls = root / "colls"
        self.path = self.colls / "ansible_collections" / "gpuops" / "relaunch"
        self.project = root / "project"
        self.demo_dir = root / "demo"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PROXMOX_"))}
        self.env.update(
            ANSIBLE_CONFIG=str(self.project / "ansible.cfg"),
            ANSIBLE_LOCAL_TEMP=str(root / "local-tmp"),
            ANSIBLE_NOCOLOR="1",
            GPUOPS_DEMO_DIR=str(self.demo_dir),
            PATH=f"{BIN}:{os.environ.get('PATH', '')}",
        )

    def run(self, *cmd: str, timeout: float = 180, wrapper: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        args = [*(wrapper or []), str(BIN / cmd[0]), *cmd[1:]]
        return subprocess.run(
            args, cwd=self.project, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"{proc.args}\nrc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    inst = Installed(tmp_path_factory.mktemp("installed-coll"))
    inst.project.mkdir()
    inst.colls.mkdir()
    (inst.project / "ansible.cfg").write_text(
        f"[defaults]\ncollections_path = {inst.colls}\nstdout_callback = default\n", encoding="utf-8"
    )
    build = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "build", str(REPO), "--output-path", str(inst.tarball.parent)],
        cwd=inst.project, env=inst.env, capture_output=True, text=True, timeout=120, check=False,
    )
    _ok(build)
    _ok(inst.run("ansible-galaxy", "collection", "install", str(inst.tarball), "-p", str(inst.colls), "--no-deps"))
    return inst


def _demo_processes(installed_path: Path) -> list[int]:
    """Pids whose command line runs the installed copy's demo trainer."""
    return _processes_naming(str(installed_path / "playbooks" / "files" / "demo_train.py"))


def _processes_naming(script: str) -> list[int]:
    """Pids with `script` as one of their arguments."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if script.encode() in argv:
            pids.append(int(entry))
    return pids


def test_tarball_leaves_development_files_out(installed: Installed) -> None:
    with tarfile.open(installed.tarball) as tar:
        names = tar.getnames()
    leaked = [n for n in names for dev in DEV_FILES if n == dev.rstrip("/") or n.startswith(dev)]
    assert not leaked, leaked
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    for needed in ("meta/runtime.yml", "meta/execution-environment.yml", "requirements.txt", "bindep.txt",
                   "playbooks/relaunch.yml", "playbooks/inventory/demo.yml", "roles/job_launch/tasks/main.yml",
                   "plugins/modules/train_launch.py"):
        assert needed in names, needed
    # extensions/ ships whole (galaxy.yml): the Molecule scenarios where the collection layout puts
    # them (extensions/molecule, with the playbooks and files they share), the AWX and EE examples.
    tracked = subprocess.run(["git", "ls-files", "-z", "extensions"], cwd=REPO, capture_output=True,
                             check=True).stdout.decode().split("\0")
    extensions = [name for name in tracked if name]
    assert "extensions/molecule/container_reset/molecule.yml" in extensions
    assert "extensions/molecule/shared/create.yml" in extensions
    assert [name for name in extensions if name not in names] == []


def test_installed_copy_is_the_only_one_on_the_path(installed: Installed) -> None:
    listed = json.loads(_ok(installed.run("ansible-galaxy", "collection", "list", "gpuops.relaunch", "--format", "json")))
    paths = [Path(p) for p, colls in listed.items() if "gpuops.relaunch" in colls]
    assert paths == [installed.colls / "ansible_collections"], listed
    # ansible-doc loads the module from the installed copy, not from the checkout.
    doc = json.loads(_ok(installed.run("ansible-doc", "--json", "gpuops.relaunch.train_launch")))
    assert doc["gpuops.relaunch.train_launch"]["doc"]["filename"].startswith(str(installed.path))


def test_relaunch_by_fqcn_from_the_installed_copy(installed: Installed) -> None:
    """The demo relaunch (no stale run, so: probe, cleanup, drain, launch) by FQCN, then stopped.

    Both runs are inside a PID namespace of their own: the module stops the job (stop_demo, state=stopped);
    its supervisor, whose parent (the namespace's init) does not reap, then stays idle by design
    and ends with the namespace, so the test leaves no process behind."""
    inventory = str(installed.path / "playbooks" / "inventory" / "demo.yml")
    with pid_namespace() as ns:
        inside = ["nsenter", f"--target={ns.init_pid}", "--pid", "--mount", "--"]
        try:
            run = installed.run("ansible-playbook", "gpuops.relaunch.relaunch", "-i", inventory, wrapper=inside)
            _ok(run)
            assert "failed=0" in run.stdout, run.stdout
            # The job runs the installed copy's trainer (playbook_dir of an FQCN playbook is the
            # installed collection's playbooks/): the installed content ran, not the checkout's.
            assert set(_demo_processes(installed.path)) <= set(ns.host_pids()), run.stdout[-3000:]
            assert _demo_processes(installed.path), run.stdout[-3000:]
        finally:
            stop = installed.run("ansible-playbook", "gpuops.relaunch.stop_demo", "-i", inventory, wrapper=inside)
        _ok(stop)
        assert not _demo_processes(installed.path)  # the module waits until the job's tree is gone
    assert not _processes_naming(str(installed.demo_dir / "state" / "demo-train" / "supervisor.py"))


def test_repository_as_a_project_installs_its_requirements(installed: Installed, tmp_path: Path) -> None:
    """collections/requirements.yml, installed the way a project update does (from the project root).

    Offline: community.proxmox is taken as already installed (a link to the ``ansible`` package's copy)."""
    target = tmp_path / "project-colls"
    community = target / "ansible_collections" / "community"
    community.mkdir(parents=True)
    venv_colls = Path(subprocess.check_output(
        [sys.executable, "-c", "import ansible_collections, os; print(list(ansible_collections.__path__)[0])"],
        text=True).strip())
    (community / "proxmox").symlink_to(venv_colls / "community" / "proxmox")
    env = dict(installed.env, ANSIBLE_COLLECTIONS_PATH=str(target))
    proc = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "install", "-r", "collections/requirements.yml",
         "-p", str(target), "--offline"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    _ok(proc)
    assert (target / "ansible_collections" / "gpuops" / "relaunch" / "roles" / "job_launch").is_dir()
    assert not (target / "ansible_collections" / "gpuops" / "relaunch" / "Makefile").exists()


def test_ansible_builder_introspect_lists_the_python_dependencies(installed: Installed) -> None:
    out = _ok(installed.run("ansible-builder", "introspect", str(installed.colls)))
    data = yaml.safe_load(out)
    # Each line reads "proxmoxer>=2.0  # from collection gpuops.relaunch".
    ours = [line.split("#")[0].strip() for line in data["python"] if line.endswith("from collection gpuops.relaunch")]
    for package in EE_PACKAGES:
        assert any(line.startswith(package) for line in ours), out
    assert not [line for line in data["system"] if "gpuops.relaunch" in line], out  # bindep.txt: comments only


def test_ansible_builder_create_writes_a_build_context(installed: Installed, tmp_path: Path) -> None:
    """ansible-builder create with the example EE file (no container engine), then the builder
    stage's own introspect step on that context and the installed collection."""
    ee_dir = tmp_path / "ee"
    shutil.copytree(REPO / "extensions" / "ee", ee_dir)
    context = tmp_path / "context"
    _ok(installed.run("ansible-builder", "create", "-f", str(ee_dir / "execution-environment.yml"),
                      "-c", str(context), "--output-filename", "Containerfile"))
    build = context / "_build"
    galaxy = yaml.safe_load((build / "requirements.yml").read_text(encoding="utf-8"))
    assert {c["name"] for c in galaxy["collections"]} >= {"gpuops.relaunch", "community.proxmox"}
    assert "paramiko" in (build / "requirements.txt").read_text(encoding="utf-8")
    containerfile = (context / "Containerfile").read_text(encoding="utf-8")
    assert "ansible-galaxy" in containerfile and "introspect" in containerfile
    # What the builder stage runs after installing the collections (Containerfile's introspect),
    # here on the installed copy: the context's user requirements merged with the collection's.
    pip_out = tmp_path / "requirements-combined.txt"
    _ok(installed.run("ansible-builder", "introspect", "--sanitize", "--user-pip", str(build / "requirements.txt"),
                      "--user-bindep", str(build / "bindep.txt") if (build / "bindep.txt").exists() else "/dev/null",
                      "--write-pip", str(pip_out), str(installed.colls)))
    combined = pip_out.read_text(encoding="utf-8")
    for package in (*EE_PACKAGES, "paramiko"):
        assert package in combined, combined
