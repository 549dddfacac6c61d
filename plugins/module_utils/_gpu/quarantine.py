# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The host's GPU quarantine: GPUs the relaunch's gate found bad, kept out of later launches until a person
clears them, and when each GPU of this host was last reset by the gate.

One record per host, beside the jobs' state directories: ``STATE_DIR/gpu-quarantine.json`` (0600, owned by the
user the modules run as: root). Written like the jobs' records (``_base/safepath``): the directory walked from /
without following a link another user can change, the file replaced atomically, read only as a regular file with
no other hard link (O_NOFOLLOW, fstat), of the owner expected and bounded in size. A record that is not sound is
an error (QuarantineError), never read as "nothing quarantined": the gate then refuses, naming the file.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath

RECORD = "gpu-quarantine.json"
STATE_DIR_MODE = 0o700
MAX_RECORD_BYTES = 256 * 1024
VERSION = 1


class QuarantineError(OSError):
    """The record cannot be read or written soundly; str() names the file and why."""


def _empty() -> dict[str, Any]:
    return {"version": VERSION, "gpus": {}, "resets": {}}


def read(state_dir: str) -> dict[str, Any]:
    """The record ({"version", "gpus": {uuid: evidence + since}, "resets": {uuid: time}}); empty when there is none."""
    path = os.path.join(state_dir, RECORD)
    try:
        with safepath.walk(state_dir) as directory:
            fd = safepath.open_regular_at(directory.fd, RECORD, os.O_RDONLY)
    except FileNotFoundError:
        return _empty()
    except OSError as exc:
        raise QuarantineError(f"{path}: cannot be read safely: {exc}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise QuarantineError(f"{path}: owned by uid {info.st_uid}, not {os.geteuid()}: not this collection's record")
        if info.st_size > MAX_RECORD_BYTES:
            raise QuarantineError(f"{path}: {info.st_size} bytes, more than a record holds ({MAX_RECORD_BYTES})")
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise QuarantineError(f"{path}: not a JSON record ({exc})") from None
    if (not isinstance(record, dict) or not isinstance(record.get("gpus"), dict)
            or not isinstance(record.get("resets", {}), dict)
            or not all(isinstance(entry, dict) for entry in record["gpus"].values())):
        raise QuarantineError(f"{path}: not a quarantine record (gpus and resets must be mappings by UUID)")
    record.setdefault("resets", {})
    return record


def write(state_dir: str, record: Mapping[str, Any]) -> None:
    """Replace the record atomically (the state directory created 0700 where missing)."""
    data = json.dumps(dict(record, version=VERSION), sort_keys=True).encode("utf-8")
    try:
        with safepath.walk(state_dir, create_mode=STATE_DIR_MODE) as directory:
            safepath.write_atomic_at(directory.fd, RECORD, data)
    except OSError as exc:
        raise QuarantineError(f"{os.path.join(state_dir, RECORD)}: cannot be written safely: {exc}") from None


def added(record: Mapping[str, Any], bad: list[Mapping[str, Any]], now: float | None = None) -> dict[str, Any]:
    """The record with each GPU of `bad` (the gate's evidence) quarantined, since now unless it already was."""
    stamp = round(time.time() if now is None else now, 3)
    gpus = dict(record.get("gpus") or {})
    for entry in bad:
        uuid = str(entry.get("uuid") or "")
        if uuid and uuid not in gpus:
            gpus[uuid] = {key: entry.get(key) for key in ("index", "pci_bus_id", "escalation", "reasons", "xids",
                                                          "recovery_action", "remapped_rows")}
            gpus[uuid]["since"] = stamp
    return dict(record, gpus=gpus)


def with_resets(record: Mapping[str, Any], uuids: list[str], now: float | None = None) -> dict[str, Any]:
    """The record noting that the GPUs `uuids` were reset now (XIDs from before a reset are not counted again)."""
    stamp = round(time.time() if now is None else now, 3)
    return dict(record, resets=dict(record.get("resets") or {}, **{uuid: stamp for uuid in uuids if uuid}))


def with_launch(record: Mapping[str, Any], job: str, visible: str) -> dict[str, Any]:
    """The record noting the CUDA_VISIBLE_DEVICES the gate gave `job` ("" or no job: every GPU, nothing noted).
    The relaunch reads it before its probe, so that the probe compares the job's spec with that variable in it."""
    launched = dict(record.get("launched") or {})
    if visible:
        launched[job] = visible
    else:
        launched.pop(job, None)
    return dict(record, launched=launched)


def launched_on(record: Mapping[str, Any], job: str) -> str:
    """The CUDA_VISIBLE_DEVICES the gate last gave `job` ("" when it left no GPU out)."""
    value = (record.get("launched") or {}).get(job) if isinstance(record.get("launched"), dict) else None
    return value if isinstance(value, str) else ""


def last_reset(record: Mapping[str, Any]) -> float:
    """When a GPU of this host was last reset by the gate (0: never)."""
    times = [value for value in (record.get("resets") or {}).values() if isinstance(value, (int, float))]
    return float(max(times)) if times else 0.0
