# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_summary: one host's summary, as a fact, set_stats data and JSON."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import failure_message, host_summary
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import ReportError, write_report

ARGUMENT_SPEC = {
    "results": {"type": "dict", "required": True},
    "failure": {"type": "str"},
    "rank": {"type": "dict"},
    "job_name": {"type": "str", "default": ""},
    "summary_dir": {"type": "str", "default": ""},
    "fail_host": {"type": "bool", "default": True},
}


class ActionModule(ActionBase):
    """Runs on the controller only; writes nothing on the target."""

    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _validated, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        host = task_vars["inventory_hostname"]
        summary = host_summary(host, bool(self._task.check_mode), args["results"], args["failure"] or None,
                               args["rank"])
        result.update(
            changed=False,
            msg=summary,
            summary=summary,
            ansible_facts={"relaunch_summary": summary},
            # What set_stats does: AWX shows it with the job and passes it on in a workflow.
            ansible_stats={"data": {"relaunch_summary": {host: summary}}, "per_host": False, "aggregate": True},
            # Shown like debug's output, without -v.
            _ansible_verbose_always=True,
        )
        if args["summary_dir"]:
            try:
                result["summary_path"] = write_report(args["summary_dir"], f"{host}.json", summary)
            except ReportError as exc:
                return dict(result, failed=True, msg=f"summary_dir: {exc}")
        failure = failure_message(summary, args["job_name"])
        if args["fail_host"] and failure:
            result.update(failed=True, msg=failure)
        return result
