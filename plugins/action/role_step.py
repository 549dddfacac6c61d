# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.role_step: run a step role's module with its options taken from the role variables
(plugin_utils/role_vars), refusing a misspelt variable first."""

from __future__ import annotations

from typing import Any


from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import CheckedAction
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import MODULE_PREFIX, unknown_variables

ARGUMENT_SPEC = {
    "module": {"type": "str", "required": True, "choices": sorted(MODULE_PREFIX)},
    "options": {"type": "dict", "default": {}},
    "environment": {"type": "dict", "default": {}},
}


class ActionModule(CheckedAction):
    """Builds the module's arguments on the controller and runs the module on the target (one module run)."""

    ARGUMENT_SPEC = ARGUMENT_SPEC

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        unknown = unknown_variables(task_vars)
        if unknown:
            result.update(failed=True, changed=False, msg="; ".join(unknown), unknown_variables=unknown)
            return result
        result.update(self.run_role_module(args["module"], args["options"], task_vars, args["environment"]))
        return result
