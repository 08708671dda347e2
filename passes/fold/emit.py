"""Emit one conv or Linear per maximal form in place of the nodes it replaces, and the report's line for it."""

from __future__ import annotations

import torch
from graphgrow.passes.fold.form import Form  # noqa: TID251 (the fold package's own module)
from torch import fx, nn

from graphgrow.rewrite import factory_kwargs, graphgrow_modules, set_module, unique_attr


def emit(gm: fx.GraphModule, n: fx.Node, f: Form, src: fx.Node) -> fx.Node:
    """One layer computing `f` from `src` in place of `n`; returns the new node."""
    kw = factory_kwargs(gm, n)
    bias = (
        f.bias is not None
        and bool(f.bias.abs().max() > 0)
        or any(getattr(gm.get_submodule(p), "bias", None) is not None for p in f.weighted)
    )
    if f.kind == "conv":
        layer: nn.Module = nn.Conv2d(
            f.in_channels,
            f.out_channels,
            tuple(f.weight.shape[2:]),
            f.stride,
            f.padding,
            groups=f.groups,
            bias=bias,
            **kw,
        )
    else:
        layer = nn.Linear(f.in_channels, f.out_channels, bias=bias, **kw)
    with torch.no_grad():
        layer.weight.copy_(f.weight)
        if layer.bias is not None:
            layer.bias.copy_(f.bias if f.bias is not None else torch.zeros(f.out_channels, dtype=torch.float64))
    layer.eval()
    # the merged layer takes the place of the model's own layer (not one growth added), the largest if several
    added = graphgrow_modules(gm)
    main = max(f.weighted, key=lambda p: (p.split(".")[0] not in added, gm.get_submodule(p).weight.numel()))
    users = [x for x in gm.graph.nodes if x.op == "call_module" and x.target == main]
    if users == [next(x for x in f.nodes if x.op == "call_module" and x.target == main)]:
        path = main
        set_module(gm, path, layer)
    else:
        path = unique_attr(gm, "folded_" + main.replace(".", "_"))
        gm.add_module(path, layer)
    with gm.graph.inserting_before(n):
        new = gm.graph.call_module(path, (src,))
    new.meta.update({k: v for k, v in n.meta.items() if k.startswith("gg_")})
    n.replace_all_uses_with(new)
    return new


def describe_form(gm: fx.GraphModule, f: Form) -> str:
    """The report's line: the nodes a form replaces → the layer it becomes."""
    k = f"{f.weight.shape[2]}×{f.weight.shape[3]} conv" if f.kind == "conv" else "Linear"
    g = f", groups {f.groups}" if f.kind == "conv" and f.groups > 1 else ""
    parts = ", ".join(sorted(_node_label(gm, x) for x in f.nodes))
    return f"{parts} → one {k}{g}"


def _node_label(gm: fx.GraphModule, n: fx.Node) -> str:
    return str(n.target) if n.op == "call_module" else n.name
