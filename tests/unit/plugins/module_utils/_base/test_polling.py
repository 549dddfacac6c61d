"""The shared deadline and poll, on a fake clock: exact, and without sleeping for real."""

from __future__ import annotations

from itertools import islice

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import (
    Deadline,
    backoff,
    pause,
    poll_until,
)
from tests.harness.clock import FakeClock


def test_poll_until_stops_as_soon_as_the_condition_holds():
    clock = FakeClock()
    assert poll_until(lambda: clock.now >= 0.2, 10, 0.05, clock, clock.sleep)
    assert 0.2 <= clock.now < 0.3


def test_poll_until_gives_up_at_the_deadline_without_oversleeping():
    clock = FakeClock()
    looks = []
    assert not poll_until(lambda: looks.append(clock.now) or False, 1.01, 0.05, clock, clock.sleep)
    assert clock.now == pytest.approx(1.01)
    assert max(clock.sleeps) <= 0.05 + 1e-9
    assert looks[-1] == pytest.approx(1.01)  # one last look at the deadline


def test_poll_until_with_zero_timeout_looks_once():
    clock = FakeClock()
    calls = []
    assert not poll_until(lambda: calls.append(1) or False, 0, 0.05, clock, clock.sleep)
    assert calls == [1] and clock.sleeps == []


def test_deadline_poll():
    clock = FakeClock()
    deadline = Deadline(1.0, clock, clock.sleep)
    assert deadline.poll(lambda: clock.now >= 0.5) is True
    assert 0.5 <= clock.now < 0.7
    assert Deadline(1.0, clock, clock.sleep).poll(lambda: False) is False
    assert deadline.remaining() == 0.0 and deadline.expired()
    assert deadline.elapsed() == pytest.approx(clock.now)


def test_poll_for_returns_what_the_probe_found():
    clock = FakeClock(1000.0)
    deadline = Deadline(60, clock, clock.sleep)
    assert deadline.poll_for(lambda: "done" if clock() >= 1001 else None, interval=0.5) == "done"
    assert clock.now < 1003


def test_growing_interval_stops_at_the_deadline_and_never_sleeps_past_it():
    clock = FakeClock(1000.0)
    probes = []
    deadline = Deadline(2.0, clock, clock.sleep)
    assert deadline.poll_for(lambda: probes.append(clock()), interval=0.3, growth=1.5, max_interval=1.0) is None
    assert clock.now == pytest.approx(1002.0)
    assert clock.sleeps[:3] == pytest.approx([0.3, 0.45, 0.675])  # it backs off ...
    assert max(clock.sleeps) <= 1.0  # ... up to the largest interval
    assert probes[-1] == pytest.approx(1002.0)  # one last look at the deadline


def test_pause_since_keeps_a_fixed_cadence_and_ends_at_the_deadline():
    clock = FakeClock(100.0)
    deadline = Deadline(1.2, clock, clock.sleep)
    polled_at = clock()
    clock.now += 0.2  # the poll itself took a while
    deadline.pause(0.5, since=polled_at)
    assert clock.now == pytest.approx(100.5)
    deadline.pause(0.5)
    deadline.pause(0.5)
    assert clock.sleeps == pytest.approx([0.3, 0.5, 0.2])  # the last pause ends at the deadline
    deadline.pause(0.5)
    assert len(clock.sleeps) == 3  # nothing left to wait: no sleep at all


def test_sooner_deadline_never_outlasts_its_parent():
    clock = FakeClock()
    parent = Deadline(5, clock, clock.sleep)
    assert parent.sooner(100).remaining() == pytest.approx(5)
    assert parent.sooner(1).remaining() == pytest.approx(1)
    child = parent.sooner(1)
    child.pause(10)
    assert clock.now == pytest.approx(1)  # it sleeps on the parent's clock


def test_negative_timeout_is_already_expired():
    clock = FakeClock()
    deadline = Deadline(-3, clock, clock.sleep)
    assert deadline.expired() and deadline.remaining() == 0.0


def test_backoff_grows_to_its_maximum():
    assert list(islice(backoff(0.5, 2.0, 5.0), 6)) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert list(islice(backoff(0.2, 1.0, 0.2), 3)) == [0.2, 0.2, 0.2]


def test_pause_skips_what_is_not_a_wait():
    clock = FakeClock()
    pause(0, clock.sleep)
    pause(-1, clock.sleep)
    pause(0.25, clock.sleep)
    assert clock.sleeps == [0.25]
