"""_base/options.py: every problem gathered, each naming its option; nothing but BadOption caught."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.bounds import BoundsError, check_timeout
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import (
    BadOption,
    OptionChecks,
    OptionsInvalid,
)


def test_every_problem_is_kept_and_reported_once() -> None:
    checks = OptionChecks()
    assert checks.check(check_timeout, "timeout", 5) == 5.0
    assert checks.check(check_timeout, "timeout", float("nan")) is None
    assert checks.check(check_timeout, "lock_timeout", -1) is None
    checks.add("vmid", "must be 100 or more, got 5")
    with pytest.raises(OptionsInvalid) as caught:
        checks.raise_if_any()
    assert caught.value.options == ["timeout", "lock_timeout", "vmid"]
    assert str(caught.value) == ("timeout: must be a finite number of seconds, got nan; "
                                 "lock_timeout: must be at least 0 and at most 86400 seconds, got -1; "
                                 "vmid: must be 100 or more, got 5")
    result = caught.value.as_result()
    assert result["msg"] == str(caught.value)
    assert result["option_problems"][2] == {"option": "vmid", "reason": "must be 100 or more, got 5"}


def test_no_problem_raises_nothing() -> None:
    checks = OptionChecks()
    checks.check(check_timeout, "timeout", 0)
    checks.raise_if_any()
    assert not checks.failed()


def test_failed_names_options() -> None:
    checks = OptionChecks()
    checks.add("user", "no such user 'x'")
    assert checks.failed() and checks.failed("user", "group") and not checks.failed("group")


def test_a_bounds_error_is_a_bad_option_and_still_a_value_error() -> None:
    with pytest.raises(BoundsError) as caught:
        check_timeout("term_timeout", float("inf"))
    assert isinstance(caught.value, BadOption) and isinstance(caught.value, ValueError)
    assert caught.value.option == "term_timeout" and str(caught.value).startswith("term_timeout: ")


@pytest.mark.parametrize("internal", [ValueError("int() of a bug"), KeyError("x"), OSError("disk")])
def test_an_internal_error_is_never_reported_as_a_bad_option(internal) -> None:
    def rule() -> None:
        raise internal

    checks = OptionChecks()
    with pytest.raises(type(internal)) as caught:
        checks.check(rule)
    assert not isinstance(caught.value, (BadOption, OptionsInvalid)) and checks.problems == []
