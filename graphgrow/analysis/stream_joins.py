"""How stream tensors join (stream.py): adds of stream tensors (any spelling, in place too) and `cat` along another axis
than the hidden one; the hidden axis of each operand, or a refusal naming what breaks it."""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .stream_ops import arg, arithmetic, base_name
from .stream_parts import refuse


def is_add(n: fx.Node) -> bool:
    return arithmetic(n) in ("add", "sub") and not any(isinstance(a, tuple) for a in n.args[:2])


def tuple_element(n: fx.Node) -> fx.Node | None:
    """The tensor `n` = t[i] is when t is tuples concatenated, `(x,) + rest` (a layer returning `(hidden,) +
    outputs[1:]`): the i-th element written in a literal tuple, else None."""
    t, i = (n.args[0], n.args[1]) if base_name(n) == "getitem" and len(n.args) == 2 else (None, None)
    while isinstance(i, int) and i >= 0 and isinstance(t, fx.Node) and t.target is operator.add:
        if not isinstance(t.args[0], tuple):
            return None
        if i < len(t.args[0]):
            found = t.args[0][i]
            return found if isinstance(found, fx.Node) else None
        i, t = i - len(t.args[0]), t.args[1]
    return None


def is_cat(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in (torch.cat, torch.concat, torch.concatenate)


def is_stack(n: fx.Node) -> bool:
    """torch.stack of stream tensors along a new axis (CoaT's class tokens of its three scales, (B, 3, C))."""
    return n.op == "call_function" and n.target is torch.stack and isinstance(n.args[0], (list, tuple))


def operands(n: fx.Node) -> list[fx.Node]:
    joins = is_cat(n) or is_stack(n)
    ops = list(n.args[0]) if joins else list(n.args[:2])
    # x + 0 is x (CTRL adds a token-type embedding of 0 when no types are given): any other number is refused
    zero = [a for a in ops if not joins and type(a) in (int, float) and a == 0]
    if any(not isinstance(a, fx.Node) for a in ops if a not in zero) or len(ops) < 2 or len(zero) == len(ops):
        raise refuse(n, "adds a constant to the stream (its new coordinates would no longer be the mean or zero)")
    if not joins and n.kwargs.get("alpha", 1) != 1:
        raise refuse(n, "adds with a scale alpha")
    return [a for a in ops if isinstance(a, fx.Node)]


def operand_axis(n: fx.Node, a: fx.Node, axis: int, width: int) -> int:
    out, shape = tensor_shape(n), tensor_shape(a)
    if is_stack(n):  # the new axis is no hidden one; the axes after it move back by one in the operand
        dim = arg(n, 1, "dim", 0) % len(out)
        return axis if axis < dim else axis - 1
    if is_cat(n):
        dim = arg(n, 1, "dim", 0) % len(out)
        if dim == axis:
            raise refuse(n, "concatenates along the hidden axis")
        return axis
    if shape is None:
        raise refuse(n, "adds a tensor of unknown shape")
    k = axis - (len(out) - len(shape))
    if k < 0 or shape[k] != width:
        raise refuse(n, f"broadcasts '{a.name}' {list(shape)} across the hidden axis")
    return k


def user_axis(u: fx.Node, x: fx.Node, axis: int) -> int:
    out = tensor_shape(u)
    if is_stack(u):
        operands(u)
        return axis if axis < arg(u, 1, "dim", 0) % len(out) else axis + 1
    if is_cat(u):
        if arg(u, 1, "dim", 0) % len(out) == axis:
            raise refuse(u, "concatenates along the hidden axis")
        return axis
    operands(u)
    return axis + len(out) - len(tensor_shape(x))


def split_source(n: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, the split's dim) when `n` is one piece of x split along a dim (torch.split, chunk, split_with_sizes:
    CvT's class token split from the patch tokens), else None."""
    if base_name(n) != "getitem" or len(n.args) != 2 or not isinstance(n.args[1], int):
        return None
    s = n.args[0]
    if not isinstance(s, fx.Node) or base_name(s) not in ops.SPLITS | {"split_with_sizes"}:
        return None
    x, rank = s.args[0], len(tensor_shape(s.args[0]) or ()) if isinstance(s.args[0], fx.Node) else 0
    dim = arg(s, 1, "dim", 0) if base_name(s) == "unbind" else arg(s, 2, "dim", 0)
    return (x, dim % rank) if isinstance(x, fx.Node) and isinstance(dim, int) and rank else None


def piece_axis(n: fx.Node, axis: int, back: bool = False) -> int | None:
    """The hidden axis of piece `n` of a split of x whose hidden axis is `axis` (back: x's, `axis` being the
    piece's); None when the split is along it. A piece of unbind (Inkling's mixed depth sources, unbind(-2)[0]) has
    the split dim removed."""
    x, dim = split_source(n)  # type: ignore[misc]
    removed = len(tensor_shape(n) or ()) < len(tensor_shape(x) or ())
    if back:
        at = axis + (removed and axis >= dim)
        return None if at == dim else at
    return None if axis == dim else axis - (removed and dim < axis)


def cat_readers(gm: fx.GraphModule, u: fx.Node, axis: int, width: int) -> tuple[list[fx.Node], list[fx.Node]]:
    """(the parts, the Linear layers reading them) when `u` concatenates stream tensors along the hidden axis (last)
    and only Linear layers read it (DINOv2's head: the class token beside the patch tokens' mean): each block of
    their columns grows as a reader's does. Else a refusal."""
    parts = list(u.args[0])
    linear = [v for v in u.users if v.op == "call_module" and isinstance(gm.get_submodule(v.target), nn.Linear)]
    if axis != len(tensor_shape(u) or ()) - 1 or not linear or len(linear) != len(u.users):
        raise refuse(u, "concatenates along the hidden axis (followed only into Linear layers reading the result)")
    if any(v.args != (u,) for v in linear) or any(
        not isinstance(a, fx.Node) or (tensor_shape(a) or (0,))[-1] != width for a in parts
    ):
        raise refuse(u, "concatenates the stream along the hidden axis with other tensors")
    return parts, linear  # type: ignore[return-value]


def stream_product(n: fx.Node, axis: int, width: int) -> list[fx.Node] | None:
    """Both operands when `n` multiplies two tensors of its own shape coordinate by coordinate, the hidden size at
    `axis` (a gated unit on the stream: MLP-Mixer's GLU over the tokens, x1 · act(x2)), else None: 0 · y = 0 and a copy
    times a copy is a copy, but the mean of products is no product of means (the zero fill on all three, or copies)."""
    out = tensor_shape(n)
    if arithmetic(n) != "mul" or len(n.args) != 2 or out is None or not 0 <= axis < len(out) or out[axis] != width:
        return None
    pair = [a for a in n.args if isinstance(a, fx.Node) and tensor_shape(a) == out]
    return pair if len(pair) == 2 else None
