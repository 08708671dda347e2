"""Sizes read at run time off a tensor whose axis a pass grows (`B, N, C = x.shape`, `x.size(-1)`).

Such a value meant the old size wherever it is used off the grown tensors — to split an attention's fused
projection into heads (`C // heads`), to merge heads back (`reshape(B, N, C)`) — because those tensors keep
their size. Only a view of a grown tensor (`x.view(B, N, C)` of x itself, or `x.view(B, r, C // r)`) must read the new
size. So after a pass grows an axis, every other use of such a read gets the old size as a constant.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
from torch import fx

from ..graph import ops
from ..graph.fx_edit import tensor_shape

_VIEW_METHODS = ops.RESHAPES | {"expand"}  # their size arguments may be read from a shape


def _reads(q: fx.Node, axis: int, rank: int) -> list[fx.Node]:
    """The nodes among a shape query `q` and its indexing whose value is the size along `axis`."""
    if q.op == "call_method" and q.target == "size" and (len(q.args) > 1 or "dim" in q.kwargs):
        dim = q.args[1] if len(q.args) > 1 else q.kwargs["dim"]
        return [q] if isinstance(dim, int) and dim % rank == axis else []
    whole = (q.op == "call_method" and q.target == "size") or (
        q.op == "call_function" and q.target is getattr and q.args[1] == "shape"
    )
    if not whole:
        return []
    return [
        g
        for g in q.users
        if g.op == "call_function"
        and g.target is operator.getitem
        and isinstance(g.args[1], int)
        and g.args[1] % rank == axis
    ]


def _sinks(n: fx.Node) -> list[fx.Node]:
    """What a value computed from sizes reaches through more arithmetic on sizes (C // heads, C * 2): the nodes that
    use it for something else. [] for a node that is not such arithmetic."""
    if not _is_size_arithmetic(n):
        return []
    out: list[fx.Node] = []
    seen, todo = {n}, [n]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                (todo if _is_size_arithmetic(u) else out).append(u)
    return out


def _is_size_arithmetic(n: fx.Node) -> bool:
    return (
        n.op == "call_function"
        and getattr(n.target, "__module__", "") in ("_operator", "operator")
        and n.target is not operator.getitem
        and tensor_shape(n) is None
    )


def _views_a_grown_tensor(user: fx.Node, growing: Mapping[str, tuple[int, int]]) -> bool:
    tensor = user.args[0] if user.args and isinstance(user.args[0], fx.Node) else None
    is_view = (user.op == "call_method" and user.target in _VIEW_METHODS) or (
        user.op == "call_function" and user.target is torch.reshape
    )
    return is_view and tensor is not None and tensor.name in growing


def _replaced(args, value: fx.Node, constant: int):
    return fx.node.map_arg(args, lambda a: constant if a is value else a)


def hold_size_reads(gm: fx.GraphModule, growing: Mapping[str, tuple[int, int]]) -> int:
    """`growing`: node name → (axis, old size) of the tensors a pass grows (shapes as annotated before it).
    Every use of a run-time read of such a size, other than a view of a grown tensor, gets the old size; returns
    how many uses were held."""
    nodes = {n.name: n for n in gm.graph.nodes}
    held = 0
    for name, (axis, old) in growing.items():
        x = nodes.get(name)
        shape = tensor_shape(x) if x is not None else None
        if shape is None:
            continue
        for q in list(x.users):
            for value in _reads(q, axis % len(shape), len(shape)):
                for user in list(value.users):
                    if _views_a_grown_tensor(user, growing) or any(
                        _views_a_grown_tensor(sink, growing) for sink in _sinks(user)
                    ):
                        continue  # the size, or a size computed from it (C // radix), shapes a view of a grown tensor
                    user.args, user.kwargs = _replaced((user.args, user.kwargs), value, old)
                    held += 1
    return held
