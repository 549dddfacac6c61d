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
from pathlib import Path
from typing import Any

import pytest
import yaml
from jinja2 import StrictUndefined, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.harness.pidns import pid_namespace

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
            assert item["default"] in choices, item
        if item["type"] in {"integer", "float"} and item["default"] != "":
            assert item["min"] <= item["default"] <= item["max"], item
    assert {"relaunch_hosts", "relaunch_force"} <= set(variables)
    force = next(item for item in SURVEY["spec"] if item["variable"] == "relaunch_force")
    assert force["type"] == "multiplechoice" and force["default"] == "false"


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
    return [json.loads(path.read_text(encoding="utf-8")) for path in sorted((artifacts / "job_events").glob("*.json"))]


@pytest.mark.slow
def test_relaunch_through_ansible_runner_as_awx_runs_it(tmp_path: Path) -> None:
    pdd = tmp_path / "pdd"
    project = pdd / "project"
    project.mkdir(parents=True)
    _copy_project(project)

    # The project update: collections/requirements.yml, installed from the project root into the
    # directory AWX then puts on the job's collections path. Offline: community.proxmox is linked
    # in from the `ansible` package's copy, as the installed-collection test does.
    collections = pdd / "requirements_collections"
    community = collections / "ansible_collections" / "community"
    community.mkdir(parents=True)
    venv_colls = Path(subprocess.check_output(
        [sys.executable, "-c", "import ansible_collections; print(list(ansible_collections.__path__)[0])"],
        text=True).strip())
    (community / "proxmox").symlink_to(venv_colls / "community" / "proxmox")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PROXMOX_"))}
    base_env.update(PATH=f"{BIN}:{os.environ.get('PATH', '')}", ANSIBLE_NOCOLOR="1")
    update = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "install", "-r", "collections/requirements.yml",
         "-p", str(collections), "--offline"],
        cwd=project, env=dict(base_env, ANSIBLE_COLLECTIONS_PATH=str(collections)),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert update.returncode == 0, update.stdout + update.stderr
    installed = collections / "ansible_collections" / "gpuops" / "relaunch"
    assert (installed / "roles" / "job_launch").is_dir()

    # inventory/: the demo host (this machine, the demo trainer), its state under tmp_path.
    demo = yaml.safe_load((REPO / "playbooks" / "inventory" / "demo.yml").read_text(encoding="utf-8"))
    demo_dir = tmp_path / "demo"
    demo["all"]["hosts"]["localhost"]["demo_dir"] = str(demo_dir)
    (pdd / "inventory").mkdir()
    (pdd / "inventory" / "hosts").write_text(yaml.safe_dump(demo), encoding="utf-8")

    # env/: the credential's injection (an unreachable API; the demo host resets no container),
    # what AWX adds for the project's collections, and the survey's answers as extra vars.
    cred_env, cred_extra = inject(
        {"host": "127.0.0.1", "port": str(_closed_port()), "user": "ops@pve", "token_id": "relaunch",
         "token_secret": SECRET, "validate_certs": "true",
         "ca_cert": "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"},
        pdd,
    )
    envvars = dict(cred_env, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_LOCAL_TEMP=str(tmp_path / "local-tmp"))
    (pdd / "env" / "envvars").write_text(yaml.safe_dump(envvars), encoding="utf-8")
    survey_answers = {item["variable"]: item["default"] for item in SURVEY["spec"] if item["default"] != ""}
    survey_answers["relaunch_hosts"] = "localhost"
    (pdd / "env" / "extravars").write_text(yaml.safe_dump(dict(survey_answers, **cred_extra)), encoding="utf-8")

    ident = "awx-relaunch-1"
    trainer = str(project / "playbooks" / "files" / "demo_train.py")
    with pid_namespace() as ns:
        inside = ["nsenter", f"--target={ns.init_pid}", "--pid", "--mount", "--"]
        run = subprocess.run(
            [*inside, str(BIN / "ansible-runner"), "run", str(pdd), "-p", "playbooks/relaunch.yml", "--ident", ident],
            env=base_env, capture_output=True, text=True, timeout=240, check=False,
        )
        artifacts = pdd / "artifacts" / ident
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        # The job runs the project's trainer, inside the namespace.
        assert _processes_naming(trainer), run.stdout[-3000:]
        assert set(_processes_naming(trainer)) <= set(ns.host_pids())
    assert not _processes_naming(trainer)  # ended with the namespace

    assert (artifacts / "rc").read_text(encoding="utf-8").strip() == "0"
    assert (artifacts / "status").read_text(encoding="utf-8").strip() == "successful"
    events = _events(artifacts)
    summarize = [e for e in events if e["event"] == "runner_on_ok" and e["event_data"].get("task") == "Summarize"]
    assert len(summarize) == 1, [e["event"] for e in events]
    summary = summarize[0]["event_data"]["res"]["msg"]
    assert summary["host"] == "localhost" and summary["relaunched"] is True and summary["check_mode"] is False
    assert summary["job"]["operation"] == "start" and summary["job"]["pid"], summary
    stats = [e for e in events if e["event"] == "playbook_on_stats"]
    assert len(stats) == 1
    data = stats[0]["event_data"]
    assert data["artifact_data"]["relaunch_summary"]["localhost"]["relaunched"] is True
    assert data["failures"] == {} and data["dark"] == {}
    # The roles came from the collections the project update installed, not from the checkout.
    task_paths = {e["event_data"].get("task_path", "") for e in events}
    role_paths = {p for p in task_paths if "/roles/" in p}
    assert role_paths and all(p.startswith(str(installed / "roles")) for p in role_paths), role_paths
    assert not [p for p in task_paths if p.startswith(str(REPO))], task_paths
    # The credential's secret never reached an event.
    assert not [p for p in (artifacts / "job_events").glob("*.json") if SECRET in p.read_text(encoding="utf-8")]
    assert SECRET not in (artifacts / "stdout").read_text(encoding="utf-8")
