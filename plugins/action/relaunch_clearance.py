# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_clearance: may the job launch after the clean-up and the drain?"""

from __future__ import annotations

from typing import Any


from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import CheckedAction
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import clearance

ARGUMENT_SPEC = {
    "cleanup": {"type": "dict", "required": True},
    "drain": {"type": "dict", "default": {}},
    "reset_allowed": {"type": "bool", "default": False},
    "reset_done": {"type": "bool", "default": False},
}


class ActionModule(CheckedAction):
    """Runs on the controller only."""

    ARGUMENT_SPEC = ARGUMENT_SPEC
    _requires_connection = False

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        answer = clearance(args["cleanup"], args["drain"], args["reset_allowed"], args["reset_done"],
                           bool(self._task.check_mode), task_vars["inventory_hostname"])
        result.update(changed=False, ansible_facts={"relaunch_clearance": answer}, **answer)
        if answer["blocked"]:
            result.update(failed=True, msg=answer["blocked"])
        else:
            result["msg"] = ("only a container reboot helps, and the inventory allows it" if answer["reset"]
                             else "clear" if answer["clear"] else "a container reboot was announced (check mode)")
        return result
