# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_decision: relaunch this host or not (see plugin_utils/relaunch_flow)."""

from __future__ import annotations

from typing import Any

from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import (
    RelaunchInputError, check_force, check_ranks, check_ranks_in_inventory, decide, rank_of,
)

ARGUMENT_SPEC = {
    "probe": {"type": "dict", "required": True},
    "force": {"type": "bool", "default": False},
    "ranks": {"type": "raw"},
    "probe_var": {"type": "str", "default": "relaunch_probe"},
    "job_name": {"type": "str"},
    "alerted_job": {"type": "str"},
    "alerted_host": {"type": "str"},
}


class ActionModule(ActionBase):
    """Runs on the controller only: the answer comes from the probe's result and the other hosts' vars."""

    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _validated, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        host = task_vars["inventory_hostname"]
        hostvars = task_vars.get("hostvars", {})
        play_hosts = list(task_vars.get("ansible_play_hosts_all") or [])
        try:
            check_force(args["force"], self._forced_hosts(hostvars, play_hosts), len(play_hosts),
                        "relaunch_hosts" in task_vars or task_vars.get("ansible_limit") is not None)
            rank = None
            rank_probes = None
            # No ranks: None, or "" - ansible-core before 2.19 renders a template whose whole value
            # is None (the role's "{{ job_launch_ranks | default(none) }}") as "" (tools/matrix.py, 2.16).
            if args["ranks"] not in (None, ""):
                ranks = args["ranks"]
                check_ranks_in_inventory(host, ranks, _var(hostvars, host, "job_launch_ranks"))
                check_ranks(host, ranks, {name: _var(hostvars, name, "job_launch_ranks") for name in ranks},
                            play_hosts, list(task_vars.get("ansible_play_batch") or []))
                rank = rank_of(host, ranks, _vars(hostvars, str(ranks[0])))
                rank_probes = {name: _var(hostvars, name, args["probe_var"]) for name in rank.ranks}
        except RelaunchInputError as exc:
            return dict(result, failed=True, msg=str(exc))
        if args["alerted_job"] and not args["job_name"]:
            return dict(result, failed=True, msg="job_name is required with alerted_job: the decision compares them")
        decision = decide(args["probe"], rank, rank_probes, alerted_job=args["alerted_job"], job_name=args["job_name"],
                          alerted_host=args["alerted_host"], host=host)
        # The rank is set either way (null: a job of one host), so that no step reads the one an
        # earlier include of the role, for another job, left in the facts.
        rank_facts = rank.as_dict() if rank is not None else None
        facts: dict[str, Any] = {"relaunch_decision": decision, "relaunch_rank": rank_facts}
        return dict(result, changed=False, ansible_facts=facts, decision=decision, rank=rank_facts,
                    msg=decision["why"])

    @staticmethod
    def _forced_hosts(hostvars: Any, play_hosts: list[str]) -> int:
        forced = 0
        for name in play_hosts:
            try:
                forced += bool(boolean(_var(hostvars, name, "relaunch_force") or False, strict=False))
            except TypeError:
                continue
        return forced


def _vars(hostvars: Any, host: str) -> Any:
    try:
        return hostvars[host]
    except KeyError:
        return {}


def _var(hostvars: Any, host: str, name: str) -> Any:
    try:
        return _vars(hostvars, host).get(name)
    except Exception:  # pylint: disable=broad-except  # a var that does not template is an absent answer
        return None
