"""One name per thing: nothing was released before 0.1.0, so no module option, return value or role
variable has a second, "deprecated" or "earlier" name, and no role or playbook still reads one."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[4]
MODULES = sorted(path.stem for path in (ROOT / "plugins" / "modules").glob("*.py") if path.stem != "__init__")
ROLE_SPECS = sorted((ROOT / "roles").glob("*/meta/argument_specs.yml"))
# Names removed before the first release; a role, playbook or example (YAML, templates, inventories) that
# still reads one reads nothing.
REMOVED_NAMES = ("stop_timeout", "ready_after", "waited_s", "gpu_drain_verdict", "process_cleanup_verdict")
REMOVED_RETURNS = {"verdict", "waited_s", "ready_after", "duration"}


def doc_block(name: str, block: str) -> str:
    """A module's DOCUMENTATION or RETURN, read from its source (no import: the text is what ships)."""
    tree = ast.parse((ROOT / "plugins" / "modules" / f"{name}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == [block]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} has no {block}")


def keys(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every (dotted path, entry) of a DOCUMENTATION or RETURN tree, through options/suboptions/contains."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, dict):
                here = f"{path}.{key}" if path else str(key)
                yield here, value
                for nested in ("options", "suboptions", "contains"):
                    yield from keys(value.get(nested), here)


@pytest.mark.parametrize("name", MODULES)
def test_no_option_has_a_second_name(name: str) -> None:
    documented = yaml.safe_load(doc_block(name, "DOCUMENTATION"))
    aliased = [path for path, entry in keys(documented.get("options")) if entry.get("aliases")]
    assert aliased == []
    assert '"aliases"' not in (ROOT / "plugins" / "modules" / f"{name}.py").read_text()


@pytest.mark.parametrize("name", MODULES)
def test_nothing_is_documented_as_deprecated(name: str) -> None:
    for block in ("DOCUMENTATION", "RETURN"):
        assert "deprecated" not in doc_block(name, block).lower(), block
    returned = yaml.safe_load(doc_block(name, "RETURN")) or {}
    kept = sorted(path for path, _entry in keys(returned) if path.rsplit(".", 1)[-1] in REMOVED_RETURNS)
    assert kept == []


@pytest.mark.parametrize("spec", ROLE_SPECS, ids=lambda path: path.parts[-3])
def test_role_variables_have_one_name(spec: Path) -> None:
    text = spec.read_text()
    assert "deprecated" not in text.lower() and "earlier name" not in text
    assert [name for name in REMOVED_NAMES if name in text.replace("term_timeout", "")] == []


def test_nothing_reads_a_removed_name() -> None:
    readers = [path for folder in ("roles", "playbooks", "extensions") for path in (ROOT / folder).rglob("*")
               if path.is_file() and path.suffix in (".yml", ".yaml", ".j2", ".json", ".ini", ".cfg")]
    assert readers
    found = sorted(f"{path.relative_to(ROOT)}: {name}" for path in readers for name in REMOVED_NAMES
                   if name in path.read_text(errors="replace"))
    assert found == []
