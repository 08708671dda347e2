"""Layers written as calls on their own parameters (analysis.coupling_layers.Functional): `F.linear` /
`F.conv*d` grow by resizing the parameter tensors themselves, as the module they stand for would grow. A
weight-standardised conv grows its outputs only: each new filter is standardised on its own, so old filters keep
their statistics, and the constants in the standardisation that name the filter count (timm's
`weight.reshape(1, out_channels, -1)`) follow.
"""

from __future__ import annotations

import torch
from torch import fx

from ..analysis.coupling_layers import Functional
from ..analysis.growth import Layout
from .channel_fill import Init, columns, rows
from .tensor_paths import put_tensor, tensor_at

VIEWS = {"reshape", "view"}


def resize_functional(
    gm: fx.GraphModule,
    f: Functional,
    node: fx.Node,
    in_layout: Layout | None,
    out_layout: Layout | None,
    init: Init,
    generator,
) -> list[str]:
    """Resize the weight's columns (inputs) and rows (outputs) and the bias's rows; the owning module's size
    attributes follow when it has them. Returns the parameter paths rebuilt."""
    old = tensor_at(gm, f.weight)
    with torch.no_grad():
        put_tensor(gm, f.weight, _resized(old, f, in_layout, out_layout, init, generator), old)
        if f.bias is not None:
            bias = tensor_at(gm, f.bias)
            put_tensor(gm, f.bias, rows(bias, out_layout, init, generator, "zero").clone(), bias)
    owner_path, _, name = f.weight.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if name == "weight":  # a module kept whole that calls the function: its repr and checks stay true
        for attr, layout in (
            ("in_features", in_layout),
            ("in_channels", in_layout),
            ("out_features", out_layout),
            ("out_channels", out_layout),
        ):
            if layout is not None and isinstance(getattr(owner, attr, None), int):
                setattr(owner, attr, layout.new)
    if f.standardised and out_layout is not None:
        _follow_filter_count(node, f, out_layout)
    return [f.weight] + ([f.bias] if f.bias else [])


def _resized(
    old: torch.Tensor, f: Functional, in_layout: Layout | None, out_layout: Layout | None, init: Init, generator
) -> torch.Tensor:
    """The weight with its columns and rows laid out anew. A stacked weight (one matrix per expert) is grown expert
    by expert along its own output and input axes, with the same layout for all: the experts stay aligned, and a new
    unit's random incoming weights have one expert's fan-in."""
    if f.kind != "stacked":
        return rows(columns(old, in_layout, init, generator), out_layout, init, generator, "kaiming").clone()
    moved = old.detach().movedim((f.out_axis, f.in_axis), (0, 1))
    flat = moved.reshape(moved.shape[0], moved.shape[1], -1)
    grown = torch.stack(
        [
            rows(columns(flat[..., e], in_layout, init, generator), out_layout, init, generator, "kaiming")
            for e in range(flat.shape[-1])
        ],
        dim=-1,
    )
    return grown.reshape(grown.shape[:2] + moved.shape[2:]).movedim((0, 1), (f.out_axis, f.in_axis)).contiguous()


def _follow_filter_count(conv: fx.Node, f: Functional, layout: Layout) -> None:
    """Reshapes between the weight parameter and the conv that name the old filter count take the new one."""
    todo = [a for a in conv.all_input_nodes if a is not conv.args[0]]
    seen: set[str] = set()
    while todo:
        n = todo.pop()
        if n.name in seen or n.op == "get_attr":
            continue
        seen.add(n.name)
        todo += n.all_input_nodes
        if n.op == "call_method" and n.target in VIEWS:
            shape = n.meta.get("gg_shape")
            sizes = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
            if not isinstance(shape, tuple) or len(sizes) != len(shape):
                continue
            new = [
                layout.new if s == layout.old and d == layout.old and isinstance(s, int) else s
                for s, d in zip(sizes, shape)
            ]
            n.args = (
                (n.args[0], tuple(new))
                if len(n.args) == 2 and isinstance(n.args[1], (tuple, list))
                else (n.args[0], *new)
            )
