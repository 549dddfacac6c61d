# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The demo's "last run": a hand-launched training run that died badly and left its mess behind.

Run as ``demo_stale_run.py RUN_SCRIPT``; RUN_SCRIPT (the demo job's path) only names the run on the
command line, the way ``python3 /root/train.py`` would. It detaches like ``nohup ... & disown``
(its own session, stdio on /dev/null) and then, for real:

* a data-loader worker that already exited and that the hung main process never waits for: a
  plain zombie (``Z``);
* a worker whose main thread exited while another thread runs on: a zombie leader (``Zl``), the
  state no signal to the zombie itself removes;
* a main process that hangs for ever.

The launching process prints one JSON line with the pids and exits, so the caller returns at once.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time


def wait_for_state(pid: int, state: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            stat = handle.read()
        if stat[stat.rindex(")") + 2] == state:
            return
        time.sleep(0.01)
    raise SystemExit(f"pid {pid} did not reach state {state}")


def linger() -> None:
    while True:
        time.sleep(3600)


def hung_main(report_fd: int) -> None:
    dead_worker = os.fork()
    if dead_worker == 0:
        os._exit(1)
    zl_worker = os.fork()
    if zl_worker == 0:
        threading.Thread(target=linger, name="pt_autograd_0").start()
        # ctypes drops the GIL around the call, so the other thread keeps running.
        ctypes.CDLL(None).pthread_exit(None)
    wait_for_state(dead_worker, "Z")
    wait_for_state(zl_worker, "Z")
    report = {"main": os.getpid(), "zombie": dead_worker, "zombie_leader": zl_worker}
    os.write(report_fd, (json.dumps(report) + "\n").encode())
    os.close(report_fd)
    linger()


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: demo_stale_run.py RUN_SCRIPT")
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.close(read_end)
        os.setsid()
        if os.fork() == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            hung_main(write_end)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, encoding="utf-8") as report:
        line = report.readline()
    if not line:
        raise SystemExit("the stale run did not start")
    sys.stdout.write(line)


if __name__ == "__main__":
    main()
