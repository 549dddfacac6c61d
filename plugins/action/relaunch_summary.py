# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_summary: one host's summary, as a fact, set_stats data and JSON,
and with metrics_dir a node_exporter textfile on the target (module gpuops.relaunch.relaunch_metrics)."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import failure_message, host_summary
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import (
    ReportError, report_dir, summary_file_name, write_report,
)

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
    connection, no task more: a no-op relaunch stays at its few tasks per host)."""

    TRANSFERS_FILES = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _validated, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        host = task_vars["inventory_hostname"]
        if args["summary_dir"] and not args["job_name"]:
            return dict(result, failed=True, msg="summary_dir needs job_name (a file per host and job: DIR/HOST@JOB.json)")
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
                # One file per host and job, named so that no host name leads out of the directory
                # or onto the fleet's file; check mode's apart, never over a real run's.
                result["summary_path"] = write_report(report_dir(args["summary_dir"], bool(self._task.check_mode)),
                                                      summary_file_name(host, args["job_name"]), summary)
            except ReportError as exc:
                return dict(result, failed=True, msg=f"summary_dir: {exc}")
        if args["metrics_dir"]:
            problem = self._write_metrics(args["metrics_dir"], args["job_name"], summary, task_vars, result)
            if problem:
                return dict(result, failed=True, msg=f"metrics_dir: {problem}")
        failure = failure_message(summary, args["job_name"])
        if args["fail_host"] and failure:
            result.update(failed=True, msg=failure)
        return result

    def _write_metrics(self, directory: str, job: str, summary: dict[str, Any], task_vars: dict[str, Any],
                       result: dict[str, Any]) -> str | None:
        """Run relaunch_metrics on the target (check mode: it writes nothing); what went wrong, or None."""
        if not job:
            return "needs job_name (the gpuops_job label and the file name)"
        answer = self._execute_module(
            module_name="gpuops.relaunch.relaunch_metrics",
            module_args={"dir": directory, "job": job, "host": task_vars["inventory_hostname"], "summary": summary,
                         "gpus": summary.get("gpus") or []},
            task_vars=task_vars,
        )
        if answer.get("failed") or answer.get("unreachable") or "path" not in answer:
            problems = [p for p in answer.get("option_problems") or [] if isinstance(p, dict)]
            if not problems:
                return f"relaunch_metrics on the target: {answer.get('msg') or 'no path returned'}"
            # The module's dir is metrics_dir itself; its other options come from the summary and job_name.
            return "; ".join(str(p.get("reason")) if p.get("option") == "dir"
                             else f"relaunch_metrics' {p.get('option')}: {p.get('reason')}" for p in problems)
        # A report, as the JSON of summary_dir is: the summary task stays unchanged (a no-op run is
        # changed=0); metrics_changed says whether anything but the run's timestamp differs.
        result.update(metrics_path=answer["path"], metrics_changed=bool(answer.get("changed")))
        return None
