"""The one check for numbers of seconds: finite, within the documented bounds, the option named."""

from __future__ import annotations

import math

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import (
    MAX_TIMEOUT,
    MIN_POLL_INTERVAL,
    BoundsError,
    check_poll_interval,
    check_seconds,
    check_timeout,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.polling import Deadline


@pytest.mark.parametrize("value, words", [
    (float("nan"), "must be a finite number of seconds, got nan"),
    (float("inf"), "must be a finite number of seconds, got inf"),
    (float("-inf"), "must be a finite number of seconds, got -inf"),
    ("nan", "must be a finite number of seconds, got 'nan'"),
    (1e12, "must be at least 0 and at most 86400 seconds, got 1e+12"),
    (86400.5, "at most 86400 seconds, got 86400.5"),
    (-1, "must be at least 0 and at most 86400 seconds, got -1"),
    (-0.001, "got -0.001"),
    ("soon", "'soon' is not a number of seconds"),
    (None, "None is not a number of seconds"),
])
def test_bad_timeouts_name_the_option_and_the_value(value, words):
    with pytest.raises(BoundsError) as caught:
        check_timeout("wait_timeout", value)
    assert str(caught.value).startswith("wait_timeout: ")
    assert words in str(caught.value)
    assert isinstance(caught.value, ValueError)  # callers that catch ValueError see it too


@pytest.mark.parametrize("value, expected", [(0, 0.0), (2.5, 2.5), ("30", 30.0), (MAX_TIMEOUT, 86400.0)])
def test_good_timeouts_come_back_as_float(value, expected):
    seconds = check_timeout("timeout", value)
    assert seconds == expected and isinstance(seconds, float)


def test_a_timeout_may_have_a_smaller_maximum():
    assert check_timeout("orphan_grace", 600, maximum=600) == 600.0
    with pytest.raises(BoundsError, match="orphan_grace: must be at least 0 and at most 600 seconds, got 601"):
        check_timeout("orphan_grace", 601, maximum=600)


def test_the_minimum_itself_may_be_refused():
    with pytest.raises(BoundsError, match="api_timeout: must be more than 0 and at most 86400 seconds, got 0"):
        check_seconds("api_timeout", 0, allow_minimum=False)
    assert check_seconds("api_timeout", 0.5, allow_minimum=False) == 0.5


@pytest.mark.parametrize("value", [0, 1e-9, 0.009, -1, float("nan"), float("inf"), 3600.5])
def test_poll_intervals_have_a_floor_and_a_ceiling(value):
    with pytest.raises(BoundsError, match=r"^poll_interval: "):
        check_poll_interval("poll_interval", value)


def test_poll_interval_floor_is_ten_milliseconds():
    assert MIN_POLL_INTERVAL == 0.01
    assert check_poll_interval("poll_interval", 0.01) == 0.01
    assert check_poll_interval("poll_interval", 3600) == 3600.0


def test_a_deadline_of_nan_is_refused_and_one_of_infinity_never_gets_that_far():
    with pytest.raises(ValueError, match="NaN"):
        Deadline(float("nan"))
    # What check_timeout exists for: an infinite deadline would be accepted by Deadline and never pass.
    assert math.isinf(Deadline(float("inf")).remaining())
    with pytest.raises(BoundsError):
        check_timeout("timeout", float("inf"))
