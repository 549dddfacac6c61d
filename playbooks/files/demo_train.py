# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A stand-in training job for the demo and the tests.

Prints a few set-up lines, then "step 1 loss=..." (the ready line), then a step line every
--step-interval seconds until SIGTERM. It can start worker processes the way data loaders do and
orphan them (their parent exits at once, so they are adopted by the nearest subreaper, or by PID 1),
end with a given exit code after a while, never print the ready line, or ignore SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=3, help="set-up lines before the first step")
    parser.add_argument("--ready-after", type=float, default=0.5, help="seconds before 'step 1'")
    parser.add_argument("--no-ready", action="store_true", help="never print a step line")
    parser.add_argument("--step-interval", type=float, default=1.0)
    parser.add_argument("--exit-after", type=float, help="exit after this many seconds ...")
    parser.add_argument("--exit-code", type=int, default=0, help="... with this code")
    parser.add_argument("--workers", type=int, default=0, help="orphaned worker processes to start")
    parser.add_argument("--worker-seconds", type=float, default=1.0, help="how long each worker lives")
    parser.add_argument("--worker-setsid", action="store_true", help="workers leave the job's process group")
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (only SIGKILL ends it)")
    parser.add_argument("--pid-file", help="write each worker's pid here, one per line")
    parser.add_argument("--tag", help="ignored: lets a test find its own processes by command line")
    return parser.parse_args(argv)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def start_orphaned_worker(seconds: float, setsid: bool, pid_file: str | None) -> None:
    """Fork a worker whose parent exits at once: the worker is an orphan from its first moment."""
    middle = os.fork()
    if middle == 0:
        if setsid:
            os.setsid()
        worker = os.fork()
        if worker == 0:
            if pid_file:
                with open(pid_file, "a", encoding="utf-8") as handle:
                    handle.write(f"{os.getpid()}\n")
            say(f"worker {os.getpid()} running for {seconds:g}s")
            time.sleep(seconds)
            os._exit(0)  # pylint: disable=protected-access
        os._exit(0)  # pylint: disable=protected-access
    os.waitpid(middle, 0)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    stopping = []
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    started = time.monotonic()
    say(f"demo_train pid {os.getpid()} pgid {os.getpgrp()} starting")
    for number in range(args.lines):
        say(f"setup {number + 1}/{args.lines}")
    for _worker in range(args.workers):
        start_orphaned_worker(args.worker_seconds, args.worker_setsid, args.pid_file)
    step = 0
    next_step = started + args.ready_after
    while not stopping:
        now = time.monotonic()
        if args.exit_after is not None and now - started >= args.exit_after:
            say(f"exiting with code {args.exit_code}")
            return args.exit_code
        if not args.no_ready and now >= next_step:
            step += 1
            say(f"step {step} loss={2.5 / step:.4f}")
            next_step = now + args.step_interval
        time.sleep(0.05)
    say(f"got signal {stopping[0]}, stopping after step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
