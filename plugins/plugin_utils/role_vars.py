# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The roles' variables, declared once: which module option each one is, its role default, its fallback.

VARIABLES is the one declaration. From it:

* module_args builds a module's options from the role variables (the action gpuops.relaunch.role_step
  and the relaunch role's steps use it), so no task file repeats the map;
* tools/role_vars.py generates the roles' meta/argument_specs.yml, the defaults/main.yml of the step
  roles and the guide's variable table (docs/docsite/rst/role_variables.rst), taking type, choices
  and description from the modules' DOCUMENTATION; a unit test regenerates them and fails on drift;
* unknown_variables refuses a misspelt variable (job_launch_ready_regx) instead of ignoring it.

A variable is *unset* when the play does not define it. Unset, a variable takes its fallback
variables' value (the first one set), else its role default, else it is not passed (the module's
own default applies). Set to null it is not passed either: null means "the module's default", the
way a role task's ``default(omit)`` passed on an explicit null. Variables marked empty_unset also
treat an empty string as unset (a directory or a secret nobody gave).

Pure Python: no Ansible import, so tools/ and unit tests load it as a plain file.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

PREFIXES: tuple[str, ...] = ("job_launch_", "process_cleanup_", "gpu_drain_", "container_reset_", "relaunch_")

# The module each step role runs, and the prefix of its variables.
MODULE_PREFIX: dict[str, str] = {
    "train_launch": "job_launch_",
    "zombie_reap": "process_cleanup_",
    "gpu_mem_wait": "gpu_drain_",
    "proxmox_ct_reboot": "container_reset_",
    # The relaunch's hardware gate (its state_dir, devices and GPU backend are the job's and the drain's).
    "gpu_gate": "relaunch_gpu_",
}
# The roles whose argument_specs list a variable, by its prefix; the relaunch role honours them all.
PREFIX_ROLES: dict[str, tuple[str, ...]] = {
    "job_launch_": ("job_launch", "relaunch"),
    "process_cleanup_": ("process_cleanup", "relaunch"),
    "gpu_drain_": ("gpu_drain", "relaunch"),
    "container_reset_": ("container_reset", "relaunch"),
    "relaunch_": ("relaunch",),
}


class _Unset:
    """No role default: unset, the option is left out."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class Template:
    """A role default made of other variables, str.format style: Template("/var/log/gpuops/{job_launch_name}.log").
    Left out when a variable it names is unset or null."""

    text: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(re.findall(r"{(\w+)}", self.text))


@dataclass(frozen=True)
class RoleVar:
    """One role variable.

    module/option: the module option it is (None for a variable the roles' YAML reads itself).
    default: the role default (UNSET: none, the module's applies; a Template: made of other variables).
    fallback: variables whose value it takes when unset, the first set one.
    empty_unset: an empty string counts as unset.
    roles: the roles (or ROLE:ENTRY entry points) whose argument_specs list it (by its prefix unless given).
    required: the roles (or ROLE:ENTRY entry points) where it must be set.
    type/elements/choices/description: for a variable that is no module option (a module option's come
    from the module's DOCUMENTATION). notes: sentences added to the generated description.
    doc_default: the default the docs show where it is no plain value ("{{ inventory_hostname }}").
    """

    name: str
    module: str | None = None
    option: str | None = None
    default: Any = UNSET
    fallback: tuple[str, ...] = ()
    empty_unset: bool = False
    roles: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    type: str | None = None
    elements: str | None = None
    choices: tuple[str, ...] = ()
    description: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    doc_default: Any = UNSET

    @property
    def in_roles(self) -> tuple[str, ...]:
        if self.roles:
            return self.roles
        return next(roles for prefix, roles in PREFIX_ROLES.items() if self.name.startswith(prefix))


def _opt(module: str, option: str, **kwargs: Any) -> RoleVar:
    """The role variable that is `module`'s `option`, named after the module's prefix."""
    return RoleVar(MODULE_PREFIX[module] + option, module, option, **kwargs)


_TL, _ZR, _GW, _PX = "train_launch", "zombie_reap", "gpu_mem_wait", "proxmox_ct_reboot"

VARIABLES: tuple[RoleVar, ...] = (
    # job_launch_* -> train_launch
    _opt(_TL, "name", required=("job_launch", "relaunch"),
         notes=("No default - two jobs need two names, and a default would let a second job replace the first.",)),
    _opt(_TL, "command", required=("job_launch:main", "relaunch")),
    _opt(_TL, "state", default="started", choices=("started", "restarted"), roles=("job_launch:main",),
         notes=("Limited to its two start states (the role's stop and health entry points set their own).",)),
    _opt(_TL, "shell"),
    _opt(_TL, "chdir"),
    _opt(_TL, "env"),
    _opt(_TL, "user"),
    _opt(_TL, "group"),
    _opt(_TL, "umask"),
    _opt(_TL, "log_path", default=Template("/var/log/gpuops/{job_launch_name}.log"),
         notes=("Default C(/var/log/gpuops/NAME.log), after O(job_launch_name), so two jobs never share a log.",)),
    _opt(_TL, "keep_logs"),
    _opt(_TL, "backend"),
    _opt(_TL, "state_dir"),
    _opt(_TL, "ready_regex"),
    _opt(_TL, "min_uptime"),
    _opt(_TL, "startup_timeout"),
    _opt(_TL, "term_timeout"),
    _opt(_TL, "remove_paths"),
    _opt(_TL, "progress_regex"),
    _opt(_TL, "stall_after"),
    _opt(_TL, "log_tail_lines"),
    _opt(_TL, "metrics_dir", empty_unset=True, doc_default="",
         notes=("The role passes C(inventory_hostname) as O(gpuops.relaunch.train_launch#module:metrics_host), the "
                "C(gpuops_host) label. Empty, none is kept.",
                "See R(the metrics guide,ansible_collections.gpuops.relaunch.docsite.guide_metrics).")),
    _opt(_TL, "metrics_host", fallback=("inventory_hostname",), doc_default="{{ inventory_hostname }}",
         notes=("Unset, the inventory hostname: the C(gpuops_host) label of the job's live metrics.",)),
    _opt(_TL, "metrics_gpus"),
    _opt(_TL, "resume_args"),
    _opt(_TL, "resume"),
    _opt(_TL, "checkpoint_dir", empty_unset=True, doc_default="",
         notes=("Empty, none: O(job_launch_resume_args) are appended as written.",
                "See R(the checkpoint guide,ansible_collections.gpuops.relaunch.docsite.guide_checkpoints).")),
    _opt(_TL, "checkpoint_format"),
    _opt(_TL, "checkpoint_marker"),
    _opt(_TL, "checkpoint_missing"),
    _opt(_TL, "checkpoint_rename_torn"),
    _opt(_TL, "max_relaunches", default=3,
         notes=("Unlike the module (no limit unless asked), the role sets one - it is what runs unattended; null, no limit.",)),
    _opt(_TL, "relaunch_window", default=3600),
    _opt(_TL, "relaunch_delay"),
    _opt(_TL, "relaunch_max_delay"),
    _opt(_TL, "failure_cause",
         notes=("The GPU health gate's word (V(hardware)) for a relaunch after a failure of the job's GPU; the "
                "crash-loop guard does not count it.",)),
    _opt(_TL, "reset_guard", default=False,
         notes=("The way past a refusal by the crash-loop guard once its cause is fixed.",
                "True on every host of the relaunch's play (an extra var), it needs C(relaunch_hosts) or C(--limit) "
                "naming the hosts: the relaunch role refuses it otherwise, before anything runs.")),
    RoleVar("job_launch_probe", roles=("job_launch:main",), type="bool", default=False, description=(
        "Ask, do not act: run the role in check mode (apply C(check_mode=true) to the include) and do not count "
        "what it would do as a change. The answer is C(job_launch_result.operation) (V(none), V(start) or "
        "V(restart)) with C(job_launch_result.health) and C(job_launch_result.relaunch_guard).",)),
    RoleVar("job_launch_ranks", roles=("relaunch",), type="list", elements="str", description=(
        "The inventory hostnames of all the ranks of this host's job, in rank order (for example the group C(llm)'s "
        "hosts, from group vars); unset for a job of one host. Each rank's job gets C(MASTER_ADDR), C(MASTER_PORT), "
        "C(NODE_RANK) and C(NNODES) (filter C(gpuops.relaunch.rank_env)).",
        "A host or group variable (the inventory), since each rank reads the others' from C(hostvars), which hold no "
        "play, role or task variables; set as one of those, it is refused, naming it.")),
    RoleVar("job_launch_master_port", roles=("relaunch",), type="raw", description=(
        "Rank 0's (a host or group variable of the first of O(job_launch_ranks)) port for C(MASTER_PORT), from 1 to "
        "65535; unset, 29500. Anything else is refused, naming it, before anything changes.",)),
    RoleVar("job_launch_master_addr", roles=("relaunch",), type="str", description=(
        "Rank 0's (a host or group variable of the first of O(job_launch_ranks)) address for C(MASTER_ADDR); "
        "unset, its C(ansible_host), else its inventory hostname.",)),
    # process_cleanup_* -> zombie_reap
    _opt(_ZR, "match", default=[],
         notes=("A string is one pattern, never split on its commas (C(train_\\d{1,3}\\.py) is one pattern).",)),
    _opt(_ZR, "pids", default=[]),
    _opt(_ZR, "job_name", fallback=("job_launch_name",),
         notes=("Unset, C(job_launch_name) where the play sets it (the relaunch does).",)),
    _opt(_ZR, "job_state_dir", fallback=("job_launch_state_dir",),
         notes=("Unset, C(job_launch_state_dir) where the play sets it, else the module's default.",)),
    _opt(_ZR, "include_descendants"),
    _opt(_ZR, "allow_broad",
         notes=("With C(ansible_connection=local), true can take in the controller's workers for other hosts.",)),
    _opt(_ZR, "protected", empty_unset=True, notes=("Null or empty keeps the module's default.",)),
    _opt(_ZR, "orphan_grace"),
    _opt(_ZR, "proc_root"),
    _opt(_ZR, "gpu_device_glob"),
    _opt(_ZR, "term_signal"),
    _opt(_ZR, "term_timeout"),
    _opt(_ZR, "kill_timeout"),
    _opt(_ZR, "reap_timeout"),
    _opt(_ZR, "d_state_timeout"),
    _opt(_ZR, "reap_parents"),
    RoleVar("process_cleanup_fail_on_escalation", roles=("process_cleanup",), type="bool", default=False, description=(
        "Fail the play when only a container reboot or the host can clear what is left (C(process_cleanup_needs_reboot) "
        "or C(process_cleanup_needs_host_action)), as M(gpuops.relaunch.relaunch_clearance) decides. Not zombie_reap's "
        "O(gpuops.relaunch.zombie_reap#module:fail_on_escalation), which fails on C(signals) too; the facts are "
        "published before this fails.",)),
    # gpu_drain_* -> gpu_mem_wait
    _opt(_GW, "devices"),
    _opt(_GW, "max_used_mib"),
    _opt(_GW, "max_used_percent"),
    _opt(_GW, "no_processes"),
    _opt(_GW, "pids_gone"),
    _opt(_GW, "min_host_available_gib"),
    _opt(_GW, "timeout"),
    _opt(_GW, "poll_interval"),
    _opt(_GW, "query_timeout"),
    _opt(_GW, "gpus_required"),
    _opt(_GW, "backend"),
    RoleVar("gpu_drain_environment", type="dict", default={}, description=(
        "Extra environment for the wait, for example PYTHONPATH of the NVML bindings.",
        "Each name must be a shell variable's (letters, digits and C(_), not starting with a digit): Ansible puts the "
        "environment on the module's command line unquoted, so any other name is refused before anything runs.")),
    RoleVar("gpu_drain_fail_on_timeout", roles=("gpu_drain",), type="bool", default=True, description=(
        "Fail when the GPUs are not released in time; false leaves the decision to the play (from "
        "C(gpu_drain_needs_reboot) and C(gpu_drain_needs_host_action)).",)),
    # container_reset_* -> proxmox_ct_reboot (the role's own tasks pass them; its defaults/main.yml must agree)
    RoleVar("container_reset_allowed", type="bool", default=False, description=(
        "Whether a reboot of this host's container is allowed at all. Set it per host in the inventory.",)),
    _opt(_PX, "vmid", default=None, notes=("Required when O(container_reset_allowed) is true.",)),
    _opt(_PX, "node", empty_unset=True, notes=("Unset or empty, it is looked up through the API.",)),
    _opt(_PX, "expected_hostname", fallback=("inventory_hostname",), doc_default="{{ inventory_hostname }}",
         notes=("Defaults to the inventory hostname. Must not be empty.",)),
    _opt(_PX, "method"),
    _opt(_PX, "timeout"),
    _opt(_PX, "force"),
    _opt(_PX, "wait_timeout"),
    _opt(_PX, "lock_timeout"),
    _opt(_PX, "node_slots"),
    _opt(_PX, "slot_dir", empty_unset=True),
    _opt(_PX, "slot_timeout"),
    RoleVar("container_reset_connect_timeout", type="int", default=300, description=(
        "Seconds to wait for Ansible to reach the host again after the reboot.",)),
    _opt(_PX, "api_host", empty_unset=True),
    _opt(_PX, "api_port"),
    _opt(_PX, "api_user", empty_unset=True),
    _opt(_PX, "api_password", empty_unset=True),
    _opt(_PX, "api_token_id", empty_unset=True),
    _opt(_PX, "api_token_secret", empty_unset=True),
    _opt(_PX, "validate_certs"),
    _opt(_PX, "ca_path", empty_unset=True),
    _opt(_PX, "api_timeout"),
    RoleVar("container_reset_controller_python", type="str", default="{{ ansible_playbook_python }}", description=(
        "The Python on the controller that runs the module; it needs proxmoxer.",)),
    # relaunch_*: the relaunch role's own
    RoleVar("relaunch_force", type="bool", default=False, description=(
        "Relaunch even a job that runs with its spec, or finished (M(gpuops.relaunch.train_launch)'s "
        "O(gpuops.relaunch.train_launch#module:force) for the decision). True on every host of the play, it needs "
        "C(relaunch_hosts) or C(--limit) naming the hosts.",)),
    RoleVar("relaunch_alerted_job", type="str", default="", description=(
        "The job an event named; the event-driven relaunch (C(extensions/eda/rulebooks/relaunch_on_alert.yml)) passes "
        "the alert's C(gpuops_job) label. When it is set and is not this host's C(job_launch_name), the relaunch "
        "does nothing and its summary says why (the alert came from a job the inventory no longer runs there).",
        "Empty (no event), the relaunch decides from the probe alone.")),
    RoleVar("relaunch_alerted_host", type="str", default="", description=(
        "The inventory host an event named; the event-driven relaunch passes the alert's C(gpuops_rank0) (a "
        "multi-rank job's rank 0, or a job's one host), and C(playbooks/relaunch.yml) then runs on that host's job: "
        "its C(job_launch_ranks), or the host alone. On a host that is neither it nor a rank of its job, the "
        "relaunch does nothing and its summary says why.",
        "Empty, no event.")),
    RoleVar("relaunch_summary_dir", type="str", default="", description=(
        "When set, each host's summary is also written as JSON on the controller, one file per host and job "
        "(DIR/HOST@JOB.json, JOB is O(job_launch_name); both percent-encoded, see M(gpuops.relaunch.relaunch_summary)).",
        "In check mode the files go to DIR/check/ instead, so that they never replace a real run's.")),
    RoleVar("relaunch_metrics_dir", type="str", default="", description=(
        "When set, every run also writes the host's summary as Prometheus metrics to DIR/gpuops_relaunch_JOB.prom on "
        "the target (JOB is O(job_launch_name)), for node_exporter's textfile collector (Debian's "
        "C(prometheus-node-exporter) reads C(/var/lib/prometheus/node-exporter)); the directory must exist. "
        "M(gpuops.relaunch.relaunch_summary) writes it with M(gpuops.relaunch.relaunch_metrics), in the same task.",
        "See R(the metrics guide,ansible_collections.gpuops.relaunch.docsite.guide_metrics).")),
    # relaunch_gpu_* and job_launch_min_gpus -> gpu_gate, the relaunch's hardware gate after the drain
    RoleVar("relaunch_gpu_reset_allowed", "gpu_gate", "reset_allowed", default=False,
            notes=("Set it per host in the inventory. Off, a GPU that needs a reset is quarantined and the job refused "
                   "(or launched without it, see O(job_launch_min_gpus)).",)),
    RoleVar("relaunch_gpu_node", "gpu_gate", "reset_node", empty_unset=True,
            notes=("Set it for a Proxmox container: the inventory hostname of the node whose GPUs it uses. Unset, the "
                   "target owns its GPUs (a bare host).",)),
    RoleVar("relaunch_gpu_reset_timeout", "gpu_gate", "reset_timeout",
            notes=("For a Proxmox container (O(relaunch_gpu_node)), the node's wait before its reset too.",)),
    RoleVar("job_launch_min_gpus", "gpu_gate", "min_gpus", roles=("relaunch",),
            notes=("Unset, the job needs every GPU it was given: a bad one refuses it.",)),
    RoleVar("relaunch_gpu_xid_since", "gpu_gate", "since", default=-3600,
            notes=("Unlike the module (everything the kernel still holds), the role counts the last hour's XIDs.",)),
    RoleVar("relaunch_gpu_kernel_log", "gpu_gate", "kernel_log", default=True,
            notes=("Off, the gate judges by NVML alone: for a site whose own agent watches the kernel log's XIDs, or a "
                   "test machine where other tests write XID lines into the machine's one kernel log.",)),
    RoleVar("relaunch_gpu_quarantine_clear", "gpu_gate", "clear_quarantine", default=False,
            notes=("The way past a quarantine once a person has fixed the GPU (as O(job_launch_reset_guard) is past "
                   "the crash-loop guard); set it for the one run, on the host named.",)),
    RoleVar("relaunch_fail_host", type="bool", default=True, description=(
        "Fail the host at the end of the role when a step failed or the crash-loop guard refused (the summary "
        "is then in the failed task's result, not a fact). C(playbooks/relaunch.yml) sets it false and fails "
        "such hosts after its fleet summary.",)),
)

# Names with a prefix that are no role variable but that the collection's roles, playbooks, actions
# and extensions set (register, set_fact, ansible_facts) or read: known, so never refused as a typo.
# The drift test (tests/unit/plugins/plugin_utils/test_role_vars.py) scans those files for them.
OTHER_NAMES: dict[str, str] = {
    # playbooks/relaunch.yml (its play keywords) and the AWX survey
    "relaunch_hosts": "playbook: which hosts (a host, group or pattern)",
    "relaunch_serial": "playbook: batch size",
    "relaunch_max_fail_percentage": "playbook: max_fail_percentage",
    # the job_launch role
    "job_launch_result": "registered by job_launch (main)",
    "job_launch_stop_result": "registered by job_launch (stop)",
    "job_launch_absent_result": "registered by job_launch (absent)",
    "job_launch_health_result": "registered by job_launch (health)",
    # the process_cleanup role
    "process_cleanup_result": "registered by process_cleanup",
    "process_cleanup_clearance": "registered by process_cleanup (relaunch_clearance's answer)",
    "process_cleanup_found_escalation": "fact of process_cleanup",
    "process_cleanup_found_reasons": "fact of process_cleanup",
    "process_cleanup_escalation": "fact of process_cleanup",
    "process_cleanup_needs_reboot": "fact of process_cleanup",
    "process_cleanup_needs_host_action": "fact of process_cleanup",
    "process_cleanup_reasons": "fact of process_cleanup",
    "process_cleanup_ended": "fact of process_cleanup",
    "process_cleanup_remaining": "fact of process_cleanup",
    "process_cleanup_other_jobs": "fact of process_cleanup",
    # the gpu_drain role
    "gpu_drain_result": "registered by gpu_drain",
    "gpu_drain_clearance": "registered by gpu_drain (relaunch_clearance's answer)",
    "gpu_drain_released": "fact of gpu_drain",
    "gpu_drain_escalation": "fact of gpu_drain",
    "gpu_drain_needs_reboot": "fact of gpu_drain",
    "gpu_drain_needs_host_action": "fact of gpu_drain",
    "gpu_drain_holders": "fact of gpu_drain",
    "gpu_drain_released_mib": "fact of gpu_drain",
    "gpu_drain_msg": "fact of gpu_drain",
    # the container_reset role
    "container_reset_result": "registered by container_reset",
    "container_reset_wait": "registered by container_reset",
    # the relaunch role and its actions
    "relaunch_failure": "fact of relaunch",
    "relaunch_probe": "registered by relaunch",
    "relaunch_decided": "registered by relaunch",
    "relaunch_decision": "fact of relaunch_decision",
    "relaunch_rank": "fact of relaunch_decision",
    "relaunch_rank_ready": "fact of relaunch",
    "relaunch_rank_started": "fact of relaunch",
    "relaunch_ranks_not_ready": "fact of relaunch",
    "relaunch_ranks_not_started": "fact of relaunch",
    "relaunch_ranks_decided": "registered by relaunch",
    "relaunch_cleanup_again": "registered by relaunch",
    "relaunch_drain_again": "registered by relaunch",
    "relaunch_launch": "registered by relaunch",
    "relaunch_node_reset": "include variable of relaunch (a GPU reset on the Proxmox node)",
    "relaunch_node_reset_result": "registered by relaunch",
    "relaunch_gate_again": "registered by relaunch",
    "relaunch_launch_env": "fact of relaunch",
    "relaunch_clearance": "fact of relaunch_clearance",
    "relaunch_summary": "fact of relaunch_summary",
    "relaunch_summarized": "registered by relaunch (relaunch_summary's result, which relaunch_fleet reads)",
    "relaunch_fleet": "fact of relaunch_fleet",
    # extensions/awx/setup_awx.yml
    "relaunch_awx_credential_type": "extensions/awx",
    "relaunch_awx_survey": "extensions/awx",
    "relaunch_awx_job_template": "extensions/awx",
    "relaunch_awx_schedule": "extensions/awx",
}

_BY_NAME: dict[str, RoleVar] = {var.name: var for var in VARIABLES}
_BY_OPTION: dict[tuple[str, str], RoleVar] = {(var.module, var.option): var for var in VARIABLES if var.module and var.option}


_KNOWN: frozenset[str] = frozenset(_BY_NAME) | frozenset(OTHER_NAMES)
_KNOWN_SORTED: list[str] = sorted(_KNOWN)


def known_names() -> frozenset[str]:
    """Every prefixed name the collection knows: its role variables and the names it sets or reads."""
    return _KNOWN


def variables(module: str | None = None, role: str | None = None) -> tuple[RoleVar, ...]:
    """The declared variables, in declaration order: of one module, and/or listed by one role."""
    return tuple(var for var in VARIABLES
                 if (module is None or var.module == module)
                 and (role is None or any(r == role or r.startswith(role + ":") for r in var.in_roles)))


def role_var(module: str, option: str) -> str | None:
    """The role variable that is `module`'s `option` ("train_launch", "command" -> "job_launch_command"), or None."""
    var = _BY_OPTION.get((module, option))
    return var.name if var else None


def _value(name: str, lookup: Callable[[str], Any], empty_unset: bool = False) -> Any:
    """The variable's value; UNSET when the play does not set it (or it is empty where that counts as unset)."""
    try:
        value = lookup(name)
    except KeyError:
        return UNSET
    if empty_unset and value == "":
        return UNSET
    return value


def _resolve(var: RoleVar, lookup: Callable[[str], Any]) -> Any:
    """The variable's effective value (None: leave the option out)."""
    for name in (var.name, *var.fallback):
        value = _value(name, lookup, var.empty_unset)
        if value is not UNSET:
            return value
    if isinstance(var.default, Template):
        parts = {name: _value(name, lookup) for name in var.default.names}
        if any(part is UNSET or part is None for part in parts.values()):
            return None
        return var.default.text.format(**parts)
    return None if var.default is UNSET else var.default


def module_args(module: str, lookup: Callable[[str], Any]) -> dict[str, Any]:
    """The options of `module` ("train_launch", "zombie_reap", "gpu_mem_wait", "proxmox_ct_reboot") from the role
    variables.

    lookup(name) returns a variable's (templated) value or raises KeyError when it is not set. An unset
    variable takes its fallback's value, else its role default, else the option is left out (the module's own
    default); a null is left out; an empty string is left out where the declaration says it means unset.
    """
    if module not in MODULE_PREFIX:
        raise ValueError(f"no role variables for module {module!r}; one of {', '.join(MODULE_PREFIX)}")
    args: dict[str, Any] = {}
    for var in variables(module=module):
        value = _resolve(var, lookup)
        if value is not None:
            args[str(var.option)] = value
    return args


def name_the_variables(module: str, message: str, problems: list[dict[str, Any]],
                       explicit: Iterable[str] = ()) -> str:
    """A module failure message rewritten to name the role variable the user set (job_launch_command: ...) for
    each of the module's option_problems ([{option, reason}]), keeping the module's reason.

    An option the task gave itself (`explicit`), or one no role variable maps to, keeps its name. A problem the
    message does not quote as "option: reason" is added to it.
    """
    given = set(explicit)
    for problem in problems:
        option, reason = str(problem.get("option", "")), str(problem.get("reason", ""))
        name = None if option in given else role_var(module, option)
        if not name:
            continue
        quoted = f"{option}: {reason}"
        if quoted in message:
            message = re.sub(r"(?<![\w.])" + re.escape(quoted), lambda match, new=f"{name}: {reason}": new, message)
        else:
            message = f"{message}; {name}: {reason}" if message else f"{name}: {reason}"
    return message


def unknown_variables(names: Iterable[str]) -> list[str]:
    """For each name with one of PREFIXES that the collection does not know, one message, with the closest known
    name where one is close:
    "job_launch_ready_regx is not a variable of gpuops.relaunch (did you mean job_launch_ready_regex?)".
    """
    messages = []
    for name in sorted({name for name in names if isinstance(name, str)}):
        if not name.startswith(PREFIXES) or name in _KNOWN:
            continue
        close = difflib.get_close_matches(name, _KNOWN_SORTED, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        messages.append(f"{name} is not a variable of gpuops.relaunch{hint}")
    return messages
