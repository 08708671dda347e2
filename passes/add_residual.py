"""add_residual: a skip connection from one tensor to a later one, exact at insertion.

    out = end + skip(start)

where skip is zero at insertion and has a non-zero gradient at once:
- same shape: `g · start` with a scalar gate g = 0;
- feature maps (N, C, H, W), (N, C, L) of a Conv1d stack or (N, C, D, H, W) of a Conv3d one, different
  channels or size: 1×1 conv
  (stride = spatial ratio, or adaptive average pooling first when the ratio is not an integer) →
  BatchNorm with γ = β = 0;
- features last ((N, F), (N, T, F) tokens), different feature size: a Linear on the last dimension
  with zero weights.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    Stage,
    add_module,
    add_parameter,
    begin,
    computed_from,
    conv_dims,
    deployed_nodes,
    factory_kwargs,
    finish,
    inserting_after,
    is_float_tensor,
    kaiming_,
    main_path,
    ops,
    param_count,
    pass_function,
    pick_within_budget,
    place,
    replace_uses,
    resolve_tensor,
    set_scope,
    stage_end,
    stages,
    tensor_shape,
    zero_last_bn,
)


@pass_function  # the arguments' defaults: AddResidual's declaration
def add_residual(
    gm: fx.GraphModule, start: str | None, end: str | None, generator: torch.Generator | None = None
) -> Rewrite:
    """Add `end + skip(start)` to a copy of `gm` (module paths or node names; defaults: the feature extractor)."""
    gm, generator = begin(gm, generator)
    s: fx.Node | None
    e: fx.Node | None
    if start is None and end is None:
        s, e, why = default_span(gm)
    else:
        ds, de, why = default_span(gm) if start is None or end is None else (None, None, "")
        s = resolve_tensor(gm, start, "in") if start is not None else ds
        e = resolve_tensor(gm, end, "out") if end is not None else de
        why = (
            "given"
            if start is not None and end is not None
            else f"given {'start' if start else 'end'}; the other end: {why}"
        )
    _check_span(gm, s, e)
    s_shape, e_shape = tensor_shape(s), tensor_shape(e)
    graph = gm.graph
    like = torch.zeros((), **factory_kwargs(gm, e))
    new_nodes: list[fx.Node] = []
    with inserting_after(e):
        if s_shape == e_shape:
            gate = add_parameter(gm, "residual_gate", torch.zeros((), dtype=like.dtype, device=like.device))
            g = graph.get_attr(gate)
            skip = graph.call_function(operator.mul, (s, g))
            new_nodes += [g, skip]
            kind = "identity × gate (gate = 0)"
        elif conv_dims(s) in (1, 2, 3) and conv_dims(s) == conv_dims(e):
            skip_nodes, kind = _conv_skip(gm, s, s_shape, e_shape, like, generator)
            skip = skip_nodes[-1]
            new_nodes += skip_nodes
        elif (
            conv_dims(s) is None
            and conv_dims(e) is None
            and len(s_shape) in (2, 3)
            and len(s_shape) == len(e_shape)
            and s_shape[:-1] == e_shape[:-1]
        ):
            lin = nn.Linear(s_shape[-1], e_shape[-1], device=like.device, dtype=like.dtype)
            with torch.no_grad():
                lin.weight.zero_()
                lin.bias.zero_()
            name = add_module(gm, "residual_proj", lin)
            skip = graph.call_module(name, (s,))
            new_nodes.append(skip)
            kind = f"Linear {s_shape[-1]}→{e_shape[-1]} (zero weights)"
        else:
            raise NotApplicable(
                f"cannot connect '{s.name}' {list(s_shape)} to '{e.name}' {list(e_shape)}: "
                "shapes differ in rank, in layout (channels at dim 1 or last) "
                "or in a dimension other than channels/space/features",
                "choose start and end with the same rank (graphgrow inspect shows shapes)",
            )
        out = graph.call_function(operator.add, (e, skip))
        new_nodes.append(out)
    replace_uses(e, out, keep=new_nodes)
    set_scope(new_nodes, e)
    finish(gm)
    targets = {"start": f"{s.name} {list(s_shape)}", "end": f"{e.name} {list(e_shape)}", "skip": kind, "chosen": why}
    return Rewrite(gm, targets)


def default_span(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node, str]:
    """One stage of the backbone, never from the raw input: from the end of the stage before the last
    (one downsampling step) to the backbone's last feature map, else over the last stage itself, else the
    same over earlier stages: the first of `stage_spans` within the parameter budget, or the smallest."""
    found = stages(gm)
    if not found:
        path = main_path(gm)
        if len(path) < 2:
            raise NotApplicable("the model has no chain of layers to skip over", "give start=... and end=...")
        return path[0], path[-1], f"main path: {place(gm, path[0], found)} → {place(gm, path[-1], found)}"
    spans = stage_spans(gm, found)
    if not spans:
        block = block_span(gm)  # branches that never meet in one tensor (CrossViT): a skip over one block of one
        if block is not None:
            return block
        raise NotApplicable(
            f"no two main-path tensors of the backbone ({len(found)} stage(s) of one tensor each) can be connected",
            "give start=... and end=...",
        )
    total = max(param_count(gm), 1)
    (start, end, cost, why), over = pick_within_budget(spans, lambda t: t[2], total)
    if over:
        why += f"; adds {cost:,} parameters ({100 * cost / total:.1f}% of the model){over}"
    return start, end, why


def block_span(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node, str] | None:
    """Where the main path has no two tensors to connect (parallel branches that exchange features in every block,
    so that no one tensor lies on every path): a skip over one whole block, from the output of the block before to
    the last residual add (y = x + f(x)) a deployed output needs, of the same shape; None when there is none."""
    deployed = deployed_nodes(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    adds = [n for n in gm.graph.nodes if n in deployed and _residual_add(n)]
    for end in reversed(adds):
        inside = set(end.all_input_nodes)  # the block's own input: the add's operand, already skipped over
        up = _ancestors(end)
        for start in sorted((a for a in adds if a in up and a not in inside), key=order.__getitem__, reverse=True):
            if tensor_shape(start) == tensor_shape(end):
                where = f"over one block: from {place(gm, start, [])} to {place(gm, end, [])} (residual adds)"
                return start, end, where
    return None


def _residual_add(n: fx.Node) -> bool:
    """y = x + f(x) on float tensors of y's shape: one operand computed from the other."""
    name = ops.op_name(n.target).split(".")[0].removesuffix("_")  # x + y, torch.add, x += y, aten.add_.Tensor
    if n.op not in ("call_function", "call_method") or name not in ("add", "iadd"):
        return False
    a = [x for x in n.args[:2] if isinstance(x, fx.Node)]
    if len(a) != 2 or not all(is_float_tensor(x) and tensor_shape(x) == tensor_shape(n) for x in a):
        return False
    return a[0] in _ancestors(a[1]) or a[1] in _ancestors(a[0])


def _ancestors(n: fx.Node) -> set[fx.Node]:
    return computed_from(n) - {n}


def stage_spans(gm: fx.GraphModule, found: list[Stage]) -> list[tuple[fx.Node, fx.Node, int, str]]:
    """Skips a person would add, the preferred first: for each stage from the last, from the end of the
    stage before (one downsampling step) to its end, then over the stage itself. Each as (start, end,
    parameters the skip adds, where in words); only skips add_residual builds."""
    out = []
    for i in reversed(range(len(found))):
        stage, end = found[i], found[i].nodes[-1]
        spans = (
            [
                (
                    stage_end(found, i - 1),
                    f"one stage, with its downsampling: from {place(gm, stage_end(found, i - 1), found)} "
                    f"to the end of {stage.describe(gm, len(found))}",
                )
            ]
            if i
            else []
        )
        if len(stage.nodes) >= 2:
            spans.append(
                (stage.nodes[0], f"over {stage.describe(gm, len(found))}, from its first to its last main-path tensor")
            )
        for start, why in spans:
            cost = skip_params(tensor_shape(start) or (), tensor_shape(end) or (), conv_dims(start), conv_dims(end))
            if cost is not None:
                out.append((start, end, cost, why))
    return out


def skip_params(s_shape: tuple, e_shape: tuple, s_dims: int | None = None, e_dims: int | None = None) -> int | None:
    """Parameters of the skip add_residual builds between tensors of these shapes (a gate, a 1×1 conv +
    BatchNorm that downsamples feature maps — `*_dims`: conv_dims of each end —, or a Linear on the
    features); None where it builds none (another rank or layout, or upsampling)."""
    if s_shape == e_shape:
        return 1
    if s_dims in (1, 2, 3) and s_dims == e_dims and all(a >= b for a, b in zip(s_shape[2:], e_shape[2:])):
        return s_shape[1] * e_shape[1] + 2 * e_shape[1]
    if s_dims is None and e_dims is None and len(s_shape) == len(e_shape) in (2, 3) and s_shape[:-1] == e_shape[:-1]:
        return s_shape[-1] * e_shape[-1] + e_shape[-1]
    return None


def _check_span(gm: fx.GraphModule, s: fx.Node, e: fx.Node) -> None:
    for n, role in ((s, "start"), (e, "end")):
        if not is_float_tensor(n):
            raise NotApplicable(
                f"{role} '{n.name}' is not a single floating-point tensor (shape {n.meta.get('gg_shape')})",
                "pick a node whose output is one tensor",
            )
    if s is e:
        raise NotApplicable(f"start and end are the same tensor '{s.name}'", "pick an end after the start")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if order[s] > order[e]:
        raise NotApplicable(f"start '{s.name}' comes after end '{e.name}' in the graph", "swap them")
    if tensor_shape(s)[0] != tensor_shape(e)[0]:
        raise NotApplicable(
            f"start '{s.name}' and end '{e.name}' have different batch sizes", "pick tensors of the same batch"
        )


def _conv_skip(gm, s, s_shape, e_shape, like, generator):
    """1×1 conv (+ adaptive pooling when needed) → BatchNorm(γ=β=0), inserted after the current point;
    2-D maps (N, C, H, W), 1-D ones (N, C, L) or volumes (N, C, D, H, W) of a video network."""
    graph = gm.graph
    (cin, *src_size), (cout, *end_size) = s_shape[1:], e_shape[1:]
    dims = len(src_size)
    if any(b > a for a, b in zip(src_size, end_size)):
        raise NotApplicable(
            f"end {list(e_shape)} is spatially larger ({_size(end_size)}) than start ({_size(src_size)}); "
            "add_residual only downsamples",
            "choose a start at or above the end's resolution",
        )
    nodes = []
    src = s
    if all(a % b == 0 for a, b in zip(src_size, end_size)):
        stride = tuple(a // b for a, b in zip(src_size, end_size))
        pooled = ""
    else:
        pool = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}[dims]
        src = graph.call_function(pool, (s, tuple(end_size) if dims > 1 else end_size[0]))
        nodes.append(src)
        stride = (1,) * dims
        pooled = f"adaptive avg pool {_size(src_size)}→{_size(end_size)}, "
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](
        cin, cout, 1, stride=stride, bias=False, device=like.device, dtype=like.dtype
    )
    kaiming_(conv.weight, generator)
    bn = zero_last_bn(cout, like, dims)
    down = nn.Sequential(conv, bn)
    name = add_module(gm, "residual_downsample", down)
    c = graph.call_module(f"{name}.0", (src,))
    b = graph.call_module(f"{name}.1", (c,))
    nodes += [c, b]
    st = f"stride {stride[0]}" if len(set(stride)) == 1 else f"stride {stride}"
    kind = {1: " (1-D)", 2: "", 3: " (3-D)"}[dims]
    return nodes, f"{pooled}1×1 conv{kind} {cin}→{cout} {st} + BatchNorm(γ=β=0)"


def _size(size) -> str:
    return "×".join(map(str, size))


@dataclass(frozen=True)
class AddResidual(Pass):
    """Add a skip connection end + skip(start), exact at insertion (1×1 conv + zero-γ BN, or a zero gate)."""

    name: ClassVar[str] = "add_residual"
    function = add_residual
    ensures = (ADDS_PARAMETERS,)
    start: str | None = arg(
        None,
        "node name (its output) or module path (its input); default: the end of the backbone's stage before the last",
    )
    end: str | None = arg(
        None, "node name (its output) or module path (its output); default: the backbone's last feature map"
    )

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """A skip over each backbone stage, and from each stage's end to the next stage's end, the last first."""
        ds: fx.Node | None = None
        de: fx.Node | None = None
        with contextlib.suppress(NotApplicable):
            ds, de, _ = default_span(gm)
        return [
            Candidate({"start": s.name, "end": e.name}, where, cost, (s, e) == (ds, de))
            for s, e, cost, where in stage_spans(gm, stages(gm))
        ]
