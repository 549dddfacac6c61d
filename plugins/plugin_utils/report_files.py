# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Reports of a run written on the controller: JSON, whole or not at all."""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import stat
import tempfile
from typing import Any, Mapping

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath


class ReportError(Exception):
    """The report could not be written (the message says where and why)."""


# The fleet's file: no summary file's name (HOST@JOB.json, with one '@') can be it.
FLEET_FILE = "fleet.json"
# A part of a fleet (one job of an AWX workflow, e.g. one slice of a sliced job template): fleet-PART.json, with no
# '@' either, so that parallel jobs writing into one directory never replace each other's fleet.
FLEET_PART_PREFIX = "fleet-"
# The set_stats key of a part's fleet: gpuops_fleet_awx_job_ID (the AWX job's id), unique in a workflow. Not
# relaunch_*: a later relaunch in the workflow gets it as an extra var, and relaunch_* names are checked there.
FLEET_STATS_PREFIX = "gpuops_fleet_awx_job_"
# A fleet file larger than this is no fleet file of ours (10,000 hosts make about 3 MB).
MAX_REPORT_BYTES = 64 * 1024 * 1024
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


def fleet_part(awx: Mapping[str, Any]) -> str:
    """The part of a fleet a run is, by what AWX tells it (relaunch_flow.awx_job): "" (the whole fleet: outside
    AWX, or an AWX job of no workflow, which no other job shares a fleet with) or, for a job that is a node of a
    workflow job (every slice job of a sliced job template is), "awx-workflow-W-job-J"."""
    if not awx or awx.get("workflow_job") is None:
        return ""
    return workflow_part(awx["workflow_job"], awx["job"])


def workflow_part(workflow_job: Any, job: Any = None) -> str:
    """The part name of an AWX workflow job's fleet: awx-workflow-W, the whole (what fleet_merge writes), or
    awx-workflow-W-job-J, one of its jobs (a slice)."""
    whole = f"awx-workflow-{workflow_job}"
    return whole if job is None else f"{whole}-job-{job}"


def fleet_file_name(part: str = "") -> str:
    """The fleet file of a part (fleet_part): fleet.json for the whole fleet, else fleet-PART.json (PART encoded
    as file_name_part). No summary file's name (one '@') can be either."""
    return f"{FLEET_PART_PREFIX}{file_name_part(part)}.json" if part else FLEET_FILE


def workflow_part_pattern(workflow_job: str) -> str:
    """The fnmatch pattern of the fleet files of every job of an AWX workflow job (its slices)."""
    return f"{FLEET_PART_PREFIX}{file_name_part(workflow_part(workflow_job, ''))}*.json"


def plain_file_name(name: str, what: str) -> str:
    """`name` when it names a file inside a directory (no '/', not '.' or '..', no NUL), else ReportError."""
    if not isinstance(name, str) or not name or "/" in name or "\x00" in name or name in (".", ".."):
        raise ReportError(f"{what} must be a file name inside the directory, not {json.dumps(name)}")
    return name


def list_reports(directory: str, pattern: str) -> list[str]:
    """The names in `directory` that match the fnmatch `pattern` (case-sensitive), sorted."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise ReportError(f"cannot list {directory}: {exc.strerror or exc}") from None
    return sorted(name for name in names if fnmatch.fnmatchcase(name, pattern))


def read_report(directory: str, name: str) -> Any:
    """The JSON of DIRECTORY/NAME, which must be a regular file (a symlink is not followed: an error, as a
    directory, a FIFO or a device is) of at most MAX_REPORT_BYTES. ReportError says which file and why."""
    path = os.path.join(directory, plain_file_name(name, "a report file"))
    try:
        # Walked from / as the state records are: a link on the way that another user can change is refused.
        directory_walked = safepath.walk(directory)
    except OSError as exc:
        raise ReportError(f"cannot open the directory {directory}: {exc.strerror or exc}") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory_walked.fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ReportError(f"{path} is a symbolic link, not a report file (links are not followed)") from None
        raise ReportError(f"cannot open {path}: {exc.strerror or exc}") from None
    finally:
        directory_walked.close()
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # before fdopen, which refuses a directory with its own error
            raise ReportError(f"{path} is not a regular file")
        if info.st_size > MAX_REPORT_BYTES:
            raise ReportError(f"{path} is {info.st_size} bytes, more than a report has ({MAX_REPORT_BYTES})")
        with os.fdopen(os.dup(fd), "rb") as stream:
            data = stream.read(MAX_REPORT_BYTES + 1)
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"{path} is not JSON: {exc}") from None
    except RecursionError:
        raise ReportError(f"{path} is not a report: it is nested too deeply to read") from None
