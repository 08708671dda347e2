"""Opening a model for a job: load it safely, capture it (fx or torch.export), check the capture against the
model in both modes, and annotate shapes at the example input — a float shape or an input spec."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from ..capture.input_shape import infer_input_shape, parse_example_input, require_single_input
from ..capture.trace import graph_info, trace
from ..core.errors import InputError, LoadError, TraceError, ValidationError
from ..graph.graph_meta import input_spec_of, store_shape
from ..graph.inputs import InputSpec, as_spec, is_positional, named_for, plain_spec, report_fields
from ..graph.shapes import annotate
from ..io.load import FACTORY_SEED, LoadedModel, load_model

if TYPE_CHECKING:
    from ..capture.parts import Part

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


@dataclass
class OpenedModel:
    loaded: LoadedModel
    gm: fx.GraphModule
    input_shape: InputSpec  # the example input (graph.inputs): a bare shape's one-tensor spec, or named inputs
    inferred_from: str | None = None  # how the input shape was inferred, when it was not given
    # set when the whole model could not be captured and `gm` is a part of it (capture/parts.py; open_model(parts=))
    part: Part | None = None


def shape_report(shape: InputSpec) -> dict:
    """A report's input fields: `input_shape` (the first input's shape, what older readers show) and, unless the
    example input is a bare shape, `inputs` (name, shape, dtype of each)."""
    return report_fields(shape)


def open_model(
    source: str,
    input_shape=None,
    trust: bool = False,
    leaves: Sequence[str] = (),
    progress: Progress = _noop,
    trace_mode: str = "eval",
    max_memory: int | None = None,
    factory_seed: int = FACTORY_SEED,
    capture: str = "auto",
    max_load: int | None = None,
    weights: str | None = None,
    parts: bool = False,
) -> OpenedModel:
    """Load (safely), trace, check the trace against the model, and annotate shapes. The
    example input (a shape or an input spec) comes from the argument, the file (graphgrow outputs
    remember it), the zoo or the first layer. `capture`: "auto", "fx" or "export" (trace()). `max_load`:
    load_model's bound on what the file unpacks to (None: its default). `weights`: a safetensors state dict for a
    model built by name (--weights). `parts`: when the whole model cannot be captured (a TraceError), open the
    largest part of it that can (capture/parts.py): the result's `gm` is that part's capture, `part` says which."""
    progress(f"loading {source}")
    loaded = load_model(source, trust=trust, factory_seed=factory_seed, max_load=max_load, weights=weights)
    given = parse_example_input(
        input_shape if input_shape is not None else loaded.input_shape, loaded.module
    )  # flag or stored: one check
    progress("tracing" if capture == "auto" else f"tracing ({capture} capture)")
    try:
        gm = trace(loaded.module, given, leaves, mode=trace_mode, check=False, capture=capture)  # fidelity: below
    except TraceError as e:
        if not parts or given is None or leaves:
            raise
        return _open_part(loaded, source, as_spec(given, loaded.module), e.message, max_memory, progress)
    if given is None:
        inferred_shape, why = infer_input_shape(gm)
        if inferred_shape is None:
            raise InputError(
                f"cannot tell the example input shape of {source}: {why}",
                "pass --input-shape N,C,H,W (e.g. 1,3,224,224), or --input NAME:DTYPE[SHAPE] per input",
            )
        progress(f"input shape {'×'.join(map(str, inferred_shape))} inferred: {why}")
        store_shape(gm, named_for(gm, plain_spec(inferred_shape)))
        inferred: str | None = why
    else:
        if is_positional(given):  # a bare shape: the model's one input
            require_single_input(gm)
            if given[0].dtype == "float32":
                _refuse_float_token_ids(gm)
        inferred = None
    shape = input_spec_of(gm)  # as trace stored it: token ids' range taken from the model's embedding
    if graph_info(gm).get("trace", {}).get("capture") == "export":
        progress("captured with torch.export")
    _check_finite(loaded.module, source)
    from ..analysis.budget import MEASURED, check_input_memory

    # on the meta device before any real forward, or measured on a real run under the limit when it cannot say
    measured = check_input_memory(gm, shape, max_memory)
    if measured:
        progress(measured)
        notes = graph_info(gm).setdefault("trace", {}).setdefault("notes", [])  # `inspect` shows them
        notes[:] = [n for n in notes if not n.startswith(MEASURED)] + [measured]  # this run's, not a stored one's
    progress("propagating shapes")
    try:
        annotate(gm, shape)
    except ValidationError as e:
        raise InputError(
            f"the model cannot run on an input of {_shown(shape)}: {e.message}",
            "give the input the model expects: --input-shape N,C,H,W, or --input NAME:DTYPE[SHAPE] per input",
        ) from e
    if loaded.kind != "graphgrow":  # a graphgrow file's graph is the model; anything else is checked against it
        from ..capture.fidelity import check_fidelity

        progress("checking the traced graph against the model (eval and train mode)")
        check_fidelity(loaded.module, gm, shape)  # a capture that differs from the model is refused, not worked around
    return OpenedModel(loaded, gm, shape, inferred)


def _open_part(
    loaded: LoadedModel, source: str, spec: InputSpec, why: str, max_memory: int | None, progress: Progress
) -> OpenedModel:
    """The largest part of a model that cannot be captured whole, opened as a model is (capture/parts.py)."""
    from ..capture.parts import capture_part

    _check_finite(loaded.module, source)
    part = capture_part(loaded.module, spec, why, max_memory, progress)
    progress(part.summary())
    return OpenedModel(loaded, part.gm, part.spec, None, part=part)


def _shown(shape: InputSpec) -> str:
    if is_positional(shape):
        return f"shape {tuple(shape[0].shape)}"
    return "inputs " + ", ".join(f"{t.name}:{t.dtype}{list(t.shape)}" for t in shape)


def _check_finite(model: nn.Module, source: str) -> None:
    """A weight that is NaN or ±inf is broken. A buffer may hold ±inf, a value that means "no bound" (the clip
    bounds of a Gemma 4 encoder's linear layers before calibration, a mask's -inf); NaN is broken there too. An
    infinite value that reaches the outputs is refused with them (the check before each pass)."""
    for name, t in model.named_parameters():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise LoadError(
                f"{source} has NaN or Inf values in '{name}'",
                "graphgrow will not grow or export a broken model; fix or re-initialise those weights",
            )
    for name, b in model.named_buffers():
        if b.is_floating_point() and torch.isnan(b).any():
            raise LoadError(
                f"{source} has NaN values in the buffer '{name}'",
                "graphgrow will not grow or export a broken model; fix or re-initialise that buffer",
            )


def _refuse_float_token_ids(gm: fx.GraphModule) -> None:
    """A float example input fed straight into an embedding fails deep inside torch: say what the model wants."""
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    for user in placeholder.users:
        is_embedding = (user.op == "call_module" and isinstance(gm.get_submodule(str(user.target)), nn.Embedding)) or (
            user.op == "call_function" and getattr(user.target, "__name__", "") == "embedding"
        )
        if is_embedding:
            raise InputError(
                f"the model's input '{placeholder.name}' goes into an embedding ({user.name}): it takes "
                "integer token ids, not the float tensor --input-shape describes",
                f"give --input {placeholder.name}:int64[1,16] (NAME:DTYPE[SHAPE])",
            )
