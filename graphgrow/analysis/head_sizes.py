"""Size arguments of the reshapes between an attention's projections and the attention (analysis.head_flow): the
head count written in a tuple added to sizes read at run time (`x.view(x.size()[:-1] + (heads, -1))`, BERT-style), a
constant times a size (`mul(size, heads)`), and sizes computed from sizes read at run time that follow the growth by
themselves (`q.size(0) * q.size(1)`: batch · heads). Apart from head_flow, which follows layouts op by op, because
reading a size argument is one job of its own.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from ..graph.fx_edit import tensor_shape
from .eager_attention import scale_value
from .head_layout import Axis, size_of


def follows(layout: dict[str, object], a: fx.Node, axis: Axis, growing: set[str]) -> bool:
    """`a` is arithmetic on sizes read at run time of tensors laid out in `layout` (GPT-NeoX-Japanese's
    `batch_size * num_heads` from `q.size()`) and grows as `axis` does: checked at the sizes now and with every
    growing factor of `axis` doubled."""
    probe = {f: 2 * s for f, s in axis if f in growing}

    def read(new: dict[str, int]):
        def size(t: fx.Node, dim: int) -> int:
            lay = layout.get(t.name)
            if isinstance(lay, tuple):
                return math.prod(new.get(f, s) if f else s for f, s in lay[dim])
            return tensor_shape(t)[dim]

        return size

    try:
        now, grown = scale_value(a, read({})), scale_value(a, read(probe))
    except (ValueError, TypeError, IndexError, ZeroDivisionError):
        return False
    return bool(probe) and grown * size_of(axis) == now * math.prod(probe.get(f, s) for f, s in axis)


def joined_sizes(a: fx.Node) -> tuple[str, tuple] | None:
    """(the size read, the sizes added) when a reshape's shape is `t.size()[:k] + (c, …)` (BERT-style
    transpose_for_scores: `x.view(x.size()[:-1] + (heads, -1))`): the leading sizes are read from a tensor at run time,
    the tuple holds the constants; else None."""
    if not (a.op == "call_function" and a.target is operator.add and len(a.args) == 2):
        return None
    head, tail = a.args
    if not isinstance(tail, tuple) or not all(isinstance(c, (int, fx.Node)) for c in tail):
        return None
    if not (isinstance(head, fx.Node) and head.op == "call_function" and head.target is operator.getitem):
        return None
    read = head.args[0]
    if not (isinstance(read, fx.Node) and read.op == "call_method" and read.target == "size" and len(read.args) == 1):
        return None
    return head.name, tail


def constant_factor(a) -> tuple[int, int] | None:
    """(position, c) when `a` is mul(size, c) or mul(c, size) with an int c."""
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target in (operator.mul, torch.mul):
        for i, v in enumerate(a.args[:2]):
            if isinstance(v, int) and not isinstance(v, bool):
                return i, v
    return None
