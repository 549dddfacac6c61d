# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The processes of other train_launch jobs: a selection by command line leaves them alone.

Two jobs on one host may run the same script, so a ``match`` pattern that names one names the
other too. A process that a selection names (or reaches as a descendant) belongs to another job,
and is left out of the job and reported, when it is proven a member of it (the rule of
``_launch/tree.py``, from the process's side):

* it carries that job's run mark (``GPUOPS_RELAUNCH_RUN=JOB_DIR:RUN_ID``) in the environment it
  was started with, the job's run record (``JOB_DIR/run.json``) names that run, and it did not
  start before the run's main process; or
* it is, or descends from, that job's supervisor: a live process whose (pid, start time) the job's
  run or idle record names and which carries the supervisor's own mark
  (``GPUOPS_RELAUNCH_SUPERVISOR=JOB_DIR``). As the job's child subreaper it adopts whatever the job
  orphans, so a process that cleared its environment (``env -i``, ``su -``) is still found.

Ancestry outranks marks. The nearest proven supervisor or run among a process and its ancestors
says whose it is: a process below the proven supervisor of the selection's own job (``job_name``) is
that job's whatever its marks say (a worker of one job can copy another's environment: both run as
one user), and one below another job's proven supervisor is that job's. A mark that contradicts the
ancestry is a conflict, reported as a finding (kind ``mark_conflict``), never a shield. Job
directories are compared by (device, inode), not by spelling: ``//var/lib/gpuops/a`` is ``a``.

An environment variable is anyone's to set, so a mark alone proves nothing: the records must
agree, and records are believed only from a job directory that nobody but root or the user running
this module can have written (a directory of this user, writable by no one else, on a path without a
symlink whose every directory is root's or this user's and lets no one else rename in it). A process carrying the mark of the job the selection is for
(``job_name``) is the selection's to take.

Only the processes a selection names, their descendants and the ancestors of those are looked at
(their ``environ``), never the whole table.

The run-id fence: a selection for one run of its job (``expect_run_id``: the run a relaunch's look
saw, "" for none) leaves a *newer* run of that job alone, as it leaves another job's. The newer run is
the one the job's believed records (``run.json``) name when its run id is not the expected one and its
main process runs (``tree.leader_alive``); its members are proven by ancestry only - the processes at
and below its proven supervisor or its proven main process - never by a mark. Another relaunch of the
same job started it after the look (a watchdog's run and an alert's at once), and did its own clean-up
first; what descends from the run's supervisor (the job's child subreaper, which adopts what the run
orphans) is that run's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionChecks
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.private_dir import NO_WRITE_FOR_OTHERS, check_private_dir
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import ProcessTable
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.selection import NAMESPACE_INIT_PID
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import Identity, ProcessControl, format_pids
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import Escalation, FindingKind, Verdict
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.records import JobRecords
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.spec import NAME_PATTERN
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.jobfiles import IDLE_FILE, RUN_MARK, SUPERVISOR_MARK
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.tree import (
    JobIdentity,
    RecordError,
    leader_alive,
    proven_supervisor,
    recorded_identity,
    same_directory,
    supersedes,
)

RUN_MARK_PROOF = "run_mark"
SUPERVISOR_PROOF = "supervisor"
RUN_PROOF = "run"


def own_job_dir(params: Mapping[str, Any], checks: OptionChecks) -> str | None:
    """The state directory of the job the selection is for (``job_state_dir``/``job_name``), or
    None without ``job_name``; a wrong value is noted in `checks`, naming its option."""
    name = params.get("job_name")
    if name is None:
        return None
    if not NAME_PATTERN.match(name):
        checks.add("job_name", f"{name!r} is not a train_launch job name (letters, digits, '.', '_', '-'; "
                               "first a letter or digit; at most 64 characters)")
        return None
    state_dir = params["job_state_dir"]
    if not state_dir or not os.path.isabs(state_dir):
        checks.add("job_state_dir", f"{state_dir!r} is not an absolute path")
        return None
    return os.path.join(os.path.normpath(state_dir), name)


@dataclass(frozen=True)
class OtherJob:
    """The job a process was proven to belong to, and how."""

    job_dir: str
    run_id: str | None
    proof: str
    supervisor_pid: int | None = None
    # The selection's own job, in a newer run than the one the selection is for (the run-id fence).
    newer_run: bool = False

    def why(self) -> str:
        run = f" (run {self.run_id})" if self.run_id else ""
        if self.newer_run:
            return (f"belongs to this job's newer run {self.run_id}, started after the run the selection is for: "
                    f"it is or descends from that run's {'main process' if self.proof == RUN_PROOF else 'supervisor'}, "
                    f"pid {self.supervisor_pid}")
        if self.proof == RUN_MARK_PROOF:
            how = "it carries that run's mark"
        elif self.proof == RUN_PROOF:
            how = f"it is or descends from that run's main process, pid {self.supervisor_pid}"
        else:
            how = f"it is or descends from that job's supervisor, pid {self.supervisor_pid}"
        return f"belongs to the job {self.job_dir}{run}: {how}"


@dataclass(frozen=True)
class _Records:
    """What one job directory's records say (only from a directory that can be believed)."""

    run: JobIdentity | None
    idle_supervisor: Identity | None

    @property
    def supervisors(self) -> list[Identity]:
        """The supervisor identities the records name: the run's, and one waiting idle for the next run."""
        recorded = [self.run.supervisor if self.run is not None else None, self.idle_supervisor]
        return [identity for identity in recorded if identity is not None]


class OtherJobs:
    """Which processes of one snapshot belong to a job other than `own_job_dir`; asked pid by pid.

    Each answer is kept, so a process is looked at once however often it is asked about.
    """

    def __init__(self, table: ProcessTable, own_job_dir: str | None, control: ProcessControl | None = None,
                 expect_run_id: str | None = None) -> None:
        self.table = table
        self.own_job_dir = own_job_dir
        self.control = control or ProcessControl(table.proc_root)
        # The run of the own job the selection is for ("" for none; None: no fence).
        self.expect_run_id = expect_run_id
        self._claims: dict[int, OtherJob | None] = {}
        self._heads: dict[int, OtherJob | None] = {}
        self._records: dict[str, _Records | None] = {}
        # Processes whose marks name another job than their ancestry proves: pid -> (marked, proven) job dirs.
        self.conflicts: dict[int, tuple[str, str]] = {}

    # --- asked by the selection ----------------------------------------------------------------

    def reason(self, pid: int) -> str | None:
        """Why `pid` is another job's (the selection leaves it out), or None."""
        claim = self.claim(pid)
        return claim.why() if claim is not None else None

    def claim(self, pid: int) -> OtherJob | None:
        if pid not in self._claims:
            self._claims[pid] = self._prove(pid)
        return self._claims[pid]

    @property
    def claimed(self) -> dict[int, OtherJob]:
        """Every process asked about that belongs to another job."""
        return {pid: claim for pid, claim in sorted(self._claims.items()) if claim is not None}

    def report(self) -> list[dict[str, Any]]:
        """The claimed processes, for a module's result (``other_jobs``)."""
        processes = self.table.processes
        fenced = self.expect_run_id is not None
        return [
            {"pid": pid, "starttime": processes[pid].starttime, "comm": processes[pid].comm,
             "job_dir": claim.job_dir, "run_id": claim.run_id, "proof": claim.proof,
             **({"newer_run": claim.newer_run} if fenced else {})}
            for pid, claim in self.claimed.items()
        ]

    @cached_property
    def newer_run(self) -> JobIdentity | None:
        """The own job's newer live run, which the selection leaves alone (the run-id fence), or None:
        no fence, no own job, records that cannot be believed, the expected run, or a run that does not run."""
        if self.expect_run_id is None or self.own_job_dir is None:
            return None
        run = (self._believed(self.own_job_dir) or _Records(None, None)).run
        if run is None or not supersedes(self.expect_run_id, run.run_id, lambda: leader_alive(run, self.table.proc_root)):
            return None
        return run

    def superseded(self) -> dict[str, Any] | None:
        """The newer run for a module's result (``newer_run``): run_id, pid, starttime; None without one."""
        run = self.newer_run
        return {"run_id": run.run_id, "pid": run.pid, "starttime": run.starttime} if run is not None else None

    def add_findings(self, verdict: Verdict) -> None:
        """One finding (kind ``other_job``, escalation none) per job whose processes were left alone, and
        one (kind ``mark_conflict``, escalation signals) per process whose marks contradict its ancestry."""
        by_job: dict[str, list[int]] = {}
        for pid, claim in self.claimed.items():
            by_job.setdefault(claim.job_dir, []).append(pid)
        newer = sorted(pid for pid, claim in self.claimed.items() if claim.newer_run)
        for job_dir, pids in sorted(by_job.items()):
            pids = [pid for pid in pids if pid not in newer]
            if pids:
                verdict.add(FindingKind.OTHER_JOB, Escalation.NONE, other_job_why(job_dir, pids), pids)
        if newer:
            verdict.add(FindingKind.OTHER_JOB, Escalation.NONE, newer_run_why(self.claimed[newer[0]].run_id, newer), newer)
        for pid, (marked, proven) in sorted(self.conflicts.items()):
            whose = "this job" if proven == self.own_job_dir else f"the job {proven}"
            verdict.add(FindingKind.MARK_CONFLICT, Escalation.SIGNALS,
                        f"pid {pid} carries the marks of the job {escape_controls(marked)}, but descends from the proven "
                        f"supervisor or run of {proven}: it is {whose}'s (ancestry outranks what a process says about itself)",
                        [pid])

    # --- asked by the stop path ----------------------------------------------------------------

    def head(self, pid: int) -> OtherJob | None:
        """The job whose proven supervisor or run `pid` is itself (its records believed, the recorded
        (pid, start time) alive and carrying that job's mark), own job included; None otherwise."""
        if pid not in self._heads:
            self._heads[pid] = self._prove_head(pid)
        return self._heads[pid]

    def is_own(self, job_dir: str) -> bool:
        return self.own_job_dir is not None and same_directory(job_dir, self.own_job_dir)

    def marked_otherwise(self, pid: int, job_dir: str) -> str | None:
        """The job directory `pid`'s marks name, where that is not `job_dir` (None if none does)."""
        process = self.table.processes.get(pid)
        if process is None:
            return None
        identity = Identity.of(process)
        run = self.control.environ_value(identity, RUN_MARK)
        for marked in (run.rpartition(":")[0] if run is not None else None,
                       self.control.environ_value(identity, SUPERVISOR_MARK)):
            if marked is not None and not same_directory(marked, job_dir):
                return marked
        return None

    # --- the proof ------------------------------------------------------------------------------

    def _prove(self, pid: int) -> OtherJob | None:
        process = self.table.processes.get(pid)
        if process is None or process.is_kernel_thread:
            return None
        # Ancestry first: the nearest proven supervisor or run among the process and its ancestors
        # decides the job; that job's supervisor further up, where there is one, is the proof named.
        heads = [head for head in (self.head(candidate) for candidate in self._lineage(pid)) if head is not None]
        head = heads[0] if heads else None
        if head is not None:
            head = next((later for later in heads if later.job_dir == head.job_dir and later.proof == SUPERVISOR_PROOF), head)
            marked = self.marked_otherwise(pid, head.job_dir)
            if marked is not None:
                self.conflicts[pid] = (marked, self.own_job_dir if self.is_own(head.job_dir) else head.job_dir)
            if self.is_own(head.job_dir):
                # The selection's own job, whatever its marks say - unless it is the job's newer run.
                return self._newer_run_claim(head)
            mark = self.control.environ_value(Identity.of(process), RUN_MARK)
            run = (self._believed(head.job_dir) or _Records(None, None)).run
            if mark is not None and run is not None and run.marks(process, mark):
                return OtherJob(head.job_dir, run.run_id, RUN_MARK_PROOF)
            return head
        # No proven supervisor or run above it: its mark, where the job's records confirm it.
        mark = self.control.environ_value(Identity.of(process), RUN_MARK)
        if mark is not None:
            job_dir, _sep, run_id = mark.rpartition(":")
            if self.is_own(job_dir):
                return None  # the selection's own job
            records = self._believed(job_dir)
            run = records.run if records is not None else None
            if run is not None and run.marks(process, mark):
                return OtherJob(job_dir, run_id, RUN_MARK_PROOF)
        return None

    def _newer_run_claim(self, head: OtherJob) -> OtherJob | None:
        """`head` (a proven supervisor or main process of the own job) as the newer run's, where it is that
        run's recorded supervisor or main process; None (the selection's) otherwise."""
        run = self.newer_run
        if run is None or head.supervisor_pid is None or head.supervisor_pid not in (run.supervisor_pid, run.pid):
            return None
        return OtherJob(head.job_dir, run.run_id, head.proof, head.supervisor_pid, newer_run=True)

    def _lineage(self, pid: int) -> list[int]:
        """`pid` and its ancestors below the namespace's PID 1."""
        lineage = []
        for candidate in (pid, *self.table.ancestors(pid)):
            if candidate <= NAMESPACE_INIT_PID:
                break
            lineage.append(candidate)
        return lineage

    def _prove_head(self, pid: int) -> OtherJob | None:
        process = self.table.processes.get(pid)
        if process is None or process.is_zombie or process.is_kernel_thread:
            return None
        identity = Identity.of(process)
        job_dir = self.control.environ_value(identity, SUPERVISOR_MARK)
        records = self._believed(job_dir) if job_dir is not None else None
        # The stop path's own proof: the recorded (pid, start time), alive, carrying the job's mark.
        if records is not None and any(recorded.pid == pid and proven_supervisor(self.table, recorded, job_dir)
                                       for recorded in records.supervisors):
            return OtherJob(job_dir, records.run.run_id if records.run is not None else None, SUPERVISOR_PROOF, pid)
        mark = self.control.environ_value(identity, RUN_MARK)
        if mark is None:
            return None
        job_dir = mark.rpartition(":")[0]
        records = self._believed(job_dir)
        run = records.run if records is not None else None
        leader = run.leader if run is not None else None
        if leader is not None and leader.matches(process) and run.marks(process, mark):
            return OtherJob(job_dir, run.run_id, RUN_PROOF, pid)
        return None

    def _believed(self, job_dir: str) -> _Records | None:
        if job_dir not in self._records:
            self._records[job_dir] = _read_records(job_dir) if trustworthy_job_dir(job_dir) else None
        return self._records[job_dir]


def other_job_why(job_dir: str, pids: list[int]) -> str:
    """The finding's why for `pids` of another job, left alone."""
    return (f"pids {format_pids(pids)} match the selection but belong to the job {job_dir}: left alone "
            f"(name that job with job_name to select its processes)")


def newer_run_why(run_id: str | None, pids: list[int]) -> str:
    """The finding's why for `pids` of the selection's own job's newer run (the run-id fence), left alone."""
    return (f"pids {format_pids(pids)} match the selection but belong to this job's newer run {run_id}, started "
            f"meanwhile by another run (expect_run_id names an older one): left alone")


def trustworthy_job_dir(job_dir: str) -> bool:
    """Whether records in `job_dir` can be believed: a directory of the user running this module,
    writable by no one else, on a path walked from ``/`` without a symlink, whose every directory
    is root's or this user's and lets no one else rename in it (private_dir's rule)."""
    # normpath keeps a leading "//" (POSIX lets it mean something else): one spelling only.
    if not job_dir or not os.path.isabs(job_dir) or os.path.normpath(job_dir) != job_dir or job_dir.startswith("//"):
        return False
    try:
        check_private_dir("job_state_dir", job_dir, NO_WRITE_FOR_OTHERS, create=False)
    except (BadOption, OSError):
        return False
    return True


def _read_records(job_dir: str) -> _Records:
    records = JobRecords(job_dir)
    run = records.read_run()
    identity = None
    if run is not None:
        try:
            identity = JobIdentity.from_run(run, job_dir)
        except RecordError:
            identity = None
    idle = records.read(IDLE_FILE) or {}
    return _Records(identity, recorded_identity(idle.get("supervisor_pid"), idle.get("supervisor_starttime")))
