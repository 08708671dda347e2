"""Text read from files, made safe to print on a terminal.

Names, log entries and metadata come from files: a stored terminal escape sequence (ESC ]0;… retitles the
window, ESC [2J clears it, others rewrite what was printed before) or a bidirectional override (U+202E turns
the rest of a line around) would act on the user's terminal if printed raw. Every control character is
printed as its Python escape instead (`\\x1b`, `\\u202e`); --json output needs none of this (JSON escapes them).
"""

from __future__ import annotations

from typing import Any

from ..core.errors import escape_controls


def printable(value: Any) -> Any:
    """`value` with every string in it (dict keys, list items, at any depth) escaped as above."""
    if isinstance(value, str):
        return escape_controls(value)
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(printable(v) for v in value) if type(value) in (list, tuple) else value
    return value
