# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.fleet_merge: one fleet summary from the parts of one run (the slices of a sliced AWX
job template), read from relaunch_fleet's files or from the set_stats data an AWX workflow passes on."""

from __future__ import annotations

import re
from typing import Any

from ansible.utils.display import Display

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import CheckedAction
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import FleetError, fleet_line, merge_fleets
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import (
    FLEET_FILE, FLEET_STATS_PREFIX, ReportError, fleet_file_name, list_reports, plain_file_name, read_report, report_dir,
    workflow_part, workflow_part_pattern, write_report,
)

display = Display()

ARGUMENT_SPEC = {
    "summary_dir": {"type": "str", "default": ""},
    "parts": {"type": "list", "elements": "str"},
    "workflow_job": {"type": "str"},
    "dest": {"type": "str"},
}
MUTUALLY_EXCLUSIVE = [["parts", "workflow_job"]]
_STATS_KEY = re.compile(re.escape(FLEET_STATS_PREFIX) + r"[0-9]+")


class ActionModule(CheckedAction):
    """Runs on the controller only."""

    ARGUMENT_SPEC = ARGUMENT_SPEC
    MUTUALLY_EXCLUSIVE = MUTUALLY_EXCLUSIVE
    _requires_connection = False

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        directory = report_dir(args["summary_dir"], bool(self._task.check_mode)) if args["summary_dir"] else ""
        try:
            fleets, dest, source = self._parts(args, directory, task_vars)
            fleet = merge_fleets(fleets)
        except (FleetError, ReportError) as exc:
            return dict(result, failed=True, msg=escape_controls(str(exc)))
        line = f"{fleet_line(fleet)}, merged from {len(fleets)} part(s) ({source})"
        display.display(line, stderr=True)
        result.update(changed=False, msg=line, fleet=fleet, ansible_facts={"relaunch_fleet": fleet},
                      ansible_stats={"data": {"relaunch_fleet": fleet}, "per_host": False, "aggregate": False})
        if directory:
            try:
                result["summary_path"] = write_report(directory, dest, fleet)
            except ReportError as exc:
                return dict(result, failed=True, msg=f"summary_dir: {exc}")
        return result

    @staticmethod
    def _parts(args: dict[str, Any], directory: str,
               task_vars: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
        """(name -> fleet, the merged file's name, where the parts came from)."""
        if args["parts"] is not None or args["workflow_job"] is not None:
            if not directory:
                raise ReportError("summary_dir is required with parts or workflow_job: the fleet files are read there")
            if args["parts"] is not None:
                names = [plain_file_name(name, "parts") for name in args["parts"]]
                dest = FLEET_FILE
            else:
                pattern = workflow_part_pattern(args["workflow_job"])
                names = list_reports(directory, pattern)
                if not names:
                    raise ReportError(f"workflow_job: no fleet file of workflow job {args['workflow_job']} in "
                                      f"{directory} (none named {pattern})")
                dest = fleet_file_name(workflow_part(args["workflow_job"]))
            source = f"files in {directory}"
            fleets = {name: read_report(directory, name) for name in names}
        else:
            # A workflow node after the sliced job: AWX passes each slice's set_stats data on as extra vars.
            fleets = {name: task_vars[name] for name in sorted(task_vars) if _STATS_KEY.fullmatch(str(name))}
            if not fleets:
                raise ReportError(
                    f"no parts to merge: give parts (fleet files in summary_dir), workflow_job (the AWX workflow job of "
                    f"the slices, whose files are in summary_dir), or run this after the sliced job in an AWX workflow, "
                    f"which passes each slice's fleet on as {FLEET_STATS_PREFIX}ID (none is set)")
            dest = FLEET_FILE
            source = "set_stats data of the workflow"
        dest = plain_file_name(args["dest"], "dest") if args["dest"] else dest
        if dest in fleets:
            raise ReportError(f"dest: {dest} is one of the parts; name another file for the merged fleet")
        if "@" in dest or not dest.endswith(".json"):
            raise ReportError(f"dest must end in .json and have no '@' (host summary files have one), not {dest!r}")
        return fleets, dest, source
