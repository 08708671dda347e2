"""Coupling rules for ops that take channels apart or put them together along the channel axis: slices,
`narrow`, split/chunk/tensor_split/unbind, `stack`, reshapes that split or merge the channel axis, and a
softmax over another axis. Each becomes a join (same channels), a link (a span of channels, repeated in
blocks or scaled) or a freeze with the reason. Ops whose constant arguments name channel counts or
offsets are recorded as *edits*, so that a growth can rewrite those constants.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..graph import ops
from ..graph.fx_edit import from_input, tensor_shape
from .axes import node_axis
from .coupling_build import Build, Site
from .reshapes import is_reshape, reshape_regroup, split_call, stack_axis, unit_dims_regroup


@dataclass
class ChannelEdit:
    """A node whose constant arguments follow the channels: kind 'slice' (getitem), 'narrow', 'split'
    (the tuple-producing node), 'reshape' (a literal channel count at args path `where`), 'groups' (F.group_norm's
    num_groups), 'view' (a literal channel count in a per-channel tensor's view; `source` is the group member reading
    the tensor). (Not head_layout's FactorEdit, a literal that is a product of head-layout factors.)"""

    kind: str
    node: str
    source: str  # the tensor whose channels it takes apart
    where: tuple = ()


SOFTMAXES = ops.SOFTMAX_FUNCTIONS


def split_rule(b: Build, s: Site) -> bool:
    """Apply the rule for the site's node when it is one of these ops; False when it is none of them."""
    n, out, join, freeze, link, edits = s.node, s.out, b.join, b.freeze, b.link, b.edits
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if n.op == "call_function" and n.target is torch.stack:
        return _stack(n, join, freeze)
    if split_call(n) is not None:
        return _split_tuple(n, freeze, edits)
    if x is None:
        return False
    if n.op == "call_function" and n.target is operator.getitem and split_call(x) is not None:
        return _piece(n, x, join, link)
    if n.op == "call_function" and n.target is operator.getitem:
        return _slice(n, x, out, link, edits) or _interleaved(b, n, x) or _gathered(b, n, x)
    if n.op in ("call_function", "call_method") and ops.op_name(n.target).split(".")[0] == "index_select":
        return _gathered(b, n, x)
    if (n.op == "call_method" and n.target == "narrow") or (n.op == "call_function" and n.target is torch.narrow):
        return _narrow(n, x, join, link, freeze, edits)
    if is_reshape(n):
        return _reshape(n, x, join, link, freeze, edits)
    # from the input only: a parameter's view (Mamba's D.unsqueeze(0)) joined by shape would keep its old size
    if unit_dims_regroup(n, node_axis(x)) is not None and out is not None and from_input(x):
        join(x, n)  # size-1 dims dropped or added: every channel where it was
        return True
    if n.op == "call_method" and n.target == "expand" and out is not None:
        return _expand(n, x, join, edits)
    if (
        _softmax_dim(n) is not None
        and out is not None
        and node_axis(x) is not None
        and _softmax_dim(n) % len(tensor_shape(x)) != node_axis(x)
    ):
        join(x, n)  # normalises over another axis: each channel alone
        return True
    return False


def _stack(n: fx.Node, join, freeze) -> bool:
    tensors = n.args[0] if n.args else n.kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, fx.Node) for t in tensors) or not tensors:
        return False
    axes = {node_axis(t) for t in tensors}
    if len(axes) != 1 or stack_axis(n, node_axis(tensors[0])) is None:
        freeze(list(tensors) + [n], f"'{n.name}' stacks tensors whose channel axes differ")
        return True
    join(*tensors, n)  # a new axis: channel c of every input is channel c of the stack
    return True


def _split_tuple(n: fx.Node, freeze, edits: list[ChannelEdit]) -> bool:
    kind, dim = split_call(n)  # type: ignore[misc]
    x = n.args[0]
    if not all(
        u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int) for u in n.users
    ):
        freeze([x], f"'{n.name}' ({kind}) is used as a whole; only its pieces taken one by one are followed")
    elif dim == node_axis(x):
        if kind == "unbind":
            freeze([x], f"'{n.name}' unbinds the channel axis into separate tensors")
        else:
            edits.append(ChannelEdit("split", n.name, x.name))
    return True


def _piece(n: fx.Node, tup: fx.Node, join, link) -> bool:
    kind, dim = split_call(tup)  # type: ignore[misc]
    x = tup.args[0]
    shapes = tup.meta.get("gg_shape")
    if not isinstance(shapes, list) or not isinstance(n.args[1], int):
        return False
    if dim != node_axis(x):
        join(x, n)  # pieces along another axis keep every channel
        return True
    if kind == "unbind":
        return True  # frozen at the tuple
    i = n.args[1] % len(shapes)
    offset = sum(s[dim] for s in shapes[:i])
    link(n, x, offset)  # piece i is channels [offset, offset + size) of x
    return True


def _slice(n: fx.Node, x: fx.Node, out, link, edits: list[ChannelEdit]) -> bool:
    index = n.args[1]
    index = index if isinstance(index, tuple) else (index,)
    shape, axis = tensor_shape(x), node_axis(x)
    if (
        shape is None
        or axis is None
        or out is None
        or not all(isinstance(i, slice) or i is Ellipsis for i in index)
        or sum(i is Ellipsis for i in index) > 1
    ):
        return False
    if any(isinstance(b, fx.Node) for i in index if isinstance(i, slice) for b in (i.start, i.stop, i.step)):
        return False
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    if axis >= len(index):
        return False
    start, stop, step = slice.indices(index[axis], shape[axis])
    if step != 1 or stop <= start:
        return False
    link(n, x, start)
    edits.append(ChannelEdit("slice", n.name, x.name, (axis,)))
    return True


def _strided(n: fx.Node, x: fx.Node) -> tuple[int, int] | None:
    """(start, step) when `n` is `x[..., start::step]` on x's channel axis, step > 1, start < step, open-ended (no stop,
    or torch.export's largest integer: a stop at the channel count would cut the grown axis), every other dim whole;
    else None."""
    index = n.args[1] if n.op == "call_function" and n.target is operator.getitem and len(n.args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    shape, axis = tensor_shape(x), node_axis(x)
    if shape is None or axis is None or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return None
    if sum(i is Ellipsis for i in index) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    if len(index) > len(shape) or axis >= len(index):
        return None
    if any(i != slice(None) for d, i in enumerate(index) if d != axis):
        return None
    start, stop, step = index[axis].start or 0, index[axis].stop, index[axis].step
    to_end = stop is None or (isinstance(stop, int) and stop >= 2**62)  # open: a stop at the size would not follow
    if not isinstance(start, int) or not isinstance(step, int) or not 0 <= start < step or not to_end:
        return None
    return (start, step) if step > 1 and shape[axis] % step == 0 else None


def _interleaved(b: Build, n: fx.Node, x: fx.Node) -> bool:
    """`x[..., o::s]` for every o < s (GPT-OSS's gate and up, alternate channels of one projection): the pieces are
    one group, and each of their channels is `s` neighbouring channels of x (piece o's channel c is x's channel
    c·s + o), so the pieces growing by k grow x by k·s at its end, every piece taking its share. One piece alone,
    or pieces that do not cover x, are not this (the channels left out would be no piece's)."""
    found = _strided(n, x)
    if found is None or b.vertex(n) is None:
        return False
    start, step = found
    copies = _whole_copies(x)  # torch.export reads `h[:, 0::2]` as `h[0:]` then `[:, 0::2]`: one copy per piece
    pieces: dict[int, fx.Node] = {}
    for c in copies:
        for u in c.users:
            other = _strided(u, c)
            if other is not None and other[1] == step:
                pieces[other[0]] = u
    if sorted(pieces) != list(range(step)):
        return False
    b.join(n, *pieces.values())
    if start == 0:
        b.link(n, x, 0, scale=step)
    return True


def _whole(n: fx.Node) -> bool:
    """`n` is `x[0:]` / `x[:, :]`: every element of x, as torch.export writes a slice's untouched leading dims."""
    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return False
    index, shape = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],), tensor_shape(n.args[0])
    return (
        shape is not None
        and len(index) <= len(shape)
        and all(
            isinstance(i, slice)
            and i.step in (None, 1)
            and i.start in (None, 0)
            and (i.stop is None or (isinstance(i.stop, int) and i.stop >= d))
            for i, d in zip(index, shape)
        )
    )


def _whole_copies(x: fx.Node) -> list[fx.Node]:
    """x's source (through whole copies) and every whole copy of it."""
    while _whole(x) and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    found, todo = [], [x]
    while todo:
        c = todo.pop()
        found.append(c)
        todo += [u for u in c.users if _whole(u)]
    return found


def _gathered(b: Build, n: fx.Node, x: fx.Node) -> bool:
    """`x[ids]` / `x[:, ids]` / `index_select(x, d, ids)` with one integer tensor index along another dim than the
    channels (a per-expert bias gathered by the routed indices, tokens picked): whole rows, each channel kept."""
    shape, out, axis = tensor_shape(x), tensor_shape(n), node_axis(x)
    if shape is None or out is None or axis is None or len(shape) != len(out) or node_axis(n) != axis:
        return False
    if n.target is operator.getitem:
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        tensors = [d for d, i in enumerate(index) if isinstance(i, fx.Node)]
        if len(tensors) != 1 or not all(
            isinstance(i, slice) and i == slice(None) for i in index if i is not index[tensors[0]]
        ):
            return False
        dim = tensors[0]
        ids = index[dim]
    else:
        given, ids = (
            n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None),
            n.kwargs.get("index", n.args[2] if len(n.args) > 2 else None),
        )
        if not isinstance(given, int) or not isinstance(ids, fx.Node):
            return False
        dim = given % len(shape)
    ids_shape = tensor_shape(ids)
    if (
        dim == axis
        or ids_shape is None
        or len(ids_shape) != 1
        or not str(ids.meta.get("gg_dtype", "")).startswith("torch.int")
    ):
        return False
    if out[axis] != shape[axis] or b.vertex(n) is None:
        return False
    b.join(x, n)
    return True


def _narrow(n: fx.Node, x: fx.Node, join, link, freeze, edits: list[ChannelEdit]) -> bool:
    args = list(n.args[1:]) + [n.kwargs.get(k) for k in ("dim", "start", "length") if k in n.kwargs]
    shape, axis = tensor_shape(x), node_axis(x)
    if len(args) < 3 or not all(isinstance(a, int) for a in args[:3]) or shape is None or axis is None:
        freeze([x, n], f"'{n.name}' (narrow) has arguments computed at run time")
        return True
    dim, start = args[0] % len(shape), args[1] % shape[args[0] % len(shape)]
    if dim != axis:
        join(x, n)
        return True
    link(n, x, start)
    edits.append(ChannelEdit("narrow", n.name, x.name))
    return True


def _reshape(n: fx.Node, x: fx.Node, join, link, freeze, edits: list[ChannelEdit]) -> bool:
    found = reshape_regroup(n, node_axis(x))
    if found is None:
        return False
    where = literal_at(n, found.out_axis)
    if where is not None:
        edits.append(ChannelEdit("reshape", n.name, x.name, where))
    if found.kind == "keep":
        join(x, n)
    elif found.kind == "split":  # x's channel j·stride + t is n's channel t
        link(n, x, 0, repeat=found.repeat, stride=found.stride)
    else:  # n's channel j·stride + c·scale + q is x's channel c
        link(x, n, 0, repeat=found.repeat, stride=found.stride, scale=found.scale)
    return True


def _expand(n: fx.Node, x: fx.Node, join, edits: list[ChannelEdit]) -> bool:
    """x.expand(B, -1, -1) (a class token broadcast over the batch): channels kept where the size there is -1,
    computed, or the channel count as a literal (an edit, rewritten when the channels grow)."""
    xs, os_, axis = tensor_shape(x), tensor_shape(n), node_axis(x)
    if xs is None or os_ is None or axis is None or "size" in n.kwargs:
        return False
    out_axis = axis + len(os_) - len(xs)
    if node_axis(n) != out_axis or os_[out_axis] != xs[axis]:
        return False
    sizes = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
    if len(sizes) != len(os_):
        return False
    where = literal_at(n, out_axis)
    if where is not None:
        edits.append(ChannelEdit("reshape", n.name, x.name, where))
    join(x, n)
    return True


def literal_at(n: fx.Node, dim: int) -> tuple | None:
    """Where in a reshape's arguments the size of output dim `dim` is a literal (not -1, not computed):
    ("a", i) for args[i], ("a", i, j) for args[i][j], ("k", "shape", j) for kwargs["shape"][j]."""
    where: tuple
    if "shape" in n.kwargs:
        shape, where = n.kwargs["shape"], ("k", "shape", dim)
        value = shape[dim] if isinstance(shape, (tuple, list)) and dim < len(shape) else None
    elif len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
        value, where = (n.args[1][dim] if dim < len(n.args[1]) else None), ("a", 1, dim)
    else:
        value, where = (n.args[1 + dim] if 1 + dim < len(n.args) else None), ("a", 1 + dim)
    return where if isinstance(value, int) and value != -1 else None


def _softmax_dim(n: fx.Node) -> int | None:
    is_fn = n.op == "call_function" and n.target in SOFTMAXES
    is_method = n.op == "call_method" and n.target in ("softmax", "log_softmax")
    if not (is_fn or is_method):
        return None
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    return dim if isinstance(dim, int) else None


def pad_rule(b: Build, s: Site) -> bool:
    """F.pad(x, pads, ...): pads along other dims keep each channel apart; pads on the channel dim add channels
    the growth cannot place (frozen, with the reason). `pads` pairs dims from the last one backwards."""
    n, x = s.node, s.x
    pads = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad")
    shape = tensor_shape(x) if x is not None else None
    axis = node_axis(x) if x is not None else None
    if x is None or shape is None or axis is None or not isinstance(pads, (list, tuple)):
        return False
    k = len(shape) - 1 - axis  # the channel dim's pair in `pads`
    pair = list(pads[2 * k : 2 * k + 2])
    if not pair or pair == [0, 0]:
        b.join(x, n)
        return True
    b.freeze(
        [x, n],
        f"'{n.name}' (pad) pads the channel dim by {pair}: the padded channels are no layer's output, "
        "so the channels before and after it cannot grow together",
    )
    return True
