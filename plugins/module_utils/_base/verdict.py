# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one escalation vocabulary: what it takes to clear what was found, least force first.

Every module and role of the collection answers in these words (``escalation`` in a result):

* ``none``: nothing stands in the way (nothing found, or nothing more this step could do);
* ``signals``: signals and reaping clear it (and the time the kernel takes to tear a process down);
* ``container_reboot``: only a restart of the container clears it;
* ``gpu_reset``: only a reset of a GPU clears it (``nvidia-smi --gpu-reset`` on the machine that owns
  the GPU -- the host, or the Proxmox node of a container -- with no process anywhere there holding it);
* ``host_reboot``: only a reboot of the machine that owns the GPU clears it (for a container, the
  Proxmox node, not the container);
* ``host_action``: nothing short of the host's own action (a person, on the host) is known to clear it.

The GPU words (``gpu_reset``, ``host_reboot``) come from gpu_health; they rank above a container
reboot (which cannot reset a GPU) and below ``host_action``, which stays the most force: what no
known step clears, and what an unknown word is taken for.

A decision is taken on these values and on the structured fields of a :class:`Finding` (its
``kind``, its pids), never on the wording of a message: ``why`` is for people.

Every family names what it found in the one vocabulary of :class:`FindingKind`: one word per kind
of thing, singular (a finding is about one kind of thing, however many pids it names), the same
word whichever module found it; the escalation says what clears it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable


class Escalation(Enum):
    """What clears a finding. The order of the members is the ranking: later means more force."""

    NONE = "none"
    SIGNALS = "signals"
    CONTAINER_REBOOT = "container_reboot"
    GPU_RESET = "gpu_reset"
    HOST_REBOOT = "host_reboot"
    HOST_ACTION = "host_action"

    @property
    def rank(self) -> int:
        return _ORDER.index(self)


_ORDER = tuple(Escalation)
# The words, least force first, for argument specs and documentation.
ESCALATION_WORDS = tuple(level.value for level in _ORDER)


def worst(levels: Iterable[Escalation]) -> Escalation:
    """The one ranking: the level that needs the most force (NONE for no levels)."""
    return max(levels, key=lambda level: level.rank, default=Escalation.NONE)


class FindingKind(Enum):
    """What a finding is about: the one vocabulary of ``findings[].kind`` in every module's result."""

    NOTHING = "nothing"                      # nothing of the job and nothing blocking a relaunch
    RUNNING = "running"                      # a process (of the job, or holding a GPU) still runs
    ZOMBIE = "zombie"                        # a zombie its parent has not reaped (yet)
    ZOMBIE_LEADER = "zombie_leader"          # a zombie whose other threads still run (Zl)
    UNREAPED_ORPHAN = "unreaped_orphan"      # a zombie orphaned to an init that does not reap it
    UNINTERRUPTIBLE = "uninterruptible"      # a thread in D (in the GPU driver: host_action)
    SURVIVED_KILL = "survived_kill"          # still running after SIGKILL
    PERMISSION_DENIED = "permission_denied"  # could not be signalled
    NOT_SIGNALLED = "not_signalled"          # still running; no step of the plan reached it
    HOLDS_DEVICE = "holds_device"            # holds a GPU device file open
    OTHER_JOB = "other_job"                  # another train_launch job's, left alone
    MARK_CONFLICT = "mark_conflict"          # its marks name another job than its proven ancestry: the ancestry's
    RELEASED = "released"                    # the GPUs are released
    INVISIBLE = "invisible"                  # a GPU holder whose pid this namespace cannot see
    UNLISTED_MEMORY = "unlisted_memory"      # GPU memory used with no process listed
    GPU_CONDITION = "gpu_condition"          # a GPU's release condition not met yet
    PIDS_PRESENT = "pids_present"            # pids waited for are still there
    HOST_MEMORY = "host_memory"              # host memory not back yet
    NOT_HOLDING = "not_holding"              # listed on a GPU but holds no device file, so not signalled
    # gpu_health: the hardware
    HEALTHY = "healthy"                      # a GPU with nothing found
    GPU_LOST = "gpu_lost"                    # NVML: the GPU is lost (fell off the bus, stopped answering)
    RESET_REQUIRED = "reset_required"        # NVML: the GPU requires a reset
    RECOVERY_ACTION = "recovery_action"      # NVML's recovery action (driver 570+) asks for one
    ROW_REMAP = "row_remap"                  # a row remap pending (a reset activates it) or failed
    RETIRED_PAGES = "retired_pages"          # pages retired pending a reset (pre-Ampere)
    ECC_ERRORS = "ecc_errors"                # uncorrectable ECC errors since the driver loaded (volatile)
    NVLINK_DOWN = "nvlink_down"              # NVLink links down
    THROTTLE = "throttle"                    # a hardware slowdown or power brake (a warning)
    XID = "xid"                              # XID events in the kernel log since the cut-off


# The words, for documentation and tests (every module's RETURN lists these).
FINDING_KINDS = tuple(kind.value for kind in FindingKind)


@dataclass(frozen=True)
class Finding:
    """One thing found, what it takes to clear it, and why, for people.

    `kind` is a :class:`FindingKind` or its word; any other word is a programming error (ValueError).
    """

    kind: FindingKind | str  # stored as its word
    escalation: Escalation
    why: str
    pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        try:
            word = FindingKind(self.kind).value
        except ValueError:
            raise ValueError(f"{self.kind!r} is not a finding kind (one of {', '.join(FINDING_KINDS)})") from None
        object.__setattr__(self, "kind", word)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "escalation": self.escalation.value, "pids": list(self.pids), "why": self.why}


@dataclass
class Verdict:
    """The findings of one step; its escalation is the worst of theirs."""

    findings: list[Finding] = field(default_factory=list)

    def add(self, kind: FindingKind | str, escalation: Escalation, why: str, pids: Iterable[int] = ()) -> None:
        """One more finding; an unknown `kind` raises ValueError (see :class:`Finding`)."""
        self.findings.append(Finding(kind, escalation, why, tuple(sorted(pids))))

    def extend(self, other: "Verdict") -> None:
        self.findings.extend(other.findings)

    @property
    def escalation(self) -> Escalation:
        return worst(f.escalation for f in self.findings)

    @property
    def reasons(self) -> list[str]:
        return [f.why for f in self.findings]

    def as_dict(self) -> dict[str, Any]:
        return {
            "escalation": self.escalation.value,
            "reasons": self.reasons,
            "findings": [f.as_dict() for f in self.findings],
        }


class Judged:
    """A result that carries its findings as `judgement`."""

    judgement: Verdict

    @property
    def escalation(self) -> Escalation:
        return self.judgement.escalation

    @property
    def reasons(self) -> list[str]:
        return self.judgement.reasons


class Action(Enum):
    """What the relaunch does with the job (train_launch's decision; the controller's plugins read it
    from here without importing the launch's judgement)."""

    NONE = "none"            # left alone
    RELAUNCH = "relaunch"    # stopped (if it runs) and started again
    REFUSED = "refused"      # a relaunch is wanted, but the crash-loop guard refuses it


class Health(Enum):
    """How a training job is doing, as train_launch judges it from its records, its processes and its log.

    A separate axis from :class:`Escalation` (what it takes to clear leftovers): health says whether
    the job needs relaunching at all, escalation how hard the clean-up before it is.
    """

    RUNNING = "running"      # alive, and progressing (or no stall detection asked for)
    STALLED = "stalled"      # alive, but no progress line for stall_after seconds
    FINISHED = "finished"    # ended by itself with exit code 0
    CRASHED = "crashed"      # ended with a non-zero exit code, a signal, or could not start
    MISSING = "missing"      # no record of a run, or its processes are gone without an exit record
    STOPPED = "stopped"      # ended because train_launch stopped it while it was running and progressing

    @property
    def failed(self) -> bool:
        """A failure that a relaunch answers (with resume_args, counted by the crash-loop guard)."""
        return self in (Health.CRASHED, Health.STALLED, Health.MISSING)


# The words, for argument specs and documentation.
HEALTH_WORDS = tuple(state.value for state in Health)
