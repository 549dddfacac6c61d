# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters of the relaunch role."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import (
    RelaunchInputError, alerted_job_hosts, failure_message, rank_of,
)


def rank_env(env: Any, ranks: Any, host: str, hostvars: Any) -> dict[str, Any]:
    """The job's environment with this host's rank variables (MASTER_ADDR, MASTER_PORT, NODE_RANK,
    NNODES) when `ranks` lists it and rank 0's port is a port; unchanged otherwise (relaunch_decision then
    says what is wrong, before anything changes)."""
    if env is None:
        env = {}
    if not isinstance(env, dict):
        raise AnsibleFilterError(f"rank_env: job_launch_env must be a dict, not {type(env).__name__}")
    if ranks is None or isinstance(ranks, (str, bytes)) or host not in [str(name) for name in ranks]:
        return dict(env)
    try:
        rank0 = hostvars[str(ranks[0])]
    except KeyError:
        return dict(env)
    try:
        return dict(env, **rank_of(host, ranks, rank0).env())
    except RelaunchInputError:
        return dict(env)


class FilterModule:
    """gpuops.relaunch filters."""

    def filters(self) -> dict[str, Any]:
        return {"rank_env": rank_env, "failure_message": failure_message, "alerted_job_hosts": alerted_job_hosts}
