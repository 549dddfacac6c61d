# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_summary: one host's summary, as a fact, set_stats data and JSON,
and with metrics_dir a node_exporter textfile on the target (module gpuops.relaunch.relaunch_metrics)."""

from __future__ import annotations

from typing import Any


from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import CheckedAction
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.host_report import publish
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import step_results

ARGUMENT_SPEC = {
    "results": {"type": "dict", "required": True},
    "decision_steps": {"type": "dict", "default": {}},
    "failure": {"type": "str"},
    "rank": {"type": "dict"},
    "job_name": {"type": "str", "default": ""},
    "summary_dir": {"type": "str", "default": ""},
    "metrics_dir": {"type": "str", "default": ""},
    "fail_host": {"type": "bool", "default": True},
}


class ActionModule(CheckedAction):
    """Runs on the controller; with metrics_dir it also runs relaunch_metrics on the target (the same
    connection, no task more)."""

    ARGUMENT_SPEC = ARGUMENT_SPEC

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        results = step_results(args["results"], args["decision_steps"])
        result.update(publish(task_vars["inventory_hostname"], bool(self._task.check_mode), results,
                              args["failure"] or None, args["rank"], args["job_name"], args["summary_dir"],
                              args["metrics_dir"], args["fail_host"], self.module_runner(task_vars)))
        return result
