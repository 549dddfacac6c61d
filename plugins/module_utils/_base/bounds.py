# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one check for every number of seconds a user gives: finite, and within documented bounds.

``value < 0`` lets NaN through (every comparison with NaN is false), and a deadline of NaN or
infinity never passes: the task would hang. A poll interval of a nanosecond spins a core. So every
timeout is finite and at most a day, and every poll interval at least 10 ms.

These are the number rules of ``options.OptionChecks``: BoundsError is a BadOption, so a module
that runs them through its checks reports each bad number with every other problem, once.
"""

from __future__ import annotations

import math
from typing import Any

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption

MAX_TIMEOUT = 86400.0
MIN_POLL_INTERVAL = 0.01
MAX_POLL_INTERVAL = 3600.0


class BoundsError(BadOption):
    """A number out of its documented range; the message names the option (a ValueError too)."""


def check_seconds(option: str, value: Any, minimum: float = 0.0, maximum: float = MAX_TIMEOUT,
                  allow_minimum: bool = True) -> float:
    """`value` as float seconds if it is finite and within [minimum, maximum]; BoundsError otherwise.

    With `allow_minimum` false the minimum itself is refused (a value must be more than it).
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise BoundsError(option, f"{value!r} is not a number of seconds") from None
    if not math.isfinite(seconds):
        raise BoundsError(option, f"must be a finite number of seconds, got {value!r}")
    low_ok = seconds >= minimum if allow_minimum else seconds > minimum
    if not low_ok or seconds > maximum:
        low = f"at least {minimum:g}" if allow_minimum else f"more than {minimum:g}"
        raise BoundsError(option, f"must be {low} and at most {maximum:g} seconds, got {seconds:g}")
    return seconds


def check_timeout(option: str, value: Any, maximum: float = MAX_TIMEOUT) -> float:
    """A deadline in seconds: 0 up to a day (or `maximum`)."""
    return check_seconds(option, value, 0.0, maximum)


def check_poll_interval(option: str, value: Any) -> float:
    """A pause between polls: at least 10 ms (a shorter one only burns a core), at most an hour."""
    return check_seconds(option, value, MIN_POLL_INTERVAL, MAX_POLL_INTERVAL)
