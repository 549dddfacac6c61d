"""The inventory a slice job of a sliced AWX job template gets, by AWX's rule (read, not copied, from
ansible/awx awx/main/models/inventory.py):

- ``Inventory.get_script_data`` takes the inventory's enabled hosts ordered by name and hands them to
  ``Inventory.get_sliced_hosts``, which keeps every ``slice_count``-th host from the ``slice_number``-th
  (1-based): slice k of N holds the hosts at positions k-1, k-1+N, k-1+2N ... of that order;
- every group of the inventory is there, with its vars, but lists only the slice's hosts; hosts in no group
  are listed under ``all``; ``_meta.hostvars`` has the slice's hosts only.

Slice jobs are the nodes of the sliced job's workflow job, numbered 1..N (awx/main/models/jobs.py
``JobTemplate.create_unified_job``), and run with AWX's meta variables as extra vars
(``UnifiedJob.awx_meta_vars``): a job id and its workflow job's id and name, no slice number or count.
"""

from __future__ import annotations

from typing import Any


def sliced_hosts(hosts: dict[str, dict[str, Any]], number: int, count: int) -> list[str]:
    """The names of slice `number` (1-based) of `count`, of `hosts` (name -> variables; a host whose
    ``enabled`` is false is left out, as AWX leaves out disabled hosts)."""
    enabled = sorted(name for name, variables in hosts.items() if variables.get("enabled", True) is not False)
    return enabled[number - 1::count] if count > 1 and number > 0 else enabled


def slice_inventory(hosts: dict[str, dict[str, Any]], groups: dict[str, list[str]], number: int, count: int,
                    group_vars: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON inventory (an inventory script's output) of slice `number` of `count`."""
    names = sliced_hosts(hosts, number, count)
    data: dict[str, Any] = {"all": {}, "_meta": {"hostvars": {
        name: {k: v for k, v in hosts[name].items() if k != "enabled"} for name in names}}}
    grouped = {name for members in groups.values() for name in members}
    data["all"]["hosts"] = [name for name in names if name not in grouped]
    for group, members in groups.items():
        info: dict[str, Any] = {}
        kept = [name for name in members if name in names]
        if kept:
            info["hosts"] = kept
        if (group_vars or {}).get(group):
            info["vars"] = group_vars[group]
        if info:
            data[group] = info
    if groups:
        data["all"]["children"] = list(groups)
    return data


def awx_meta_vars(job_id: int, workflow_job_id: int | None, name: str) -> dict[str, Any]:
    """Some of the extra vars AWX gives a job (under both prefixes, as AWX does): no slice number."""
    found: dict[str, Any] = {}
    for prefix in ("awx", "tower"):
        found[f"{prefix}_job_id"] = job_id
        found[f"{prefix}_job_launch_type"] = "workflow" if workflow_job_id is not None else "manual"
        found[f"{prefix}_job_template_name"] = name
        if workflow_job_id is not None:
            found[f"{prefix}_workflow_job_id"] = workflow_job_id
            found[f"{prefix}_workflow_job_name"] = name
    return found
