"""A later node of a workflow reads its own run. AWX passes an earlier node's set_stats data to the next node as
extra vars, which outrank facts and registered results: a playbook or role that read a name that some node puts
into set_stats would read the earlier node's data in a later node (relaunch.yml failed every host so, reading
the fact relaunch_summary). So no name a shipped playbook or role reads is a set_stats key of the collection,
except where a playbook reads the set_stats data on purpose (fleet_merge.yml, through its action)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml
from jinja2 import Environment, meta

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import FLEET_STATS_PREFIX

ROOT = Path(__file__).resolve().parents[3]
YAML_FILES = sorted([*(ROOT / "playbooks").glob("*.yml"), *(ROOT / "roles").glob("*/tasks/*.yml")])
# What the collection's actions put into set_stats (host_report.publish, relaunch_fleet, fleet_merge).
ACTION_STATS = {"relaunch_summary", "relaunch_fleet"}
# Keywords whose strings are bare Jinja expressions.
EXPRESSIONS = {"when", "changed_when", "failed_when", "until", "that"}


def _strings(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(key, string) for every string in a YAML tree, the key it is the value of."""
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _strings(value, str(name))
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value, key)
    elif isinstance(node, str):
        yield key, node


def _stats_keys(tree: Any) -> set[str]:
    """The data keys of every set_stats task in a YAML tree."""
    found: set[str] = set()
    if isinstance(tree, dict):
        for name, value in tree.items():
            if name in ("ansible.builtin.set_stats", "set_stats") and isinstance(value, dict):
                found |= set(value.get("data") or {})
            found |= _stats_keys(value)
    elif isinstance(tree, list):
        for value in tree:
            found |= _stats_keys(value)
    return found


class _Known(dict):
    """Every filter and test is known: Ansible's and the collection's are not Jinja's own."""

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(key) or _any_filter


def _any_filter(value: Any, *_args: Any, **_kwargs: Any) -> Any:
    return value


def _names_read(tree: Any) -> set[str]:
    env = Environment()
    env.filters, env.tests = _Known(env.filters), _Known(env.tests)
    names: set[str] = set()
    for key, text in _strings(tree):
        source = "{{ " + text + " }}" if key in EXPRESSIONS else text
        if "{{" in source or "{%" in source:
            names |= meta.find_undeclared_variables(env.parse(source))
    return names


def test_the_collection_sets_the_stats_this_test_knows() -> None:
    stats = set().union(*(_stats_keys(yaml.safe_load(path.read_text(encoding="utf-8"))) for path in YAML_FILES))
    assert stats == {"reclaim_summary"}  # the actions' keys are ACTION_STATS, and FLEET_STATS_PREFIX + a job id


def test_no_playbook_or_role_reads_a_name_that_a_workflow_node_passes_on() -> None:
    stats = ACTION_STATS.union(*(_stats_keys(yaml.safe_load(path.read_text(encoding="utf-8"))) for path in YAML_FILES))
    shadowed = {}
    for path in YAML_FILES:
        read = _names_read(yaml.safe_load(path.read_text(encoding="utf-8")))
        hit = sorted(name for name in read if name in stats or name.startswith(FLEET_STATS_PREFIX))
        if hit:
            shadowed[str(path.relative_to(ROOT))] = hit
    assert shadowed == {}
