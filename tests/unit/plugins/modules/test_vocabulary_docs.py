"""The modules' documentation speaks the collection's vocabularies, taken from the Python constants:
every escalation ``choices`` is ESCALATION_WORDS in rank order (all of them for gpu_health; the process
modules, which never judge a GPU's hardware, leave out the GPU words and only those), every kind a RETURN names is a FindingKind, the
plan's stages are STAGES, and every option's ``choices`` in the argument spec (built from a constant)
equals the documented one (what ansible-test validate-modules compares)."""

from __future__ import annotations

import importlib
import re
from typing import Any, Iterator

import pytest
import yaml

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import ESCALATION_WORDS, FINDING_KINDS
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.plan import STAGES

MODULES = ["zombie_facts", "zombie_reap", "gpu_mem_wait", "gpu_reclaim", "gpu_health"]
# The words only gpu_health gives: what a GPU reset needs, what only a host reboot fixes.
GPU_WORDS = ("gpu_reset", "host_reboot")
DOC_WORD = re.compile(r"(?<![A-Z])V\(([a-z_-]+)\)")


def module(name: str) -> Any:
    return importlib.import_module(f"ansible_collections.gpuops.relaunch.plugins.modules.{name}")


def walk(node: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for item in node:
            yield from walk(item, path)


def text(entry: dict) -> str:
    description = entry.get("description", "")
    return " ".join(description) if isinstance(description, list) else str(description)


@pytest.mark.parametrize("name", MODULES)
def test_escalation_choices_are_the_one_vocabulary(name):
    returned = yaml.safe_load(module(name).RETURN)
    escalations = [(path, entry["choices"]) for path, entry in walk(returned)
                   if path.rsplit(".", 1)[-1] == "escalation" and "choices" in entry]
    assert escalations, name
    words = list(ESCALATION_WORDS) if name == "gpu_health" else [w for w in ESCALATION_WORDS if w not in GPU_WORDS]
    for path, choices in escalations:
        assert choices == words, path


@pytest.mark.parametrize("name", MODULES)
def test_every_kind_a_return_names_is_a_finding_kind(name):
    returned = yaml.safe_load(module(name).RETURN)
    named = set()
    for _path, entry in walk(returned):
        for sentence in re.split(r"(?<=[.;])\s", text(entry)):
            if "C(kind)" in sentence:
                named |= set(DOC_WORD.findall(sentence)) - set(ESCALATION_WORDS)
    assert named, name
    assert named <= set(FINDING_KINDS), sorted(named - set(FINDING_KINDS))


def test_the_plan_stages_are_documented_as_the_code_names_them():
    plan = yaml.safe_load(module("zombie_reap").RETURN)["plan"]
    sentence = next(line for line in plan["description"] if "C(stage)" in line)
    assert DOC_WORD.findall(sentence) == list(STAGES)


class SpecSeen(Exception):
    """Raised instead of building the module: the argument spec main() passed."""


@pytest.mark.parametrize("name", MODULES)
def test_argument_spec_choices_equal_the_documented_ones(name, monkeypatch):
    mod = module(name)
    seen: dict[str, Any] = {}

    def capture(**kwargs):
        seen.update(kwargs["argument_spec"])
        raise SpecSeen

    monkeypatch.setattr(mod, "AnsibleModule", capture)
    with pytest.raises(SpecSeen):
        mod.main()
    documented = dict(yaml.safe_load(mod.DOCUMENTATION).get("options") or {})
    for fragment in yaml.safe_load(mod.DOCUMENTATION).get("extends_documentation_fragment", []):
        source = fragment.split(".")[2]
        if "." in fragment.split(".", 2)[2]:
            continue  # attributes.X fragments hold no options
        doc = importlib.import_module(f"ansible_collections.gpuops.relaunch.plugins.doc_fragments.{source}")
        documented.update(yaml.safe_load(doc.ModuleDocFragment.DOCUMENTATION).get("options") or {})
    for option, spec in seen.items():
        assert option in documented, option
        assert spec.get("choices") == documented[option].get("choices"), option
