"""The events guide's YAML says what the shipped files say: the controller form's rule is the shipped
rulebook's (its condition, throttle and variables), answers the survey's Hosts question with the group the
playbook's first play fills, and the guide's Alertmanager route is extensions/eda/alertmanager.yml's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
GUIDE = REPO / "docs" / "docsite" / "rst" / "guide_events.rst"
RULEBOOK = REPO / "extensions" / "eda" / "rulebooks" / "relaunch_on_alert.yml"
ROUTE = REPO / "extensions" / "eda" / "alertmanager.yml"
PLAYBOOK = REPO / "playbooks" / "relaunch.yml"


def yaml_blocks() -> list[Any]:
    """Every ``.. code-block:: yaml`` of the guide, loaded."""
    text = GUIDE.read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(r"^( *)\.\. code-block:: yaml\n\n((?:\1 {3,}.*\n|\n)+)", text, re.M):
        lines = match.group(2).splitlines()
        indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
        blocks.append(yaml.safe_load("\n".join(line[indent:] for line in lines)))
    return blocks


def shipped_rule() -> dict[str, Any]:
    [ruleset] = yaml.safe_load(RULEBOOK.read_text(encoding="utf-8"))
    [rule] = ruleset["rules"]
    return rule


def test_the_controller_form_is_the_shipped_rule_with_run_job_template():
    [controller] = [block for block in yaml_blocks() if "run_job_template" in str(block)]
    [rule] = controller[0]["rules"]
    shipped = shipped_rule()
    assert rule["condition"] == shipped["condition"] and rule["throttle"] == shipped["throttle"]
    extra_vars = rule["action"]["run_job_template"]["job_args"]["extra_vars"]
    assert "limit" not in rule["action"]["run_job_template"]["job_args"]
    assert {key: value for key, value in extra_vars.items() if key != "relaunch_hosts"} == (
        shipped["action"]["run_playbook"]["extra_vars"])
    # The survey's Hosts question is required: answered with the group the first play fills, never all.
    first_play, relaunch_play = yaml.safe_load(PLAYBOOK.read_text(encoding="utf-8"))[:2]
    group = first_play["tasks"][0]["ansible.builtin.add_host"]["groups"]
    assert extra_vars["relaunch_hosts"] == group and group in relaunch_play["hosts"]


def test_the_guides_route_is_the_shipped_route():
    [route] = yaml.safe_load(ROUTE.read_text(encoding="utf-8"))["route"]["routes"]
    [guide] = [block for block in yaml_blocks() if isinstance(block, dict) and "route" in block]
    [guide_route] = guide["route"]["routes"]
    assert guide_route == route
