"""Text read from files, made safe to print on a terminal.

Names, log entries and metadata come from files: a stored terminal escape sequence (ESC ]0;… retitles the
window, ESC [2J clears it, others rewrite what was printed before) or a bidirectional override (U+202E turns
the rest of a line around) would act on the user's terminal if printed raw. Every control character is
printed as its Python escape instead (`\\x1b`, `\\u202e`); --json output needs none of this (JSON escapes them).
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls, DEL, C1 controls, and the Unicode format characters that reorder or hide text
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escaped(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(value: Any) -> Any:
    """`value` with every string in it (dict keys, list items, at any depth) escaped as above."""
    if isinstance(value, str):
        return _CONTROL.sub(_escaped, value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(printable(v) for v in value) if type(value) in (list, tuple) else value
    return value
