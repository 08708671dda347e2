"""What a command was asked, as options objects passed cli → jobs → search, every field by name.

LoadOptions: how to open the model (the example input, --trust, --leaf, --trace-mode, --capture, --max-load, --weights).
OutputOptions: what to write (-o, --onnx, the default name's suffix, --dry-run, --diagram).
Limits (analysis.budget): --max-params and --max-memory, carried to each place that reads them (no global).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadOptions:
    input_shape: Any = None  # text ("1,3,32,32"), a shape, an input spec, or None: the file or the zoo tells it
    trust: bool = False
    leaves: Sequence[str] = ()
    trace_mode: str = "eval"
    capture: str = "auto"
    max_load: int | None = None  # bytes a model file may unpack to (--max-load); None: io.load.DEFAULT_MAX_LOAD
    weights: str | None = None  # a .safetensors state dict for a model built by name (--weights; io.weights)

    def job_arguments(self) -> dict[str, Any]:
        """The options as the jobs that take them one by one (replay, targets, export, check, inspect) name them:
        the CLI passes all of them at once, so none is left behind."""
        return {
            "input_shape": self.input_shape,
            "trust": self.trust,
            "leaves": self.leaves,
            "trace_mode": self.trace_mode,
            "capture": self.capture,
            "max_load": self.max_load,
            "weights": self.weights,
        }


@dataclass(frozen=True)
class OutputOptions:
    out: str | None = None  # None: beside the model as NAME`suffix`
    onnx_out: str | None = None
    suffix: str = ".grown.pt"
    dry_run: bool = False  # run and verify, write nothing (a diagram is still drawn)
    diagram: str | None = None
