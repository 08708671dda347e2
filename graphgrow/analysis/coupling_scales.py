"""Per-channel tensors an elementwise op reads: a parameter or buffer with one value per channel of the op's output,
broadcast along its channel axis (a layer scale γ, Mamba's skip D, a decay per channel), resized with the group.

One parameter may be read by several such ops (a recurrence unrolled over time multiplies its state by the same
decay at every step; torch.export reads a parameter through one node): each use is recorded, and coupling freezes
the groups when the uses land in different groups (coupling._freeze_shared_tensors). A tensor operand with a value
per channel that is none of these is frozen with the reason (`unresized_operand`), never left at its old size.
"""

from __future__ import annotations

import torch
from torch import fx

from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .axes import node_axis
from .coupling_splits import literal_at

VIEWS = ops.RESHAPES | ops.UNIT_DIMS | ops.BROADCASTS  # the views a layer scale is read through (gamma.view(C, 1, 1))
SIZED_VIEWS = ops.RESHAPES | {"expand"}  # of those, the ones whose arguments are sizes (squeeze/unsqueeze take dims)
ELEMENTWISE_NAMES = ops.BINARY_NAMES | ops.IN_PLACE_OPERATORS | {"add_", "mul_"}


def per_channel_tensor(gm, a: fx.Node, out_shape, axis: int) -> tuple[str, list[tuple[str, tuple]]] | None:
    """The attribute path when `a` is a parameter/buffer with one value per channel, broadcast along the
    channel axis (a layer scale γ, read as `x * self.gamma` or `x.mul(self.gamma.reshape(1, -1, 1, 1))`, or
    `torch.unsqueeze(self.bias, 1)` as torch.export writes it), with the views on the way whose literal arguments
    name the channel count (`gamma.view(64, 1, 1)`: rewritten)."""
    if not _broadcasts_per_channel(tensor_shape(a), out_shape, axis):
        return None
    views: list[tuple[str, tuple]] = []
    while (
        a.op in ("call_method", "call_function")
        and ops.op_name(a.target) in VIEWS
        and len(a.users) == 1
        and a.args
        and isinstance(a.args[0], fx.Node)
        and all(not isinstance(x, fx.Node) for x in list(a.args[1:]) + list(a.kwargs.values()))
    ):
        view_shape = tensor_shape(a) or ()
        views += [
            (a.name, where)
            for d, size in enumerate(view_shape)
            if size == out_shape[axis] and ops.op_name(a.target) in SIZED_VIEWS
            for where in [literal_at(a, d)]
            if where is not None
        ]
        a = a.args[0]
    if a.op != "get_attr" or not all(_reads_per_channel(u, a) for u in a.users):
        return None
    t = getattr(
        gm.get_submodule(a.target.rpartition(".")[0]) if "." in a.target else gm, a.target.rpartition(".")[2], None
    )
    return (str(a.target), views) if isinstance(t, torch.Tensor) and t.numel() == out_shape[axis] else None


def one_value(a: fx.Node) -> bool:
    shape = tensor_shape(a)
    return isinstance(shape, tuple) and all(d == 1 for d in shape)


def unresized_operand(n: fx.Node, known: list[fx.Node]) -> fx.Node | None:
    """A tensor operand of elementwise `n` that none of `known` is (the operands with a channel axis and the
    per-channel tensors found) but that holds a value per output channel: a growth would leave it at its old size."""
    out_shape, axis = tensor_shape(n), node_axis(n)
    for a in n.all_input_nodes:
        shape = tensor_shape(a)
        if a not in known and axis is not None and _broadcasts_per_channel(shape, out_shape, axis):
            return a
    return None


def _broadcasts_per_channel(shape, out_shape, axis: int) -> bool:
    if not isinstance(shape, tuple) or not isinstance(out_shape, tuple) or len(shape) > len(out_shape):
        return False  # a product of sizes has no shape
    lead = len(out_shape) - len(shape)
    return (
        out_shape[axis] != 1
        and lead <= axis
        and all(d == (out_shape[axis] if lead + i == axis else 1) for i, d in enumerate(shape))
    )


def _reads_per_channel(u: fx.Node, a: fx.Node) -> bool:
    """Whether user `u` of parameter node `a` reads it as a per-channel operand of an elementwise op (or through a
    view that only that op reads): the one use it had to have before, or one of several alike."""
    if len(a.users) == 1:
        return True
    v = a  # the operand `u` reads: `a` itself or the last view on the way
    while u.op in ("call_method", "call_function") and ops.op_name(u.target) in VIEWS and len(u.users) == 1:
        v, u = u, next(iter(u.users))
    axis = node_axis(u)
    return (
        u.op in ("call_method", "call_function")
        and ops.op_name(u.target) in ELEMENTWISE_NAMES
        and axis is not None
        and _broadcasts_per_channel(tensor_shape(v), tensor_shape(u), axis)
    )
