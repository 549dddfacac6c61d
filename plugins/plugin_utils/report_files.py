# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Reports of a run written on the controller: JSON, whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


class ReportError(Exception):
    """The report could not be written (the message says where and why)."""


# The fleet's file: no summary file's name (HOST@JOB.json, with one '@') can be it.
FLEET_FILE = "fleet.json"
# Check mode's reports go to DIR/check/, so that they never replace a real run's (no report file is a directory).
CHECK_DIR = "check"
# What a file name part keeps as it is. Upper case is encoded too: on a file system that folds case (macOS'
# default) `Node1` and `node1` would be one file.
_KEPT = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_.~")


def file_name_part(text: str) -> str:
    """`text` as part of a file name: percent-encoded (RFC 3986, as ``urllib.parse.quote``) but for lower case
    letters, digits, ``-``, ``_``, ``~`` and a ``.`` that does not lead. Never contains ``/``, ``@`` or a control
    character, never starts with ``.``; different texts give names that differ even when case is folded, and
    ``urllib.parse.unquote`` gives the text back."""
    encoded = []
    for index, byte in enumerate(text.encode("utf-8", "surrogatepass")):
        keep = byte in _KEPT and not (index == 0 and byte == ord("."))
        encoded.append(chr(byte) if keep else f"%{byte:02X}")
    return "".join(encoded)


def summary_file_name(host: str, job: str) -> str:
    """A host's summary file for one job: HOST@JOB.json, both encoded (file_name_part): one file per host and
    job, inside the directory whatever the names, and never the fleet's."""
    if not job:
        raise ValueError("a summary file needs the job's name (job_name)")
    return f"{file_name_part(host)}@{file_name_part(job)}.json"


def report_dir(directory: str, check_mode: bool) -> str:
    """Where a run's reports go: DIRECTORY, or in check mode DIRECTORY/check."""
    return os.path.join(directory, CHECK_DIR) if check_mode else directory


def write_report(directory: str, name: str, data: Any) -> str:
    """Write `data` as JSON to DIRECTORY/NAME (mode 0644) through a temporary file in the same
    directory and a rename, so that a reader never sees half a report and a symlink planted at the
    name is replaced, not followed. Creates the directory. Returns the path."""
    path = os.path.join(directory, name)
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as stream:
                json.dump(data, stream, indent=4, sort_keys=True)
                stream.write("\n")
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except (OSError, TypeError, ValueError) as exc:
        raise ReportError(f"cannot write {path}: {exc}") from None
    return path
