# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action for gpuops.relaunch.relaunch_decision: look at the job (train_launch's probe, the one module run
of a healthy host) and decide whether to relaunch it; relaunch a job of one host in the same task
(plugin_utils/relaunch_steps); summarize a host that needs nothing more (see plugin_utils/relaunch_flow for
the decisions, plugin_utils/role_vars for the modules' options)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ansible.module_utils.parsing.convert_bool import boolean

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.checked_action import CheckedAction
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.host_report import publish
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import (
    RelaunchInputError, awx_job, check_fleet_wide, check_rank_names, check_ranks, check_ranks_in_inventory, check_ranks_in_slice, check_strategy,
    decide, rank_of,
)
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_steps import STEP_NAMES, StepRunner, check_gpu_node, relaunch_steps
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_options import options_from_variables
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_spec import role_variable_errors
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.role_vars import name_the_variables, unknown_variables

# gpu_gate takes a query_timeout of at most 600 seconds (gpu_mem_wait's may be longer).
MAX_GATE_QUERY_TIMEOUT = 600.0

ARGUMENT_SPEC = {
    "force": {"type": "bool", "default": False},
    "ranks": {"type": "raw"},
    # Empty when job_launch_name is unset: the role variables' check in run() names the variable.
    "job_name": {"type": "str", "default": ""},
    "alerted_job": {"type": "str"},
    "alerted_host": {"type": "str"},
    # The ranks' own looks (each rank's registered result of this action), for the decision of the whole job.
    "rank_looks": {"type": "list", "elements": "raw"},
    "summary_dir": {"type": "str", "default": ""},
    "metrics_dir": {"type": "str", "default": ""},
    "fail_host": {"type": "bool", "default": True},
}


class ActionModule(CheckedAction):
    """Without rank_looks: one module run on the target (the probe), the decision and, when nothing
    more is to be done, the summary. With rank_looks: the controller only, the whole job's decision."""

    ARGUMENT_SPEC = ARGUMENT_SPEC

    def act(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        host = task_vars["inventory_hostname"]
        if args["rank_looks"] is not None:
            return dict(result, **self._decide_with_ranks(host, args, task_vars))
        # The role's variables are checked here, not by a task of Ansible's per host (plugin_utils/role_spec).
        problems = unknown_variables(task_vars) + role_variable_errors(task_vars, self._templar.template)
        if problems:
            return self._fail(result, host, None, f"{host}: nothing was done: " + "; ".join(problems), args, task_vars)
        try:
            check_gpu_node(host, self._templar.template(task_vars.get("relaunch_gpu_node")),
                           [str(name) for name in (task_vars.get("groups") or {}).get("all") or []])
            rank = self._rank(host, args, task_vars)
        except RelaunchInputError as exc:
            return self._fail(result, host, None, str(exc), args, task_vars)
        options = self._probe_options(args, rank, task_vars)
        probe = self._execute_module(module_name="gpuops.relaunch.train_launch", module_args=options,
                                     task_vars=task_vars)
        # The module's echo of its arguments is the task's own (the job's command and environment): noise
        # in every result shown at -v, and not what the probe found.
        probe.pop("invocation", None)
        if probe.get("failed") or probe.get("unreachable"):
            msg = name_the_variables("train_launch", str(probe.get("msg") or "the probe failed"),
                                     probe.get("option_problems") or [])
            return self._fail(result, host, probe, msg, args, task_vars)
        decision = decide(probe, rank, alerted_job=args["alerted_job"], job_name=args["job_name"],
                          alerted_host=args["alerted_host"], host=host)
        rank_facts = rank.as_dict() if rank is not None else None
        # A rank decides with its job's other ranks in the next step; a job of one host is decided now.
        done = rank is None and not decision["relaunch"]
        relaunched = None
        if rank is None and decision["relaunch"]:
            relaunched = self._relaunch(decision, host, task_vars, launch=True)
            # Only a container reboot helps: the role reboots, looks again and launches (roles/relaunch/tasks/steps.yml).
            # So does a GPU its Proxmox node must reset: the role resets it there, the gate looks again, it launches
            # (roles/relaunch/tasks/gpu_node_reset.yml).
            # The GPU gate's refusal ends it here (refused in the summary, as the crash-loop guard's refusal).
            done = not (relaunched["reset"] or relaunched["node_reset"]) or bool(relaunched["refused"])
        if probe.get("diff"):
            # --diff: what a restart would change in the job's spec (command, env, log path, backend ...).
            result["diff"] = probe["diff"]
        # A rank's launch is given the environment its probe compared (the job's, with the rank's variables),
        # and its live file names rank 0, which every rank's alert then carries.
        launch_options = {"env": options["env"], "metrics_rank0": rank.ranks[0]} if rank is not None else {}
        result.update(changed=False, probe=probe, decision=decision, rank=rank_facts, done=done, msg=decision["why"],
                      launch_options=launch_options,
                      ansible_facts={"relaunch_decision": decision, "relaunch_rank": rank_facts})
        if relaunched is not None:
            result["steps"] = relaunched["steps"]
            result["ansible_facts"]["relaunch_clearance"] = relaunched["steps"]["clearance"]
            result["gpu_node_reset"] = relaunched["node_reset"]
            if relaunched["launch_env"] is not None:
                # The GPU gate left GPUs out: the launch after a container reboot (steps.yml) gets its CUDA_VISIBLE_DEVICES.
                result["launch_options"] = dict(launch_options, env=relaunched["launch_env"])
        if done:
            failure = relaunched["failure"] if relaunched else None
            unreachable = bool(relaunched and relaunched["unreachable"])
            published = self._publish(host, probe, decision, args, task_vars, failure=failure, reach_target=not unreachable,
                                      steps=result.get("steps"))
            facts = dict(result["ansible_facts"], **published.pop("ansible_facts", {}))
            result.update(published, ansible_facts=facts)
            if unreachable:
                result.update(unreachable=True, msg=failure)
        if relaunched is not None:
            # The summary changes nothing; the stop, the clean-up and the launch do.
            result["changed"] = _changed(relaunched["steps"])
        # Nothing is left for this host in the play: summarized, and neither failed nor refused.
        result["nothing_left"] = done and not result.get("host_fails")
        return result

    def _rank(self, host: str, args: Mapping[str, Any], task_vars: Mapping[str, Any]) -> Any:
        """This host's rank (None: a job of one host), after the checks that need the play."""
        hostvars = task_vars.get("hostvars", {})
        play_hosts = [str(name) for name in task_vars.get("ansible_play_hosts_all") or []]
        named = "relaunch_hosts" in task_vars or task_vars.get("ansible_limit") is not None

        def there(variable: str) -> Callable[[str], bool]:
            return lambda name: _true(_var(hostvars, name, variable))
        # The force is the task's argument; the guard reset, the role variable the probe is given.
        check_fleet_wide("relaunch_force", args["force"], there("relaunch_force"), play_hosts, named)
        check_fleet_wide("job_launch_reset_guard", _true(self._templar.template(task_vars.get("job_launch_reset_guard"))),
                         there("job_launch_reset_guard"), play_hosts, named)
        # No ranks: None, or "" - ansible-core before 2.19 renders a template whose whole value is None as "".
        ranks = args["ranks"]
        if ranks in (None, ""):
            return None
        check_rank_names(host, ranks)  # before any name is looked up: [[node1], node2] is no list of names
        check_ranks_in_inventory(host, ranks, _var(hostvars, host, "job_launch_ranks"))
        # A rank that is not in the inventory at all (a sliced AWX job's other slice) has no hostvars to read.
        check_ranks_in_slice(host, ranks, hostvars, awx_job(task_vars))
        check_ranks(host, ranks, {name: _var(hostvars, name, "job_launch_ranks") for name in ranks},
                    play_hosts, list(task_vars.get("ansible_play_batch") or []))
        check_strategy(host, self._strategy())
        return rank_of(host, ranks, _vars(hostvars, str(ranks[0])))

    def _strategy(self) -> str | None:
        play = getattr(self._task, "_parent", None)
        while play is not None and not hasattr(play, "strategy"):
            play = getattr(play, "_play", None) or getattr(play, "_parent", None)
        return getattr(play, "strategy", None)

    def _relaunch(self, decision: Mapping[str, Any], host: str, task_vars: dict[str, Any], launch: bool,
                  launch_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """This host's steps after a decision to relaunch (plugin_utils/relaunch_steps), on this task's connection."""
        job = options_from_variables("train_launch", self._templar.template, task_vars)
        # A container's GPU reset on its node (gpu_reset there) waits as long as the gate's own reset would.
        node_wait = options_from_variables("gpu_gate", self._templar.template, task_vars).get("reset_timeout")
        return relaunch_steps(self._step_runner(task_vars), decision,
                              _true(self._templar.template(task_vars.get("container_reset_allowed"))),
                              bool(self._task.check_mode), host, launch=launch,
                              gate=self._gate_options(job, task_vars),
                              launch_env=launch_env if launch_env is not None else job.get("env") or {},
                              node_reset_timeout=node_wait)

    def _gate_options(self, job: Mapping[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        """gpu_gate's options that are the job's and the drain's (its own come from its role variables): the
        quarantine record beside the jobs' state directories, and the drain's GPUs and way of reading them."""
        drain = options_from_variables("gpu_mem_wait", self._templar.template, task_vars)
        options = {key: drain[key] for key in ("devices", "backend", "gpus_required") if key in drain}
        options["job_name"] = str(job.get("name") or "")
        if "query_timeout" in drain:
            options["query_timeout"] = min(float(drain["query_timeout"]), MAX_GATE_QUERY_TIMEOUT)
        if job.get("state_dir"):
            options["state_dir"] = job["state_dir"]
        return options

    def _step_runner(self, task_vars: dict[str, Any]) -> StepRunner:
        """Runs a step's module with its options from the role variables; the drain's module run gets
        gpu_drain_environment (as the role's drain task does)."""
        drain_environment = self._templar.template(task_vars.get("gpu_drain_environment") or {})

        def run(module: str, options: Mapping[str, Any], drain: bool) -> dict[str, Any]:
            answer = self.run_role_module(module, options, task_vars, drain_environment if drain else None)
            # The module's echo of its arguments is the task's own (the job's command and environment): noise in
            # every result shown at -v.
            answer.pop("invocation", None)
            return answer
        return run

    def _probe_options(self, args: Mapping[str, Any], rank: Any, task_vars: dict[str, Any]) -> dict[str, Any]:
        """train_launch's options for state=probe from the role variables (the spec the launch would start)."""
        options = options_from_variables("train_launch", self._templar.template, task_vars)
        if rank is not None:
            # A rank of a multi-rank job gets MASTER_ADDR, MASTER_PORT, NODE_RANK and NNODES: part of the spec.
            options["env"] = dict(options.get("env") or {}, **rank.env())
        visible = self._launched_on(options, task_vars)
        if visible:
            # The GPU gate launched it without a bad GPU: that CUDA_VISIBLE_DEVICES is part of the spec it runs with.
            options["env"] = dict(options.get("env") or {}, CUDA_VISIBLE_DEVICES=visible)
        options.update(state="probe", force=args["force"])
        return options

    def _launched_on(self, job: Mapping[str, Any], task_vars: dict[str, Any]) -> str:
        """The CUDA_VISIBLE_DEVICES the GPU gate last gave this job ("" where it left no GPU out). Only a job that
        declared it can run on fewer GPUs (job_launch_min_gpus) can have one: only it pays this module run."""
        gate = options_from_variables("gpu_gate", self._templar.template, task_vars)
        if not gate.get("min_gpus"):
            return ""
        answer = self._execute_module(module_name="gpuops.relaunch.gpu_gate", task_vars=task_vars, module_args=dict(
            self._gate_options(job, task_vars), record_only=True, job_name=str(job.get("name") or "")))
        return str(answer.get("cuda_visible_devices") or "") if not answer.get("failed") else ""

    def _fail(self, result: dict[str, Any], host: str, probe: dict[str, Any] | None, msg: str,
              args: Mapping[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        """The host failed before anything changed: summarized as failed (so that its summary file and
        metrics say so), failing now or, without fail_host, after the fleet summary."""
        unreachable = bool((probe or {}).get("unreachable"))
        published = self._publish(host, probe, None, args, task_vars, failure=f"{self._task.get_name()}: {msg}",
                                  reach_target=not unreachable)
        facts = dict(published.pop("ansible_facts", {}), relaunch_decision=None, relaunch_rank=None)
        result.update(published, changed=False, probe=probe, done=True, nothing_left=False, ansible_facts=facts)
        if unreachable:
            result.update(unreachable=True, msg=msg)
        elif args["fail_host"]:
            result.update(failed=True, msg=msg)
        return result

    def _publish(self, host: str, probe: dict[str, Any] | None, decision: dict[str, Any] | None,
                 args: Mapping[str, Any], task_vars: dict[str, Any], failure: str | None = None,
                 reach_target: bool = True, steps: Mapping[str, Any] | None = None) -> dict[str, Any]:
        results = {"probe": probe, "decision": decision, **(steps or {})}
        return publish(host, bool(self._task.check_mode), results, failure, None,
                       args["job_name"], args["summary_dir"], args["metrics_dir"] if reach_target else "",
                       args["fail_host"], self.module_runner(task_vars))

    def _decide_with_ranks(self, host: str, args: Mapping[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        """The whole job's decision from every rank's own look (rank_looks: each rank's registered result
        of this action, in rank order; a rank whose look failed or is missing does not count), and where
        the job is to be relaunched this rank's stop, clean-up, drain and clearance (it launches after the
        barrier, in the role); a step that fails fails the task, naming the step (``failure``)."""
        looks = [look if isinstance(look, Mapping) else {} for look in args["rank_looks"]]
        own = next((look for look in looks if _rank_host(look) == host), None)
        if own is None:
            return {"failed": True, "msg": f"{host}: rank_looks holds no look of this host's rank"}
        ranks = [str(name) for name in own["rank"]["ranks"]]
        try:
            rank = rank_of(host, ranks, {"job_launch_master_addr": own["rank"].get("master_addr"),
                                         "job_launch_master_port": own["rank"].get("master_port")})
        except RelaunchInputError as exc:
            return {"failed": True, "msg": str(exc)}
        probes = {name: look.get("probe") for name, look in zip(ranks, looks) if not look.get("failed")}
        decision = decide(own.get("probe") or {}, rank, probes, alerted_job=args["alerted_job"],
                          job_name=args["job_name"], alerted_host=args["alerted_host"], host=host)
        answer = {"changed": False, "decision": decision, "rank": rank.as_dict(), "msg": decision["why"],
                  "ansible_facts": {"relaunch_decision": decision}}
        if decision["relaunch"]:
            relaunched = self._relaunch(decision, host, task_vars, launch=False, launch_env=dict(
                options_from_variables("train_launch", self._templar.template, task_vars).get("env") or {}, **rank.env()))
            steps = relaunched["steps"]
            answer.update(steps=steps, changed=_changed(steps))
            answer["ansible_facts"]["relaunch_clearance"] = steps["clearance"]
            answer["gpu_node_reset"] = relaunched["node_reset"]
            if relaunched["launch_env"] is not None:
                answer["launch_options"] = {"env": relaunched["launch_env"], "metrics_rank0": rank.ranks[0]}
            if relaunched["refused"]:
                # A rank the GPU gate refused: no rank of the job launches (the barrier), this one fails with the evidence.
                relaunched["failure"] = f"{STEP_NAMES['gate']}: {relaunched['refused']}"
            if relaunched["failure"]:
                answer.update(failed=True, msg=relaunched["failure"], failure=relaunched["failure"])
                if relaunched["unreachable"]:
                    answer["unreachable"] = True
        return answer


def _changed(steps: Mapping[str, Any]) -> bool:
    """Whether a step changed the host (the stop, the clean-up, the launch; the clearance is a judgement)."""
    return any(bool(step.get("changed")) for step in steps.values() if step)


def _rank_host(look: Mapping[str, Any]) -> str | None:
    """The host whose look this is, by the rank it names (None: not a rank's look)."""
    rank = look.get("rank")
    if not isinstance(rank, Mapping):
        return None
    ranks, index = rank.get("ranks"), rank.get("index")
    if not isinstance(ranks, list) or not isinstance(index, int) or not 0 <= index < len(ranks):
        return None
    return str(ranks[index])


def _true(value: Any) -> bool:
    try:
        return bool(boolean(value or False, strict=False))
    except TypeError:
        return False


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
