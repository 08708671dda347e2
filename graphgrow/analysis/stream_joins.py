"""How stream tensors join (stream.py): adds of stream tensors (any spelling, in place too) and `cat` along another axis
than the hidden one; the hidden axis of each operand, or a refusal naming what breaks it."""

from __future__ import annotations

import torch
from torch import fx

from ..graph.fx_edit import tensor_shape
from .stream_ops import arg, arithmetic
from .stream_parts import refuse


def is_add(n: fx.Node) -> bool:
    return arithmetic(n) in ("add", "sub")


def is_cat(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is torch.cat


def operands(n: fx.Node) -> list[fx.Node]:
    ops = list(n.args[0]) if is_cat(n) else list(n.args[:2])
    # x + 0 is x (CTRL adds a token-type embedding of 0 when no types are given): any other number is refused
    zero = [a for a in ops if not is_cat(n) and type(a) in (int, float) and a == 0]
    if any(not isinstance(a, fx.Node) for a in ops if a not in zero) or len(ops) < 2 or len(zero) == len(ops):
        raise refuse(n, "adds a constant to the stream (its new coordinates would no longer be the mean or zero)")
    if not is_cat(n) and n.kwargs.get("alpha", 1) != 1:
        raise refuse(n, "adds with a scale alpha")
    return [a for a in ops if isinstance(a, fx.Node)]


def operand_axis(n: fx.Node, a: fx.Node, axis: int, width: int) -> int:
    out, shape = tensor_shape(n), tensor_shape(a)
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
    if is_cat(u):
        if arg(u, 1, "dim", 0) % len(out) == axis:
            raise refuse(u, "concatenates along the hidden axis")
        return axis
    operands(u)
    return axis + len(out) - len(tensor_shape(x))
