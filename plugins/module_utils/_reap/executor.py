# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Runs a reap plan against real processes and says honestly what is left.

Every signal goes through the collection's one gate (:class:`signal_gate.SignalGate`), which
refuses protected processes and delivers only to the exact (pid, starttime) identity the plan
printed, pinned by a pidfd where the kernel has them.

Every wait polls the real condition (gone, a zombie, out of D) against a deadline; nothing sleeps
a fixed time. What stays after the ladder becomes an escalation, in the collection's one
vocabulary (:mod:`.verdict`): ``container_reboot`` when only a restart of the container clears it
(zombies orphaned to an init that does not reap), ``host_action`` when not even that may help
(threads that stay in uninterruptible sleep, a process that survives SIGKILL).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Pattern

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import check_timeout
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import poll_until
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    Process,
    ProcessTable,
    Thread,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.plan import (
    END_PARENT,
    END_PARENT_KILL,
    KILL,
    KILL_LEADER,
    NOTIFY_PARENT,
    TERMINATE,
    ReapOptions,
    ReapPlan,
    Step,
    parse_term_signal,
    plan_reap,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import (
    NAMESPACE_INIT_PID,
    JobSelector,
    Protection,
    job_selection_from_params,
    own_pid_in,
    refuse_broad_selection,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.assessment import (
    MAX_ORPHAN_GRACE,
    Assessment,
    AssessmentOptions,
    assess_table,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._reap.other_jobs import (
    OtherJobs,
    newer_run_why,
    other_job_why,
    own_job_dir,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import check_expect_run_id
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, FindingKind, Judged, Verdict, worst
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import (
    DENIED,
    REFUSED,
    SENT,
    Identity,
    ProcessControl,
    SignalGate,
    format_pids,
)

POLL_INTERVAL = 0.05
MAX_ROUNDS = 3


@dataclass
class Action:
    """A signal the executor tried to send, and what came of it."""

    step: Step
    result: str
    elapsed: float
    round: int = 1

    def as_dict(self) -> dict[str, Any]:
        entry = self.step.as_dict()
        del entry["reason"], entry["when"]
        entry.update(result=self.result, elapsed=round(self.elapsed, 3), round=self.round)
        return entry


@dataclass
class Outcome(Judged):
    """What the ladder did and what it could not clear."""

    actions: list[Action] = field(default_factory=list)
    ended: list[dict[str, Any]] = field(default_factory=list)
    remaining: list[dict[str, Any]] = field(default_factory=list)
    judgement: Verdict = field(default_factory=Verdict)

    @property
    def signals_sent(self) -> int:
        return sum(1 for action in self.actions if action.result == SENT)

    @property
    def changed(self) -> bool:
        return self.signals_sent > 0 and bool(self.ended)

    def merge(self, later: "Outcome") -> None:
        self.actions.extend(later.actions)
        self.ended.extend(later.ended)
        self.remaining.extend(later.remaining)
        self.judgement.extend(later.judgement)


class Executor:
    """Walks the ladder of one plan. Signals only plan targets, and never a protected process."""

    def __init__(
        self,
        plan: ReapPlan,
        control: ProcessControl,
        protection: Protection,
        options: ReapOptions,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        round_number: int = 1,
    ) -> None:
        self.plan = plan
        self.control = control
        self.protection = protection
        self.gate = SignalGate(protection, control)
        self.options = options
        self.clock = clock
        self.sleep = sleep
        self.round = round_number
        self.started = clock()
        self.outcome = Outcome()
        self.results: dict[tuple[str, tuple[int, int]], str] = {}

    # --- what a process is now ---------------------------------------------------------------

    def _now(self, identity: Identity) -> Process | None:
        return self.control.current(identity)

    def _state(self, identity: Identity) -> str:
        """``gone``, ``zombie`` (exited, waiting for its parent) or ``running`` (a thread lives)."""
        process = self._now(identity)
        if process is None:
            return "gone"
        if process.is_zombie and process.threads <= 1:
            return "zombie"
        return "running"

    def _running(self, identity: Identity) -> bool:
        return self._state(identity) == "running"

    def _stuck(self, identity: Identity) -> list[Thread]:
        """Threads of a running `identity` in uninterruptible sleep."""
        if not self._running(identity):
            return []
        return [t for t in self.control.threads(identity.pid) if t.state == "D"]

    def _wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        return poll_until(condition, timeout, POLL_INTERVAL, self.clock, self.sleep)

    # --- signalling --------------------------------------------------------------------------

    def _signal(self, step: Step) -> str:
        if step.target.key not in self.plan.targets:
            result = REFUSED
        else:
            result = self.gate.send(step.target, step.signal)
        self.results[(step.stage, step.target.key)] = result
        self.outcome.actions.append(Action(step, result, self.clock() - self.started, self.round))
        return result

    # --- the ladder --------------------------------------------------------------------------

    def run(self) -> Outcome:
        terminate = self.plan.stage(TERMINATE)
        leaders = self.plan.stage(KILL_LEADER)
        for step in terminate + leaders:
            if self._running(step.target):
                self._signal(step)
        if terminate:
            self._wait(lambda: not any(self._running(s.target) for s in terminate), self.options.term_timeout)

        kills = [s for s in self.plan.stage(KILL) if self._running(s.target)]
        for step in kills:
            self._signal(step)
        killed = [s.target for s in kills + leaders]
        self._wait(lambda: all(not self._running(t) or self._stuck(t) for t in killed), self.options.kill_timeout)

        job = self.plan.job
        if any(self._stuck(t) for t in job):
            self._wait(lambda: not any(self._stuck(t) for t in job), self.options.d_state_timeout)

        self._reap_zombies()
        self._finish()
        return self.outcome

    def _zombies(self) -> list[Identity]:
        return [i for i in self.plan.job if self._state(i) == "zombie"]

    def _parent_step(self, zombie: Identity, stage: str) -> Step | None:
        """The planned `stage` step for the current parent of `zombie`, if it is that very process."""
        process = self._now(zombie)
        if process is None:
            return None
        parent = self.control.look(process.ppid)
        if parent is None:
            return None
        for step in self.plan.stage(stage):
            if step.target.matches(parent):
                return step
        return None

    def _reap_zombies(self) -> None:
        zombies = self._zombies()
        if not zombies:
            return
        notified: set[tuple[int, int]] = set()
        for zombie in zombies:
            step = self._parent_step(zombie, NOTIFY_PARENT)
            if step is not None and step.target.key not in notified:
                notified.add(step.target.key)
                self._signal(step)
        if self._wait(lambda: not self._zombies(), self.options.reap_timeout):
            return
        if not self.options.reap_parents:
            return
        ending: dict[tuple[int, int], Step] = {}
        for zombie in self._zombies():
            step = self._parent_step(zombie, END_PARENT)
            if step is not None:
                ending[step.target.key] = step
        if not ending:
            return
        for step in ending.values():
            self._signal(step)
        parents = [s.target for s in ending.values()]
        self._wait(lambda: not any(self._running(p) for p in parents), self.options.term_timeout)
        kills = [s for s in self.plan.stage(END_PARENT_KILL) if s.target.key in ending and self._running(s.target)]
        for step in kills:
            self._signal(step)
        self._wait(lambda: all(not self._running(p) or self._stuck(p) for p in parents), self.options.kill_timeout)
        self._wait(lambda: not self._zombies(), self.options.reap_timeout)

    # --- the verdict on what is left ---------------------------------------------------------

    def _finish(self) -> None:
        outcome = self.outcome
        signalled = {key for (_stage, key), result in self.results.items() if result == SENT}
        tracked = {i.key: i for i in self.plan.job}
        for step in self.plan.steps:
            if step.target.key in signalled:
                tracked.setdefault(step.target.key, step.target)
        orphans: list[Identity] = []
        for key in sorted(tracked):
            identity = tracked[key]
            was = "zombie" if key in self.plan.exited else "running"
            now = self._state(identity)
            if now != was:
                outcome.ended.append({"pid": identity.pid, "starttime": identity.starttime, "comm": identity.comm, "was": was, "now": now})
            if now == "running":
                self._explain_running(identity)
            elif now == "zombie" and key in {i.key for i in self.plan.job}:
                if self._explain_zombie(identity):
                    orphans.append(identity)
        if orphans:
            init = self.control.look(NAMESPACE_INIT_PID)
            outcome.judgement.add(
                FindingKind.UNREAPED_ORPHAN, Escalation.CONTAINER_REBOOT,
                f"zombies {format_pids(o.pid for o in orphans)} are orphaned to PID 1 ({init.comm if init else '?'}) or to a "
                f"parent outside this namespace, and were not reaped within {self.options.reap_timeout:g}s: "
                f"only a restart of the container clears them",
                [o.pid for o in orphans],
            )

    def _remaining(self, identity: Identity, state: str, kind: FindingKind, escalation: Escalation, reason: str,
                   why: str | None = None) -> None:
        """A process that stayed: in `remaining`, and (except unreaped orphans, named together) a
        finding, whose text is `why` or else `reason`."""
        self.outcome.remaining.append({
            "pid": identity.pid, "starttime": identity.starttime, "comm": identity.comm, "state": state,
            "kind": kind.value, "escalation": escalation.value, "reason": reason,
        })
        if kind != FindingKind.UNREAPED_ORPHAN:
            self.outcome.judgement.add(kind, escalation, why or reason, [identity.pid])

    def _explain_running(self, identity: Identity) -> None:
        key = identity.key
        results = {stage: result for (stage, k), result in self.results.items() if k == key}
        stuck = self._stuck(identity)
        if stuck:
            for thread in stuck:
                reason = (
                    f"pid {identity.pid} thread {thread.tid} ({thread.comm}) is still in uninterruptible sleep "
                    f"(wchan {thread.wchan or '?'}) {self.options.d_state_timeout:g}s after SIGKILL: no signal "
                    f"reaches it until it wakes; the host must act"
                )
                self._remaining(identity, "D", FindingKind.UNINTERRUPTIBLE, Escalation.HOST_ACTION, reason)
            return
        if DENIED in results.values():
            reason = f"pid {identity.pid} ({identity.comm}) could not be signalled: permission denied"
            self._remaining(identity, "running", FindingKind.PERMISSION_DENIED, Escalation.HOST_ACTION, reason)
            return
        if results.get(KILL) == SENT or results.get(KILL_LEADER) == SENT or results.get(END_PARENT_KILL) == SENT:
            reason = (
                f"pid {identity.pid} ({identity.comm}) still runs {self.options.kill_timeout:g}s after SIGKILL; "
                f"the host must act"
            )
            self._remaining(identity, "running", FindingKind.SURVIVED_KILL, Escalation.HOST_ACTION, reason)
            return
        if identity.key in {i.key for i in self.plan.job}:
            reason = f"pid {identity.pid} ({identity.comm}) is still running: it was not signalled ({', '.join(sorted(set(results.values()))) or 'no step'})"
            self._remaining(identity, "running", FindingKind.NOT_SIGNALLED, Escalation.NONE, reason)

    def _explain_zombie(self, identity: Identity) -> bool:
        """Report a job zombie that stayed; True when only a container restart clears it."""
        process = self._now(identity)
        ppid = process.ppid if process is not None else 0
        if ppid in (0, NAMESPACE_INIT_PID):
            reaper = "PID 1" if ppid else "a parent outside this namespace"
            self._remaining(identity, "Z", FindingKind.UNREAPED_ORPHAN, Escalation.CONTAINER_REBOOT,
                            f"orphaned to {reaper}, not reaped within {self.options.reap_timeout:g}s")
            return True
        parent = self.control.look(ppid)
        parent_name = f"{ppid} ({parent.comm})" if parent is not None else str(ppid)
        why = self.protection.reason(ppid)
        if why is None and parent is not None and Identity.of(parent).key in {i.key for i in self.plan.job}:
            why = "a job process that did not end: see its own entry"
        if why is None and self._parent_step(identity, NOTIFY_PARENT) is None:
            why = "not a parent the plan may signal"
        if why is not None:
            reason = f"zombie of its parent {parent_name}, which is left alone ({why}); it holds only its pid"
        elif self.options.reap_parents:
            reason = f"zombie of its parent {parent_name}, which did not reap it even after being ended"
        else:
            reason = (
                f"zombie of its parent {parent_name}, which did not reap it within {self.options.reap_timeout:g}s of "
                f"SIGCHLD; it holds only its pid (reap_parents: true would end that parent)"
            )
        self._remaining(identity, "Z", FindingKind.ZOMBIE, Escalation.NONE, reason, f"pid {identity.pid}: {reason}")
        return False


@dataclass
class ReapResult:
    """The plan(s) and, unless in check mode, what executing them did; what was found before the
    ladder (judged on the plan's own scan) and what is left after it (one fresh scan, or the same
    as found when nothing was executed)."""

    plans: list[ReapPlan]
    outcome: Outcome | None
    elapsed: float
    found: Assessment
    left: Assessment
    other_jobs: list[dict[str, Any]] = field(default_factory=list)
    # The run-id fence (expect_run_id given): the job's newer live run that was left alone, if a look found one.
    fenced: bool = False
    newer_run: dict[str, Any] | None = None

    @property
    def first(self) -> ReapPlan:
        return self.plans[0]

    @property
    def escalation(self) -> Escalation:
        """What it takes to clear what is left: the worst of what the ladder could not clear and of
        the look after it (the look sees what is not the job's too, such as orphans under PID 1)."""
        return worst((self._ladder.escalation, self._left_beyond_ladder.escalation))

    @property
    def judgement(self) -> Verdict:
        """The findings behind `escalation`: what the ladder could not clear, the other jobs left
        alone, and the look's own findings where the look asks for more than the ladder does (in
        check mode, or with nothing to execute, that is what was found)."""
        judgement = Verdict(list(self._ladder.findings))
        newer = [entry for entry in self.other_jobs if entry.get("newer_run")]
        for job_dir, pids in _by_job([entry for entry in self.other_jobs if not entry.get("newer_run")]).items():
            judgement.add(FindingKind.OTHER_JOB, Escalation.NONE, other_job_why(job_dir, pids), pids)
        if newer:
            pids = sorted(entry["pid"] for entry in newer)
            judgement.add(FindingKind.OTHER_JOB, Escalation.NONE, newer_run_why(newer[0]["run_id"], pids), pids)
        beyond = self._left_beyond_ladder
        if beyond.escalation.rank > self._ladder.escalation.rank:
            judgement.extend(beyond)
        return judgement

    @property
    def _ladder(self) -> Verdict:
        return self.outcome.judgement if self.outcome is not None else Verdict()

    @property
    def _left_beyond_ladder(self) -> Verdict:
        """The look's findings except those about processes the ladder itself judged (its `remaining`):
        it tried them, so its word stands (a zombie whose parent was sent SIGCHLD and may not be ended
        holds only its pid, where the look, which does not know that, would ask for signals)."""
        judged = {entry["pid"] for entry in self.outcome.remaining} if self.outcome is not None else set()
        return Verdict([f for f in self.left.judgement.findings if not f.pids or not set(f.pids) <= judged])

    def as_dict(self) -> dict[str, Any]:
        plan_steps = []
        for number, plan in enumerate(self.plans, start=1):
            plan_steps.extend(dict(step, round=number) for step in plan.as_list())
        outcome = self.outcome or Outcome()
        return {
            "changed": outcome.changed,
            "job": [{"pid": i.pid, "starttime": i.starttime, "comm": i.comm} for i in self.first.job],
            "plan": plan_steps,
            "notes": [note for plan in self.plans for note in plan.notes],
            "protected": _unique(entry for plan in self.plans for entry in plan.protected),
            "other_jobs": self.other_jobs,
            "missing_pids": self.first.missing_pids,
            "actions": [a.as_dict() for a in outcome.actions],
            "signals_sent": outcome.signals_sent,
            "ended": outcome.ended,
            "remaining": outcome.remaining,
            **self.judgement.as_dict(),
            "found": _look(self.found),
            "left": _look(self.left),
            "elapsed": round(self.elapsed, 3),
            **({"superseded": self.newer_run is not None, "newer_run": self.newer_run} if self.fenced else {}),
        }


def _look(assessment: Assessment) -> dict[str, Any]:
    """An assessment as `found` and `left` carry it: its escalation, reasons and findings."""
    return assessment.judgement.as_dict()


def _by_job(entries: list[dict[str, Any]]) -> dict[str, list[int]]:
    by_job: dict[str, list[int]] = {}
    for entry in entries:
        by_job.setdefault(entry["job_dir"], []).append(entry["pid"])
    return dict(sorted(by_job.items()))


def _unique(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    for entry in entries:
        if entry not in seen:
            seen.append(entry)
    return seen


def check_own_namespace(proc_root: str) -> None:
    """Signals go to pids of this process's namespace: refuse a /proc of another one (BadOption)."""
    try:
        seen_as = os.readlink(os.path.join(proc_root, "self"))
    except OSError:
        seen_as = ""
    if seen_as != str(os.getpid()):
        raise BadOption(
            "proc_root",
            f"{proc_root} is not the process table of the PID namespace this module runs in, so its "
            f"pids cannot be signalled safely (use it in check mode only, or run the module inside that namespace)",
        )


def options_from_params(
    params: Mapping[str, Any], check_mode: bool = False,
) -> tuple[JobSelector, tuple[Pattern[str], ...], ReapOptions]:
    """zombie_reap's selection, protected patterns and ladder options; OptionsInvalid lists every problem.

    Outside check mode, `proc_root` must be this process's own PID namespace (it is signalled).
    """
    checks = OptionChecks()
    selector, protected = job_selection_from_params(params, checks)
    job_dir = own_job_dir(params, checks)
    if selector.is_empty and not checks.failed("match", "pids"):
        checks.add("match", "is empty, and so is pids; name the job with a pattern or a pid (zombie_reap never acts on everything)")
    term_signal = checks.check(parse_term_signal, params["term_signal"])
    timeouts = {
        option: checks.check(check_timeout, option, params[option])
        for option in ("term_timeout", "kill_timeout", "reap_timeout", "d_state_timeout")
    }
    orphan_grace = checks.check(check_timeout, "orphan_grace", params["orphan_grace"], maximum=MAX_ORPHAN_GRACE)
    expect_run_id = checks.check(check_expect_run_id, params.get("expect_run_id"))
    if params.get("expect_run_id") is not None and params.get("job_name") is None:
        checks.add("expect_run_id", "needs job_name (and job_state_dir): the run it names is a run of that job")
    if not check_mode:
        checks.check(check_own_namespace, params["proc_root"])
    checks.raise_if_any()
    options = ReapOptions(
        term_signal=term_signal or signal.SIGTERM,
        term_timeout=float(timeouts["term_timeout"] or 0.0),
        kill_timeout=float(timeouts["kill_timeout"] or 0.0),
        reap_timeout=float(timeouts["reap_timeout"] or 0.0),
        d_state_timeout=float(timeouts["d_state_timeout"] or 0.0),
        reap_parents=params["reap_parents"],
        orphan_grace=float(orphan_grace or 0.0),
    )
    return dataclasses.replace(selector, job_dir=job_dir, expect_run_id=expect_run_id), protected, options


@dataclass
class Snapshot:
    """One scan, its protection, the other jobs' processes in it, and the job."""

    table: ProcessTable
    protection: Protection
    other_jobs: OtherJobs
    job: set[int]
    own: int

    def assess(self, options: AssessmentOptions, clock: Callable[[], float], sleep: Callable[[float], None]) -> Assessment:
        """What zombie_facts would say of this very scan (no scan of its own)."""
        return assess_table(self.table, options, self.protection, self.other_jobs, self.own, clock, sleep)


def snapshot_for_plan(proc_root: str, selector: JobSelector, protected: tuple[Pattern[str], ...],
                      refuse_broad: bool = False) -> Snapshot:
    """One scan, its protection, and the job, with the threads (state, wchan) of the job loaded.

    With `refuse_broad`, a selection too broad in this very scan raises BroadSelectionError
    (before any thread is read): the plan is made from the table the refusal judged.
    """
    table = ProcessTable.scan(proc_root)
    own = own_pid_in(proc_root)
    protection = Protection(table, protected, own)
    other_jobs = OtherJobs(table, selector.job_dir, expect_run_id=selector.expect_run_id)
    if refuse_broad:
        refuse_broad_selection(selector, table, protection, own, other_jobs.reason)
    job = selector.select(table, protection, spared=other_jobs.reason) if not selector.is_empty else set()
    for pid in job:
        table.load_threads(pid)
    return Snapshot(table, protection, other_jobs, job, own)


# How long a fenced clean-up waits for the job's lock: a train_launch task holds it while it stops the
# job and proves a new start (its term_timeout, startup_timeout and margins; 30 + 120 + 90 by default).
JOB_LOCK_WAIT = 600.0


class JobLockError(Exception):
    """The job's lock was not taken: another task held it too long, or it could not be opened."""


def wait_for_job_lock(job_dir: str, timeout: float = JOB_LOCK_WAIT) -> None:
    """Take the job's lock (train_launch's, held until this module exits), where the job's directory
    exists. The run-id fence's last gap: a start in progress has launched its run before it records
    it, so a look in between would take the new run for the selection's; under the lock the look sees
    the recorded run. JobLockError when another task holds the lock past `timeout` or it cannot be opened."""
    records = JobRecords(job_dir)
    if records.is_real_dir():
        try:
            records.lock(timeout)
        except OSError as exc:
            raise JobLockError(str(exc)) from None


def reap_job(
    selector: JobSelector,
    protected: Iterable[Pattern[str]],
    options: ReapOptions,
    proc_root: str = "/proc",
    device_glob: str = "/dev/nvidia*",
    check_mode: bool = False,
    control: ProcessControl | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ReapResult:
    """Plan, and unless `check_mode` execute, the ladder for the job; repeat for processes the job
    forked while it was being ended (at most MAX_ROUNDS plans).

    BroadSelectionError (nothing signalled) when the selection is too broad in the first scan, the
    one the first plan is made from. That scan is also what `found` judges. When a ladder ran, every
    round ends with one scan: the one that finds no newcomer (or ends the last round) is what `left`
    judges; with nothing to execute (check mode, an empty plan) `left` is `found`, and there is no
    second scan.
    """
    started = clock()
    if selector.expect_run_id is not None and selector.job_dir is not None and not check_mode:
        wait_for_job_lock(selector.job_dir)
    patterns = tuple(protected)
    looks = AssessmentOptions(selector=selector, protected=patterns, device_glob=device_glob, orphan_grace=options.orphan_grace)
    control = control or ProcessControl(proc_root)
    look = snapshot_for_plan(proc_root, selector, patterns, refuse_broad=True)
    found = look.assess(looks, clock, sleep)
    plan = plan_reap(look.table, selector, look.protection, options, look.other_jobs.reason)
    plans = [plan]
    other_jobs = {(entry["pid"], entry["starttime"]): entry for entry in look.other_jobs.report()}
    fence = {"fenced": selector.expect_run_id is not None, "newer_run": look.other_jobs.superseded()}
    if check_mode or plan.is_empty:
        return ReapResult(plans, None, clock() - started, found, found, list(other_jobs.values()), **fence)
    outcome = Executor(plan, control, look.protection, options, clock, sleep).run()
    seen = {i.key for i in plan.job}
    while True:
        look = snapshot_for_plan(proc_root, selector, patterns)
        fence["newer_run"] = fence["newer_run"] or look.other_jobs.superseded()
        newcomers = sorted(
            pid for pid in look.job
            if Identity.of(look.table.processes[pid]).key not in seen and not look.table.processes[pid].is_zombie
        )
        if not newcomers or len(plans) == MAX_ROUNDS:
            break
        follow_up = JobSelector(pids=tuple(newcomers), include_descendants=selector.include_descendants,
                                job_dir=selector.job_dir, expect_run_id=selector.expect_run_id)
        plan = plan_reap(look.table, follow_up, look.protection, options, look.other_jobs.reason)
        plans.append(plan)
        for entry in look.other_jobs.report():
            other_jobs.setdefault((entry["pid"], entry["starttime"]), entry)
        seen |= {i.key for i in plan.job}
        outcome.merge(Executor(plan, control, look.protection, options, clock, sleep, len(plans)).run())
    left = look.assess(looks, clock, sleep)
    _name_held_devices(outcome, look.table, left)
    return ReapResult(plans, outcome, clock() - started, found, left, list(other_jobs.values()), **fence)


def _name_held_devices(outcome: Outcome, table: ProcessTable, left: Assessment) -> None:
    """The GPU device files the processes left running still hold: evidence for the host, from the
    holders the look after the ladder found in its scan."""
    for entry in outcome.remaining:
        if entry["state"] == "Z":
            continue
        same = Identity(entry["pid"], entry["starttime"]).matches(table.processes.get(entry["pid"]))
        entry["devices"] = sorted({h["device"] for h in left.gpu_holders if same and h["pid"] == entry["pid"]})
        if entry["devices"]:
            outcome.judgement.add(FindingKind.HOLDS_DEVICE, Escalation.NONE,
                                  f"pid {entry['pid']} ({entry['comm']}) still holds {', '.join(entry['devices'])}", [entry["pid"]])


def summary(result: ReapResult, check_mode: bool) -> str:
    """One line for the task output."""
    plan = result.first
    missing = f"; pids {format_pids(plan.missing_pids)} do not exist" if plan.missing_pids else ""
    if result.newer_run is not None:
        newer = result.newer_run
        missing += (f"; the job's newer run {newer['run_id']} (pid {newer['pid']}), started meanwhile by another run, "
                    f"was left alone")
    if plan.is_empty:
        return f"nothing to reap: no process of the job is left{missing}"
    if check_mode or result.outcome is None:
        signals = len(result.first.steps)
        targets = len(result.first.targets)
        return (
            f"check mode: the plan has {signals} step(s) for {targets} process(es) of {len(plan.job)} in the job; "
            f"nothing was signalled{missing}"
        )
    outcome = result.outcome
    if result.escalation == Escalation.NONE:
        left = f"{len(outcome.remaining)} left, none needing a reboot (see remaining)" if outcome.remaining else "nothing left that blocks a relaunch"
    else:
        left = f"escalation {result.escalation.value}: {'; '.join(result.judgement.reasons)}"
    return f"ended {len(outcome.ended)} process(es) with {outcome.signals_sent} signal(s); {left}{missing}"
