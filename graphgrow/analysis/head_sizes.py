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

from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .eager_attention import scale_value
from .head_layout import Axis, FactorEdit, refuse, size_of, words


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


def attribute_number(gm: fx.GraphModule, a) -> int | None:
    """The value of `a` when it reads a number attribute of the model (`self.num_heads` in a model the capture traced
    with its number attributes read at run time, because its forward branches on `training`): a fixed number, not a
    size read off a tensor, so it does not follow a growth by itself. None for anything else."""
    if not (isinstance(a, fx.Node) and a.op == "get_attr"):
        return None
    owner, _, name = str(a.target).rpartition(".")
    try:
        value = getattr(gm.get_submodule(owner), name)
    except AttributeError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def regroup_edits(gm: fx.GraphModule, n: fx.Node, heads: Axis, growing: set[str]) -> list[FactorEdit]:
    """The head count written in a reshape of the scores or weights between (batch · heads, q, k) and (batch, heads,
    q, k) (DeBERTa-v2's `scores.view(-1, heads, q, k)`, Swin's shifted windows `attn.view(-1, windows, heads, q, k)`):
    an edit, also where it is read from a number attribute (it is then written as the grown count); a size read at
    run time or -1 follows by itself."""
    t = n.target.overloadpacket if isinstance(n.target, torch._ops.OpOverload) else n.target
    k = 0 if ops.op_name(t) in ("zeros", "empty") else 1  # zeros(sizes) (baddbmm's input), x.view(sizes)
    packed = len(n.args) == k + 1 and isinstance(n.args[k], (list, tuple))
    sizes = list(n.args[k] if packed else n.args[k:])
    named = tuple(f for f in heads if f[0])
    where = ("args", k, len(sizes) - 3) if packed else ("args", len(sizes) - 3 + k)
    c = constant_factor(sizes[-3]) if len(sizes) >= 3 and any(f[0] in growing for f in named) else None
    if c is not None and c[1] % size_of(named) == 0:  # batch · heads as mul(batch, heads) (BLOOM's weights @ value)
        return [FactorEdit(n.name, where, c[1], named, c[0])]
    count = attribute_number(gm, sizes[-3]) if len(sizes) >= 4 else None
    count = sizes[-3] if count is None and len(sizes) >= 4 and isinstance(sizes[-3], int) else count
    if count is None or count == -1 or not any(f[0] in growing for f in named):
        return []
    if count != size_of(named):
        raise refuse(n, f"reshapes the attention scores with {count} heads, not {words(named)}")
    return [FactorEdit(n.name, where, count, named)]
