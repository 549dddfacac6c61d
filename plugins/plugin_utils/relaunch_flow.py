# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The relaunch role's decisions and summaries, on the controller, as plain functions of the results.

The role (``roles/relaunch``) sequences the modules; every choice between its steps is made here:

* :func:`decide`: relaunch this host or not, why, and with which resume, from train_launch's probe
  (``decision``, given ``force``), the answers of the other ranks of a multi-rank job, and the rule
  that a force on every host of the play needs the hosts named;
* :func:`clearance`: after the clean-up and the drain, may the job launch, does only a container
  reboot help (and may it), or must the host fail, and with which message;
* :func:`host_summary` / :func:`fleet_summary`: what the run did, per host and for the fleet, with the
  same types on every ansible-core (built here, not by templating, which turned ``pid`` into ``"258"``
  on one version and an int on the next).

Escalation ranking is :func:`verdict.worst`, the collection's one ranking; escalation and health words
are the one vocabulary of ``_base/verdict.py``. Nothing here reads a message's wording.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import cap_line, escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Action, Escalation, Health, worst

NONE, RELAUNCH, REFUSED = Action.NONE.value, Action.RELAUNCH.value, Action.REFUSED.value

# What a host's line in the fleet summary says it did, in the order the counts list them.
FLEET_STATUSES = ("relaunched", "unchanged", "refused", "failed", "would_relaunch")
# The phases of a relaunch, in order; their seconds come from the modules' own `elapsed`.
PHASES = ("stop", "cleanup", "drain", "container_reset", "gpu_gate", "launch")
# The rank variables torch.distributed (and most launchers) read; part of the job's spec.
DEFAULT_MASTER_PORT = 29500

NOT_LOOKED = "not looked: nothing was relaunched"


class RelaunchInputError(ValueError):
    """The inventory or the play asks for something the relaunch must refuse, before anything changes."""


# --- ranks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rank:
    """This host's place in a multi-rank job."""

    index: int
    ranks: tuple[str, ...]
    master_addr: str
    master_port: int

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "of": len(self.ranks), "ranks": list(self.ranks),
                "master_addr": self.master_addr, "master_port": self.master_port}

    def env(self) -> dict[str, str]:
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "NODE_RANK": str(self.index), "NNODES": str(len(self.ranks))}


def rank_of(host: str, ranks: Any, rank0_vars: Mapping[str, Any]) -> Rank:
    """This host's rank from its job_launch_ranks (not checked against the play: see check_ranks).
    RelaunchInputError when rank 0's job_launch_master_port is no port."""
    names = tuple(str(name) for name in ranks)
    first = names[0] if names else host
    addr = master_addr(rank0_vars, host, first)
    port = master_port(rank0_vars.get("job_launch_master_port"), host, first)
    return Rank(names.index(host) if host in names else -1, names, addr, port)


def master_addr(rank0_vars: Mapping[str, Any], host: str, first: str) -> str:
    """Rank 0's job_launch_master_addr, else its ansible_host, else its inventory hostname (`first`), for MASTER_ADDR;
    RelaunchInputError naming the variable when the one set is no host name or address (a list would reach the job
    as MASTER_ADDR="['x']", a space or a control character is in no address)."""
    for variable in ("job_launch_master_addr", "ansible_host"):
        value = rank0_vars.get(variable)
        if value is None or value == "":
            continue
        if not isinstance(value, str) or not value.isprintable() or any(char.isspace() for char in value):
            raise RelaunchInputError(
                f"{host}: {variable} (of rank 0, {first}) must be a host name or address for MASTER_ADDR, not "
                f"{escape_controls(cap_line(repr(value)))}. No rank of this job is relaunched.")
        return value
    return first


def master_port(value: Any, host: str, first: str) -> int:
    """Rank 0's job_launch_master_port as a port (1-65535), DEFAULT_MASTER_PORT when unset (null or ""; a
    null template renders as "" before ansible-core 2.19); RelaunchInputError for anything else: the
    port reaches the job as MASTER_PORT, and a job told MASTER_PORT=-5 fails only at its rendezvous."""
    if value is None or (isinstance(value, str) and value == ""):
        return DEFAULT_MASTER_PORT
    port = None
    if isinstance(value, int) and not isinstance(value, bool):
        port = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        port = int(value)
    if port is None or not 1 <= port <= 65535:
        raise RelaunchInputError(
            f"{host}: job_launch_master_port (of rank 0, {first}) must be a port number from 1 to 65535, not "
            f"{escape_controls(repr(value))}. No rank of this job is relaunched.")
    return port


def check_rank_names(host: str, ranks: Any) -> None:
    """RelaunchInputError unless `ranks` is a list of inventory hostnames (strings): a list in it ([[node1], node2])
    or a null ([null, node1]) is no host, and must be refused naming the variable, not fail as a traceback."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or any(
            name is None or name == "" or isinstance(name, (Mapping, Sequence, set)) and not isinstance(name, str)
            for name in ranks):
        raise RelaunchInputError(f"{host}: job_launch_ranks must be a list of inventory hostnames, not "
                                 f"{escape_controls(cap_line(repr(ranks)))}. No rank of this job is relaunched.")


def check_ranks_in_inventory(host: str, ranks: Any, own: Any) -> None:
    """RelaunchInputError unless `ranks` (job_launch_ranks as this host's task sees it) is what this host's
    hostvars hold (`own`): each rank reads the others' job_launch_ranks from hostvars, which have the
    inventory's variables (and extra vars) but not a play's, a role's or a task's."""
    def names(value: Any) -> list[str] | None:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            return None
        return [str(name) for name in value]
    if own is None or names(own) != names(ranks):
        where = "is not in its hostvars" if own is None else f"is {escape_controls(repr(own))} in its hostvars"
        raise RelaunchInputError(
            f"{host}: job_launch_ranks must be set as a host or group variable (inventory), not a play, role or task "
            f"variable: every rank reads the other ranks' job_launch_ranks from hostvars, and this host's {where}. "
            f"No rank of this job is relaunched.")


def check_ranks(host: str, ranks: Any, layouts: Mapping[str, Any], play_hosts: Sequence[str],
                batch: Sequence[str]) -> None:
    """RelaunchInputError unless `ranks` lists this host once among the job's ranks, every rank is in
    this run and in this batch, and every rank lists the same ranks (`layouts`: each rank's list)."""
    check_rank_names(host, ranks)
    names = [str(name) for name in ranks]
    problems = []
    if host not in names:
        problems.append("it does not list this host")
    if len(set(names)) != len(names):
        problems.append("it lists a host more than once")
    missing = [name for name in names if name not in play_hosts]
    if missing:
        problems.append(f"rank(s) {', '.join(missing)} are not in this run (left out by relaunch_hosts or --limit)")
    later = [name for name in names if name in play_hosts and name not in batch]
    if later:
        problems.append(f"rank(s) {', '.join(later)} are not in this batch (relaunch_serial must keep a job's ranks together)")
    differ = sorted(name for name, layout in layouts.items() if [str(n) for n in (layout or [])] != names)
    if differ:
        problems.append(f"rank(s) {', '.join(differ)} list other ranks")
    if problems:
        raise RelaunchInputError(
            f"{host}: job_launch_ranks ({', '.join(names)}) must list this host once among the inventory hostnames of "
            f"all the job's ranks, each once, all in this run and this batch, and every rank must list the same "
            f"ranks: {'; '.join(problems)}. No rank of this job is relaunched.")


# The variables AWX passes every job it runs (awx/main/models/unified_jobs.py UnifiedJob.awx_meta_vars and
# jobs.py Job.awx_meta_vars, each under the prefixes of awx/main/constants.py JOB_VARIABLE_PREFIXES: awx_, tower_).
AWX_PREFIXES = ("awx", "tower")


def awx_job(variables: Mapping[str, Any]) -> dict[str, Any]:
    """What AWX tells a playbook about the job that runs it: {"job": id, "workflow_job": id or None,
    "workflow_job_name": name or None}, or {} outside AWX (no awx_job_id / tower_job_id).

    AWX passes no slice number or slice count: a slice job knows its own job id and, as every slice job is a
    node of the sliced job's workflow job (awx/main/models/jobs.py JobTemplate.create_unified_job), that
    workflow job's id and name; its slice number lives only in the job's record (job_slice_number)."""
    for prefix in AWX_PREFIXES:
        job = variables.get(f"{prefix}_job_id")
        if job is not None and job != "":
            workflow = variables.get(f"{prefix}_workflow_job_id")
            name = variables.get(f"{prefix}_workflow_job_name")
            return {"job": job, "workflow_job": workflow if workflow not in (None, "") else None,
                    "workflow_job_name": name if name not in (None, "") else None}
    return {}


def check_ranks_in_slice(host: str, ranks: Any, inventory_hosts: Container[str], awx: Mapping[str, Any]) -> None:
    """RelaunchInputError when a rank of this host's job is not in this run's inventory at all (not merely left
    out by relaunch_hosts or --limit, which check_ranks names): the job must not run half-relaunched.

    This is what a sliced AWX job template does to a job whose ranks fall into different slices: each slice
    job's inventory holds only its share of the hosts (awx/main/models/inventory.py Inventory.get_script_data
    with Inventory.get_sliced_hosts: the enabled hosts ordered by name, every Nth from the slice's number), with
    every group but only that slice's hosts in them, and hostvars of that slice's hosts only; every slice that
    holds a rank of the job refuses it the same way. `awx` is awx_job(variables) ({} outside AWX). A
    `ranks` that is no list, or does not list this host, is left to check_ranks."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        return
    names = [str(name) for name in ranks]
    if host not in names:
        return  # check_ranks names that
    absent = [name for name in names if name not in inventory_hosts]
    if not absent:
        return
    here = [name for name in names if name in inventory_hosts]
    what = (f"{host}: job_launch_ranks ({', '.join(names)}): rank(s) {', '.join(absent)} are not in this run's "
            f"inventory at all, only rank(s) {', '.join(here)} are")
    todo = ("No rank of this job is relaunched: a multi-rank job never runs half-relaunched. Relaunch it from a job "
            "template that is not sliced (job_slice_count 1) and holds all its ranks (for example one limited to "
            "them), or let the event path relaunch it through such a template (a limit does not keep ranks together "
            "in a sliced template: AWX slices the whole inventory, the limit applies inside each slice)")
    if awx and awx.get("workflow_job") is not None:
        named = f" ({awx['workflow_job_name']})" if awx.get("workflow_job_name") else ""
        where = (
            f"{what} (AWX job {awx['job']}, a node of workflow job {awx['workflow_job']}{named}). A sliced job "
            f"template (job_slice_count above 1) runs as a workflow job whose slice jobs each get only their share "
            f"of the inventory's hosts (every Nth host by name: AWX's Inventory.get_sliced_hosts), and AWX tells a "
            f"slice job neither its slice number nor which slice holds a host. If this is such a slice, rank(s) "
            f"{', '.join(absent)} are in other slice jobs of workflow job {awx['workflow_job']}, which refuse this "
            f"job the same way; if not, they are not in the inventory. {todo}")
    elif awx:
        where = (f"{what} (AWX job {awx['job']}, which is no slice: it belongs to no workflow job). Name the job's "
                 f"ranks by their inventory hostnames. No rank of this job is relaunched")
    else:
        where = (f"{what}: a misspelt hostname, a rank of another inventory, or one slice of a sliced job, which holds "
                 f"only its share of the hosts. Name the job's ranks by their inventory hostnames, in one inventory. "
                 f"{todo}")
    raise RelaunchInputError(escape_controls(where) + ".")


# Strategies under which every host finishes a task before any host starts the next: the ranks' barriers
# (ranks_barrier.yml, ranks_launched.yml) read the other ranks' marks set by the task before.
BARRIER_STRATEGIES = frozenset(("linear", "ansible.builtin.linear", "debug", "ansible.builtin.debug"))


def check_strategy(host: str, strategy: str | None) -> None:
    """RelaunchInputError unless the play's strategy holds the ranks' barriers (see BARRIER_STRATEGIES):
    under `free` or `host_pinned` a rank would read its peers' marks before they set them, and launch
    alone or not at all."""
    if strategy and strategy not in BARRIER_STRATEGIES:
        raise RelaunchInputError(
            f"{host}: job_launch_ranks needs the linear strategy (every rank finishes a step before any rank starts "
            f"the next; the ranks wait for each other before the launch), and this play's strategy is "
            f"{escape_controls(repr(strategy))}. Run the role in a play with strategy: linear (playbooks/relaunch.yml "
            f"sets it). No rank of this job is relaunched.")


# --- the decision ---------------------------------------------------------------------------------


# The variables that, true on every host of the play (an extra var, an AWX survey answer with no hosts
# chosen), act on the whole fleet: what each does to a host, and how to say it for some hosts only.
FLEET_WIDE = {
    "relaunch_force": (
        "force",
        "relaunch_hosts=all to force the whole inventory), or set relaunch_force per host in the inventory"),
    "job_launch_reset_guard": (
        "reset the crash-loop guard of",
        "relaunch_hosts=all to reset the guard of every job, which lets every crash loop relaunch again)"),
}


def check_fleet_wide(variable: str, here: bool, there: Callable[[str], bool], play_hosts: Sequence[str],
                     hosts_named: bool) -> None:
    """A FLEET_WIDE variable true on every host of the play (e.g. -e relaunch_force=true restarts every
    healthy job of the fleet; -e job_launch_reset_guard=true lets every crash loop relaunch again) needs
    the hosts said explicitly (relaunch_hosts or --limit), so that a typo such as -e relaunch_host=x, or
    an AWX survey answered without choosing hosts, never reaches a whole inventory.

    `here`: its value on this host; `there(host)` answers for another host of the play. It is asked only
    where the variable is true here and the hosts were not named, and only until the first host where it
    is not: a run without it reads no other host's variables (a per-host cost that does not grow with
    the fleet)."""
    if not here or hosts_named or not play_hosts:
        return
    if all(there(host) for host in play_hosts):
        does, otherwise = FLEET_WIDE[variable]
        raise RelaunchInputError(
            f"{variable} is true on every host of the play ({len(play_hosts)}), and neither relaunch_hosts nor --limit "
            f"says which hosts to {does}: nothing was changed. Name the hosts with -e relaunch_hosts=HOSTS or --limit "
            f"HOSTS ({otherwise}.")


def decide(probe: Mapping[str, Any], rank: Rank | None = None,
           rank_probes: Mapping[str, Mapping[str, Any] | None] | None = None,
           alerted_job: str | None = None, job_name: str | None = None,
           alerted_host: str | None = None, host: str | None = None) -> dict[str, Any]:
    """Relaunch this host or not: train_launch's probe `decision` (its health, spec, guard and force),
    and for a rank of a multi-rank job, its whole job's.

    `alerted_job`, `alerted_host`: the job and inventory host an event named (relaunch_alerted_job,
    relaunch_alerted_host, set by the event-driven relaunch). When the job is not this host's
    (`job_name`, job_launch_name), nothing is done, whatever the probe found: the alert came from a job
    this inventory no longer runs there (renamed, or a stale textfile), and relaunching the host's own
    job for it would restart a job nobody said failed. When the host is neither this one (`host`) nor a
    rank of this host's job (`rank`), nothing is done either: a group or a pattern in the alert's host
    label reached more hosts than it named. (The alert names a multi-rank job by its rank 0, the
    gpuops_rank0 label: the relaunch then runs on all its ranks, see alerted_job_hosts.)

    One rank that must be relaunched (or that the guard refuses) means every rank must: the others
    would wait at a rendezvous that never completes. A rank whose probe did not answer does not count
    (a passing SSH failure must not stop a healthy job); it fails on its own, and the barrier before
    the launch keeps every other rank from launching without it. When one rank failed (crashed,
    stalled, missing) every rank resumes: the ranks restart together from one checkpoint.
    """
    not_for_this = None
    if alerted_host not in (None, "") and alerted_host not in (rank.ranks if rank is not None else (host,)):
        not_for_this = (f"the alert names the host {_quoted(alerted_host)}, not this one ({_quoted(host)})"
                        + (" nor a rank of its job" if rank is not None else ""))
    elif alerted_job not in (None, "") and alerted_job != job_name:
        not_for_this = (f"the alert names the job {_quoted(alerted_job)}, but this host's job (job_launch_name) is "
                        f"{_quoted(job_name)}")
    if not_for_this:
        return {"action": NONE, "relaunch": False, "resume": False, "resume_mode": None, "stop": False,
                "wanted_by": [], "why": f"{not_for_this}: nothing is done", "expect_run_id": seen_run(probe)}
    own = dict(probe.get("decision") or {})
    decision = {
        "action": own.get("action", NONE),
        "relaunch": bool(own.get("relaunch", False)),
        "why": str(own.get("why", "")),
        "resume": bool(own.get("resume", False)),
        # What the launch is told, so that it resumes exactly as the probe decided (train_launch's
        # resume_mode: always or never; null from a probe that does not say, and then the inventory's
        # job_launch_resume).
        "resume_mode": own.get("resume_mode"),
        # Whether something of the job runs that the stop must end first. Nothing running (a crash, a
        # reboot): the stop is skipped; the launch writes the incident record then, and it restarts
        # a job that started in between (state=started stops what runs with another spec).
        "stop": bool(probe.get("running", True)),
        "wanted_by": [],
        # The run-id fence: the run the probe judged, which the stop and the clean-up are for; a newer run
        # (another relaunch of the job, started after this look) is theirs to leave alone.
        "expect_run_id": seen_run(probe),
    }
    if rank is None:
        return decision
    answers = {name: (rank_probes or {}).get(name) for name in rank.ranks}
    must = [name for name, answer in answers.items()
            if answer and (answer.get("decision") or {}).get("action", NONE) != NONE]
    decision["wanted_by"] = must
    if must and decision["action"] == NONE:
        decision.update(action=RELAUNCH, relaunch=True,
                        why=f"relaunched with its job, because rank(s) {', '.join(must)} must be")
    failed = [name for name, answer in answers.items() if answer and _failed(answer)]
    if failed and decision["relaunch"]:
        # Told always, the start appends resume_args where it can (the probe's resumable: it has them, and
        # the job ran before); `resume` says what it will do.
        decision.update(resume=bool(own.get("resumable", False)), resume_mode="always")
    shared = shared_checkpoint_step(answers)
    if decision["relaunch"] and shared is not None:
        # Every rank resumes the same step: the newest one complete on all of them (-1: none is).
        decision["checkpoint_step"] = shared
    return decision


def shared_checkpoint_step(answers: Mapping[str, Mapping[str, Any] | None]) -> int | None:
    """The newest checkpoint step complete on every rank that answered (each probe's checkpoint.complete_steps),
    -1 where they share none, None where no rank judges checkpoints (no checkpoint_dir). A rank that answered
    without them rules every step out: it saw no complete checkpoint."""
    seen = [answer.get("checkpoint") for answer in answers.values() if answer]
    if not any(isinstance(found, Mapping) for found in seen):
        return None
    common: set[int] | None = None
    for found in seen:
        steps = found.get("complete_steps") if isinstance(found, Mapping) else None
        mine = {step for step in steps or [] if isinstance(step, int) and not isinstance(step, bool)}
        common = mine if common is None else common & mine
    return max(common) if common else -1


def resumed_checkpoint(launch: Mapping[str, Any], health: Mapping[str, Any]) -> dict[str, Any] | None:
    """The summary's ``checkpoint``: the launch's (train_launch's RV checkpoint, judged once the job was stopped)
    path and step resumed, the torn ones skipped, and the work lost - the last progress step the probe saw before
    the failure minus the step resumed (null where either is not a number). None without checkpoint_dir."""
    found = launch.get("checkpoint")
    if not isinstance(found, Mapping):
        return None
    resumed = bool(found.get("resumed"))
    step = found.get("step") if resumed and isinstance(found.get("step"), int) else None
    last = health.get("last_step")
    try:
        last_step = int(str(last)) if last is not None else None
    except ValueError:
        last_step = None
    return {"resumed": resumed, "path": found.get("path") if resumed else None, "step": step,
            "format": found.get("format"), "torn_skipped": found.get("torn_skipped", 0),
            "torn": [entry.get("path") for entry in found.get("torn") or [] if isinstance(entry, Mapping)],
            "work_lost_steps": last_step - step if last_step is not None and step is not None else None}


def seen_run(probe: Mapping[str, Any]) -> str:
    """The run train_launch's probe judged (its health.run_id), as the stop's and the clean-up's expect_run_id:
    "" when it judged none (the job never ran, or its records were not sound), so that any run found later is newer."""
    run_id = (probe.get("health") or {}).get("run_id") if isinstance(probe.get("health"), Mapping) else None
    return run_id if isinstance(run_id, str) else ""


def superseded(*steps: Any) -> bool:
    """Whether a step of this relaunch (the stop, a clean-up) found the job running a newer run than the one its
    probe saw and left it alone: another run relaunched the job meanwhile."""
    return any(_result(step).get("superseded") is True for step in steps)


def alerted_job_hosts(alerted_host: Any, host: str, ranks: Any, inventory_hosts: Iterable[str]) -> list[str]:
    """The inventory hosts an event-driven relaunch runs on, for an alert that names `alerted_host` (the
    alert's gpuops_rank0: a multi-rank job's rank 0, or a job's one host), as that host answers it
    (`host`, its `ranks`: job_launch_ranks): its job's ranks that are in the inventory
    (`inventory_hosts`), in rank order, or the host alone for a job of one host. A host that is not the
    one named ([]: a group name in the label reached it) adds none.

    A rank missing from the inventory, ranks that are no list of names or that leave the host out: the
    relaunch then refuses the job with check_ranks' message, rather than this quietly running elsewhere
    (or adding a host that the inventory does not have)."""
    if alerted_host != host:
        return []
    if ranks is None or ranks == "" or isinstance(ranks, (str, bytes, Mapping)) or not isinstance(ranks, Sequence):
        return [host]
    names = [str(name) for name in ranks]
    if host not in names:
        return [host]
    known = set(inventory_hosts)
    return [name for name in names if name in known]


def _quoted(value: Any) -> str:
    """What an event said (a label from a textfile, a webhook post), quoted and with control characters visible."""
    return escape_controls(repr(str(value)))


FAILED_HEALTH = frozenset(state.value for state in Health if state.failed)


def _failed(probe: Mapping[str, Any]) -> bool:
    """Whether the probe found a failure a relaunch answers (Health.failed: crashed, stalled, missing)."""
    return (probe.get("health") or {}).get("state") in FAILED_HEALTH


# --- clearance after the clean-up and the drain ---------------------------------------------------


def clearance(cleanup: Mapping[str, Any], drain: Mapping[str, Any], reset_allowed: bool,
              reset_done: bool, check_mode: bool, host: str) -> dict[str, Any]:
    """May the job launch now? The worst of what the clean-up left and what the drain found decides.

    ``reset`` is true when only a container reboot helps, the inventory allows it, and it was not done
    yet; ``blocked`` is the message the host fails with, or None. In check mode a reboot is only
    announced, so what it would clear is still there: the run goes on to say what the launch would do.
    """
    # A clean-up that left a newer run of the job alone (another run relaunched it meanwhile): the drain was skipped,
    # the GPUs are that run's; the launch finds it running (train_launch state=started changes nothing then).
    drain = {} if superseded(cleanup) else _result(drain)
    cleanup_level = _escalation(cleanup.get("escalation"))
    drain_level = _escalation(drain.get("escalation")) if drain else Escalation.NONE
    released = bool(drain.get("released", True)) if drain else True
    level = worst((cleanup_level, drain_level))
    reset = level == Escalation.CONTAINER_REBOOT and reset_allowed and not reset_done
    reasons = [str(r) for r in cleanup.get("reasons") or []]
    if not released:
        reasons.append(str(drain.get("msg") or "the GPUs were not released"))
    # `signals` left after the clean-up is what the clean-up itself does (in check mode it sent none;
    # zombies waiting for a parent it ended are reaped on their own): it blocks only through the GPUs.
    clear = level.rank < Escalation.CONTAINER_REBOOT.rank and released
    blocked = None
    if not clear and not reset and not (check_mode and reset_done):
        if level == Escalation.HOST_ACTION:
            lead = "The host must act: "
        elif level == Escalation.HOST_REBOOT:
            lead = "Only a reboot of the machine that owns the GPUs clears it (for a container, its Proxmox node): "
        elif level == Escalation.GPU_RESET:
            lead = ("Only a GPU reset clears it (the GPU gate resets what its own look finds, where "
                    "relaunch_gpu_reset_allowed is true): ")
        elif level == Escalation.CONTAINER_REBOOT:
            lead = ("A container reboot did not clear it: " if reset_done
                    else "Only a container reboot helps (container_reset_allowed is false for this host): ")
        else:
            lead = "The GPUs were not released: "
        blocked = f"{host}: not relaunching. {lead}{'; '.join(reasons)}"
    return {"escalation": level.value, "released": released, "reset": reset, "clear": clear,
            "blocked": blocked, "reasons": reasons}


def hardware_caused(gate: Mapping[str, Any]) -> bool:
    """Whether the GPU gate found this failure the hardware's and the job still launches: it reset a GPU, or
    left out one it found bad now (not only one an earlier run quarantined). The launch then tells the
    crash-loop guard (train_launch failure_cause=hardware), which does not count such a relaunch."""
    if gate.get("outcome") != "launch":
        return False
    found_now = any(isinstance(bad, Mapping) and not bad.get("quarantined") for bad in gate.get("bad") or [])
    return found_now or gate_reset_done(gate)


def gate_reset_done(gate: Mapping[str, Any]) -> bool:
    """Whether the GPU gate reset a GPU in this look (gpu_gate's `reset` entries, `done`)."""
    return any(isinstance(entry, Mapping) and entry.get("done") for entry in gate.get("reset") or [])


def gate_refusal(host: str, gate: Mapping[str, Any]) -> str:
    """What a host the GPU gate refused fails with: the gate's reason, then each bad GPU's evidence (index, UUID,
    bus id, the recovery action, the remap counts, the XIDs with their time and text), escaped."""
    parts = []
    for bad in gate.get("bad") or []:
        if not isinstance(bad, Mapping):
            continue
        xids = ", ".join(f"XID {x.get('xid')} at {x.get('first')} ({x.get('text')})" for x in bad.get("xids") or []
                         if isinstance(x, Mapping))
        parts.append(f"GPU {bad.get('index')} {bad.get('uuid')} {bad.get('pci_bus_id')}: {bad.get('escalation')}"
                     f"{', quarantined' if bad.get('quarantined') else ''}; recovery action {bad.get('recovery_action')}; "
                     f"remapped rows {bad.get('remapped_rows')}" + (f"; {xids}" if xids else ""))
    evidence = f" Evidence: {' | '.join(parts)}." if parts else ""
    return escape_controls(cap_line(
        f"{host}: not relaunching. The GPUs need {gate.get('escalation')}: {gate.get('why')}.{evidence} "
        f"The job was stopped and cleaned; a person must act (the event path does not retry a refusal)."))


def _escalation(word: Any) -> Escalation:
    try:
        return Escalation(word)
    except ValueError:
        # A word outside the vocabulary is a broken answer: it blocks rather than passes.
        return Escalation.HOST_ACTION


# --- summaries ------------------------------------------------------------------------------------


HEALTH_KEYS = ("state", "reason", "last_step", "last_progress_at", "since_progress", "exit_code", "exit_signal",
               "ended_at", "log_tail")
GUARD_KEYS = ("max_relaunches", "relaunch_window", "recent", "would_refuse", "history")
# What the summary adds when train_launch says it (the budget knows why: whether this relaunch counts,
# why, and the growing delay's due time); absent from an older train_launch's answer, absent here.
GUARD_BUDGET_KEYS = ("counts", "why", "step", "cause", "delay", "due_at_iso", "wait")


def _result(value: Any) -> Mapping[str, Any]:
    """A registered result, or {} for a step that did not run (skipped, or never reached)."""
    if not isinstance(value, Mapping) or value.get("skipped"):
        return {}
    return value


def _elapsed(*results: Mapping[str, Any]) -> float | None:
    seconds = [float(r["elapsed"]) for r in results if isinstance(r.get("elapsed"), (int, float))]
    return round(sum(seconds), 3) if seconds else None


def step_results(registered: Mapping[str, Any], decision_steps: Mapping[str, Any]) -> dict[str, Any]:
    """The results of one relaunch's steps: those the role's tasks registered (the reboot, the looks after it, the
    launch) and, where no task of the role ran one (null, or skipped), the decision's own: the stop, the clean-up and
    the drain run in a decision's task (a job of one host's, or a rank's joint decision)."""
    ran = {name: value for name, value in registered.items() if _result(value)}
    return {**registered, **decision_steps, **ran}


def host_summary(host: str, check_mode: bool, results: Mapping[str, Any], failure: str | None,
                 rank: Mapping[str, Any] | None) -> dict[str, Any]:
    """One host's summary from the results the role registered (see roles/relaunch/tasks).

    `results` keys: probe, decision, stop, cleanup, drain, reset, cleanup_again, drain_again, launch.
    """
    probe = _result(results.get("probe"))
    decision = results.get("decision") or {}
    action = str(decision.get("action") or NONE)
    wanted = action == RELAUNCH
    # The steps run only after a decision to relaunch. Without one, what the variables hold is from
    # an earlier include of the role in the same play (registered variables outlive it): not this run's.
    steps = results if wanted else {}
    stop = _result(steps.get("stop"))
    cleanup = _result(steps.get("cleanup"))
    drain = _result(steps.get("drain"))
    reset = _result(steps.get("reset"))
    cleanup_again = _result(steps.get("cleanup_again"))
    drain_again = _result(steps.get("drain_again"))
    launch = _result(steps.get("launch"))
    gate = _result(steps.get("gate"))
    health = probe.get("health") or {}
    guard = probe.get("relaunch_guard") or {}
    found = cleanup.get("found") or {}
    # The job as the launch left it, or as the probe found it when nothing was launched.
    job = launch or probe
    # A launch that started nothing found the job running with this spec: another run (a watchdog run
    # and an alert's at once) started it between this run's look and its launch.
    # The stop or the clean-up says so first (superseded: they left that newer run alone).
    started_by_another = wanted and not check_mode and failure is None and not launch.get("changed")
    summary: dict[str, Any] = {
        "host": host,
        "check_mode": bool(check_mode),
        # In check mode nothing was relaunched; would_relaunch says what a real run would do.
        "relaunched": wanted and not check_mode and failure is None and not started_by_another,
        "would_relaunch": wanted,
        "action": action,
        "failed": failure,
        "why": str(decision.get("why") or ("the probe did not answer" if not probe else "")),
        "health": {key: health.get(key, [] if key == "log_tail" else None) for key in HEALTH_KEYS},
        # The stop wrote it before any signal (or the launch, when nothing was left to stop).
        "incident": stop.get("incident") or launch.get("incident"),
        "resumed": wanted and bool(launch.get("resumed", False)),
        # With checkpoint_dir: which checkpoint and step were resumed, torn ones skipped, the work lost.
        "checkpoint": resumed_checkpoint(launch if wanted else {}, health),
        "relaunch_guard": {**{key: guard.get(key, [] if key == "history" else None) for key in GUARD_KEYS},
                           **{key: guard[key] for key in GUARD_BUDGET_KEYS if key in guard}},
        "found": str(found.get("escalation") or cleanup.get("escalation")) if cleanup else NOT_LOOKED,
        "reasons": _unique(list(found.get("reasons") or []) + list(cleanup.get("reasons") or [])),
        "ended": [entry.get("pid") for entry in (cleanup.get("ended") or []) + (cleanup_again.get("ended") or [])
                  if isinstance(entry, Mapping)],
        "gpu_released_mib": (drain_again or drain).get("released_mib"),
        # The drain's last look (after a container reset, the drain after it): released or not, and
        # each GPU's memory; null and [] where no drain ran.
        "gpu_released": _released(drain_again or drain),
        "gpus": _gpus(drain_again or drain),
        "container_reset": bool(reset.get("changed", False)),
        # Processes whose marks named another job while their ancestry proved them this job's: the stop
        # ended them as this job's (ancestry outranks marks), the clean-up's look named the conflict.
        "mark_conflicts": _mark_conflicts(stop, launch, found, cleanup),
        "job": {"operation": job.get("operation"), "pid": job.get("pid"), "log_path": job.get("log_path"),
                "ready_line": job.get("ready_line")},
        "seconds": _phase_seconds(stop, (cleanup,), (drain,),
                                  (reset, results.get("reset_wait"), cleanup_again, drain_again), launch, gate),
        # Multi-rank jobs: index, of, ranks, master_addr, master_port (null for a job of one host).
        "rank": dict(rank) if rank else None,
    }
    if not probe:
        summary["health"].update(state="unknown", reason="the probe did not answer")
    if started_by_another:
        summary["why"] += (f"; but when this run launched, the job already ran with this spec (pid {job.get('pid')}), "
                           f"started meanwhile by another run: this run started nothing")
    # The GPU gate (after the drain, before the launch): its refusal is the run's refusal, as the crash-loop guard's is.
    # Nothing of this host runs after it, so a failure beside it is the refusal itself (a rank's joint decision
    # fails its task with it, to keep the other ranks at their barrier).
    summary["gpu_gate"] = gate_summary(gate)
    if gate.get("outcome") == "refuse":
        summary.update(action=REFUSED, relaunched=False, failed=None, why=f"the GPU gate refused: {gate.get('why')}")
    summary["after"] = after_action(summary, launch)
    # The job's live file (train_launch's metrics_dir), where the run now recorded keeps one: it owns the
    # job's health series, so the relaunch's own metrics leave them out (see _metrics/textfile.py).
    summary["live_metrics"] = (launch if launch else probe).get("live_metrics")
    # What the fleet summary calls it (relaunched, unchanged, refused, failed, would_relaunch).
    summary["status"] = fleet_status(summary)
    return summary


GATE_KEYS = ("outcome", "escalation", "why", "bad", "visible", "reset", "quarantined", "quarantine_cleared")


def gate_summary(gate: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the GPU gate answered (None where it did not look: nothing was relaunched)."""
    if not gate:
        return None
    return {key: gate.get(key, [] if key in ("bad", "visible", "reset", "quarantined", "quarantine_cleared") else None)
            for key in GATE_KEYS}


def after_action(summary: Mapping[str, Any], launch: Mapping[str, Any]) -> dict[str, Any]:
    """The job after this run acted, where `summary["health"]` is what the probe saw before: the state
    (the new run runs once its start was proven; not known after a failure; else as the probe saw it)
    and the crash-loop guard's count, this run's relaunch included (train_launch counts it when it
    starts after a failure, even if the start then fails)."""
    seen = summary["health"].get("state")
    if summary.get("relaunched"):
        state = "running"
    elif summary.get("failed") and summary.get("would_relaunch") and not summary.get("check_mode"):
        state = "unknown"  # stopped, perhaps started: the next look says
    elif launch.get("running") is True and not summary.get("check_mode"):
        state = "running"  # started by another run meanwhile, the launch found
    else:
        state = seen
    recent = summary["relaunch_guard"].get("recent")
    guard = launch.get("relaunch_guard") if isinstance(launch.get("relaunch_guard"), Mapping) else {}
    # A relaunch that does not count (the hardware's failure, or progress) leaves the count as it was.
    if launch.get("changed") and guard.get("needed") and guard.get("counts") is not False and isinstance(guard.get("recent"), int):
        recent = guard["recent"] + 1
    return {"state": state, "recent_relaunches": recent}


def _mark_conflicts(stop: Mapping[str, Any], launch: Mapping[str, Any], found: Mapping[str, Any],
                    cleanup: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each pid whose marks contradicted its ancestry, once: from the stops' C(stop.mark_conflicts)
    (with the job the marks named), then the clean-up's findings of kind mark_conflict."""
    conflicts: dict[Any, dict[str, Any]] = {}
    for result in (stop, launch):
        entries = (result.get("stop") or {}).get("mark_conflicts") if isinstance(result.get("stop"), Mapping) else None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, Mapping) and entry.get("pid") not in conflicts:
                conflicts[entry.get("pid")] = {"pid": entry.get("pid"), "marked_job_dir": entry.get("marked_job_dir"),
                                               "seen_by": "stop"}
    for source in (found, cleanup):
        findings = source.get("findings")
        for finding in findings if isinstance(findings, list) else []:
            if not isinstance(finding, Mapping) or finding.get("kind") != "mark_conflict":
                continue
            for pid in finding.get("pids") or []:
                conflicts.setdefault(pid, {"pid": pid, "marked_job_dir": None, "seen_by": "cleanup"})
    return list(conflicts.values())


def _released(drain: Mapping[str, Any]) -> bool | None:
    released = drain.get("released")
    return released if isinstance(released, bool) else None


GPU_KEYS = ("index", "uuid", "name", "total_mib")


def _gpus(drain: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each GPU of gpu_mem_wait's `gpus`: index, uuid, name, total_mib and used_mib at its last look."""
    gpus = drain.get("gpus")
    if not isinstance(gpus, list):
        return []
    return [dict({key: gpu.get(key) for key in GPU_KEYS}, used_mib=gpu.get("used_mib_after"))
            for gpu in gpus if isinstance(gpu, Mapping)]


def _phase_seconds(stop: Mapping[str, Any], cleanup: Iterable[Mapping[str, Any]], drain: Iterable[Mapping[str, Any]],
                   reset: Iterable[Any], launch: Mapping[str, Any], gate: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Seconds per phase that ran, from the modules' own `elapsed` (the time on the target)."""
    phases = {
        "stop": _elapsed(stop),
        "cleanup": _elapsed(*cleanup),
        "drain": _elapsed(*drain),
        "container_reset": _elapsed(*(_result(r) for r in reset)),
        "gpu_gate": _elapsed(gate or {}),
        "launch": _elapsed(launch),
    }
    return {name: seconds for name, seconds in phases.items() if seconds is not None}


def _unique(items: Iterable[Any]) -> list[Any]:
    seen: list[Any] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen


def outcome_line(summary: Mapping[str, Any], job_name: str) -> str:
    """One line a person reads: the host and job, what the probe saw, what the run did, and why
    (control characters escaped: `why` may quote what the job printed)."""
    health = (summary.get("health") or {}).get("state") or "unknown"
    status = fleet_status(summary)
    job = summary.get("job") or {}
    did = {
        "relaunched": f"relaunched (pid {job.get('pid')}{', resumed' if summary.get('resumed') else ''})",
        "unchanged": "nothing done",
        "refused": "refused, nothing stopped",
        "would_relaunch": "would relaunch (check mode)",
        "failed": "FAILED",
    }[status]
    why = summary.get("failed") if status == "failed" else summary.get("why")
    return escape_controls(f"{summary.get('host')} [{job_name}]: {health}, {did}: {why}")


def fleet_status(summary: Mapping[str, Any] | None) -> str:
    """What one host's line of the fleet summary says it did."""
    if not summary or summary.get("failed"):
        return "failed"
    if summary.get("action") == REFUSED:
        return "refused"
    if summary.get("relaunched"):
        return "relaunched"
    if summary.get("would_relaunch") and summary.get("check_mode"):
        return "would_relaunch"
    return "unchanged"


FAILED_EARLY = "failed before the decision: its variables did not pass the role's argument check, or it was unreachable"


def fleet_summary(summaries: Mapping[str, Mapping[str, Any] | None],
                  failed_early: Iterable[str] = ()) -> dict[str, Any]:
    """The run, summed up: per host, per multi-rank job (which ranks relaunched, which failed), counts.

    `summaries` maps every host of the play that got as far as the relaunch to its host summary
    (None for a host that failed before its summary was made); `failed_early` names the hosts among
    them that failed before the decision (argument check, unreachable).
    """
    early = set(failed_early)
    hosts: dict[str, dict[str, Any]] = {}
    jobs: dict[str, dict[str, Any]] = {}
    for host, summary in summaries.items():
        status = fleet_status(summary)
        summary = summary or {}
        rank = summary.get("rank") or None
        hosts[host] = {
            "status": status,
            "health": (summary.get("health") or {}).get("state"),
            "found": summary.get("found"),
            "ended": len(summary.get("ended") or []),
            "container_reset": bool(summary.get("container_reset", False)),
            "pid": (summary.get("job") or {}).get("pid"),
            "seconds": round(sum((summary.get("seconds") or {}).values()), 2),
            "rank": rank.get("index") if rank else None,
            "failed": FAILED_EARLY if host in early else summary.get("failed") or (
                "failed before its summary" if status == "failed" else None),
        }
        if rank:
            ranks = [str(name) for name in rank.get("ranks") or []]
            if ranks:
                jobs.setdefault(ranks[0], {"ranks": ranks})
    return _counted(hosts, jobs)


def _counted(hosts: dict[str, Any], jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fleet of `hosts` and `jobs` (each with its ranks): each job's relaunched and failed ranks (a rank that
    is not among the hosts counts as failed), and the counts."""
    for job in jobs.values():
        ranks = job["ranks"]
        job["relaunched"] = [name for name in ranks if hosts.get(name, {}).get("status") == "relaunched"]
        job["failed"] = [name for name in ranks if hosts.get(name, {"status": "failed"})["status"] == "failed"]
    statuses = [row["status"] for row in hosts.values()]
    return {"hosts": hosts, "jobs": jobs, "counts": {status: statuses.count(status) for status in FLEET_STATUSES}}


def fleet_line(fleet: Mapping[str, Any]) -> str:
    """The fleet in one line: how many hosts, and how many of them each status."""
    counts = fleet.get("counts") or {}
    parts = [f"{counts[status]} {status.replace('_', ' ')}" for status in FLEET_STATUSES if counts.get(status)]
    failed = [host for host, row in (fleet.get("hosts") or {}).items() if row.get("status") == "failed"]
    tail = f" (failed: {', '.join(failed)})" if failed else ""
    return escape_controls(f"{len(fleet.get('hosts') or {})} host(s): {', '.join(parts) or 'none'}{tail}")


class FleetError(ValueError):
    """Fleets that cannot be merged into one truthful view (the message says which and why)."""


# How deep a fleet summary may nest: its own shape is a few levels (hosts, a host's row, its health, a log tail).
MAX_FLEET_DEPTH = 32


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests lists or mappings more than `limit` levels deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Iterable[Any] = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _check_fleet(name: str, fleet: Any) -> Mapping[str, Any]:
    """`fleet` when it is a fleet summary (fleet_summary's shape, its counts those of its hosts), else FleetError."""
    why = None
    if _deeper_than(fleet, MAX_FLEET_DEPTH):
        # Before anything walks it: a part nested a few thousand levels deep ends every recursive walk
        # (repr, a JSON encoder, Ansible's result) in "maximum recursion depth exceeded", naming nothing.
        why = f"it is nested more than {MAX_FLEET_DEPTH} levels deep"
    elif not isinstance(fleet, Mapping):
        why = f"it is a JSON {type(fleet).__name__}, not an object"
    elif not all(isinstance(fleet.get(key), Mapping) for key in ("hosts", "jobs", "counts")):
        why = "it lacks hosts, jobs or counts"
    else:
        rows = fleet["hosts"]
        bad = [host for host, row in rows.items() if not isinstance(row, Mapping) or row.get("status") not in FLEET_STATUSES]
        statuses = [row["status"] for host, row in rows.items() if host not in bad]
        if bad:
            why = f"host(s) {', '.join(map(str, bad[:5]))} have no status of a fleet ({', '.join(FLEET_STATUSES)})"
        elif dict(fleet["counts"]) != {status: statuses.count(status) for status in FLEET_STATUSES}:
            why = f"its counts {_short(fleet['counts'])} are not those of its {len(rows)} host(s)"
        elif not all(isinstance(job, Mapping) and isinstance(job.get("ranks"), list) for job in fleet["jobs"].values()):
            why = "a job of it has no list of ranks"
    if why:
        raise FleetError(escape_controls(f"{name}: not a fleet summary of gpuops.relaunch.relaunch_fleet: {why}"))
    return fleet


def _short(value: Any) -> str:
    """A short, printable rendering of `value` for a message."""
    text = repr(value)
    return escape_controls(text if len(text) <= 200 else text[:200] + "...")


def merge_fleets(parts: Mapping[str, Any]) -> dict[str, Any]:
    """One fleet from the fleets of parts of one run (e.g. the slices of a sliced AWX job), keyed by where each
    came from (a file name, a variable): hosts and jobs united, each job's relaunched and failed ranks and the
    counts recounted over all of them (so the counts are the sum of the parts'), and `parts`: each part's number
    of hosts. FleetError when a part is no fleet summary, when there is no part, or when a host is in two parts
    (its line would count twice; the slices of one sliced job never share a host) or a job's ranks differ between
    parts; nothing is merged then."""
    if not parts:
        raise FleetError("no fleet summary to merge")
    fleets = {name: _check_fleet(name, fleet) for name, fleet in parts.items()}
    seen: dict[str, str] = {}
    overlaps: dict[str, list[str]] = {}
    hosts: dict[str, Any] = {}
    jobs: dict[str, dict[str, Any]] = {}
    for name, fleet in fleets.items():
        for host, row in fleet["hosts"].items():
            if host in seen:
                overlaps.setdefault(host, [seen[host]]).append(name)
                continue
            seen[host] = name
            hosts[host] = dict(row)
        for first, job in fleet["jobs"].items():
            ranks = [str(rank) for rank in job["ranks"]]
            known = jobs.setdefault(str(first), {"ranks": ranks, "from": name})
            if known["ranks"] != ranks:
                raise FleetError(escape_controls(
                    f"the job of rank 0 {first} lists ranks {', '.join(known['ranks'])} in {known['from']} and "
                    f"{', '.join(ranks)} in {name}: these are not parts of one run"))
    if overlaps:
        listed = "; ".join(f"{host} in {', '.join(names)}" for host, names in sorted(overlaps.items())[:10])
        more = f" and {len(overlaps) - 10} more" if len(overlaps) > 10 else ""
        raise FleetError(escape_controls(
            f"{len(overlaps)} host(s) are in more than one fleet summary ({listed}{more}): merged, they would count "
            f"twice. Merge the parts of one run only (the slices of one sliced job never share a host); nothing was "
            f"merged"))
    for job in jobs.values():
        del job["from"]
    return dict(_counted(hosts, jobs), parts={name: len(fleet["hosts"]) for name, fleet in fleets.items()})


def failure_message(summary: Mapping[str, Any], job_name: str) -> str | None:
    """What a host whose relaunch failed, or was refused by the crash-loop guard, fails with (None:
    it does not fail)."""
    host = summary.get("host")
    status = fleet_status(summary)
    if status == "failed":
        return f"{host}: {summary.get('failed') or 'failed before its summary'}"
    gate = summary.get("gpu_gate") or {}
    if status == "refused" and gate.get("outcome") == "refuse":
        return gate_refusal(str(host), gate)
    if status == "refused":
        health = summary.get("health") or {}
        tail = " | ".join(str(line) for line in health.get("log_tail") or [])
        return f"{host}: not relaunching {job_name}: {summary.get('why')}. Nothing was stopped. Log tail: {tail}"
    return None
