# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The start every action plugin of the collection shares: the task's arguments checked against the
action's own spec before it acts, and a runner for the modules it runs on the target."""

from __future__ import annotations

from typing import Any, Callable

from ansible.plugins.action import ActionBase

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
