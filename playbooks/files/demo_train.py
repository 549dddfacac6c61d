# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""A stand-in training job for the demo and the tests.

Prints a few set-up lines, then "step 1 loss=..." (the ready line), then a step line every
--step-interval seconds until SIGTERM. It can start worker processes the way data loaders do and
orphan them (their parent exits at once, so they are adopted by the nearest subreaper, or by PID 1),
end with a given exit code after a while, never print the ready line, or ignore SIGTERM.

It also shows each health case of gpuops.relaunch.train_launch for real:

* --stall-at-step N: after step N it prints no more steps but stays alive (a hung collective: one
  thread waits for ever on a lock), still ending on SIGTERM unless --ignore-term; with
  --stall-chatter S it goes on printing a line that is not a step every S seconds, as a watchdog's
  warnings do;
* --crash-at-step N: after step N it exits with --exit-code (1 unless given);
* --finish-at-step N: after step N it exits with 0 (training done);
* --resume WHAT: prints "resuming from WHAT" first (what resume_args would pass);
* --rendezvous: one rank of a multi-rank job. The ranks (MASTER_ADDR, MASTER_PORT, NODE_RANK and
  NNODES, as the relaunch gives them) meet before the first step and exchange a byte before every
  step, as a collective does: a rank whose peer is gone exits with 1, as a job does when NCCL loses
  a peer, and a rank whose peer is held still waits (a hung collective).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import threading
import time


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=3, help="set-up lines before the first step")
    parser.add_argument("--ready-after", type=float, default=0.5, help="seconds before 'step 1'")
    parser.add_argument("--no-ready", action="store_true", help="never print a step line")
    parser.add_argument("--step-interval", type=float, default=1.0)
    parser.add_argument("--exit-after", type=float, help="exit after this many seconds ...")
    parser.add_argument("--exit-code", type=int, help="... with this code (0 for --exit-after, 1 for --crash-at-step)")
    parser.add_argument("--stall-at-step", type=int, help="after this step print no more steps, but stay alive")
    parser.add_argument("--stall-chatter", type=float, help="while stalled, print a non-step line every this many seconds")
    parser.add_argument("--crash-at-step", type=int, help="after this step exit with --exit-code (default 1)")
    parser.add_argument("--finish-at-step", type=int, help="after this step exit with 0")
    parser.add_argument("--resume", help="say 'resuming from RESUME' before the first step")
    parser.add_argument("--workers", type=int, default=0, help="orphaned worker processes to start")
    parser.add_argument("--worker-seconds", type=float, default=1.0, help="how long each worker lives")
    parser.add_argument("--worker-setsid", action="store_true", help="workers leave the job's process group")
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (only SIGKILL ends it)")
    parser.add_argument("--pid-file", help="write each worker's pid here, one per line")
    parser.add_argument("--rendezvous", action="store_true", help="meet the other ranks first, exchange a byte each step")
    parser.add_argument("--rendezvous-timeout", type=float, default=60.0, help="give up (exit 2) after this many seconds")
    parser.add_argument("--step-padding", type=int, default=0,
                        help="end each step line with this many bytes (a job that prints lines of megabytes)")
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


class Ranks:
    """This rank's connections to its peers: rank 0 to every other rank, the others to rank 0."""

    def __init__(self, stopping: list[int]) -> None:
        self.addr = os.environ["MASTER_ADDR"]
        self.port = int(os.environ["MASTER_PORT"])
        self.rank = int(os.environ["NODE_RANK"])
        self.size = int(os.environ["NNODES"])
        self.stopping = stopping
        self.peers: list[socket.socket] = []

    def meet(self, timeout: float) -> bool:
        """Connect to every peer; False when stopped or past `timeout` first."""
        deadline = time.monotonic() + timeout
        if self.rank == 0:
            with socket.create_server((self.addr, self.port)) as server:
                server.settimeout(0.1)
                while len(self.peers) < self.size - 1:
                    if self.stopping or time.monotonic() > deadline:
                        return False
                    try:
                        self.peers.append(server.accept()[0])
                    except socket.timeout:
                        continue
            return True
        while not self.peers:
            if self.stopping or time.monotonic() > deadline:
                return False
            try:
                self.peers.append(socket.create_connection((self.addr, self.port), timeout=1))
            except OSError:
                time.sleep(0.1)
        return True

    def exchange(self) -> bool | None:
        """One collective: True when every peer took part, False when one is gone, None when stopped meanwhile."""
        if self.rank == 0:
            for peer in self.peers:
                got = self._receive(peer)
                if got is not True:
                    return got
            return all(self._send(peer) for peer in self.peers)
        return self._send(self.peers[0]) and self._receive(self.peers[0])

    @staticmethod
    def _send(peer: socket.socket) -> bool:
        try:
            peer.sendall(b".")
        except OSError:
            return False
        return True

    def _receive(self, peer: socket.socket) -> bool | None:
        while not self.stopping:
            if select.select([peer], [], [], 0.1)[0]:
                try:
                    return peer.recv(1) == b"."
                except OSError:
                    return False
        return None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    stopping = []
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    started = time.monotonic()
    say(f"demo_train pid {os.getpid()} pgid {os.getpgrp()} starting")
    if args.resume is not None:
        say(f"resuming from {args.resume}")
    for number in range(args.lines):
        say(f"setup {number + 1}/{args.lines}")
    for _worker in range(args.workers):
        start_orphaned_worker(args.worker_seconds, args.worker_setsid, args.pid_file)
    ranks = Ranks(stopping) if args.rendezvous else None
    if ranks is not None:
        if not ranks.meet(args.rendezvous_timeout):
            say(f"rank {ranks.rank}: the other ranks did not meet at {ranks.addr}:{ranks.port}")
            return 2
        say(f"rendezvous: rank {ranks.rank} of {ranks.size} at {ranks.addr}:{ranks.port}")
    step = 0
    stalled = False
    next_step = started + args.ready_after
    while not stopping:
        now = time.monotonic()
        if args.exit_after is not None and now - started >= args.exit_after:
            code = 0 if args.exit_code is None else args.exit_code
            say(f"exiting with code {code}")
            return code
        if stalled and args.stall_chatter and now >= next_step:
            say(f"still waiting for allreduce after step {step}")
            next_step = now + args.stall_chatter
        if not args.no_ready and not stalled and now >= next_step:
            if ranks is not None:
                together = ranks.exchange()
                if together is None:
                    break
                if not together:
                    say(f"rank {ranks.rank}: a peer is gone after step {step}")
                    return 1
            step += 1
            say(f"step {step} loss={2.5 / step:.4f}" + (" " + "#" * args.step_padding if args.step_padding else ""))
            next_step = now + args.step_interval
            if step == args.finish_at_step:
                say(f"finished after step {step}")
                return 0
            if step == args.crash_at_step:
                code = 1 if args.exit_code is None else args.exit_code
                say(f"crashing after step {step} with code {code}")
                return code
            if step == args.stall_at_step:
                stalled = True
                say(f"stalling after step {step}")
                # Like a collective that never completes: a thread blocked for ever on a lock.
                threading.Thread(target=threading.Event().wait, name="allreduce", daemon=True).start()
        time.sleep(0.05)
    say(f"got signal {stopping[0]}, stopping after step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
