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
