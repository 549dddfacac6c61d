# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A module's options from the role variables a task sees, templated on the controller: the one way the
actions (role_step, relaunch_decision) read the variables that plugin_utils/role_vars declares."""

from __future__ import annotations

from typing import Any, Callable, Mapping

try:
    # ansible-core 2.19 and later: templating a value that is `omit` raises this.
    from ansible.errors import AnsibleValueOmittedError
    OMITTED: tuple[type[Exception], ...] = (AnsibleValueOmittedError,)
except ImportError:
    # Older ansible-core templates it to the play's omit token instead (compared below).
    OMITTED = ()

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import module_args


def variable_lookup(template: Callable[[Any], Any], task_vars: Mapping[str, Any]) -> Callable[[str], Any]:
    """A variable's value in `task_vars`, templated with `template` (the action's templar); KeyError when
    it is not set or its value is "{{ omit }}"."""
    omit = task_vars.get("omit")

    def lookup(name: str) -> Any:
        if name not in task_vars:
            raise KeyError(name)
        try:
            value = template(task_vars[name])
        except OMITTED as omitted:
            raise KeyError(name) from omitted
        if omit is not None and value == omit:
            raise KeyError(name)
        return value
    return lookup


def options_from_variables(module: str, template: Callable[[Any], Any], task_vars: Mapping[str, Any]) -> dict[str, Any]:
    """`module`'s options from the role variables in `task_vars` (see :func:`variable_lookup`)."""
    return module_args(module, variable_lookup(template, task_vars))
