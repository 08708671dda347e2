"""Typed errors. Every failure a user can cause or a check can detect is one of these.

Each error carries a one-line `message` (what went wrong) and a `hint` (what to do
instead); the CLI prints `error: <message> (<hint>)` and exits with `exit_code`.
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls, and the Unicode format characters that reorder or hide text
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escaped(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape_controls(text: str) -> str:
    """`text` with every control character as its Python escape (a newline as \\x0a, ESC as \\x1b, U+202E as
    \\u202e): text quoting what a file holds stays one line and cannot act on a terminal."""
    return CONTROL_CHARACTERS.sub(_escaped, text)


def first_line(e: BaseException | str, limit: int = 300) -> str:
    """The first non-empty line of an exception's message (its type name when it has none), cut to `limit`."""
    text = str(e) if isinstance(e, str) else str(e) or type(e).__name__
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else ("" if isinstance(e, str) else type(e).__name__)
    return first[:limit]


def with_context(e: GraphgrowError, prefix: str) -> GraphgrowError:
    """A copy of `e` (same class, hint and attributes) whose message starts with `prefix`."""
    import copy

    new = copy.copy(e)
    new.message = f"{prefix}: {e.message}"
    new.args = (new.message,)
    return new


class GraphgrowError(Exception):
    """Base of all graphgrow errors."""

    exit_code = 2  # bad input unless a subclass says otherwise

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class LoadError(GraphgrowError):
    """A model file or model name could not be read safely."""


class SaveError(GraphgrowError):
    """An output could not be written (the input is never touched)."""


class InputError(GraphgrowError):
    """The example input shape is missing or does not fit the model."""


class SpecError(GraphgrowError):
    """A pipeline spec names an unknown pass, argument or a bad value. When the spec is known, the
    error shows it with a caret under the problem (`pointer()`; part of str(e))."""

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        spec: str | None = None,
        position: int | None = None,
        argument: str | None = None,
    ):
        super().__init__(message, hint)
        self.spec, self.position, self.argument = spec, position, argument

    def pointer(self, width: int = 120) -> str:
        """Two lines: the spec (a window around the problem when long) and a caret under the problem."""
        if self.spec is None or self.position is None:
            return ""
        start = max(0, min(self.position - width // 2, len(self.spec) - width))
        shown = self.spec[start : start + width]
        lead = "…" if start else ""
        return (
            f"  {lead}{shown}{'…' if start + width < len(self.spec) else ''}\n"
            f"  {' ' * (len(lead) + self.position - start)}^"
        )

    def __str__(self) -> str:
        pointer = self.pointer()
        return super().__str__() + (f"\n{pointer}" if pointer else "")


class TraceError(GraphgrowError):
    """torch.fx could not trace the model."""


class NotApplicable(GraphgrowError):
    """A pass cannot apply to this graph; the message says why and what to do."""


class ValidationError(GraphgrowError):
    """A graph failed lint, recompile or shape validation after a pass."""

    exit_code = 1


class PreservationError(GraphgrowError):
    """A pass changed the model's function, or left new parameters untrainable."""

    exit_code = 1


class ExportError(GraphgrowError):
    """ONNX export or the ONNX checker failed."""

    exit_code = 1


class RuntimeUnavailable(GraphgrowError):
    """The requested onnxruntime execution provider cannot run here."""


class EquivalenceError(GraphgrowError):
    """onnxruntime and PyTorch disagree beyond the tolerance."""

    exit_code = 1


class SearchError(GraphgrowError):
    """A growth search could not finish: a trial failed (its error is named) or Ray could not start."""

    exit_code = 1


class SearchInterrupted(SearchError):
    """A growth search stopped before its end (Ctrl-C); its checkpoints are kept for --resume."""

    exit_code = 130


class DistributedError(GraphgrowError):
    """A growth step in a process group could not finish on every rank (a rank failed, disagreed, died or did not
    answer in time); every rank keeps its old model, optimiser and scheduler."""

    exit_code = 1
