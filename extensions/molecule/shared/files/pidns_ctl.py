# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Start or end a Molecule instance: a PID namespace whose init (``sleep infinity``) never reaps.

``pidns_ctl.py start STATE`` starts ``unshare --pid --fork --mount-proc sleep infinity`` in a session
of its own and records the init's host pid and start time in STATE (JSON); an instance that already
runs is left alone. ``pidns_ctl.py stop STATE`` sends SIGKILL to the recorded init, only if the pid
still has the recorded start time (a reused pid is never signalled), waits until it is gone (the
kernel then ends everything inside the namespace) and removes STATE. Each prints one JSON line
with ``changed``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat, or None when the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text(encoding="utf-8").split()]
    except OSError:
        return []


def alive(record: dict) -> bool:
    return starttime(record["pid"]) == record["starttime"]


def read(state: Path) -> dict | None:
    try:
        return json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def start(state: Path) -> dict:
    record = read(state)
    if record is not None and alive(record):
        return {"changed": False, **record}
    unshare = subprocess.Popen(  # pylint: disable=consider-using-with
        ["unshare", "--pid", "--fork", "--mount-proc", "sleep", "infinity"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in children(unshare.pid):
            # Until exec the child still runs unshare's image.
            if comm(pid) not in (None, "unshare") and starttime(pid) is not None:
                record = {"pid": pid, "starttime": starttime(pid),
                          "unshare_pid": unshare.pid, "unshare_starttime": starttime(unshare.pid)}
                state.write_text(json.dumps(record) + "\n", encoding="utf-8")
                return {"changed": True, **record}
        if unshare.poll() is not None:
            raise SystemExit(f"unshare exited with {unshare.returncode} before its init appeared")
        time.sleep(0.02)
    unshare.kill()
    unshare.wait(timeout=30)
    raise SystemExit("the PID namespace init did not appear within 30 s")


def stop(state: Path) -> dict:
    record = read(state)
    if record is None:
        return {"changed": False}
    changed = False
    if alive(record):
        os.kill(record["pid"], signal.SIGKILL)
        changed = True
    deadline = time.monotonic() + 30
    unshare = {"pid": record["unshare_pid"], "starttime": record["unshare_starttime"]}
    while alive(record) or alive(unshare):
        if time.monotonic() > deadline:
            raise SystemExit(f"pid {record['pid']} or its unshare {unshare['pid']} is still there after 30 s")
        time.sleep(0.02)
    state.unlink()
    return {"changed": changed, **record}


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        raise SystemExit("usage: pidns_ctl.py start|stop STATE")
    result = (start if sys.argv[1] == "start" else stop)(Path(sys.argv[2]))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
