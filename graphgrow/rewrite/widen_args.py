"""The graph side of a growth: constants in slices, splits and reshapes that name channel counts or
offsets follow the new layout (coupling records them as edits), and net2net replicas chosen per block.
"""

from __future__ import annotations

import torch
from torch import fx

from ..analysis.coupling import Coupling
from ..analysis.coupling_splits import ChannelEdit
from ..analysis.growth import Layout
from ..analysis.reshapes import split_call


def block_sources(size: int, count: int, blocks: int, generator: torch.Generator) -> list[int | None]:
    """net2net sources for `count` new channels spread over `blocks` equal blocks: each block's new channels
    replicate channels of the same block, at the same places in every block (so a split into blocks sees the
    same replicas in each)."""
    width, per = size // blocks, count // blocks
    perm = torch.randperm(width, generator=generator).tolist()
    return [b * width + perm[i % width] for b in range(blocks) for i in range(per)]


def apply_edits(gm: fx.GraphModule, coupling: Coupling, layouts: dict[int, Layout]) -> None:
    nodes = {n.name: n for n in gm.graph.nodes}

    def layout(name: str) -> Layout | None:
        return layouts.get(coupling.group_of[name]) if name in coupling.group_of else None

    for edit in coupling.edits:
        n = nodes[edit.node]
        if edit.kind == "split":
            _split(n, edit, layout)
        elif layout(edit.source) is None and layout(edit.node) is None:
            continue
        elif edit.kind == "slice":
            _slice(n, edit, layout)
        elif edit.kind == "narrow":
            _narrow(n, edit, layout)
        elif edit.kind == "reshape":
            _reshape(n, edit, layout)
        elif edit.kind == "groups":
            _groups(n, edit, layout)
        elif edit.kind == "view":  # a per-channel tensor's view: the channel count of the group reading it
            _reshape(n, edit, layout, edit.source)


def _span(n: fx.Node, edit: ChannelEdit, layout, start: int, length: int) -> tuple[int, int]:
    """The new (start, length) of a span of the source's channels that node `n` takes."""
    src, mine = layout(edit.source), layout(edit.node)
    new_start = start if src is None else (src.old_to_new[start] if start < src.old else src.new)
    return new_start, (mine.new if mine is not None else length)


def _slice(n: fx.Node, edit: ChannelEdit, layout) -> None:
    axis = edit.where[0]
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    x_shape = n.args[0].meta["gg_shape"]
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(x_shape) - len(index) + 1) + index[at + 1 :]
    start, stop, _ = index[axis].indices(x_shape[axis])
    new_start, length = _span(n, edit, layout, start, stop - start)
    index = index[:axis] + (slice(new_start or None, new_start + length, None),) + index[axis + 1 :]
    n.args = (n.args[0], index) + tuple(n.args[2:])


def _narrow(n: fx.Node, edit: ChannelEdit, layout) -> None:
    args = list(n.args)
    dim, start, length = (args[1:4] + [n.kwargs.get(k) for k in ("dim", "start", "length")])[:3]
    start %= n.args[0].meta["gg_shape"][dim]
    new_start, new_length = _span(n, edit, layout, start, length)
    kwargs = dict(n.kwargs)
    for key, value, at in (("start", new_start, 2), ("length", new_length, 3)):
        if key in kwargs:
            kwargs[key] = value
        else:
            args[at] = value
    n.args, n.kwargs = tuple(args), kwargs


def _split(n: fx.Node, edit: ChannelEdit, layout) -> None:
    """Any split along the channel axis becomes torch.split with the pieces' new sizes (new channels at a
    boundary belong to the piece before it, as in the coupling's links)."""
    src = layout(edit.source)
    if src is None:
        return
    dim = split_call(n)[1]  # type: ignore[index]
    ends, total = [], 0
    for shape in n.meta["gg_shape"]:
        total += shape[dim]
        ends.append(total)
    moved = [0] + [src.old_to_new[p] if p < src.old else src.new for p in ends]
    sizes = [b - a for a, b in zip(moved, moved[1:])]
    n.op, n.target, n.args, n.kwargs = "call_function", torch.split, (n.args[0], sizes), {"dim": dim}


def _groups(n: fx.Node, edit: ChannelEdit, layout) -> None:
    """F.group_norm's num_groups: the old groups plus the whole new ones (coupling's unit)."""
    mine = layout(edit.node)
    if mine is None:
        return
    kind, key = edit.where
    old = n.args[key] if kind == "a" else n.kwargs[key]
    value = mine.new // (mine.old // old)
    if kind == "a":
        n.args = n.args[:key] + (value,) + n.args[key + 1 :]
    else:
        n.kwargs = {**n.kwargs, key: value}


def _reshape(n: fx.Node, edit: ChannelEdit, layout, sized_by: str | None = None) -> None:
    mine = layout(sized_by or edit.node)
    if mine is None:
        return
    kind, *path = edit.where
    if kind == "k":
        shape = list(n.kwargs[path[0]])  # type: ignore[call-overload]
        shape[path[1]] = mine.new
        n.kwargs = {**n.kwargs, path[0]: tuple(shape)}
        return
    args = list(n.args)
    if len(path) == 2:
        inner = list(args[path[0]])
        inner[path[1]] = mine.new
        args[path[0]] = tuple(inner)
    else:
        args[path[0]] = mine.new
    n.args = tuple(args)
