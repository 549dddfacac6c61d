# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Terminals obey bytes: a job's log line is escaped before it reaches a result or a message.

A log can carry what a terminal takes as commands: OSC (``ESC ] 0 ; title BEL`` sets the window
title, OSC 52 writes the clipboard), CSI (``ESC [ 2 J`` clears the screen, colours, cursor moves;
C1's single-byte ``U+009B`` is CSI too), BEL, backspace and carriage return that overwrite what the
operator reads. A result is shown by Ansible's callbacks, AWX, ``jq`` and ``less -R`` alike, and a
message is printed as it is: so every log line that leaves a module goes through ``escape_controls``
once, where it is read, and a control character reaches the operator as visible text (``\\x1b``).

Job text is data for template engines too: a summary goes into set_stats, and a workflow (AWX, or any
tool that passes a node's stats on) hands it to the next node as extra vars, which ansible-core
templates as trusted. So the same escape writes the ``{`` that opens a Jinja delimiter (``{{``, ``{%``,
``{#``) as ``\\x7b``: ``{{ lookup('pipe', ...) }}`` becomes ``\\x7b{ lookup('pipe', ...) }}``, which no
Jinja evaluates. Ansible templates a variable's value with these default delimiters on every version
(a template task's ``variable_start_string`` changes only its own file's), except where the value itself
starts with the header ``#jinja2:`` that sets others (``variable_start_string:'[['``; on ansible-core
before 2.19 even without a newline after it): so the ``#`` of ``#jinja2:`` is written ``\\x23``.
"""

from __future__ import annotations

import re
from typing import AnyStr

# C0 but tab, DEL, C1 (U+0080-U+009F), and surrogates: a byte that is not UTF-8, decoded with
# surrogateescape, is the lone surrogate U+DC80-U+DCFF, which no JSON encoder should see either.
# And what Jinja would read: a "{" that opens a delimiter and the "#" of the header "#jinja2:" that
# sets other delimiters; after the escape no "{{", "{%", "{#" or "#jinja2:" is left.
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]|{(?=[{%#])|#(?=jinja2:)")


def _visible(match: re.Match) -> str:
    code = ord(match.group(0))
    if 0xDC80 <= code <= 0xDCFF:
        return "\\x%02x" % (code - 0xDC00)  # the undecodable byte itself
    if code > 0xFF:
        return "\\u%04x" % code
    return "\\x%02x" % code


def escape_controls(text: str) -> str:
    """`text` with every control character but tab (C0, DEL, C1) and every lone surrogate written as
    a visible escape: ``\\x1b``, ``\\x9b``, ``\\x07``, ``\\xff`` for an undecodable byte 0xff; and
    every ``{`` that opens a Jinja delimiter as ``\\x7b`` and the ``#`` of ``#jinja2:`` as ``\\x23``, so that
    no template engine evaluates it."""
    return _CONTROLS.sub(_visible, text)


def decode_line(raw: bytes) -> str:
    """A log line as text that is safe to show: UTF-8 where it is, each other byte as ``\\xNN``."""
    return escape_controls(raw.decode("utf-8", "surrogateescape"))


# The most of one line a job wrote (a log line, a progress or ready line, a command line) that is kept
# in a record or returned: a job can print a line of megabytes, and the escaping above can make each
# byte four. So a line is cut to this, and marked as cut, before it is escaped.
LINE_LIMIT = 4096


def cap_line(line: AnyStr, length: int | None = None) -> AnyStr:
    """`line` as kept and shown: its first LINE_LIMIT bytes (characters, for text) and, where that is not
    all of it, a note saying so (`` [cut: 6291463 bytes in all]``). `length`: the whole line's length where
    the caller read only its head (a line is read by bounded chunks, never whole into memory)."""
    whole = len(line) if length is None else max(length, len(line))
    if whole <= LINE_LIMIT:
        return line
    if isinstance(line, str):
        return line[:LINE_LIMIT] + " [cut: %d characters in all]" % whole
    return line[:LINE_LIMIT] + b" [cut: %d bytes in all]" % whole
