# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The relaunch role's variables checked against the role's own argument spec, inside the decision.

Ansible checks a role's variables with a task of its own ("Validating arguments against arg spec
'main'") wherever the role's ``main`` entry point is included: per host a worker that templates the
whole spec (86 options with their descriptions) before a module runs, about as much controller CPU as
the probe's own task. ``playbooks/relaunch.yml`` imports the entry points ``decide`` and ``relaunch``
instead (``tasks/decide.yml``, ``tasks/relaunch.yml``: no spec of their own, so Ansible adds no task),
and the decision makes the same check here, against the same options, before anything reaches the
target. An include of ``main`` gets both; the second finds what the first did.

The spec is read once per ansible-playbook: the strategy loads the action plugin in its main process
before it forks the workers, and they inherit it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from ansible.errors import AnsibleError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import cap_line, escape_controls
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_options import DRAIN_ENVIRONMENT, environment_problems, variable_lookup

SPEC_PATH = Path(__file__).resolve().parents[2] / "roles" / "relaunch" / "meta" / "argument_specs.yml"


def load_options(path: Path = SPEC_PATH) -> dict[str, Any]:
    """The options of the role's entry point ``main`` (generated from role_vars.py and the modules'
    DOCUMENTATION by tools/role_vars.py)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as handle:
        return yaml.load(handle, Loader=loader)["argument_specs"]["main"]["options"]


OPTIONS: dict[str, Any] = load_options()


def role_variable_errors(task_vars: Mapping[str, Any], template: Callable[[Any], Any],
                         options: Mapping[str, Any] = OPTIONS) -> list[str]:
    """What Ansible's argument check of the role would say about the role's variables in `task_vars`
    (each templated with `template`, the action's templar; "{{ omit }}" counts as unset), control
    characters escaped; [] when they pass."""
    lookup = variable_lookup(template, task_vars)
    provided: dict[str, Any] = {}
    errors: list[str] = []
    for name in options:
        try:
            provided[name] = lookup(name)
        except KeyError:
            continue
        except AnsibleError as exc:
            errors.append(f"{name} does not template: {exc.message}")
    # Ansible's check converts what it should refuse (["x"] for a string becomes "['x']"): refused first.
    errors += shape_problems(provided, options)
    checked = ArgumentSpecValidator(dict(options)).validate(provided)
    # Every module refuses a number that is not finite (a NaN timeout never ends), but only when its step
    # runs: a drain's NaN after the job was stopped. Refused here, nothing has changed yet.
    not_finite = [f"{name} must be a finite number, got {value!r}" for name, value in checked.validated_parameters.items()
                  if options[name].get("type") == "float" and isinstance(value, float) and not math.isfinite(value)]
    # The drain's environment goes onto a command line: a name that is no variable's would run as shell text.
    environment = environment_problems(checked.validated_parameters.get(DRAIN_ENVIRONMENT))
    return [escape_controls(message) for message in errors + checked.error_messages + not_finite] + environment


# The option types whose value is one piece of text (a path is text too), and the kinds of value that are none.
_TEXT_TYPES = ("str", "path")
_NOT_TEXT = (Mapping, list, tuple, set, frozenset)


def _not_text(value: Any) -> str | None:
    """What `value` is when it cannot be one piece of text (a list, a mapping, null), else None."""
    if value is None:
        return "null"
    if isinstance(value, _NOT_TEXT):
        return "a mapping" if isinstance(value, Mapping) else "a list"
    return None


def shape_problems(provided: Mapping[str, Any], options: Mapping[str, Any] = OPTIONS) -> list[str]:
    """What Ansible's argument check lets through by converting it, each naming the variable: a list or a mapping
    where the spec says text (job_launch_master_addr: ["x"] would launch with MASTER_ADDR="['x']"), and in a list
    of text an item that is null, a list or a mapping (job_launch_ranks: [[node1], node2] became "['node1']", and a
    null item ""). A null for the whole variable is fine: it means the module's default (see role_vars)."""
    problems = []
    for name, value in provided.items():
        spec = options.get(name) or {}
        kind = spec.get("type", "str")
        if value is None:
            continue
        if kind in _TEXT_TYPES and isinstance(value, _NOT_TEXT):
            problems.append(f"{name} must be a string, not {_not_text(value)}: {_shown(value)}")
        elif kind == "list" and spec.get("elements") in _TEXT_TYPES and isinstance(value, (list, tuple)):
            bad = [(index, item) for index, item in enumerate(value) if _not_text(item) is not None]
            if bad:
                index, item = bad[0]
                problems.append(f"{name} must be a list of strings, and its item {index} is {_not_text(item)}: "
                                f"{_shown(value)}")
    return problems


def _shown(value: Any) -> str:
    """`value` as a message shows it: its repr, cut and escaped."""
    return escape_controls(cap_line(repr(value)))
