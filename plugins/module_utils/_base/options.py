# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one way a module checks its options: gather every problem, then fail once naming each option.

A rule is a plain function that returns the checked value or raises BadOption (the option's name
and what is wrong with the value the user gave). OptionChecks runs the rules, keeps every
BadOption and lets the module fail once with all of them, so a task with three mistakes needs one
run to see them, not three.

Only BadOption is caught. A ValueError, KeyError or OSError out of a rule is a bug (or the machine
failing), not the user's mistake, and must never come back as "bad option": it propagates. So a
rule keeps its own ``try`` as narrow as the one call whose failure means "the user's value is
wrong" (``pwd.getpwnam`` for a user name, ``re.compile`` for a pattern) and raises BadOption there.
The number rules of ``bounds`` raise BoundsError, which is a BadOption.

A module uses it like this::

    checks = OptionChecks()
    timeout = checks.check(check_timeout, "timeout", params["timeout"])
    if params["vmid"] < 100:
        checks.add("vmid", f"must be 100 or more, got {params['vmid']}")
    checks.raise_if_any()          # OptionsInvalid, listing all of them

and fails on them with ``fail_on_invalid_options``::

    with fail_on_invalid_options(module, changed=False):
        options = options_from_params(module.params)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")


class BadOption(ValueError):
    """A value the user gave that cannot be used; str() is "option: reason".

    The reason says what is wrong without repeating a secret's value.
    """

    def __init__(self, option: str, reason: str) -> None:
        self.option = option
        self.reason = reason
        super().__init__(f"{option}: {reason}")

    def as_dict(self) -> dict[str, str]:
        return {"option": self.option, "reason": self.reason}


class OptionsInvalid(Exception):
    """Every problem found with a module's options (at least one); str() lists them all."""

    def __init__(self, problems: list[BadOption]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(str(problem) for problem in self.problems))

    @property
    def options(self) -> list[str]:
        """The names of the options with a problem, each once, in the order found."""
        return list(dict.fromkeys(problem.option for problem in self.problems))

    def as_result(self) -> dict[str, Any]:
        """What a module's fail_json takes: `msg` and the structured `option_problems`."""
        return {"msg": str(self), "option_problems": [problem.as_dict() for problem in self.problems]}


@contextmanager
def fail_on_invalid_options(module: Any, **result: Any) -> Iterator[None]:
    """Fail `module` (its ``fail_json``, with `result`) on an OptionsInvalid raised inside, naming every problem."""
    try:
        yield
    except OptionsInvalid as exc:
        module.fail_json(**result, **exc.as_result())


class OptionChecks:
    """Collects the BadOption of every rule run through it."""

    def __init__(self) -> None:
        self.problems: list[BadOption] = []

    def add(self, option: str, reason: str) -> None:
        """Note a problem found without a rule function (a relation between two options, say)."""
        self.problems.append(BadOption(option, reason))

    def check(self, rule: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """`rule(*args, **kwargs)`, or None after noting the BadOption it raised (nothing else is caught)."""
        try:
            return rule(*args, **kwargs)
        except BadOption as problem:
            self.problems.append(problem)
            return None

    def failed(self, *options: str) -> bool:
        """Whether any of `options` (any option at all, without arguments) has a problem so far.

        A rule that builds on other options' values runs only when they passed.
        """
        wanted = set(options)
        return any(not wanted or problem.option in wanted for problem in self.problems)

    def raise_if_any(self) -> None:
        """OptionsInvalid with every problem noted, if there is one."""
        if self.problems:
            raise OptionsInvalid(self.problems)


def string_list(option: str, value: Any) -> list[str]:
    """`value` of a list-of-strings option declared ``type: raw``: a string is a list of one.

    Ansible's own list type splits a string on commas, which cuts a regular expression such as
    ``train_\\d{1,3}\\.py`` in two. Numbers become their text (YAML reads ``123`` as one); anything
    else (a mapping, a nested list, a boolean) is a BadOption naming the option.
    """
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise BadOption(option, f"must be a string or a list of strings, got {type(value).__name__}")
    strings: list[str] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise BadOption(option, f"must be a string or a list of strings, got the element {item!r} ({type(item).__name__})")
        strings.append(item if isinstance(item, str) else str(item))
    return strings
