# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A reaping parent for the stale run, inside the never-reaping PID namespace.

Starts the argv in ``MOLECULE_STALE_ARGV`` (JSON; it is not on this process's own command line,
so the role's match never selects the reaper) under a detached child subreaper that reaps
whatever is orphaned to it, for ever: what process_cleanup ends is then reaped, as under a
container init that reaps. Prints the stale run's output (its report line) and returns.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def reap_for_ever() -> None:
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.2)


def main() -> None:
    argv = json.loads(os.environ["MOLECULE_STALE_ARGV"])
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.close(read_end)
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        devnull = os.open(os.devnull, os.O_RDWR)
        if os.fork() == 0:
            os.dup2(devnull, 0)
            os.dup2(write_end, 1)
            os.dup2(devnull, 2)
            os.execvp(argv[0], argv)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(write_end)
        reap_for_ever()
    os.close(write_end)
    with os.fdopen(read_end, encoding="utf-8") as output:
        sys.stdout.write(output.read())


if __name__ == "__main__":
    main()
