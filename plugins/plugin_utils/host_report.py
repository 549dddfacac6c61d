# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One host's summary, published: the fact ``relaunch_summary``, set_stats data (AWX), the JSON file of
``summary_dir``, the node_exporter textfile of ``metrics_dir`` (module relaunch_metrics on the target, on
the task's connection) and one readable line. The summary task and, for a host that needs nothing, the
decision publish it the same way through :func:`publish`."""

from __future__ import annotations

from typing import Any, Mapping

from ansible.utils.display import Display

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import ModuleRunner
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import (
    failure_message, host_summary, outcome_line,
)
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import (
    ReportError, report_dir, summary_file_name, write_report,
)

display = Display()


def publish(host: str, check_mode: bool, results: Mapping[str, Any], failure: str | None,
            rank: Mapping[str, Any] | None, job_name: str, summary_dir: str, metrics_dir: str, fail_host: bool,
            run_module: ModuleRunner) -> dict[str, Any]:
    """The result of a task that summarizes `host`: `summary`, the facts and stats, the files' paths,
    `host_fails` and `host_failure` (the message it fails with, or None), `msg` (one line; the host fails with the
    failure message instead when `fail_host` and it failed or was refused). The line is also displayed: the task's
    result is shown in full only at -v."""
    if not job_name and failure is not None:
        # A host that failed before its job had a name (job_launch_name unset) has no file to name: its
        # failure is the message.
        summary_dir = metrics_dir = ""
    elif not job_name and summary_dir:
        return {"failed": True, "msg": "summary_dir needs job_name (a file per host and job: DIR/HOST@JOB.json)"}
    summary = host_summary(host, check_mode, results, failure, rank)
    line = outcome_line(summary, job_name)
    result: dict[str, Any] = {
        "changed": False,
        "msg": line,
        "ansible_facts": {"relaunch_summary": summary},
        # What set_stats does: AWX shows it with the job and passes it on in a workflow.
        "ansible_stats": {"data": {"relaunch_summary": {host: summary}}, "per_host": False, "aggregate": True},
    }
    if summary_dir:
        try:
            # One file per host and job, named so that no host name leads out of the directory or onto
            # the fleet's file; check mode's apart, never over a real run's.
            result["summary_path"] = write_report(report_dir(summary_dir, check_mode),
                                                  summary_file_name(host, job_name), summary)
        except ReportError as exc:
            return dict(result, failed=True, msg=f"summary_dir: {exc}")
    if metrics_dir:
        problem = _write_metrics(metrics_dir, job_name, host, summary, run_module, result)
        if problem:
            return dict(result, failed=True, msg=f"metrics_dir: {problem}")
    failure_text = failure_message(summary, job_name)
    # The host fails (now, or with fail_host false after the fleet summary): its relaunch failed or was refused.
    # playbooks/relaunch.yml fails it with host_failure of this registered result, never with the fact: an extra
    # var outranks the fact, and a workflow's earlier node passes its set_stats relaunch_summary on as one.
    result["host_fails"] = failure_text is not None
    result["host_failure"] = failure_text
    if fail_host and failure_text:
        # The callback prints the failure; the line would say it a second time.
        result.update(failed=True, msg=failure_text)
    else:
        display.display(line, stderr=True)
    return result


def _write_metrics(directory: str, job: str, host: str, summary: dict[str, Any], run_module: ModuleRunner,
                   result: dict[str, Any]) -> str | None:
    """Run relaunch_metrics on the target (check mode: it writes nothing); what went wrong, or None."""
    if not job:
        return "needs job_name (the gpuops_job label and the file name)"
    answer = run_module("gpuops.relaunch.relaunch_metrics",
                        {"dir": directory, "job": job, "host": host, "summary": summary,
                         "gpus": summary.get("gpus") or []})
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
