"""insert_adapter: a 1×1 conv (feature maps, channels at dim 1) or Linear (channels last) after a node,
initialised to [I | 0].

out_channels = width (default): the identity, exact.
out_channels > width: identity rows for the old channels, random rows for the new
  ones, and the adapter's whole channel group widened (consumers get zero columns):
  exact, and the new units learn. init=gradmax aims the new rows from a batch (`data`) so the
  gradient on the consumers' zero columns is largest (graphgrow.rewrite.gradmax).
out_channels < width: narrowing drops channels and changes the function; refused
  unless allow_narrowing=true, which inserts a bottleneck (width → out → width,
  [I | 0] then [I ; 0]) and reports how far the output moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import fx

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    add_module,
    analyze,
    begin,
    channel_axis,
    conv_dims,
    default_point,
    factory_kwargs,
    finish,
    gradmax_init,
    group_layouts,
    grow_group,
    identity_adapter,
    inserting_after,
    is_float_tensor,
    load_data,
    pass_function,
    replace_uses,
    set_scope,
    stage_end_candidates,
    tensor_or_feature_end,
    tensor_shape,
)


def adapter_axis(node: fx.Node) -> int | None:
    """Where the adapter mixes: dim 1 of a feature map (a conv layout, a Conv1d's (N, C, L) too), else the last dim."""
    shape = tensor_shape(node) or ()
    if conv_dims(node) is not None:
        return 1
    return channel_axis(shape) if shape else None


def adapter_params(node: fx.Node, out_channels: int | None) -> int:
    """Parameters an adapter after `node` adds (a C×C' weight and its bias)."""
    shape = tensor_shape(node) or ()
    axis = adapter_axis(node)
    if axis is None:
        return 0
    c = shape[axis]
    return c * (out_channels or c) + (out_channels or c)


@pass_function  # the arguments' defaults and allowed values: InsertAdapter's declaration
def insert_adapter(
    gm: fx.GraphModule,
    after: str | None,
    out_channels: int | None,
    allow_narrowing: bool,
    init: Literal["zero", "gradmax"],
    data,
    generator: torch.Generator | None = None,
) -> Rewrite:
    """Insert an identity-initialised adapter after `after` (default: the last feature map before global pooling).
    init=gradmax (widening only): `data` is a callable (or `package.module:function`) returning (inputs, loss_fn)."""
    if init == "gradmax" and data is None:
        load_data(None, "insert_adapter")  # refused before any work: gradmax needs a batch
    gm, generator = begin(gm, generator)
    node, chosen = (
        tensor_or_feature_end(gm, after)
        if after is not None
        else default_point(gm, lambda n: adapter_params(n, out_channels))
    )
    shape = tensor_shape(node)
    axis = adapter_axis(node) if is_float_tensor(node) else None
    if axis is None:
        raise NotApplicable(
            f"'{node.name}' (shape {node.meta.get('gg_shape')}) has no channel dimension to adapt",
            "pick a node with a (N, C, …) or (N, …, C) tensor",
        )
    width = shape[axis]
    out = width if out_channels is None else out_channels
    like = torch.zeros((), **factory_kwargs(gm, node))
    dims = conv_dims(node)  # a 1×1 conv over a feature map's spatial dims, else a Linear
    targets: dict[str, object] = {"after": f"{node.name} {list(shape)}", "chosen": chosen}
    exact = True
    if init == "gradmax" and out <= width:
        raise NotApplicable(
            f"init=gradmax aims the new channels of a widening adapter; out_channels={out} on "
            f"'{node.name}' ({width} channels) adds none, so there is no zero last factor to aim at",
            f"give out_channels > {width}, or use init=zero",
        )
    if out < width and not allow_narrowing:
        raise NotApplicable(
            f"narrowing '{node.name}' from {width} to {out} channels drops channels and changes the function",
            "pass allow_narrowing=true to insert a bottleneck anyway (the report says how far the output moves)",
        )
    if out < width:
        down = add_module(gm, f"{node.name}_adapter_down", identity_adapter(width, out, dims, like))
        up = add_module(gm, f"{node.name}_adapter_up", identity_adapter(out, width, dims, like))
        with inserting_after(node):
            d = gm.graph.call_module(down, (node,))
            u = gm.graph.call_module(up, (d,))
        replace_uses(node, u, keep=[d, u])
        set_scope([d, u], node)
        targets["adapter"] = f"bottleneck {width}→{out}→{width} ([I | 0] then [I ; 0]): changes the function"
        exact = False
    else:
        name = add_module(gm, f"{node.name}_adapter", identity_adapter(width, width, dims, like))
        with inserting_after(node):
            a = gm.graph.call_module(name, (node,))
        a.meta.update(gg_shape=shape, gg_dtype=node.meta.get("gg_dtype"))
        replace_uses(node, a, keep=[a])
        set_scope([a], node)
        targets["adapter"] = f"{type(gm.get_submodule(name)).__name__} {width}→{out}, [I | 0]"
        if out > width:
            coupling = analyze(gm)
            gid = coupling.group_of[a.name]
            rebuilt = grow_group(gm, coupling, gid, out - width, "zero", generator)
            targets["rebuilt"] = ", ".join(rebuilt)
    gm, notes = finish(gm), []
    if init == "gradmax":  # after finish: the grown layers are in the recompiled forward
        aimed = gradmax_init(gm, *group_layouts(coupling, gid, out - width), data, pass_name="insert_adapter")
        if aimed is not None:
            targets["gradmax"], targets["gain"] = aimed.describe(), float(f"{aimed.gain:.4g}")
            notes += aimed.notes
    return Rewrite(gm, targets, notes, exact=exact)


@dataclass(frozen=True)
class InsertAdapter(Pass):
    """Insert a 1×1 conv / Linear adapter initialised to the identity [I | 0]; widening grows its channel group."""

    name: ClassVar[str] = "insert_adapter"
    function = insert_adapter
    ensures = (ADDS_PARAMETERS,)
    after: str | None = arg(
        None, "node name or module path (its output); default: the latest stage end within the budget"
    )
    out_channels: int | None = arg(None, "the adapter's width (default: the same width)", low=1)
    allow_narrowing: bool = arg(False, "allow fewer channels (changes the function; the report says how much)")
    init: Literal["zero", "gradmax"] = arg(
        "zero",
        "widening: zero: random new rows, zero columns in the consumers; gradmax: the new rows aimed from `data`",
    )
    data: str | None = arg(
        None, "with init=gradmax: package.module:function returning (inputs, loss_fn); CLI: --data", names_code=True
    )

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """The end of each backbone stage, the last first."""
        return stage_end_candidates(gm, lambda n: adapter_params(n, self.out_channels))
