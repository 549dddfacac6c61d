"""_base/terminal.py: control characters in a job's log reach the operator as visible text."""

from __future__ import annotations

import json

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import decode_line, escape_controls


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("\x1b]0;owned\x07title", "\\x1b]0;owned\\x07title"),   # OSC: window title, ended by BEL
        ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),          # CSI: clear screen, colour
        ("\x9b2J", "\\x9b2J"),                                  # C1 CSI, one character
        ("\x90q\x9c", "\\x90q\\x9c"),                            # C1 DCS ... ST
        ("a\x7fb\x08c\rd\x00e", "a\\x7fb\\x08c\\x0dd\\x00e"),     # DEL, backspace, CR, NUL
        ("col\tumn", "col\tumn"),                               # tab stays
        ("step 3 loss=1.5 \u00e9\u4e2d\U0001f680", "step 3 loss=1.5 \u00e9\u4e2d\U0001f680"),
        ("\ud800lone", "\\ud800lone"),                          # a lone surrogate that no byte made
    ],
)
def test_escape_controls(raw: str, shown: str) -> None:
    assert escape_controls(raw) == shown


def test_undecodable_bytes_are_shown_as_themselves() -> None:
    line = decode_line(b"\xff\xfe step \xc3\xa9 \x9b \xc2\x9b\x1b[0m")
    # 0x9b alone is not UTF-8 (an undecodable byte); C2 9B is U+009B (C1 CSI): both are escaped.
    assert line == "\\xff\\xfe step \u00e9 \\x9b \\x9b\\x1b[0m"
    json.dumps(line).encode("utf-8")  # no lone surrogate is left for a JSON encoder to choke on
    assert all(ord(char) >= 0x20 and not 0x7f <= ord(char) <= 0x9f for char in line)


def test_a_job_line_is_cut_to_one_limit_and_marked_before_it_is_escaped() -> None:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import LINE_LIMIT, cap_line
    assert cap_line(b"step 1") == b"step 1" and cap_line("x" * LINE_LIMIT) == "x" * LINE_LIMIT
    long = b"\x1b" * (6 * 1024 * 1024)
    shown = decode_line(cap_line(long))
    # Cut first, then escaped: at most four characters a byte of the limit, and the note says so.
    assert shown == "\\x1b" * LINE_LIMIT + " [cut: %d bytes in all]" % len(long)
    assert cap_line("y" * (LINE_LIMIT + 1)) == "y" * LINE_LIMIT + " [cut: %d characters in all]" % (LINE_LIMIT + 1)
    # Only the head was read: the caller says how long the whole line was.
    assert cap_line(b"z" * 10, length=10 ** 9) == b"z" * 10 + b" [cut: 1000000000 bytes in all]"
