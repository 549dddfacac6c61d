# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A module's options from the role variables a task sees, templated on the controller: the one way the
actions (role_step, relaunch_decision) read the variables that plugin_utils/role_vars declares."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

try:
    # ansible-core 2.19 and later: templating a value that is `omit` raises this.
    from ansible.errors import AnsibleValueOmittedError
    OMITTED: tuple[type[Exception], ...] = (AnsibleValueOmittedError,)
except ImportError:
    # Older ansible-core templates it to the play's omit token instead (compared below).
    OMITTED = ()

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import module_args

# The one role variable that becomes a module run's environment (the drain's: simulated NVML, CUDA settings).
DRAIN_ENVIRONMENT = "gpu_drain_environment"
# A name the shell takes as a variable's: Ansible puts the environment in front of the module's command line
# unquoted (NAME=value ...), so any other name would be run as shell text.
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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


def environment_problems(environment: Any, variable: str = DRAIN_ENVIRONMENT) -> list[str]:
    """What is wrong with `environment` as a module run's environment, each naming `variable`: a name that is not a
    shell variable's, a value with a NUL byte; [] when nothing is (the type is the argument spec's to check)."""
    if not isinstance(environment, Mapping):
        return []
    problems = []
    for name, value in environment.items():
        if not isinstance(name, str) or not _VARIABLE_NAME.match(name):
            problems.append(f"{variable}: {escape_controls(repr(name))} is not an environment variable name "
                            f"(letters, digits and _, not starting with a digit)")
        elif "\0" in str(value):
            problems.append(f"{variable}: the value of {name} contains a NUL byte")
    return problems
