"""Shape propagation with real small tensors, validation at two batch sizes, params and FLOPs.

Real tensors, not fake ones: on long chains they are ~30× faster and they run the
exact kernels the model will run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from ..core.errors import ValidationError, first_line
from ..core.protocol import BATCHES, weight_noise
from ..core.state import training_mode
from . import ops
from .inputs import ExampleInput, as_spec, batch_of, call, is_positional, positional, spec_inputs
from .ops import op_name


def example_input(gm: torch.nn.Module, spec: ExampleInput, seed: int = 0, batch: int | None = None) -> Any:
    """Seeded example inputs for `spec` (batch replaced when given), on the model's device (graph.inputs.spec_inputs):
    a dict name → tensor, or, for a bare shape's spec (one input passed positionally), that one tensor."""
    spec = as_spec(spec)
    x = spec_inputs(gm, spec, seed, batch)
    return x[spec[0].name] if is_positional(spec) else x


def shape_of(value: Any) -> Any:
    """A tensor's shape as a tuple; nested shapes for tuples/lists; None otherwise."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)):
        return [shape_of(v) for v in value]
    return None


class _Recorder(fx.Interpreter):
    """Runs the graph and records each node's output shape and dtype (and FLOPs when asked)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        count_flops: bool = False,
        known_flops: dict[str, tuple[tuple[Any, ...], int]] | None = None,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.shapes: dict[str, Any] = {}
        self.dtypes: dict[str, torch.dtype | None] = {}
        self.flops: dict[str, int] = {}
        self.count_flops = count_flops
        self.known_flops = known_flops or {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            known = self.known_flops.get(n.name)
            if known is not None and self.count_flops and known[0] == _flop_key(self.module, n, self.shapes):
                out = super().run_node(n)  # the same computation on the same shapes as before the pass: same FLOPs
                self.flops[n.name] = known[1]
            elif self.count_flops and n.op in ("call_module", "call_function", "call_method"):
                with FlopCounterMode(display=False) as fc:
                    out = super().run_node(n)
                self.flops[n.name] = int(fc.get_total_flops())
            else:
                out = super().run_node(n)
        except Exception as e:
            shapes = [self.shapes.get(a.name) for a in n.all_input_nodes]
            raise ValidationError(
                f"node '{n.name}' ({n.op} {_target_name(n)}) fails on inputs of shapes {shapes}: "
                f"{first_line(e, 10_000)}",
                "check --input-shape, or the target the pass was given",
            ) from e
        self.shapes[n.name] = shape_of(out)
        self.dtypes[n.name] = out.dtype if isinstance(out, torch.Tensor) else None
        return out


def _flop_key(gm: fx.GraphModule, n: fx.Node, shapes: dict[str, Any]) -> tuple[Any, ...]:
    """What a node's FLOP count depends on: op, target, the module's settings and weight shapes, input shapes."""
    module: tuple[Any, ...] = ()
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        module = (type(m), m.extra_repr(), tuple(tuple(p.shape) for p in m.parameters()))
    return (
        n.op,
        _target_name(n),
        module,
        tuple(shapes.get(a.name) for a in n.all_input_nodes),
        repr(n.args),
        repr(n.kwargs),
    )


def _target_name(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


@dataclass
class ShapeRun:
    output: Any
    shapes: dict[str, Any]
    dtypes: dict[str, Any]
    flops: dict[str, int]
    inputs: Any = None  # what it ran on (annotate's run: verification reuses it when these are its first examples)


def run_recording(gm: fx.GraphModule, x: Any, count_flops: bool = False) -> ShapeRun:
    """Run `gm` on `x` (in its current mode, without grad) and record shapes per node."""
    rec = _Recorder(gm, count_flops)
    with torch.no_grad():
        out = rec.run(*positional(x))
    return ShapeRun(out, rec.shapes, rec.dtypes, rec.flops, x)


def annotate(
    gm: fx.GraphModule, input_shape: ExampleInput, previous: fx.GraphModule | None = None, example: Any = None
) -> ShapeRun:
    """Store shape, dtype, params and FLOPs (per example) on every node's meta.

    Runs once in eval mode at the example batch size; meta keys: gg_shape, gg_dtype,
    gg_flops, gg_params. Raises ValidationError naming the node that fails. With
    `previous` (the annotated model a pass started from), nodes that compute the same
    thing on the same shapes keep their FLOP count instead of being counted again.
    `example`: the input to run at the example batch (default: example_input's, seed 0); what is
    recorded does not depend on the values, so verification can reuse the run (validate_batch_sizes).
    """
    input_shape = as_spec(input_shape)
    x = example_input(gm, input_shape) if example is None else example
    batch = max(batch_of(input_shape), 1)
    known: dict[str, tuple[tuple[Any, ...], int]] = {}
    if previous is not None:
        old_shapes = {n.name: n.meta.get("gg_shape") for n in previous.graph.nodes}
        known = {
            n.name: (_flop_key(previous, n, old_shapes), int(n.meta["gg_flops"]) * batch)
            for n in previous.graph.nodes
            if "gg_flops" in n.meta and n.op in ("call_module", "call_function", "call_method")
        }
    with training_mode(gm, False):
        rec = _Recorder(gm, True, known)
        with torch.no_grad():
            out = rec.run(*positional(x))
        run = ShapeRun(out, rec.shapes, rec.dtypes, rec.flops, x)
    for n in gm.graph.nodes:
        n.meta["gg_shape"] = run.shapes.get(n.name)
        n.meta["gg_dtype"] = run.dtypes.get(n.name)
        n.meta["gg_flops"] = run.flops.get(n.name, 0) // batch
        n.meta["gg_params"] = node_params(gm, n)
    return run


def node_params(gm: fx.GraphModule, n: fx.Node) -> int:
    """Parameters owned by a node: a called module's (recursively) or a fetched parameter's."""
    if n.op == "call_module":
        return int(sum(p.numel() for p in gm.get_submodule(n.target).parameters()))  # type: ignore[misc]
    if n.op == "get_attr":
        obj = gm
        for part in n.target.split("."):
            obj = getattr(obj, part)
        return obj.numel() if isinstance(obj, torch.nn.Parameter) else 0
    return 0


def param_count(gm: torch.nn.Module) -> int:
    return sum(p.numel() for p in gm.parameters())


def state_bytes(m: torch.nn.Module) -> int:
    """Bytes of a module's weights: every tensor of its state dict (parameters and buffers)."""
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


def total_flops(gm: fx.GraphModule) -> int:
    """FLOPs per example, from the last `annotate` (0 for unannotated nodes)."""
    return sum(n.meta.get("gg_flops", 0) for n in gm.graph.nodes)


def validate_batch_sizes(
    gm: fx.GraphModule,
    input_shape: ExampleInput,
    batches: tuple[int, int] = BATCHES,
    first: ShapeRun | None = None,
    first_input: Any = None,
    second: ShapeRun | None = None,
) -> None:
    """Run at two batch sizes and refuse a graph that bakes in the batch size.

    Between the runs a node's dimensions may stay equal or scale with the batch (the
    batch itself, or folded into another dimension as attention's (B·N, C) or
    (3, B, heads, N, d) do); each output must lead with the batch; and the examples
    both runs share (the second run's first examples are the first run's input) must
    get the same outputs, so no example's result depends on the batch it came in.
    `first` reuses a run already made on `first_input` at batches[0] (in eval mode); `second` one made at
    batches[1] < batches[0] on the first batches[1] examples of `first_input` (the annotation's run at the
    example batch, which then costs nothing more).
    """
    b1, b2 = batches
    input_shape = as_spec(input_shape)
    if first is not None and first_input is None:
        raise ValueError("validate_batch_sizes: pass first_input with first")
    if second is not None and (first_input is None or b2 >= b1):
        raise ValueError("validate_batch_sizes: a second run is the first b2 < b1 examples of first_input")
    x1 = first_input if first_input is not None else example_input(gm, input_shape, seed=11, batch=b1)
    with training_mode(gm, False):
        r1 = first if first is not None else run_recording(gm, x1)
        if second is not None:
            r2 = second
        else:
            r2 = run_recording(gm, _joined(x1, example_input(gm, input_shape, seed=12, batch=b2), b1, b2))
    hint = "a view/reshape probably bakes in the batch size; use x.flatten(1) or x.view(x.size(0), -1)"
    sized_by_data = _after_data_reads(gm)
    for n in gm.graph.nodes:
        s1, s2 = r1.shapes.get(n.name), r2.shapes.get(n.name)
        if s1 == s2 or n in sized_by_data:
            continue
        if not _scales_with_batch(s1, s2, b1, b2):
            raise ValidationError(
                f"node '{n.name}' has shape {s1} at batch {b1} but {s2} at batch {b2}: "
                "only dimensions that grow with the batch may change",
                hint,
            )
    for out_shape, b in ((_output_shapes(r1.output), b1), (_output_shapes(r2.output), b2)):
        for s in out_shape:
            if not s or s[0] != b:
                raise ValidationError(
                    f"model output has shape {s} for batch {b}: the first dimension must be the batch",
                    "graphgrow exports with a dynamic batch dimension in front",
                )
    if b2 >= b1:
        _check_examples_independent(r1.output, r2.output, b1, hint, gm, x1)
    elif second is not None:  # the second run's examples are the first run's first ones
        _check_examples_independent(r2.output, r1.output, b2, hint, gm, first_examples(x1, b2))


def _after_data_reads(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes downstream of a value read from the data (ops.DATA_READS: `.item()`, `.tolist()`, `nonzero`): their
    sizes may follow the values (a mixture of experts' tokens per expert), not only the batch. The outputs are still
    checked (batch in front, each example's result independent of the others in its batch)."""
    found: set[fx.Node] = set()
    for n in gm.graph.nodes:  # in topological order: a node's inputs are classed before it
        name = op_name(n.target).split(".")[0] if n.op in ("call_function", "call_method") else ""
        if name in ops.DATA_READS or any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def first_examples(x: Any, n: int) -> Any:
    """The first `n` examples of an input (each named input alike)."""
    return {k: v[:n] for k, v in x.items()} if isinstance(x, dict) else x[:n]


def same_inputs(a: Any, b: Any) -> bool:
    """Two inputs (tensors, or dicts of named tensors) with equal shapes, dtypes, devices and values."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same_inputs(a[k], b[k]) for k in a)
        )
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and bool(torch.equal(a, b))
    )


def _joined(x1: Any, extra: Any, b1: int, b2: int) -> Any:
    """The second run's input: the first run's examples, then new ones (each named input alike)."""
    if isinstance(x1, dict):
        return {k: _joined(x1[k], extra[k], b1, b2) for k in x1}
    return torch.cat([x1, extra[: max(b2 - b1, 0)]])[:b2] if b2 >= b1 else extra


def _scales_with_batch(s1: tuple[int, ...], s2: tuple[int, ...], b1: int, b2: int) -> bool:
    """Same rank; every dimension equal or grown in proportion to the batch (d1·b2 = d2·b1)."""
    if isinstance(s1, tuple) and isinstance(s2, tuple):
        if len(s1) != len(s2) or not s1:
            return False
        changed = [(a, b) for a, b in zip(s1, s2) if a != b]
        return bool(changed) and all(a * b2 == b * b1 and a % b1 == 0 for a, b in changed)
    if isinstance(s1, list) and isinstance(s2, list):
        return len(s1) == len(s2) and all(a == b or _scales_with_batch(a, b, b1, b2) for a, b in zip(s1, s2))
    return False


BATCH_TOL = 1e-4  # the examples' outputs at two batch sizes agree to this fraction of max|out| (other kernels)


def _check_examples_independent(out1: Any, out2: Any, b1: int, hint: str, model: torch.nn.Module, x1: Any) -> None:
    """The first b1 examples of the second run are the first run's input `x1` (out1 is `model`'s output on it): their
    outputs must agree. An output that misses is judged against how far it moves when every weight moves by BATCH_TOL
    (core.protocol.weight_noise): an output that cancels (~0 from terms ~1, a zero-initialised head reading grown
    features) rounds relative to its terms, not to itself."""
    noise: list[float] | None = None
    for i, (a, b) in enumerate(zip(_flat(out1), _flat(out2))):
        if not (a.is_floating_point() and b.is_floating_point()) or a.dim() == 0 or b.shape[1:] != a.shape[1:]:
            continue
        ref, got = a.double(), b[: a.shape[0]].double()
        scale = ref.abs().max().item() if ref.numel() else 0.0
        if not torch.isfinite(ref).all():
            continue
        err = (ref - got).abs().max().item() if ref.numel() else 0.0
        if err <= BATCH_TOL * max(scale, 1e-12):
            continue
        if noise is None:
            try:
                with training_mode(model, False):
                    noise = weight_noise(model, lambda m: call(m, x1), BATCH_TOL)
            except Exception:  # noqa: BLE001 - a probe: a model that cannot run again here keeps the plain verdict
                noise = []
        if not (i < len(noise) and err <= noise[i]):
            raise ValidationError(
                f"the same example gives different outputs at batch {b1} and in a larger batch (max |Δ| {err:.3g}): "
                "examples in a batch influence each other",
                hint,
            )


def _flat(out: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _output_shapes(out: Any) -> list[tuple[int, ...]]:
    flat, _ = tree_flatten(out)
    return [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]
