"""Drift between the one declaration of the roles' variables (plugin_utils/role_vars) and what it drives or must know:
the generated argument_specs, defaults and guide table; the defaults files written by hand; every prefixed name the
collection's roles, playbooks, actions and extensions set or read."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from ansible_collections.gpuops.relaunch.plugins.plugin_utils import role_vars
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import PREFIXES, UNSET, Template, known_names

ROOT = Path(__file__).resolve().parents[4]


def _generator():
    """tools/role_vars.py, the generator (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("gpuops_relaunch_role_vars_tool", ROOT / "tools" / "role_vars.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _generator()

NAME = re.compile(r"(?<![\w.'\"\[-])((?:%s)\w+)" % "|".join(PREFIXES))
JINJA = re.compile(r"{{(.*?)}}|{%(.*?)%}", re.S)
CONDITIONS = ("when", "failed_when", "changed_when", "until", "that")
SET_FACT = ("set_fact", "ansible.builtin.set_fact")
# Prefixed strings in the plugins' Python that are keys of module results, not variables.
RESULT_KEYS = {"relaunch_guard": "train_launch's return value", "relaunch_window": "a key of relaunch_guard"}


@pytest.mark.parametrize("path", sorted(generator.generated()), ids=lambda path: str(path.relative_to(ROOT)))
def test_generated_files_follow_the_declaration(path: Path) -> None:
    """tools/role_vars.py --write makes them; an edit by hand, or a declaration changed without it, is drift."""
    assert path.exists() and path.read_text(encoding="utf-8") == generator.generated()[path], (
        f"{path.relative_to(ROOT)} differs from plugins/plugin_utils/role_vars.py: run tools/role_vars.py --write")


@pytest.mark.parametrize("role", ["container_reset", "relaunch"])
def test_defaults_written_by_hand_agree_with_the_declaration(role: str) -> None:
    """These roles' defaults/main.yml are not generated: each value there must be the declared role default."""
    defaults = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text(encoding="utf-8")) or {}
    declared = {var.name: var for var in role_vars.VARIABLES}
    for name, value in defaults.items():
        assert name in declared, f"roles/{role}/defaults/main.yml: {name} is not declared in role_vars.VARIABLES"
        var = declared[name]
        expected = var.doc_default if var.doc_default is not UNSET else var.default
        assert not isinstance(expected, Template) and expected is not UNSET, name
        assert value == expected, (name, value, expected)


def test_the_module_options_named_exist_in_the_modules() -> None:
    for var in role_vars.VARIABLES:
        if var.module:
            assert var.option in generator.module_options(var.module), var.name


def test_the_argument_specs_entry_points_list_what_the_roles_pass() -> None:
    specs = yaml.safe_load((ROOT / "roles" / "job_launch" / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    assert specs["main"]["options"]["job_launch_command"]["required"] is True
    assert "required" not in specs["stop"]["options"]["job_launch_command"]
    assert specs["main"]["options"]["job_launch_max_relaunches"]["default"] == 3
    relaunch = yaml.safe_load((ROOT / "roles" / "relaunch" / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    listed = set(relaunch["main"]["options"])
    assert {"job_launch_ready_regex", "process_cleanup_term_timeout", "gpu_drain_timeout", "container_reset_vmid",
            "relaunch_force"} <= listed
    assert "job_launch_probe" not in listed and "process_cleanup_fail_on_escalation" not in listed


# --- every prefixed name the collection sets or reads is known ---------------------------------------------------


def _jinja_names(text: str) -> Iterator[str]:
    for match in JINJA.finditer(text):
        yield from NAME.findall(match.group(1) or match.group(2) or "")


def _yaml_names(node: Any, key: str | None = None) -> Iterator[str]:
    """Names a YAML document sets (register, set_fact, vars, defaults) or reads (Jinja, conditions)."""
    if isinstance(node, dict):
        for name, value in node.items():
            if name == "register" and isinstance(value, str) and value.startswith(PREFIXES):
                yield value
            if name in SET_FACT + ("vars", "extra_vars", "hostvars") and isinstance(value, dict):
                yield from (str(variable) for variable in value if str(variable).startswith(PREFIXES))
            if name in CONDITIONS:
                for condition in value if isinstance(value, list) else [value]:
                    if isinstance(condition, str):
                        yield from NAME.findall(condition)
            yield from _yaml_names(value, str(name))
    elif isinstance(node, list):
        for item in node:
            yield from _yaml_names(item, key)
    elif isinstance(node, str):
        yield from _jinja_names(node)


def _yaml_files() -> Iterator[Path]:
    for folder in ("roles", "playbooks", "extensions"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".yml", ".yaml") and path.is_file() and "argument_specs" not in path.name:
                yield path


def _set_or_read(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    found: set[str] = set()
    for document in yaml.safe_load_all(text):
        found |= set(_yaml_names(document))
        # Top-level keys of a defaults, vars or inventory file are variables.
        if path.parent.name in ("defaults", "vars") or "inventory" in path.parts or path.name == "molecule.yml":
            found |= {key for key in _all_keys(document) if key.startswith(PREFIXES)}
    return found


def _all_keys(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _all_keys(value)
    elif isinstance(node, list):
        for item in node:
            yield from _all_keys(item)


def _python_names(path: Path) -> set[str]:
    """The string constants of an action or plugin_utils file that are prefixed names (variables, facts)."""
    return {node.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"(?:%s)\w+" % "|".join(PREFIXES), node.value) and node.value not in RESULT_KEYS}


def collection_names() -> dict[str, set[str]]:
    """Every prefixed name set or read, by the file it is in."""
    names = {str(path.relative_to(ROOT)): _set_or_read(path) for path in _yaml_files()}
    for folder in ("plugins/action", "plugins/plugin_utils"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name != "role_vars.py":
                names[str(path.relative_to(ROOT))] = _python_names(path)
    survey = json.loads((ROOT / "extensions" / "awx" / "survey.json").read_text(encoding="utf-8"))
    names["extensions/awx/survey.json"] = {item["variable"] for item in survey["spec"]}
    return names


def test_the_scan_finds_names_of_every_kind() -> None:
    """The scan itself: registered names, facts, role variables read in Jinja and in actions are found."""
    names = collection_names()
    assert "process_cleanup_result" in names["roles/process_cleanup/tasks/main.yml"]  # register
    assert "gpu_drain_needs_reboot" in names["roles/gpu_drain/tasks/main.yml"]  # set_fact
    assert "gpu_drain_environment" in names["roles/gpu_drain/tasks/main.yml"]  # read in Jinja
    assert "relaunch_hosts" in names["playbooks/relaunch.yml"]
    assert {"relaunch_alerted_job", "relaunch_alerted_host"} <= names["extensions/eda/rulebooks/relaunch_on_alert.yml"]
    assert any("relaunch_" in name for file, found in names.items() if file.startswith("plugins/action/") for name in found)


def test_every_name_the_collection_sets_or_reads_is_known() -> None:
    """A name added to a role, playbook, action or extension without declaring it would be refused at run time as a
    misspelt variable: declare it in role_vars.VARIABLES (a variable) or role_vars.OTHER_NAMES (a fact, a result)."""
    known = known_names()
    unknown = sorted(f"{file}: {name}" for file, found in collection_names().items() for name in found - known)
    assert unknown == []
