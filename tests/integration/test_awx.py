"""The AWX path: the credential type, the survey, and a relaunch run the way AWX runs a job.

No AWX server here. What AWX itself would check is checked on the files (extensions/awx/): the
credential type's schema and injectors, the survey spec; the injectors are rendered as AWX's
``CredentialType.inject_credential`` renders them (a sandboxed Jinja environment, the
``tower.filename.<label>`` namespace for files written into the private data directory's env/),
and the module runs with that environment. Then ansible-runner runs playbooks/relaunch.yml from a
private data directory laid out as AWX lays it out: project/ (a copy of the repository), the
collections of collections/requirements.yml installed the way a project update installs them,
inventory/, env/envvars (the credential), env/extravars (the survey's answers); inside a PID
namespace of its own, so the demo job ends with it. The assertions read the job events.

The second such job runs against the fakepve lab of the end-to-end test (a real LXC container
behind a fake Proxmox API, reached over the test sshd the way a node is): the Proxmox API comes only
from the credential (a token and the lab's CA, injected as AWX injects them), the container holds a
stale run that only a reboot clears, and the events show the reboot, the launch after it and the
set_stats summary; fakepve shows the one reboot it was asked for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from jinja2 import StrictUndefined, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The container-reset job reuses the end-to-end test's lab: `lab` and `pct_host` are its pytest
# fixtures, and `pct_ssh` (the session's test sshd) is what `pct_host` asks for; importing them is
# what makes them available here.
from tests.harness.awx_slices import awx_meta_vars, slice_inventory, sliced_hosts
from tests.harness.pct_sshd import pct_ssh  # noqa: F401  pylint: disable=unused-import
from tests.harness.pidns import PidNamespace, pid_namespace
from tests.harness.playbook import DECIDE_TASK
from tests.integration.test_relaunch_e2e import (  # noqa: F401  pylint: disable=unused-import
    HOSTNAME, VMID, job_processes, lab, needs_sshd, pct_host, posts, relaunch_vars, running_job, start_stale_run,
)
from tests.integration.test_relaunch_ranks import host_vars as ranks_host_vars

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
AWX_DIR = REPO / "extensions" / "awx"
CREDENTIAL_TYPE = yaml.safe_load((AWX_DIR / "credential_type.yml").read_text(encoding="utf-8"))
SURVEY = json.loads((AWX_DIR / "survey.json").read_text(encoding="utf-8"))

# AWX's rules (awx/main/fields.py): field ids, input types, injector sections, env names it refuses.
FIELD_ID = re.compile(r"^[a-zA-Z_]+[a-zA-Z0-9_]*$")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
SURVEY_TYPES = {"text", "textarea", "password", "integer", "float", "multiplechoice", "multiselect"}
ENV_REFUSED = {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "JOB_ID", "INVENTORY_ID", "INVENTORY_SOURCE_ID",
               "INVENTORY_UPDATE_ID", "AD_HOC_COMMAND_ID", "REST_API_URL", "REST_API_TOKEN", "MAX_EVENT_RES",
               "CALLBACK_QUEUE", "CALLBACK_CONNECTION", "CACHE", "JOB_CALLBACK_DEBUG", "INVENTORY_HOSTVARS",
               "AWX_HOST", "PROJECT_REVISION", "SUPERVISOR_WEB_CONFIG_PATH"}
SECRET = "relaunch-token-secret-3f9c"  # long enough that no_log masking does not hide other words
needs_lxc = pytest.mark.skipif(shutil.which("lxc-start") is None, reason="lxc-start is missing (make apt installs lxc)")


def _fields() -> dict[str, dict[str, Any]]:
    return {field["id"]: field for field in CREDENTIAL_TYPE["inputs"]["fields"]}


def _templates() -> list[tuple[str, str]]:
    """(where, template) for every injector template."""
    injectors = CREDENTIAL_TYPE["injectors"]
    found = [(f"file {label}", tmpl) for label, tmpl in injectors.get("file", {}).items()]
    found += [(f"env {name}", tmpl) for name, tmpl in injectors.get("env", {}).items()]

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{where}[{index}]")
        else:
            found.append((where, str(node)))

    walk(injectors.get("extra_vars", {}), "extra_vars")
    return found


def _module_env_fallbacks() -> dict[str, str]:
    """option -> environment variable, as proxmox_ct_reboot's argument spec falls back."""
    from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import proxmox_connection_spec

    return {option: spec["fallback"][1][0] for option, spec in proxmox_connection_spec().items() if "fallback" in spec}


class _Namespace:
    """AWX's TowerNamespace: attributes set as files are written."""


def inject(inputs: dict[str, Any], private_data_dir: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """What AWX's CredentialType.inject_credential gives a job for a credential with `inputs`:
    (env, extra_vars). Files are written into private_data_dir/env with mode 0600."""
    tower = _Namespace()
    namespace: dict[str, Any] = {"tower": tower}
    for name, value in inputs.items():
        namespace[name] = value
    for field in CREDENTIAL_TYPE["inputs"]["fields"]:
        if field.get("type") == "boolean" and field["id"] not in inputs:
            namespace[field["id"]] = False  # AWX: a missing boolean is False
    sandbox = ImmutableSandboxedEnvironment()
    injectors = CREDENTIAL_TYPE["injectors"]
    env_dir = private_data_dir / "env"
    env_dir.mkdir(parents=True, exist_ok=True)
    for label, tmpl in injectors.get("file", {}).items():
        data = sandbox.from_string(tmpl).render(**namespace)
        handle, path = tempfile.mkstemp(dir=env_dir)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(data)
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
        if "." not in label:
            tower.filename = path  # type: ignore[attr-defined]
        else:
            if not hasattr(tower, "filename"):
                tower.filename = _Namespace()  # type: ignore[attr-defined]
            setattr(tower.filename, label.split(".", 1)[1], path)  # type: ignore[attr-defined]
    env = {name: sandbox.from_string(tmpl).render(**namespace) for name, tmpl in injectors.get("env", {}).items()}

    def extra(node: Any) -> Any:
        if isinstance(node, dict):
            return {extra(k): extra(v) for k, v in node.items()}
        if isinstance(node, list):
            return [extra(v) for v in node]
        return sandbox.from_string(str(node)).render(**namespace)

    return env, extra(injectors.get("extra_vars", {}))


# --- (a) schemas ---------------------------------------------------------------------------------


def test_credential_type_inputs_follow_awx_schema() -> None:
    assert CREDENTIAL_TYPE["kind"] in {"cloud", "net"}
    assert CREDENTIAL_TYPE["name"] and CREDENTIAL_TYPE["description"]
    fields = CREDENTIAL_TYPE["inputs"]["fields"]
    ids = [field["id"] for field in fields]
    assert len(ids) == len(set(ids)), ids
    assert set(ids) == {"host", "port", "user", "token_id", "token_secret", "password", "validate_certs", "ca_cert"}
    allowed = {"id", "label", "type", "help_text", "secret", "multiline", "choices", "default", "format", "ask_at_runtime"}
    for field in fields:
        assert FIELD_ID.match(field["id"]), field
        assert set(field) <= allowed, field
        assert field["label"], field
        assert field.get("type", "string") in {"string", "boolean"}, field
        if field.get("type") == "boolean":
            assert "secret" not in field and "multiline" not in field, field
        if "choices" in field:
            assert field.get("type", "string") == "string" and field.get("default") in field["choices"], field
    # Every secret is marked secret; nothing else is (so AWX shows the rest back).
    assert {f["id"] for f in fields if f.get("secret")} == {"token_secret", "password"}
    assert _fields()["ca_cert"].get("multiline") is True
    assert set(CREDENTIAL_TYPE["inputs"]["required"]) <= set(ids)
    # Injected values that an empty string would break (int, bool) are required inputs.
    assert {"host", "port", "user", "validate_certs"} <= set(CREDENTIAL_TYPE["inputs"]["required"])


def test_credential_type_injectors_reference_declared_inputs() -> None:
    injectors = CREDENTIAL_TYPE["injectors"]
    assert set(injectors) <= {"file", "env", "extra_vars"}
    fields = _fields()
    file_labels = set()
    for label in injectors.get("file", {}):
        assert label == "template" or (label.startswith("template.") and FIELD_ID.match(label[9:])), label
        file_labels.add(label.split(".", 1)[1] if "." in label else "")
    for name in injectors.get("env", {}):
        assert ENV_NAME.match(name) and name not in ENV_REFUSED and not name.startswith("ANSIBLE_"), name
    env = ImmutableSandboxedEnvironment()
    for where, tmpl in _templates():
        names = meta.find_undeclared_variables(env.parse(tmpl))
        assert names <= set(fields) | {"tower"}, (where, names)
        for label in re.findall(r"tower\.filename\.(\w+)", tmpl):
            assert label in file_labels, (where, label)
    # AWX validates injectors by rendering them with every input given (StrictUndefined).
    strict = ImmutableSandboxedEnvironment(undefined=StrictUndefined)
    filename = _Namespace()
    for label in file_labels:
        setattr(filename, label, "/runner/env/tmpfile")
    tower = _Namespace()
    tower.filename = filename  # type: ignore[attr-defined]
    given = {name: "x" for name in fields}
    for _where, tmpl in _templates():
        strict.from_string(tmpl).render(tower=tower, **given)
    # The CA arrives as a file.
    assert "ca_cert" in file_labels


def test_credential_type_injects_exactly_the_module_env_fallbacks() -> None:
    """Every PROXMOX_* variable proxmox_ct_reboot falls back to is injected, and nothing else."""
    fallbacks = _module_env_fallbacks()
    assert set(CREDENTIAL_TYPE["injectors"]["env"]) == set(fallbacks.values()), fallbacks
    # The CA path has an env fallback, so no extra var is needed for container_reset.
    assert fallbacks["ca_path"] == "PROXMOX_CA_PATH"
    assert not CREDENTIAL_TYPE["injectors"].get("extra_vars")


def _documented_variables() -> set[str]:
    documented = set()
    header = []
    for line in (REPO / "playbooks" / "relaunch.yml").read_text(encoding="utf-8").splitlines():
        if line == "---":
            continue
        if not line.startswith("#"):
            break
        header.append(line)
    documented |= set(re.findall(r"\brelaunch_\w+", "\n".join(header)))
    for spec in sorted((REPO / "roles").glob("*/meta/argument_specs.yml")):
        data = yaml.safe_load(spec.read_text(encoding="utf-8"))
        for entry in data["argument_specs"].values():
            documented |= set(entry.get("options", {}))
    return documented


def test_survey_follows_awx_schema_and_names_documented_variables() -> None:
    assert set(SURVEY) == {"name", "description", "spec"}
    assert SURVEY["name"] and isinstance(SURVEY["spec"], list) and SURVEY["spec"]
    documented = _documented_variables()
    variables = [item["variable"] for item in SURVEY["spec"]]
    assert len(variables) == len(set(variables))
    for item in SURVEY["spec"]:
        assert {"question_name", "variable", "type", "required", "default"} <= set(item), item
        assert item["type"] in SURVEY_TYPES, item
        assert isinstance(item["required"], bool), item
        assert FIELD_ID.match(item["variable"]), item
        assert item["variable"] in documented, item["variable"]
        if item["type"] in {"multiplechoice", "multiselect"}:
            choices = item["choices"] if isinstance(item["choices"], list) else item["choices"].split("\n")
            assert item["default"] in choices or (item["default"] == "" and not item["required"]), item
        if item["type"] in {"integer", "float"} and item["default"] != "":
            assert item["min"] <= item["default"] <= item["max"], item
    assert {"relaunch_hosts", "relaunch_force"} <= set(variables)
    # The hosts are typed at every launch: a default of all would make a force or a guard reset answered in the
    # survey fleet-wide without anyone naming the fleet (relaunch_decision refuses that only where no hosts are named).
    hosts = next(item for item in SURVEY["spec"] if item["variable"] == "relaunch_hosts")
    assert hosts["required"] is True and hosts["default"] == ""
    # Left blank, AWX passes no relaunch_force, so each host's inventory relaunch_force decides: an
    # answer of "false" (the default once) was an extra var that overrode a host_vars true.
    force = next(item for item in SURVEY["spec"] if item["variable"] == "relaunch_force")
    assert force["type"] == "multiplechoice" and force["default"] == "" and force["required"] is False
    schedule = yaml.safe_load((AWX_DIR / "schedule.yml").read_text(encoding="utf-8"))
    extra_data = [play["vars"]["relaunch_awx_schedule"]["extra_data"] for play in schedule
                  if "relaunch_awx_schedule" in play.get("vars", {})]
    assert extra_data and all("relaunch_force" not in data for data in extra_data)
    # The crash-loop guard is reset from the survey, by a person, once: false unless answered, and
    # never in the schedule, where every run would clear the history the guard counts.
    reset = next(item for item in SURVEY["spec"] if item["variable"] == "job_launch_reset_guard")
    assert reset["type"] == "multiplechoice" and reset["choices"] == ["false", "true"]
    assert reset["default"] == "false" and reset["required"] is False
    assert all("job_launch_reset_guard" not in data for data in extra_data)


def test_job_template_example_names_the_playbook_and_the_survey() -> None:
    template = yaml.safe_load((AWX_DIR / "job_template.yml").read_text(encoding="utf-8"))["relaunch_awx_job_template"]
    assert (REPO / template["playbook"]).is_file()
    assert template["survey_enabled"] is True
    setup = (AWX_DIR / "setup_awx.yml").read_text(encoding="utf-8")
    for module in ("credential_type", "credential", "project", "inventory", "job_template"):
        assert f"awx.awx.{module}:" in setup, module


def test_setup_playbook_passes_syntax_check() -> None:
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), "--syntax-check", str(AWX_DIR / "setup_awx.yml")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- (b) the injectors rendered as AWX renders them, and the module's view of them ----------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _module_with_env(env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    """proxmox_ct_reboot run ad hoc on localhost with `env` (and no other PROXMOX_*): its result."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROXMOX_", "ANSIBLE_"))}
    base.update(env, ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json",
                ANSIBLE_LOCAL_TEMP=str(tmp_path / "local-tmp"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run(
        [str(BIN / "ansible"), "localhost", "-m", "gpuops.relaunch.proxmox_ct_reboot",
         "-a", "vmid=200 expected_hostname=ct1 api_timeout=2"],
        cwd=REPO, env=base, capture_output=True, text=True, timeout=120, check=False,
    )
    result = json.loads(proc.stdout)
    return result["plays"][0]["tasks"][0]["hosts"]["localhost"]


def test_injected_token_credential_with_ca_reaches_the_module(tmp_path: Path) -> None:
    port = _closed_port()
    ca_pem = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
    env, extra = inject(
        {"host": "127.0.0.1", "port": str(port), "user": "ops@pve", "token_id": "relaunch",
         "token_secret": SECRET, "validate_certs": "true", "ca_cert": ca_pem},
        tmp_path,
    )
    assert not extra
    ca_file = Path(env["PROXMOX_CA_PATH"])
    assert ca_file.parent == tmp_path / "env" and ca_file.read_text(encoding="utf-8") == ca_pem
    assert stat.S_IMODE(ca_file.stat().st_mode) == 0o600
    assert env["PROXMOX_PASSWORD"] == "" and env["PROXMOX_TOKEN_SECRET"] == SECRET
    result = _module_with_env(env, tmp_path)
    # Every required option was found in the environment: the module got as far as the network.
    assert result.get("failed") is True, result
    assert "missing required" not in result["msg"] and "convert" not in result["msg"], result["msg"]
    assert "Connection refused" in result["msg"], result["msg"]
    assert SECRET not in json.dumps(result)


def test_injected_password_credential_without_ca_names_the_host(tmp_path: Path) -> None:
    port = _closed_port()
    env, _extra = inject(
        {"host": "127.0.0.1", "port": str(port), "user": "ops@pve", "password": SECRET, "validate_certs": "true"},
        tmp_path,
    )
    assert env["PROXMOX_CA_PATH"] == ""  # no CA given: no (empty) CA file named
    assert env["PROXMOX_TOKEN_ID"] == "" and env["PROXMOX_TOKEN_SECRET"] == ""
    result = _module_with_env(env, tmp_path)
    assert result.get("failed") is True, result
    assert f"https://127.0.0.1:{port}" in result["msg"], result["msg"]
    assert SECRET not in json.dumps(result)


# --- (c) a relaunch through ansible-runner, laid out as AWX lays out a job ------------------------


def _copy_project(target: Path) -> None:
    """The repository as a project checkout: what git tracks (and new files), nothing ignored."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _base_env() -> dict[str, str]:
    """The execution node's environment: no ANSIBLE_* or PROXMOX_* of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PROXMOX_"))}
    env.update(PATH=f"{BIN}:{os.environ.get('PATH', '')}", ANSIBLE_NOCOLOR="1")
    return env


@dataclass(frozen=True)
class AwxJob:
    """A private data directory as AWX lays it out for a job, after the project update."""

    pdd: Path
    project: Path
    collections: Path  # what the project update installed; the job's collections path
    installed: Path  # gpuops.relaunch as the project update installed it


def _project_update(pdd: Path) -> AwxJob:
    """project/ (a copy of the repository), then its collections/requirements.yml installed from the
    project root into the directory AWX then puts on the job's collections path. Offline:
    community.proxmox is linked in from the `ansible` package's copy, as the installed-collection
    test does."""
    project = pdd / "project"
    project.mkdir(parents=True)
    _copy_project(project)
    collections = pdd / "requirements_collections"
    community = collections / "ansible_collections" / "community"
    community.mkdir(parents=True)
    venv_colls = Path(subprocess.check_output(
        [sys.executable, "-c", "import ansible_collections; print(list(ansible_collections.__path__)[0])"],
        text=True).strip())
    (community / "proxmox").symlink_to(venv_colls / "community" / "proxmox")
    update = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "install", "-r", "collections/requirements.yml",
         "-p", str(collections), "--offline"],
        cwd=project, env=dict(_base_env(), ANSIBLE_COLLECTIONS_PATH=str(collections)),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert update.returncode == 0, update.stdout + update.stderr
    installed = collections / "ansible_collections" / "gpuops" / "relaunch"
    assert (installed / "roles" / "job_launch").is_dir()
    return AwxJob(pdd, project, collections, installed)


def _write_job(job: AwxJob, inventory: dict[str, Any], cred_env: dict[str, str], cred_extra: dict[str, Any],
               hosts: str, local_tmp: Path, script: bool = False) -> None:
    """inventory/hosts; env/envvars: the credential's injection and what AWX adds for the project's
    collections; env/extravars: the survey's defaults, `hosts` as its Hosts answer, and the
    credential's extra vars. With `script`, `inventory` is an inventory script's JSON, written as AWX
    writes it (awx/main/tasks/jobs.py BaseTask.write_inventory_file: a Python script that prints it, 0700)."""
    (job.pdd / "inventory").mkdir()
    if script:
        path = job.pdd / "inventory" / "hosts"
        path.write_text(f"#! /usr/bin/env python3\n# -*- coding: utf-8 -*-\nprint({json.dumps(inventory)!r})\n",
                        encoding="utf-8")
        path.chmod(0o700)
    else:
        (job.pdd / "inventory" / "hosts").write_text(yaml.safe_dump(inventory), encoding="utf-8")
    (job.pdd / "env").mkdir(exist_ok=True)
    envvars = dict(cred_env, ANSIBLE_COLLECTIONS_PATH=str(job.collections), ANSIBLE_LOCAL_TEMP=str(local_tmp))
    (job.pdd / "env" / "envvars").write_text(yaml.safe_dump(envvars), encoding="utf-8")
    _write_extravars(job, hosts, cred_extra)


def _write_extravars(job: AwxJob, hosts: str, extra: dict[str, Any], passed_on: dict[str, Any] | None = None) -> None:
    """env/extravars: the survey's defaults, `hosts` as its Hosts answer and `extra`; for a later node of a
    workflow, over the set_stats data of the nodes before it (`passed_on`), as AWX merges them
    (awx/main/models/workflow.py: the ancestors' artifacts first, the node's own extra vars over them)."""
    survey_answers = {item["variable"]: item["default"] for item in SURVEY["spec"] if item["default"] != ""}
    survey_answers["relaunch_hosts"] = hosts
    extravars = dict(passed_on or {}, **survey_answers, **extra)
    (job.pdd / "env" / "extravars").write_text(yaml.safe_dump(extravars), encoding="utf-8")


def _run_job(job: AwxJob, ns: PidNamespace, ident: str, env: dict[str, str],
             playbook: str = "playbooks/relaunch.yml") -> subprocess.CompletedProcess:
    """ansible-runner runs `playbook` from the private data directory, inside `ns`."""
    inside = ["nsenter", f"--target={ns.init_pid}", "--pid", "--mount", "--"]
    return subprocess.run(
        [*inside, str(BIN / "ansible-runner"), "run", str(job.pdd), "-p", playbook, "--ident", ident],
        env=env, capture_output=True, text=True, timeout=400, check=False,
    )


def _processes_naming(script: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if script.encode() in argv:
                pids.append(int(entry))
    return pids


def _events(artifacts: Path) -> list[dict[str, Any]]:
    """The job events in the order they happened (their counter; the file names do not sort so), each with its
    event_data as AWX stores it: {} where runner gave none (a `verbose` event, a line printed outside a
    callback, such as a Python warning at ansible's start)."""
    events = [json.loads(path.read_text(encoding="utf-8")) for path in (artifacts / "job_events").glob("*.json")]
    for event in events:
        event["event_data"] = event.get("event_data") or {}
    return sorted(events, key=lambda event: event["counter"])


def _stats(events: list[dict[str, Any]]) -> dict[str, Any]:
    stats = [e for e in events if e["event"] == "playbook_on_stats"]
    assert len(stats) == 1, [e["event"] for e in events]
    return stats[0]["event_data"]


def _assert_roles_from_the_project_update(job: AwxJob, events: list[dict[str, Any]]) -> None:
    """The roles came from the collections the project update installed, not from the checkout."""
    task_paths = {e["event_data"].get("task_path", "") for e in events}
    role_paths = {p for p in task_paths if "/roles/" in p}
    assert role_paths and all(p.startswith(str(job.installed / "roles")) for p in role_paths), role_paths
    assert not [p for p in task_paths if p.startswith(str(REPO))], task_paths


def _assert_secret_never_shown(artifacts: Path, secret: str) -> None:
    assert not [p for p in (artifacts / "job_events").glob("*.json") if secret in p.read_text(encoding="utf-8")]
    assert secret not in (artifacts / "stdout").read_text(encoding="utf-8")


@pytest.mark.slow
def test_relaunch_through_ansible_runner_as_awx_runs_it(tmp_path: Path) -> None:
    job = _project_update(tmp_path / "pdd")

    # inventory/: the demo host (this machine, the demo trainer), its state under tmp_path; the
    # credential: an unreachable API (the demo host resets no container).
    demo = yaml.safe_load((REPO / "playbooks" / "inventory" / "demo.yml").read_text(encoding="utf-8"))
    demo["all"]["hosts"]["localhost"]["demo_dir"] = str(tmp_path / "demo")
    cred_env, cred_extra = inject(
        {"host": "127.0.0.1", "port": str(_closed_port()), "user": "ops@pve", "token_id": "relaunch",
         "token_secret": SECRET, "validate_certs": "true",
         "ca_cert": "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"},
        job.pdd,
    )
    _write_job(job, demo, cred_env, cred_extra, "localhost", tmp_path / "local-tmp")

    ident = "awx-relaunch-1"
    trainer = str(job.project / "playbooks" / "files" / "demo_train.py")
    with pid_namespace() as ns:
        run = _run_job(job, ns, ident, _base_env())
        artifacts = job.pdd / "artifacts" / ident
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        # The job runs the project's trainer, inside the namespace.
        assert _processes_naming(trainer), run.stdout[-3000:]
        assert set(_processes_naming(trainer)) <= set(ns.host_pids())
    assert not _processes_naming(trainer)  # ended with the namespace

    assert (artifacts / "rc").read_text(encoding="utf-8").strip() == "0"
    assert (artifacts / "status").read_text(encoding="utf-8").strip() == "successful"
    events = _events(artifacts)
    # A job of one host is relaunched and summarized in the decision's task.
    summarize = [e for e in events if e["event"] == "runner_on_ok" and e["event_data"].get("task", "").endswith(DECIDE_TASK)]
    assert len(summarize) == 1, [e["event"] for e in events]
    summary = summarize[0]["event_data"]["res"]["ansible_facts"]["relaunch_summary"]
    assert summary["host"] == "localhost" and summary["relaunched"] is True and summary["check_mode"] is False
    assert summary["job"]["operation"] == "start" and summary["job"]["pid"], summary
    data = _stats(events)
    assert data["artifact_data"]["relaunch_summary"]["localhost"]["relaunched"] is True
    assert data["failures"] == {} and data["dark"] == {}
    _assert_roles_from_the_project_update(job, events)
    # The credential's secret never reached an event.
    _assert_secret_never_shown(artifacts, SECRET)

    # The same private data directory runs the next nodes of an AWX workflow, each with the set_stats data of
    # the node before it as extra vars. The job printed what a template engine would run and crashed (its
    # processes ended with the namespace above): a Jinja expression, and a line that starts with the header
    # #jinja2: that sets other delimiters (ansible-core before 2.19 reads it without a newline after it).
    markers = [tmp_path / "templated-jinja", tmp_path / "templated-header"]
    printed = [f"step 9 {{{{ lookup('pipe', 'touch {markers[0]}') }}}}",
               "#jinja2:variable_start_string:'[[',variable_end_string:']]',keep_trailing_newline:'[[ lookup(*"
               f"\"pipe|touch {markers[1]}\".split(\"|\")) ]]' "]
    with (tmp_path / "demo" / "train.log").open("a", encoding="utf-8") as log:
        log.write("".join(line + "\n" for line in printed))
    report = job.project / "workflow_report.yml"  # a later node's job template: it shows what it was passed
    report.write_text(yaml.safe_dump([{
        "name": "Show what the workflow passed on", "hosts": "localhost", "gather_facts": False,
        "tasks": [{"name": "Show it", "ansible.builtin.debug": {"msg": "{{ relaunch_summary }} {{ relaunch_fleet }}"}}],
    }]), encoding="utf-8")
    with pid_namespace() as ns:
        # Node 2 relaunches the crashed job; its set_stats data carry the log's last lines, inert.
        run = _run_job(job, ns, "awx-relaunch-2", _base_env())
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        passed_on = _stats(_events(job.pdd / "artifacts" / "awx-relaunch-2"))["artifact_data"]
        summary = passed_on["relaunch_summary"]["localhost"]
        assert summary["relaunched"] is True and summary["health"]["state"] != "running", summary
        tail = summary["health"]["log_tail"]
        assert f"step 9 \\x7b{{ lookup('pipe', 'touch {markers[0]}') }}}}" in tail, tail
        assert any(line.startswith("\\x23jinja2:variable_start_string") for line in tail), tail
        assert not [text for text in ("{{", "{%", "{#", "#jinja2:") if text in json.dumps(passed_on)]

        # Node 3, the relaunch again (a scheduled one after it): the job runs, so nothing changes, and no host
        # fails on the earlier node's relaunch_summary, an extra var that outranks this run's fact.
        _write_extravars(job, "localhost", cred_extra, passed_on)
        run = _run_job(job, ns, "awx-relaunch-3", _base_env())
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        data = _stats(_events(job.pdd / "artifacts" / "awx-relaunch-3"))
        assert data["failures"] == {} and data["dark"] == {}, data
        assert data["artifact_data"]["relaunch_summary"]["localhost"]["status"] == "unchanged", data["artifact_data"]

        # Node 4, another job template after node 2, shows what node 2 passed on: it runs nothing of it.
        run = _run_job(job, ns, "awx-report", _base_env(), playbook=report.name)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        shown = [e for e in _events(job.pdd / "artifacts" / "awx-report") if e["event"] == "runner_on_ok"]
        assert "x7b{ lookup('pipe', 'touch" in shown[0]["event_data"]["res"]["msg"], shown
    assert not [marker for marker in markers if marker.exists()]


# --- (d) the same, against the fakepve lab, with a container reset --------------------------------
# The host is a real LXC container behind fakepve (tests/harness/fakepve_lxc.py), set up as the
# end-to-end test sets it up (its `lab` and `pct_host` fixtures, its stale run that only a reboot
# clears) and reached the production way (community.proxmox.proxmox_pct_remote over the test sshd,
# which runs outside the job's PID namespace, as a Proxmox node does). The Proxmox API comes only
# from the credential: an API token and the lab's CA, injected as AWX injects them.

# The inventory's API connection in the end-to-end test; here the credential gives it.
CREDENTIAL_VARS = {
    "container_reset_api_host", "container_reset_api_port", "container_reset_api_user",
    "container_reset_api_password", "container_reset_api_token_id", "container_reset_api_token_secret",
    "container_reset_validate_certs", "container_reset_ca_path",
}
REBOOT_ACTION = "gpuops.relaunch.proxmox_ct_reboot"
LAUNCH_TASK = "Launch the job and prove it started"


def _task_events(events: list[dict[str, Any]], task: str | None = None, action: str | None = None,
                 kinds: tuple[str, ...] = ("runner_on_ok", "runner_on_failed", "runner_on_skipped",
                                           "runner_on_unreachable")) -> list[dict[str, Any]]:
    """The per-host result events of a task, by name and/or module (oldest first)."""
    return [
        e for e in events
        if e["event"] in kinds
        and (task is None or e["event_data"].get("task") == task)
        and (action is None or e["event_data"].get("task_action") == action)
    ]


@pytest.mark.slow
@pytest.mark.lxc
@needs_lxc
@needs_sshd
# pylint: disable-next=redefined-outer-name
def test_relaunch_through_ansible_runner_as_awx_resets_the_container(lab, pct_host, tmp_path):
    job = _project_update(tmp_path / "pdd")
    stale = start_stale_run(lab.container)
    first_init = lab.container.init_id
    token_secret = lab.server.add_token(lab.user, "awx")

    host_vars = dict(pct_host.host_vars(VMID))
    host_vars.update({k: v for k, v in relaunch_vars(lab, reset_allowed=True).items() if k not in CREDENTIAL_VARS})
    assert host_vars["container_reset_allowed"] is True
    cred_env, cred_extra = inject(
        {"host": lab.server.host, "port": str(lab.server.port), "user": lab.user, "token_id": "awx",
         "token_secret": token_secret, "validate_certs": "true",
         "ca_cert": Path(lab.pki.ca_path).read_text(encoding="utf-8")},
        job.pdd,
    )
    ca_file = cred_env["PROXMOX_CA_PATH"]
    assert Path(ca_file).parent == job.pdd / "env"
    _write_job(job, {"all": {"hosts": {HOSTNAME: host_vars}}}, cred_env, cred_extra, HOSTNAME, tmp_path / "local-tmp")

    ident = "awx-relaunch-reset-1"
    with pid_namespace() as ns:
        # HOME holds known_hosts with the test sshd's key (an execution environment's would).
        run = _run_job(job, ns, ident, dict(_base_env(), **pct_host.environment()))
        artifacts = job.pdd / "artifacts" / ident
        assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-3000:]
        namespace_pids = set(ns.host_pids())
        job_in_ct = job_processes(lab.container)
        # The job runs in the container, not in the AWX job's namespace.
        assert job_in_ct and not {ident_.pid for ident_ in job_in_ct} & namespace_pids

    assert (artifacts / "status").read_text(encoding="utf-8").strip() == "successful"
    events = _events(artifacts)

    # The reboot task ran once, on the controller, with the credential's API, and changed.
    reboots = _task_events(events, action=REBOOT_ACTION)
    assert [e["event"] for e in reboots] == ["runner_on_ok"], [e["event"] for e in events]
    reboot = reboots[0]["event_data"]
    assert reboot["role"] == "container_reset" and reboot["host"] == HOSTNAME
    assert reboot["res"]["changed"] is True and reboot["res"]["hostname"] == HOSTNAME, reboot["res"]
    module_args = reboot["res"]["invocation"]["module_args"]
    assert module_args["api_host"] == lab.server.host and int(module_args["api_port"]) == lab.server.port
    assert module_args["api_token_id"] == "awx" and module_args["validate_certs"] is True
    assert module_args["ca_path"] == ca_file and module_args["expected_hostname"] == HOSTNAME

    # fakepve saw one reboot, asked with the token (no ticket login: the password was left empty),
    # after the hostname was read; the container really restarted and the stale run is gone.
    assert lab.server.requests("POST") == [("POST", f"/api2/json/nodes/{lab.node}/lxc/{VMID}/status/reboot")]
    seen = lab.server.requests()
    assert seen.index(("GET", f"/api2/json/nodes/{lab.node}/lxc/{VMID}/config")) < seen.index(posts(lab)[0])
    assert lab.container.starts == 2 and lab.container.init_id != first_init
    assert not any(lab.container.exists(ident_) for ident_ in stale.all())

    # The job launched after the reboot, and it outlived the AWX job's namespace.
    launches = [e for e in _task_events(events, task=LAUNCH_TASK, kinds=("runner_on_ok",))
                if e["event_data"].get("role") == "relaunch"]
    assert launches and launches[-1]["event_data"]["res"]["changed"] is True, [e["event_data"]["res"] for e in launches]
    launch = launches[-1]["event_data"]["res"]
    assert launch["backend"] == "supervisor" and launch["ready_line"].startswith("step 1 ")
    assert events.index(launches[-1]) > events.index(reboots[0])
    running = running_job(lab.container, launch)
    assert running in job_processes(lab.container)

    # What AWX shows with the job and passes on in a workflow: the set_stats summary.
    data = _stats(events)
    assert data["failures"] == {} and data["dark"] == {} and data["changed"].get(HOSTNAME), data
    summary = data["artifact_data"]["relaunch_summary"][HOSTNAME]
    assert summary["relaunched"] is True and summary["container_reset"] is True, summary
    assert summary["found"] == "container_reboot" and stale.ns_main in summary["ended"], summary
    assert int(summary["job"]["pid"]) == int(launch["pid"])
    _assert_roles_from_the_project_update(job, events)
    _assert_secret_never_shown(artifacts, token_secret)


# --- (e) a sliced job template: one ansible-runner job per slice, and the fleet merged after ---------
# AWX runs a sliced job template (job_slice_count N) as a workflow job of N slice jobs at once, each over
# its share of the inventory (tests/harness/awx_slices.py: AWX's rule) with AWX's meta variables (a job id,
# its workflow job's id; no slice number). Here: an independent host and a job of two ranks whose ranks
# fall into different slices. The merge runs as the workflow's next node does: its extra vars are the
# slices' set_stats data, merged as AWX merges them (awx/main/models/workflow.py
# WorkflowJob.get_effective_artifacts: dict.update in the order the jobs finished).
WORKFLOW_JOB = 100


@pytest.mark.slow
def test_a_sliced_job_template_relaunches_independent_hosts_and_refuses_a_job_split_across_slices(tmp_path):
    shared = _project_update(tmp_path / "project-update")
    hosts = {"a-solo": ranks_host_vars(tmp_path, "a-solo", None)}
    hosts.update({name: ranks_host_vars(tmp_path, name, ["r0", "r1"]) for name in ("r0", "r1")})
    reports = tmp_path / "reports"
    assert [sliced_hosts(hosts, number, 2) for number in (1, 2)] == [["a-solo", "r1"], ["r0"]]

    def slice_job(number: int) -> AwxJob:
        pdd = tmp_path / f"slice-{number}"
        pdd.mkdir()
        (pdd / "project").symlink_to(shared.project)
        job = AwxJob(pdd, shared.project, shared.collections, shared.installed)
        extra = dict(awx_meta_vars(WORKFLOW_JOB + number, WORKFLOW_JOB, "relaunch"), relaunch_summary_dir=str(reports))
        _write_job(job, slice_inventory(hosts, {}, number, 2), {}, extra, "all", tmp_path / "local-tmp", script=True)
        return job

    jobs = {number: slice_job(number) for number in (1, 2)}
    trainer = hosts["a-solo"]["job_launch_command"][1]
    with pid_namespace() as ns:
        runs = {number: _run_job(job, ns, f"slice-{number}", _base_env()) for number, job in jobs.items()}
        assert _processes_naming(trainer), runs[1].stdout[-3000:]  # the independent host's job runs
    events = {number: _events(job.pdd / "artifacts" / f"slice-{number}") for number, job in jobs.items()}
    for number, run in runs.items():
        assert "Traceback" not in run.stdout + run.stderr, run.stdout[-4000:]
        assert run.returncode == 2, run.stdout[-4000:]  # a refused rank fails its host, after the fleet summary

    # Each slice refused its rank of the split job, naming the rank in the other slice, before anything
    # started (no rank's job was looked at, let alone launched); the independent host relaunched.
    refusals = {}
    for number in (1, 2):
        for event in _task_events(events[number], action="gpuops.relaunch.relaunch_decision", kinds=("runner_on_ok",)):
            res = event["event_data"]["res"]
            if event["event_data"]["host"] in ("r0", "r1"):
                summary = res["ansible_facts"]["relaunch_summary"]
                assert res["probe"] is None and summary["failed"] and not summary["relaunched"], res
                refusals[event["event_data"]["host"]] = summary["failed"]
    assert set(refusals) == {"r0", "r1"}
    assert ("rank(s) r0 are not in this run's inventory at all, only rank(s) r1 are (AWX job 101, a node of workflow "
            "job 100 (relaunch))") in refusals["r1"]
    assert "rank(s) r1 are not in this run's inventory at all, only rank(s) r0 are (AWX job 102" in refusals["r0"]
    assert all("other slice jobs of workflow job 100" in text for text in refusals.values())
    assert not any(Path(hosts[name]["job_launch_state_dir"]).exists() for name in ("r0", "r1"))
    stats = {number: _stats(events[number])["artifact_data"] for number in (1, 2)}
    assert stats[1]["relaunch_summary"]["a-solo"]["relaunched"] is True

    # Each slice wrote its own part of the fleet; none replaced another's, and there is no fleet.json.
    parts = sorted(path.name for path in reports.glob("fleet*.json"))
    assert parts == ["fleet-awx-workflow-100-job-101.json", "fleet-awx-workflow-100-job-102.json"]
    assert stats[1]["gpuops_fleet_awx_job_101"]["counts"]["relaunched"] == 1
    assert set(stats[2]["gpuops_fleet_awx_job_102"]["hosts"]) == {"r0"}

    # The workflow's next node: AWX passes the slices' set_stats data on, key by key, the last to finish
    # winning relaunch_fleet (here slice 2's: one host); fleet_merge makes one fleet of the parts.
    passed_on: dict[str, Any] = {}
    for number in (1, 2):
        passed_on.update(stats[number])
    assert set(passed_on["relaunch_fleet"]["hosts"]) == {"r0"}
    merge = AwxJob(tmp_path / "merge", shared.project, shared.collections, shared.installed)
    merge.pdd.mkdir()
    (merge.pdd / "project").symlink_to(shared.project)
    local = {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}
    _write_job(merge, {"all": {"hosts": local}}, {}, dict(passed_on, relaunch_summary_dir=str(reports)), "all",
               tmp_path / "local-tmp")
    with pid_namespace() as ns:
        run = _run_job(merge, ns, "merge", _base_env(), playbook="playbooks/fleet_merge.yml")
    assert run.returncode == 0, run.stdout[-4000:]
    merged = _stats(_events(merge.pdd / "artifacts" / "merge"))["artifact_data"]["relaunch_fleet"]
    assert merged["counts"] == {"relaunched": 1, "unchanged": 0, "refused": 0, "failed": 2, "would_relaunch": 0}
    assert merged["parts"] == {"gpuops_fleet_awx_job_101": 2, "gpuops_fleet_awx_job_102": 1}
    assert json.loads((reports / "fleet.json").read_text(encoding="utf-8")) == merged
