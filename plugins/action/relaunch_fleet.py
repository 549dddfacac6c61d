# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_fleet: the run summed up over every host (run it once)."""

from __future__ import annotations

from typing import Any, Mapping

from ansible.utils.display import Display

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import CheckedAction
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import awx_job, fleet_line, fleet_summary
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import (
    FLEET_STATS_PREFIX, ReportError, fleet_file_name, fleet_part, report_dir, write_report,
)

display = Display()

ARGUMENT_SPEC = {
    "summary_var": {"type": "str", "default": "relaunch_summary"},
    "started_var": {"type": "str", "default": "relaunch_decided"},
    "summarized_var": {"type": "str", "default": "relaunch_summarized"},
    "summary_dir": {"type": "str", "default": ""},
}


class ActionModule(CheckedAction):
    """Runs on the controller only. Reads every play host's summary from this run's registered results."""

    ARGUMENT_SPEC = ARGUMENT_SPEC
    _requires_connection = False

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        hostvars = task_vars.get("hostvars", {})
        active = set(task_vars.get("ansible_play_hosts") or [])
        summaries: dict[str, Any] = {}
        early: list[str] = []
        # Every host that got as far as the decision (its result is registered even when it failed or
        # was unreachable), and every host that failed before it (the role's argument check, an
        # unreachable host); hosts of later batches have done neither, and are not in the summary yet.
        for host in task_vars.get("ansible_play_hosts_all") or []:
            host_vars = hostvars[host]
            decided = host_vars.get(args["started_var"])
            if decided is None:
                if host not in active:
                    summaries[host] = None
                    early.append(host)
                continue
            summaries[host] = this_runs_summary(decided, host_vars.get(args["summarized_var"]), args["summary_var"])
        fleet = fleet_summary(summaries, failed_early=early)
        line = fleet_line(fleet)
        display.display(line, stderr=True)
        stats = {"relaunch_fleet": fleet}
        # A job of an AWX workflow (each slice of a sliced job template is one) is a part of its fleet: its file is
        # its own (slices run at once and would replace each other's fleet.json), and so is a set_stats key, since
        # AWX passes a workflow's artifacts on merged key by key, the last job to finish winning
        # (awx/main/models/workflow.py WorkflowJob.get_effective_artifacts); fleet_merge merges the parts.
        awx = awx_job(task_vars)
        part = fleet_part(awx)
        if part and str(awx["job"]).isdigit():
            stats[f"{FLEET_STATS_PREFIX}{awx['job']}"] = fleet
        result.update(
            changed=False,
            msg=line,
            fleet=fleet,
            part=part or None,
            ansible_facts={"relaunch_fleet": fleet},
            ansible_stats={"data": stats, "per_host": False, "aggregate": False},
        )
        if args["summary_dir"]:
            try:
                result["summary_path"] = write_report(report_dir(args["summary_dir"], bool(self._task.check_mode)),
                                                      fleet_file_name(part), fleet)
            except ReportError as exc:
                return dict(result, failed=True, msg=f"summary_dir: {exc}")
        return result


def this_runs_summary(decided: Any, summarized: Any, fact: str) -> dict[str, Any] | None:
    """A host's summary as this run made it: the fact `fact` in the registered result of the task that
    set it (the decision's where it finished the host, else the summary task's), never the host's
    fact itself, which a fact cache (AWX's fact storage, jsonfile) carries over from an earlier run to a
    host that did not get that far this time (unreachable at the decision or during the steps). None:
    no summary this run."""
    source = decided if isinstance(decided, Mapping) and decided.get("done") else summarized
    facts = source.get("ansible_facts") if isinstance(source, Mapping) else None
    summary = facts.get(fact) if isinstance(facts, Mapping) else None
    return summary if isinstance(summary, dict) else None
