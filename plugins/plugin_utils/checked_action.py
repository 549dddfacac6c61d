# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The start every action plugin of the collection shares: the task's arguments checked against the
action's own spec before it acts, and a runner for the modules it runs on the target."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ansible.plugins.action import ActionBase

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_options import environment_problems, options_from_variables
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_spec import shape_problems
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import name_the_variables, role_var

# Runs a module on the target: (module name, its arguments) -> its result.
ModuleRunner = Callable[[str, dict[str, Any]], dict[str, Any]]


class CheckedAction(ActionBase):
    """An action whose task arguments are checked against ARGUMENT_SPEC (and MUTUALLY_EXCLUSIVE) before
    act() runs; a bad argument fails the task naming it. An action that runs on the controller only
    also sets ``_requires_connection = False``."""

    TRANSFERS_FILES = False
    ARGUMENT_SPEC: dict[str, Any] = {}
    MUTUALLY_EXCLUSIVE: list[list[str]] = []

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _validated, args = self.validate_argument_spec(argument_spec=self.ARGUMENT_SPEC,
                                                       mutually_exclusive=self.MUTUALLY_EXCLUSIVE)
        return self.act(args, task_vars, result)

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        """The action, with its checked arguments and the result ActionBase started."""
        raise NotImplementedError

    def module_runner(self, task_vars: dict[str, Any]) -> ModuleRunner:
        """Runs a module on this task's target, on its connection."""
        def run_module(name: str, module_args: dict[str, Any]) -> dict[str, Any]:
            return self._execute_module(module_name=name, module_args=module_args, task_vars=task_vars)
        return run_module

    def run_role_module(self, module: str, explicit: Mapping[str, Any], task_vars: dict[str, Any],
                        environment: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run a step role's module (train_launch, zombie_reap, gpu_mem_wait) on the target with its options
        from the role variables (plugin_utils/role_vars); the `explicit` options win. `environment` is added
        to the task's own for this module run only (gpu_drain_environment: a name that is not a variable's
        fails the step before anything runs). A refused option is named by the role variable the user set
        (job_launch_command: ...), not only by the module's option."""
        from_variables = options_from_variables(module, self._templar.template, task_vars)
        # What Ansible's own argument checks would convert instead of refusing (["x"] for a string), named by
        # the role variable, before the module runs.
        problems = environment_problems(environment) + shape_problems(
            {role_var(module, option) or option: value for option, value in from_variables.items() if option not in explicit})
        if problems:
            return {"failed": True, "changed": False, "msg": "; ".join(problems)}
        module_options = {**from_variables, **explicit}
        inherited = self._task.environment
        if environment:
            parents = inherited if isinstance(inherited, list) else [inherited] if inherited else []
            self._task.environment = [*parents, dict(environment)]
        try:
            answer = self._execute_module(module_name=f"gpuops.relaunch.{module}", module_args=module_options,
                                          task_vars=task_vars)
        finally:
            self._task.environment = inherited
        if answer.get("failed") and answer.get("option_problems"):
            answer["msg"] = name_the_variables(module, str(answer.get("msg") or ""), answer["option_problems"],
                                               explicit=explicit)
            # ansible-core 2.19 and later print a failure from its captured summary of the module's own message,
            # which names the option, not the variable; a bad option has no traceback to keep.
            answer.pop("exception", None)
        return answer
