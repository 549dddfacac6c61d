# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Waiting for a real condition against a deadline: the one place this collection pauses.

Every wait polls what it waits for and gives up at a deadline; nothing sleeps a guessed time.
The clock and the sleep are parameters, so tests drive them without sleeping for real.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")
Clock = Callable[[], float]
Sleep = Callable[[float], None]

DEFAULT_INTERVAL = 0.1


def pause(seconds: float, sleep: Sleep = time.sleep) -> None:
    """Wait `seconds`, or not at all when nothing is left to wait."""
    if seconds > 0:
        sleep(seconds)


def backoff(first: float, factor: float, maximum: float) -> Iterator[float]:
    """Pauses that start at `first` and grow by `factor` up to `maximum`, for ever."""
    delay = first
    while True:
        yield min(delay, maximum)
        delay *= factor


class Deadline:
    """A point in monotonic time, and the polls that wait towards it without passing it."""

    def __init__(self, seconds: float, clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> None:
        if math.isnan(seconds):
            # Every comparison with NaN is false: such a deadline would never pass.
            raise ValueError("a deadline of NaN seconds never passes")
        self.clock = clock
        self.sleep = sleep
        self.started = clock()
        self.at = self.started + max(seconds, 0.0)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def remaining(self) -> float:
        return max(self.at - self.clock(), 0.0)

    def expired(self) -> bool:
        return self.clock() >= self.at

    def sooner(self, seconds: float) -> Deadline:
        """A deadline `seconds` from now on the same clock, but never later than this one."""
        other = Deadline(seconds, self.clock, self.sleep)
        other.at = min(other.at, self.at)
        return other

    def pause(self, interval: float = DEFAULT_INTERVAL, since: float | None = None) -> None:
        """Sleep until the next poll is due: `interval` after `since` (default: now), never past the deadline.

        With `since` the moment the last poll began, polls keep a fixed cadence however long each takes.
        """
        now = self.clock()
        if since is None:
            pause(min(interval, self.at - now), self.sleep)
        else:
            pause(min(since + interval, self.at) - now, self.sleep)

    def poll_for(
        self,
        probe: Callable[[], T | None],
        interval: float = DEFAULT_INTERVAL,
        growth: float = 1.0,
        max_interval: float | None = None,
    ) -> T | None:
        """Call `probe` until it returns something other than None (returned), or the deadline passes (None).

        The probe runs at least once, and once more at the deadline, so a condition that came true
        during the last interval is seen. With `growth` above 1 the interval grows up to `max_interval`.
        """
        intervals = backoff(interval, growth, interval if max_interval is None else max_interval)
        while True:
            result = probe()
            if result is not None:
                return result
            if self.expired():
                return None
            self.pause(next(intervals))

    def poll(self, condition: Callable[[], bool], interval: float = DEFAULT_INTERVAL) -> bool:
        """True as soon as `condition()` holds; False if it still does not at the deadline."""
        return self.poll_for(lambda: True if condition() else None, interval) is not None


def poll_until(
    condition: Callable[[], bool],
    timeout: float,
    interval: float = DEFAULT_INTERVAL,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> bool:
    """Check `condition` until it holds (True) or `timeout` seconds have passed (False)."""
    return Deadline(timeout, clock, sleep).poll(condition, interval)
