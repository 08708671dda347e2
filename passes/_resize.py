"""Rebuild conv / Linear / BatchNorm layers at new widths, keeping every constructor setting.

Old weights go to their new positions (coupling.Layout); new output units get
random incoming weights (`zero` init) or copies of the unit they replicate
(`net2net`); new input columns are zero (`zero`) or share the replicated unit's
outgoing weight with it (`net2net`, random shares that sum to one, so replicas are
exact but not symmetric).
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import fx, nn

from graphgrow.coupling import BATCHNORMS, Coupling, Layout, make_layout, plan_growth
from graphgrow.errors import NotApplicable

from ._init import kaiming_

Init = Literal["zero", "net2net"]


def set_module(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)


def _like(t: torch.Tensor) -> dict:
    return {"device": t.device, "dtype": t.dtype}


def _shares(count: int, generator: torch.Generator) -> torch.Tensor:
    """Random positive shares summing to one (never equal: equal shares keep replicas symmetric)."""
    w = torch.rand(count, generator=generator, dtype=torch.float64) + 0.5
    return w / w.sum()


def _rows(old: torch.Tensor, layout: Layout | None, init: Init, generator: torch.Generator, fresh: str) -> torch.Tensor:
    """Place old rows (dim 0) and fill new ones: random ('kaiming'), 'zero', 'one', or copies for net2net."""
    if layout is None:
        return old
    new = torch.empty((layout.new,) + tuple(old.shape[1:]), **_like(old))
    new[layout.old_to_new] = old
    for slot, src in zip(layout.new_slots, layout.src):
        if init == "net2net" and src is not None:
            new[slot] = old[src]
        elif fresh == "kaiming":
            row = torch.empty((1,) + tuple(old.shape[1:]), **_like(old))
            new[slot] = kaiming_(row, generator)[0]
        else:
            new[slot] = {"zero": 0.0, "one": 1.0}[fresh]
    return new


def _cols(old: torch.Tensor, layout: Layout | None, init: Init, generator: torch.Generator) -> torch.Tensor:
    """Place old input columns (dim 1); new columns are zero, or net2net shares of their source column."""
    if layout is None:
        return old
    shape = list(old.shape)
    shape[1] = layout.new
    new = torch.zeros(shape, **_like(old))
    new[:, layout.old_to_new] = old
    if init == "net2net":
        replicas: dict[int, list[int]] = {}
        for slot, src in zip(layout.new_slots, layout.src):
            if src is not None:
                replicas.setdefault(src, []).append(slot)
        for src, slots in replicas.items():
            share = _shares(len(slots) + 1, generator).to(old.dtype)
            column = old[:, src]
            new[:, layout.old_to_new[src]] = column * share[0]
            for s, slot in zip(share[1:], slots):
                new[:, slot] = column * s
    return new


def resize_conv(m: nn.modules.conv._ConvNd, in_layout: Layout | None, out_layout: Layout | None, init: Init,
                generator: torch.Generator) -> nn.Module:
    """A conv with more input and/or output channels; stride, padding, dilation, groups, bias,
    padding_mode, dtype and device are kept. Depthwise convs grow in, out and groups together."""
    depthwise = m.groups > 1 and m.groups == m.in_channels == m.out_channels
    if m.groups > 1 and not depthwise:
        raise NotApplicable(f"cannot resize grouped conv with groups={m.groups}", "grow a layer outside the grouped conv")
    if depthwise:
        out_layout = out_layout or in_layout
        in_layout = None
    cin = (out_layout.new if depthwise else (in_layout.new if in_layout else m.in_channels))
    cout = out_layout.new if out_layout else m.out_channels
    new = type(m)(cin, cout, m.kernel_size, stride=m.stride, padding=m.padding, dilation=m.dilation,
                  groups=cout if depthwise else 1, bias=m.bias is not None, padding_mode=m.padding_mode,
                  **_like(m.weight))
    return _fill_weights(m, new, in_layout, out_layout, init, generator)


def _fill_weights(old: nn.Module, new: nn.Module, in_layout, out_layout, init: Init, generator) -> nn.Module:
    """Copy a conv's or Linear's weight and bias into `new` at the layouts' positions."""
    with torch.no_grad():
        w = _cols(old.weight, in_layout, init, generator)
        new.weight.copy_(_rows(w, out_layout, init, generator, "kaiming"))
        if old.bias is not None:
            new.bias.copy_(_rows(old.bias, out_layout, init, generator, "zero"))
    new.train(old.training)
    return new


def resize_linear(m: nn.Linear, in_layout: Layout | None, out_layout: Layout | None, init: Init,
                  generator: torch.Generator) -> nn.Linear:
    new = nn.Linear(in_layout.new if in_layout else m.in_features, out_layout.new if out_layout else m.out_features,
                    bias=m.bias is not None, **_like(m.weight))
    return _fill_weights(m, new, in_layout, out_layout, init, generator)


def resize_batchnorm(m: nn.modules.batchnorm._BatchNorm, layout: Layout, init: Init, generator) -> nn.Module:
    """New channels: γ=1, β=0, mean 0, var 1 (or the replicated channel's values for net2net)."""
    new = type(m)(layout.new, eps=m.eps, momentum=m.momentum, affine=m.affine,
                  track_running_stats=m.track_running_stats, **_like(m.weight if m.affine else m.running_mean))
    with torch.no_grad():
        if m.affine:
            new.weight.copy_(_rows(m.weight, layout, init, generator, "one"))
            new.bias.copy_(_rows(m.bias, layout, init, generator, "zero"))
        if m.track_running_stats:
            new.running_mean.copy_(_rows(m.running_mean, layout, init, generator, "zero"))
            new.running_var.copy_(_rows(m.running_var, layout, init, generator, "one"))
            new.num_batches_tracked.copy_(m.num_batches_tracked)
    new.train(m.training)
    return new


def resize(m: nn.Module, in_layout: Layout | None, out_layout: Layout | None, init: Init, generator) -> nn.Module:
    if isinstance(m, nn.modules.conv._ConvNd):
        return resize_conv(m, in_layout, out_layout, init, generator)
    if isinstance(m, nn.Linear):
        return resize_linear(m, in_layout, out_layout, init, generator)
    if isinstance(m, BATCHNORMS):
        return resize_batchnorm(m, out_layout or in_layout, init, generator)
    raise NotApplicable(f"cannot resize {type(m).__name__}", "this layer type is not supported by grow_width")


def grow_group(gm: fx.GraphModule, coupling: Coupling, gid: int, count: int, init: Init,
               generator: torch.Generator) -> list[str]:
    """Widen group `gid` (and every group it reaches) by `count` channels in place; returns the rebuilt layers."""
    group = coupling.groups[gid]
    src = None
    if init == "net2net":
        perm = torch.randperm(group.size, generator=generator).tolist()
        src = [perm[i % group.size] for i in range(count)]
    try:
        plan = plan_growth(coupling, gid, count, src)
    except ValueError as e:
        raise NotApplicable(f"cannot grow the {group.size}-channel group of {', '.join(group.sources[:3]) or group.members[0]}: {e}",
                            "widen a layer whose group can grow (graphgrow inspect --groups), or use grow_width(mode=adapter)") from e
    layouts = {g: make_layout(coupling.groups[g].size, ins) for g, ins in plan.items()}
    in_layouts: dict[str, Layout] = {}
    out_layouts: dict[str, Layout] = {}
    for g, layout in layouts.items():
        grp = coupling.groups[g]
        for n in grp.sources + grp.channelwise:
            out_layouts[n] = layout
        for n in grp.consumers:
            in_layouts[n] = layout
    nodes = {n.name: n for n in gm.graph.nodes}
    rebuilt = []
    for name in sorted(set(in_layouts) | set(out_layouts), key=list(nodes).index):
        path = nodes[name].target
        old = gm.get_submodule(path)
        set_module(gm, path, resize(old, in_layouts.get(name), out_layouts.get(name), init, generator))
        rebuilt.append(path)
    return rebuilt
