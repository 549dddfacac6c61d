# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_summary: one host's summary, as a fact, set_stats data and JSON,
and with metrics_dir a node_exporter textfile on the target (module gpuops.relaunch.relaunch_metrics)."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.host_report import publish

ARGUMENT_SPEC = {
    "results": {"type": "dict", "required": True},
    "failure": {"type": "str"},
    "rank": {"type": "dict"},
    "job_name": {"type": "str", "default": ""},
    "summary_dir": {"type": "str", "default": ""},
    "metrics_dir": {"type": "str", "default": ""},
    "fail_host": {"type": "bool", "default": True},
}


class ActionModule(ActionBase):
    """Runs on the controller; with metrics_dir it also runs relaunch_metrics on the target (the same
    connection, no task more)."""

    TRANSFERS_FILES = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _validated, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)

        def run_module(name: str, module_args: dict[str, Any]) -> dict[str, Any]:
            return self._execute_module(module_name=name, module_args=module_args, task_vars=task_vars)
        result.update(publish(task_vars["inventory_hostname"], bool(self._task.check_mode), args["results"],
                              args["failure"] or None, args["rank"], args["job_name"], args["summary_dir"],
                              args["metrics_dir"], args["fail_host"], run_module))
        return result
