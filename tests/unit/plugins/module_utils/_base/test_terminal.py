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


# --- job text is data for template engines too ----------------------------------------------------
# A summary goes into set_stats, and a workflow passes it to the next node as extra vars, which
# ansible-core templates as trusted: whatever escape_controls returns no Jinja may evaluate.
TEMPLATES = [
    "{{ lookup('pipe', 'touch /tmp/x') }}",
    "step 3 {% for i in range(9) %}x{% endfor %}",
    "{# a comment #}{{ 7 * 7 }}",
    "{{{ 7 * 7 }}}",
    # The override header sets other delimiters; before ansible-core 2.19 it needs no newline after it.
    "#jinja2:variable_start_string:'[[',variable_end_string:']]'\n[[ 7 * 7 ]]",
    "#jinja2:variable_start_string:'[[',variable_end_string:']]',newline_sequence:'\\n' [[ 7 * 7 ]] ",
]


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("{{ lookup('pipe', 'touch /tmp/x') }}", "\\x7b{ lookup('pipe', 'touch /tmp/x') }}"),
        ("a{%b{#c{ d }", "a\\x7b%b\\x7b#c{ d }"),                # a lone "{" is no delimiter
        ("{{{", "\\x7b\\x7b{"),
        ("#jinja2:trim_blocks:True", "\\x23jinja2:trim_blocks:True"),
        ("# a comment, {'a': {'b': 1}}", "# a comment, {'a': {'b': 1}}"),  # JSON and Python stay readable
    ],
)
def test_escape_controls_escapes_what_opens_a_template(raw: str, shown: str) -> None:
    assert escape_controls(raw) == shown


@pytest.mark.parametrize("text", TEMPLATES)
def test_no_escaped_text_is_a_template_to_ansible(text: str) -> None:
    """The installed ansible-core's own templar, given the escaped text as trusted (as extra vars are),
    returns it as it is; and escaping twice changes nothing more."""
    import ansible.template
    from ansible.parsing.dataloader import DataLoader

    # ansible-core 2.19 and later template only trusted text; before, every string.
    trusted = getattr(ansible.template, "trust_as_template", lambda value: value)
    escaped = escape_controls(text)
    assert escape_controls(escaped) == escaped
    templar = ansible.template.Templar(loader=DataLoader())
    assert templar.template(trusted(escaped)) == escaped
    # What the escape stops: the text as it was is a template (its result differs or it fails).
    try:
        rendered = templar.template(trusted(text))
    except Exception:  # pylint: disable=broad-exception-caught  # an error is evaluation too
        return
    assert rendered != text


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
