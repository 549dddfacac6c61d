# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.role_step: run a step role's module with its options taken from the role variables
(plugin_utils/role_vars), refusing a misspelt variable first."""

from __future__ import annotations

from typing import Any


from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import CheckedAction
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_options import options_from_variables
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import (
    MODULE_PREFIX, name_the_variables, unknown_variables,
)

ARGUMENT_SPEC = {
    "module": {"type": "str", "required": True, "choices": sorted(MODULE_PREFIX)},
    "options": {"type": "dict", "default": {}},
}


class ActionModule(CheckedAction):
    """Builds the module's arguments on the controller and runs the module on the target (one module run)."""

    ARGUMENT_SPEC = ARGUMENT_SPEC

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        unknown = unknown_variables(task_vars)
        if unknown:
            result.update(failed=True, changed=False, msg="; ".join(unknown), unknown_variables=unknown)
            return result
        module = args["module"]
        explicit = args["options"]
        module_options = {**options_from_variables(module, self._templar.template, task_vars), **explicit}
        answer = self._execute_module(module_name=f"gpuops.relaunch.{module}", module_args=module_options,
                                      task_vars=task_vars)
        if answer.get("failed") and answer.get("option_problems"):
            answer["msg"] = name_the_variables(module, str(answer.get("msg") or ""), answer["option_problems"],
                                               explicit=explicit)
            # ansible-core 2.19 and later print a failure from its captured summary of the module's own message,
            # which names the option, not the variable; a bad option has no traceback to keep.
            answer.pop("exception", None)
        result.update(answer)
        return result
