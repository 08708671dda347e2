"""graphgrow: an architecture compiler for PyTorch models.

Trace a model into a torch.fx graph, grow it with verified, function-preserving
graph-rewrite passes, export it to ONNX and prove onnxruntime agrees with PyTorch.
"""

from __future__ import annotations

from .analysis.targets import Candidate
from .capture.trace import trace
from .core.errors import (
    DistributedError,
    EquivalenceError,
    ExportError,
    GraphgrowError,
    InputError,
    LoadError,
    NotApplicable,
    PreservationError,
    RuntimeUnavailable,
    SaveError,
    SearchError,
    SearchInterrupted,
    SpecError,
    TraceError,
    ValidationError,
)
from .graph.fx_edit import Rewrite
from .graph.inputs import TensorSpec  # one named example input: gg.trace(model, {name: TensorSpec(...)})
from .graph.shapes import annotate
from .io.load import LoadedModel, load_model
from .io.save import save_model
from .jobs.optim import carry_optimizer
from .jobs.pipeline import Pipeline, PipelineResult, build_pipeline, parse_spec
from .jobs.registry import all_passes, get_pass, pass_names, register_pass
from .rewrite.pass_base import Pass, PassResult, arg

__version__ = "0.1.0"


def fold(gm, *, verify_result: bool = True, seed: int = 0, **args) -> PassResult:
    """Fold growth's linear structure (BatchNorm, gates, parallel branches, adapters) into plain layers,
    in eval-mode semantics; verified and logged like a pass. The transform is the registered `fold`; `args` are
    its own arguments (grow_kernels=...), declared there once with their defaults."""
    return get_pass("fold")(**args)(gm, verify_result=verify_result, seed=seed)


def __getattr__(name: str):
    # ONNX and onnxruntime load lazily: the pass API should not pay for them.
    if name == "export_onnx":
        from .io.export import export_onnx

        return export_onnx
    if name == "check_equivalence":
        from .verify.equivalence import check_equivalence

        return check_equivalence
    if (
        name == "as_native"
    ):  # the grown model as the original's own class (Hugging Face): transformers loads only when used
        from .jobs.native import as_native

        return as_native
    if name == "distributed":  # growth in DDP jobs, checkpoints, Lightning: torch.distributed loads only when used
        from .jobs import distributed

        return distributed
    raise AttributeError(f"module 'graphgrow' has no attribute {name!r}")


__all__ = [
    "DistributedError",
    "EquivalenceError",
    "ExportError",
    "GraphgrowError",
    "InputError",
    "LoadError",
    "NotApplicable",
    "PreservationError",
    "RuntimeUnavailable",
    "SaveError",
    "SearchError",
    "SearchInterrupted",
    "SpecError",
    "TraceError",
    "ValidationError",
    "LoadedModel",
    "load_model",
    "save_model",
    "Candidate",
    "Pass",
    "PassResult",
    "arg",
    "Pipeline",
    "PipelineResult",
    "build_pipeline",
    "parse_spec",
    "all_passes",
    "get_pass",
    "pass_names",
    "register_pass",
    "Rewrite",
    "annotate",
    "trace",
    "TensorSpec",
    "export_onnx",
    "check_equivalence",
    "fold",
    "carry_optimizer",
    "distributed",
    "as_native",
]
