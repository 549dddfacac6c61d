"""A fake monotonic clock for unit tests of code that polls: it moves only when slept on."""

from __future__ import annotations

from typing import Callable


class FakeClock:
    """Call it for the time; pass its `sleep` where the code under test would sleep.

    Each sleep is recorded and moves the time on at once, then runs the `on_sleep` actions with the
    new time (a log line appearing, a zombie being reaped), so a wait can be checked exactly and
    without waiting.
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.sleeps: list[float] = []
        self.on_sleep: list[Callable[[float], None]] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        for action in list(self.on_sleep):
            action(self.now)
