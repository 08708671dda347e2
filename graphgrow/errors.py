"""Typed errors. Every failure a user can cause or a check can detect is one of these.

Each error carries a one-line `message` (what went wrong) and a `hint` (what to do
instead); the CLI prints `error: <message> (<hint>)` and exits with `exit_code`.
"""
from __future__ import annotations


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
    """A pipeline spec names an unknown pass, argument or a bad value."""


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
