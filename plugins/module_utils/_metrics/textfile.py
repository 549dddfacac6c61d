# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A relaunch's evidence as a node_exporter textfile: the Prometheus text format, written whole or not at all.

:func:`job_metrics` turns a host's relaunch summary (``plugin_utils/relaunch_flow.host_summary``) and
the GPUs' memory at the last look into metric families; :func:`render` writes them in the text
exposition format (HELP and TYPE lines, label values escaped, families and samples in a fixed order,
no sample timestamps: the textfile collector refuses them); :func:`write_textfile` puts the text in
place on the target.

What is not known (no progress line, no drain this run, a step that is not a number) is left out
rather than guessed, and a value that is not finite (NaN, infinity) is never written: Prometheus
would take it, and an alert such as ``> 600`` would then silently never fire.

The writer walks the directory from ``/`` (``_base/safepath``: a symlink on the way only where
nobody but root can change it), never creates it (it is the collector's, and a typo must not make a
directory nobody scrapes), and replaces the file through a temporary file in the same directory
(``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0644, fsync) renamed over it: the collector never reads half a
file, and a symlink planted at the file's name is replaced, never followed.

Standard library only, and the collection's own vocabulary (``_base/verdict``): the node's live
health (``_launch/live.py``) writes its file with this very writer, from a private copy next to the
supervisor's, so this file imports only files that are standard library only too.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

if not __package__:
    # The private copy the node's live health writes with (see _launch/live.py): its neighbours are copies too.
    import safepath  # pylint: disable=import-error
    from options import BadOption  # pylint: disable=import-error
    from verdict import ESCALATION_WORDS, HEALTH_WORDS  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import ESCALATION_WORDS, HEALTH_WORDS

# What this run did: relaunch_decision's actions (none, relaunch, refused), or failed (a step failed,
# whatever was decided).
ACTION_WORDS = ("none", "relaunch", "refused", "failed")
FILE_PREFIX = "gpuops_relaunch_"
FILE_SUFFIX = ".prom"
# The one sample that differs on every run; `changed` looks past it.
TIMESTAMP_METRIC = "gpuops_relaunch_last_run_timestamp_seconds"
# A job name longer than this cannot be a file name (NAME_MAX is 255 bytes with the prefix and hash).
MAX_JOB_NAME = 200
# The labels every series of the collection carries. Not `job` and `instance`: Prometheus sets those
# on every target itself and, with the default honor_labels: false, renames a textfile's `job` to
# `exported_job`; `instance` is the node's address, not the inventory hostname a relaunch is limited to.
JOB_LABEL = "gpuops_job"
HOST_LABEL = "gpuops_host"
# The live file's series also name the job's rank 0 (the host itself for a job of one host): the alerts
# of all the ranks of one job share it (extensions/eda groups and relaunches by it).
RANK0_LABEL = "gpuops_rank0"
# And the run they judge (train_launch's run_id): a failure of the next run is another series, so that
# Alertmanager (which groups by it, extensions/eda) sends each failure at once as a notification of its
# own. One run's series last as long as the run: a few series per relaunch.
RUN_LABEL = "gpuops_run"
MAX_HOST_NAME = 253
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# More than any file this module writes: an existing file larger than this is compared as changed.
_MAX_READ = 1 << 20


class MetricsWriteError(Exception):
    """The textfile could not be read or written; str() says where and why."""


# --- the families -----------------------------------------------------------------------------------


@dataclass
class Family:
    """One metric: its name, its help, and its samples (labels in order, value); a gauge unless `kind` says counter."""

    name: str
    help: str
    samples: list[tuple[tuple[tuple[str, str], ...], float]] = field(default_factory=list)
    kind: str = "gauge"

    def add(self, value: float | None, **labels: str) -> None:
        """One sample; a value that is None or not finite is left out."""
        if value is None or not math.isfinite(value):
            return
        self.samples.append((tuple(labels.items()), float(value)))


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadOption("summary", f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _number(value: Any, where: str, option: str = "summary") -> float | None:
    """A finite or non-finite float from a number or its text; None for none; BadOption for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadOption(option, f"{where} must be a number, got a boolean")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise BadOption(option, f"{where} must be a number, got {value!r}")


def _non_negative(value: float | None) -> float | None:
    return value if value is not None and value >= 0 else None


def _step(value: Any) -> float | None:
    """A progress step as a number, where the log's step is one ("1200", "1.2e3"); else None."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _epoch(value: Any) -> float | None:
    """Seconds since the epoch from an ISO 8601 time with its offset (train_launch's last_progress_at)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None  # a time without its offset could be any of 24 hours
    return moment.timestamp()


def check_host(host: Any, option: str = "host") -> str:
    """The inventory hostname for the gpuops_host label; BadOption naming `option` for an empty or overlong one."""
    if not isinstance(host, str) or not host:
        raise BadOption(option, "must be the inventory hostname (the gpuops_host label), not empty")
    if len(host) > MAX_HOST_NAME:
        raise BadOption(option, f"is {len(host)} characters long; at most {MAX_HOST_NAME}")
    return host


def check_run(run: Any) -> str:
    """A run id for the gpuops_run label (train_launch's are 32 hex digits); BadOption naming `run` for
    anything but a short name, which the rulebook would not pass on either."""
    if not isinstance(run, str) or not _RUN_ID.fullmatch(run):
        raise BadOption("run", "must be a run id (letters, digits, '.', '_', '-'; at most 64)")
    return run


def _health_families(health: Mapping[str, Any], labels: Mapping[str, str], state: Any, seen: str) -> list[Family]:
    """The job's health series: the state `state` (1 for it, 0 for the others; all 0 for one not known)
    and, from `health` (train_launch's health), its progress. `seen` says who saw it, for the help."""
    health_family = Family("gpuops_job_health", f"1 for the job's health {seen}, 0 for the others; all 0 when not known.")
    for word in HEALTH_WORDS:
        health_family.add(1.0 if state == word else 0.0, **labels, state=word)
    since = Family("gpuops_job_seconds_since_progress", f"Seconds since the job's last progress line, {seen}.")
    since.add(_non_negative(_number(health.get("since_progress"), "health.since_progress")), **labels)
    progress_at = Family("gpuops_job_last_progress_timestamp_seconds",
                         "When the job's last progress line was first seen, in seconds since the epoch.")
    progress_at.add(_non_negative(_epoch(health.get("last_progress_at"))), **labels)
    step = Family("gpuops_job_last_step", "The step of the job's last progress line, where it is a number.")
    step.add(_step(health.get("last_step")), **labels)
    return [health_family, since, progress_at, step]


# The series the job's health is told by: written by one file only (node_exporter refuses a series
# that two files write). The job's live file owns them where the job keeps one (train_launch's
# metrics_dir); the relaunch's file then leaves them out.
HEALTH_SERIES = ("gpuops_job_health", "gpuops_job_seconds_since_progress", "gpuops_job_last_progress_timestamp_seconds",
                 "gpuops_job_last_step")
LIVE_TIMESTAMP_METRIC = "gpuops_job_live_timestamp_seconds"
LIVE_FILE_PREFIX = "gpuops_job_"


def live_metrics(job: str, host: str, health: Mapping[str, Any], now: float, rank0: str | None = None,
                 run: str | None = None, gpus: Mapping[str, Any] | None = None,
                 checkpoint_step: int | None = None, lifetime: Mapping[str, Any] | None = None) -> list[Family]:
    """The job's live file: its health as the node judged it at `now` (train_launch's health, as
    HealthReport.as_dict() says it), and when. Labelled as every series of the collection, with the
    job's rank 0 (`rank0`; unset, `host`) and, where given, the run judged (`run`, its run_id).
    `gpus`: the job's GPUs as the node last looked at them (_gpu/live_gpus.GpuWatch.look), if it has any.
    `checkpoint_step`: the newest complete checkpoint's step, where the job has a checkpoint_dir.
    `lifetime`: the job's lifetime.json (see lifetime_families), where it has one."""
    labels = {JOB_LABEL: job, HOST_LABEL: check_host(host), RANK0_LABEL: check_host(rank0 or host, "rank0")}
    job_labels = dict(labels)
    if run:
        labels[RUN_LABEL] = check_run(run)
    families = _health_families(_mapping(health, "health"), labels, health.get("state"), "as the node judged it last")
    judged = Family(LIVE_TIMESTAMP_METRIC, "When the node last judged the job's health (its live file), in seconds since the epoch.")
    judged.add(now, **labels)
    if checkpoint_step is not None:
        # What a failure now would cost: the last step minus this one (train_launch's checkpoint_dir).
        newest = Family("gpuops_job_checkpoint_step", "The step of the job's newest complete checkpoint.")
        newest.add(float(checkpoint_step), **labels)
        families.append(newest)
    return (families + [judged] + (_gpu_families(gpus, labels) if gpus else [])
            + lifetime_families(lifetime or {}, job_labels))


# What a GPU's verdict can be (gpu_health's words for one GPU), in the vocabulary's order.
GPU_HEALTH_WORDS = tuple(word for word in ESCALATION_WORDS if word in ("none", "gpu_reset", "host_reboot", "host_action"))


def _gpu_families(look: Mapping[str, Any], labels: Mapping[str, str]) -> list[Family]:
    """The job's GPUs as the node last looked at them: per GPU (labels `gpu`, its index, and `uuid`) the
    verdict (all four words, 1 for its own), NVML's recovery action, the last XID since the run started
    and when, and whether it is quarantined (only where the quarantine record exists); per job, when the
    look was and whether it answered. What a look could not read is left out, never guessed."""
    health = Family("gpuops_gpu_health", "1 for what gpu_health's judgement says it takes to clear the GPU "
                    "(none, gpu_reset, host_reboot, host_action), 0 for the others; as the node looked last.")
    recovery = Family("gpuops_gpu_recovery_action", "NVML's recovery action for the GPU (0 none, 1 GPU reset, 2 node reboot, "
                      "3 drain P2P, 4 drain and reset; driver 570+), where the driver gives it.")
    last_xid = Family("gpuops_gpu_last_xid", "The XID of the GPU's last XID burst in the kernel's own log since the run started.")
    last_xid_at = Family("gpuops_gpu_last_xid_timestamp_seconds", "When that last XID line was logged, in seconds since the epoch.")
    quarantined = Family("gpuops_gpu_quarantined", "1 when the GPU is quarantined on this host, 0 when not; only where the "
                         "quarantine record exists.")
    for gpu in look.get("gpus") or []:
        gpu_labels = {**labels, "gpu": "" if gpu.get("index") is None else str(gpu["index"]), "uuid": str(gpu.get("uuid") or "")}
        for word in GPU_HEALTH_WORDS:
            health.add(1.0 if gpu.get("escalation") == word else 0.0, **gpu_labels, escalation=word)
        recovery.add(_step(gpu.get("recovery_action")), **gpu_labels)
        last_xid.add(_step(gpu.get("last_xid")), **gpu_labels)
        last_xid_at.add(_step(gpu.get("last_xid_at")), **gpu_labels)
        if gpu.get("quarantined") is not None:
            quarantined.add(1.0 if gpu["quarantined"] else 0.0, **gpu_labels)
    answered = Family("gpuops_gpu_look_ok", "1 when the node's last look at the job's GPUs answered, 0 when it failed "
                      "(NVML hung, not installed, a GPU lost before any could be read).")
    answered.add(1.0 if look.get("ok") else 0.0, **labels)
    looked = Family("gpuops_gpu_look_timestamp_seconds", "When the node last looked at the job's GPUs, in seconds since the epoch.")
    looked.add(_step(look.get("at")), **labels)
    return [health, recovery, last_xid, last_xid_at, quarantined, answered, looked]


# A word of the job's records as a label value: what train_launch writes there, else "unknown".
_RECORD_WORD = re.compile(r"[a-z_]{1,32}")
_SIGNAL_NAME = re.compile(r"SIG[A-Z0-9+-]{1,16}")


def lifetime_families(lifetime: Mapping[str, Any], labels: Mapping[str, str]) -> list[Family]:
    """The job's lifetime.json (train_launch's guard.lifetime_record) as series without the run's label, since
    they span runs: the relaunches after a failure, ever (a counter: the crash-loop guard's window and its
    reset leave it alone), and the last failure's time, exit code and signal, health and cause."""
    if not isinstance(lifetime, Mapping):
        return []
    count = lifetime.get("relaunches")
    total = Family("gpuops_job_relaunches_total", "Relaunches after a failure over the job's life, "
                   "not only within the crash-loop guard's window.", kind="counter")
    total.add(float(count) if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None, **labels)
    failure = lifetime.get("last_failure") if isinstance(lifetime.get("last_failure"), Mapping) else {}
    at = Family("gpuops_job_last_failure_timestamp_seconds",
                "When the job was last relaunched after a failure, in seconds since the epoch.")
    code = Family("gpuops_job_last_failure_exit_code", "The exit code of the last failed run, where it exited with one.")
    info = Family("gpuops_job_last_failure", "1, labelled with the last failure: the health it was relaunched from "
                  "(crashed, stalled, missing), the signal that ended it (empty for none) and its cause (unknown, hardware).")
    if failure:
        at_value, exit_code = failure.get("at"), failure.get("exit_code")
        at.add(float(at_value) if isinstance(at_value, (int, float)) and not isinstance(at_value, bool) else None, **labels)
        code.add(float(exit_code) if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None, **labels)
        words = {key: str(failure.get(key)) for key in ("health", "cause")}
        signal = str(failure.get("exit_signal") or "")
        info.add(1.0, **labels, health=words["health"] if words["health"] in HEALTH_WORDS else "unknown",
                 signal=signal if _SIGNAL_NAME.fullmatch(signal) else "",
                 cause=words["cause"] if _RECORD_WORD.fullmatch(words["cause"]) else "unknown")
    return [total, at, code, info]


def job_metrics(job: str, summary: Mapping[str, Any], gpus: Sequence[Mapping[str, Any]], now: float,
                host: str) -> list[Family]:
    """The metric families of one job on one host, from its relaunch summary and its GPUs' memory.

    `summary` is relaunch_summary's (health, after, live_metrics, relaunch_guard, action, failed, found,
    container_reset, gpu_released); a key that is missing is not known. `health` is what the probe
    saw before the run acted (``gpuops_relaunch_probe_health``); ``after`` (state, recent_relaunches)
    the job after the action: the job's health series and the relaunch count tell that, falling back
    to the probe's where ``after`` is missing. With ``live_metrics`` (the job keeps a live file) the
    job's health series are that file's, and left out here. `gpus` holds one mapping per GPU: ``index``
    and/or ``uuid``, and ``used_mib`` (or gpu_mem_wait's ``used_mib_after``). `now` is the run's time
    (seconds since the epoch); `host` the inventory hostname. Every sample is labelled
    ``gpuops_job=JOB, gpuops_host=HOST``. BadOption (naming ``summary``, ``gpus`` or ``host``) for a
    value of the wrong kind.
    """
    health = _mapping(summary.get("health"), "health")
    guard = _mapping(summary.get("relaunch_guard"), "relaunch_guard")
    after = _mapping(summary.get("after"), "after")
    labels = {JOB_LABEL: job, HOST_LABEL: check_host(host)}

    seen = health.get("state")
    probe_family = Family("gpuops_relaunch_probe_health",
                          "1 for the health this relaunch run's probe saw before it acted, 0 for the others; "
                          "all 0 when it did not answer.")
    for word in HEALTH_WORDS:
        probe_family.add(1.0 if seen == word else 0.0, **labels, state=word)
    families: list[Family] = []
    if not summary.get("live_metrics"):
        # The job after the action: a relaunched job runs its new run, whose progress is not known yet.
        state = after.get("state", seen) if "state" in after else seen
        families = _health_families(health if state == seen and not summary.get("relaunched") else {}, labels,
                                    state, "after this relaunch run")

    recent = Family("gpuops_job_recent_relaunches", "Relaunches the crash-loop guard counts in its window, this run's included.")
    recent.add(_non_negative(_number(after.get("recent_relaunches", guard.get("recent")), "after.recent_relaunches")),
               **labels)
    limit = Family("gpuops_job_relaunch_limit", "The crash-loop guard's limit (max_relaunches in relaunch_window), where one is set.")
    limit.add(_non_negative(_number(guard.get("max_relaunches"), "relaunch_guard.max_relaunches")), **labels)

    last_run = Family(TIMESTAMP_METRIC, "When this relaunch run wrote the file, in seconds since the epoch.")
    last_run.add(now, **labels)
    action = "failed" if summary.get("failed") else str(summary.get("action") or "none")
    actions = Family("gpuops_relaunch_last_action", "1 for what this run did (none, relaunch, refused, failed), 0 for the others.")
    for word in ACTION_WORDS:
        actions.add(1.0 if action == word else 0.0, **labels, action=word)

    found = summary.get("found")
    found_family = Family("gpuops_relaunch_found",
                          "What it takes to clear what the clean-up found (escalation), 1 for it and 0 for the others; "
                          "only when the clean-up looked.")
    if found in ESCALATION_WORDS:
        for word in ESCALATION_WORDS:
            found_family.add(1.0 if found == word else 0.0, **labels, escalation=word)

    reset = Family("gpuops_relaunch_container_reset", "1 when this run rebooted the container, 0 when it did not.")
    if "container_reset" in summary:
        reset.add(1.0 if summary.get("container_reset") else 0.0, **labels)
    released = Family("gpuops_relaunch_gpu_released", "1 when the drain's last look found the GPUs released, 0 when not; "
                      "only when a drain ran.")
    if summary.get("gpu_released") is not None:
        released.add(1.0 if summary.get("gpu_released") else 0.0, **labels)

    memory = Family("gpuops_gpu_memory_used_mib", "GPU memory used at the drain's last look, in MiB.")
    for gpu, uuid, used in _gpu_rows(gpus):
        memory.add(used, **labels, gpu=gpu, uuid=uuid)

    # The GPU gate: each GPU it found bad (or kept quarantined) this run, 1 with what clears it; none when it did
    # not look or found all healthy.
    gate = summary.get("gpu_gate") if isinstance(summary.get("gpu_gate"), Mapping) else {}
    bad = Family("gpuops_relaunch_gpu_bad", "1 for each GPU the relaunch's GPU gate found bad or kept quarantined "
                 "this run, with what clears it (escalation).")
    for entry in gate.get("bad") or []:
        if isinstance(entry, Mapping) and entry.get("escalation") in ESCALATION_WORDS:
            bad.add(1.0, **labels, gpu=str(entry.get("index")), uuid=str(entry.get("uuid") or ""),
                    escalation=str(entry["escalation"]))

    return families + [recent, limit, last_run, actions, probe_family, found_family, reset, released, memory, bad,
                       *_checkpoint_families(summary.get("checkpoint"), labels)]


def _checkpoint_families(found: Any, labels: Mapping[str, str]) -> list[Family]:
    """The checkpoint this run resumed (the summary's ``checkpoint``, with train_launch's checkpoint_dir): its step,
    the torn ones skipped and the steps of work lost; nothing without one."""
    if not isinstance(found, Mapping):
        return []
    resumed = Family("gpuops_job_resumed_checkpoint_step", "The step of the checkpoint this relaunch resumed from.")
    resumed.add(_step(found.get("step")), **labels)
    torn = Family("gpuops_job_torn_checkpoints_skipped", "Torn checkpoints (a save cut short) newer than the one resumed.")
    torn.add(_non_negative(_number(found.get("torn_skipped"), "checkpoint.torn_skipped")), **labels)
    lost = Family("gpuops_job_work_lost_steps", "Steps of work lost: the last progress step before the failure minus "
                  "the step resumed.")
    lost.add(_step(found.get("work_lost_steps")), **labels)
    return [resumed, torn, lost]


def _gpu_rows(gpus: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, float | None]]:
    """(gpu label, uuid, used MiB) per GPU, ordered by index; BadOption naming `gpus` for a bad entry."""
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Sequence):
        raise BadOption("gpus", f"must be a list of mappings, got {type(gpus).__name__}")
    rows: list[tuple[tuple[float, str], str, str, float | None]] = []
    for position, gpu in enumerate(gpus):
        if not isinstance(gpu, Mapping):
            raise BadOption("gpus", f"element {position} must be a mapping, got {type(gpu).__name__}")
        index = gpu.get("index")
        uuid = "" if gpu.get("uuid") is None else str(gpu.get("uuid"))
        if index is None and not uuid:
            raise BadOption("gpus", f"element {position} has neither an index nor a uuid")
        number = _number(index, f"element {position}'s index", "gpus") if index is not None else None
        if number is not None and not (math.isfinite(number) and number >= 0 and number == int(number)):
            raise BadOption("gpus", f"element {position}'s index must be a whole number of 0 or more, got {index!r}")
        label = str(int(number)) if number is not None else uuid
        used = gpu.get("used_mib", gpu.get("used_mib_after"))
        rows.append(((number if number is not None else math.inf, uuid), label, uuid,
                     _non_negative(_number(used, f"element {position}'s used_mib", "gpus"))))
    labels = [label for _key, label, _uuid, _used in rows]
    doubled = sorted({label for label in labels if labels.count(label) > 1})
    if doubled:
        raise BadOption("gpus", f"GPU {', '.join(doubled)} is listed more than once")
    return [(label, uuid, used) for _key, label, uuid, used in sorted(rows, key=lambda row: row[0])]


# --- the text format --------------------------------------------------------------------------------


def escape_label_value(value: str) -> str:
    """A label value as the text format quotes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A finite sample value: a whole number without a fraction, anything else as Python's shortest repr."""
    if value == int(value) and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(value)


def render(families: Iterable[Family]) -> str:
    """The text exposition format of `families`, in their order; a family without samples is left out."""
    lines: list[str] = []
    for family in families:
        if not family.samples:
            continue
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for labels, value in family.samples:
            pairs = ",".join(f'{name}="{escape_label_value(text)}"' for name, text in labels)
            lines.append(f"{family.name}{{{pairs}}} {format_value(value)}" if pairs else f"{family.name} {format_value(value)}")
    return "".join(line + "\n" for line in lines)


def comparable(text: str) -> str:
    """`text` without the run's timestamp sample: what `changed` compares."""
    # Lines end at "\n" only, as the format says: a "\r" in a label value is part of the value.
    return "\n".join(line for line in text.split("\n")
                     if not line.startswith((TIMESTAMP_METRIC + "{", TIMESTAMP_METRIC + " ")))


# --- the file ---------------------------------------------------------------------------------------


def file_name(job: str, prefix: str = FILE_PREFIX) -> str:
    """gpuops_relaunch_JOB.prom (the relaunch's; LIVE_FILE_PREFIX for the job's live file,
    gpuops_job_JOB.prom); a name with characters outside [A-Za-z0-9_.-] has each replaced by _
    and a hash of the whole name appended, so two jobs never share a file. BadOption naming ``job``
    for an empty name or one too long for a file name."""
    if not isinstance(job, str) or not job:
        raise BadOption("job", "must be a non-empty job name")
    if len(job) > MAX_JOB_NAME:
        raise BadOption("job", f"is {len(job)} characters long; at most {MAX_JOB_NAME} make a file name")
    safe = _UNSAFE.sub("_", job)
    if safe != job:
        digest = hashlib.sha256(job.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        safe = f"{safe}-{digest}"
    return f"{prefix}{safe}{FILE_SUFFIX}"


@dataclass(frozen=True)
class Written:
    """What write_textfile did: the path, whether anything but the timestamp differs, whether it wrote,
    and the text that was there before (None: no regular file was there)."""

    path: str
    changed: bool
    written: bool
    before: str | None


def write_textfile(directory: str, name: str, text: str, check_mode: bool = False) -> Written:
    """Replace DIRECTORY/NAME with `text` (mode 0644) unless `check_mode`; see the module docstring.

    MetricsWriteError when the directory is not an existing directory reached safely, is not
    writable, or the write fails; nothing is left half-written.
    """
    path = os.path.join(directory, name)
    data = text.encode("utf-8", "replace")
    try:
        with safepath.walk(directory, listable=True) as parent:
            before = _read_regular(parent.fd, name)
            changed = before is None or comparable(before) != comparable(data.decode("utf-8"))
            if check_mode:
                return Written(path, changed, False, before)
            why = safepath.why_not_writable(parent.fd)
            if why:
                raise MetricsWriteError(f"{directory} {why}")
            safepath.write_atomic_at(parent.fd, name, data, 0o644)
            # The rename is on disk too: after a crash the collector finds the old file or the new one.
            os.fsync(parent.fd)
    except safepath.UnsafePath as exc:
        raise MetricsWriteError(f"{directory}: {exc}") from None
    except FileNotFoundError:
        raise MetricsWriteError(f"{directory} does not exist (it is the textfile collector's directory: "
                                f"it is not created here)") from None
    except OSError as exc:
        raise MetricsWriteError(f"cannot write {path}: {exc.strerror or exc}") from None
    return Written(path, changed, True, before)


def _read_regular(dir_fd: int, name: str) -> str | None:
    """The text of NAME if it is a regular file of ours to compare with; None for nothing, a symlink
    (never followed), anything else (open_regular_at refuses it without blocking on a FIFO), or a file
    too large to be one this module wrote."""
    try:
        fd = safepath.open_regular_at(dir_fd, name, os.O_RDONLY)
    except (safepath.NotRegularFile, OSError):
        return None
    try:
        chunks = []
        size = 0
        while size <= _MAX_READ:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > _MAX_READ:
            return None
        return b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(fd)
