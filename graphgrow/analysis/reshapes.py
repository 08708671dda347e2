"""What a reshape, a stack or a split does to the channel axis: the geometry the coupling analysis links by.

A reshape regroups dimensions; the channel axis either keeps its size (it may move), is split into
several dimensions ((N, C, H, W) → (N, g, C/g, H, W): heads, groups, radix) or is merged with others
((N, g, c, H, W) → (N, g·c, H, W), a flatten). A split keeps the innermost factor as the channel axis
(growth adds channels at the same place in each of the g blocks); a merge's channels repeat over the
dimensions before the channel axis and are scaled by the ones after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..graph import ops
from ..graph.fx_edit import tensor_shape

RESHAPE_METHODS = ("reshape", "view")
SPLITS = {"split": "split", "chunk": "chunk", "tensor_split": "tensor_split", "unbind": "unbind"}


@dataclass
class Regroup:
    """Channel axis `axis` of the input ↔ `out_axis` of the output. kind 'keep': same size; 'split': the
    input's channel c = j·stride + t for output channel t and outer index j < repeat; 'merge': output
    channel j·stride + c·scale + q for input channel c, j < repeat, q < scale."""

    kind: str
    out_axis: int
    repeat: int = 1
    stride: int = 0
    scale: int = 1


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _dim_groups(ins: tuple, outs: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of input and output dimensions with equal products (size-1 dimensions are left out)."""
    a = [i for i, d in enumerate(ins) if d != 1]
    b = [j for j, d in enumerate(outs) if d != 1]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj = [a[i]], [b[j]]
        pi, pj = ins[a[i]], outs[b[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(a):
                pi *= ins[a[i]]
                gi.append(a[i])
                i += 1
            elif pj < pi and j < len(b):
                pj *= outs[b[j]]
                gj.append(b[j])
                j += 1
            else:
                return None
        groups.append((gi, gj))
    return groups if i == len(a) and j == len(b) else None


def regroup(ins: tuple, outs: tuple, axis: int) -> Regroup | None:
    """How a reshape from `ins` to `outs` treats channel axis `axis` (None: it mixes channels with other
    dimensions in a way no block structure describes, or the channel axis has size 1)."""
    if ins[axis] == 1:
        return None
    for gi, gj in _dim_groups(ins, outs) or []:
        if axis not in gi:
            continue
        if len(gi) == 1 and len(gj) == 1:
            return Regroup("keep", gj[0])
        if len(gi) == 1:  # split: the innermost output factor carries the growth
            inner = outs[gj[-1]]
            return Regroup("split", gj[-1], repeat=ins[axis] // inner, stride=inner)
        if len(gj) == 1:
            k = gi.index(axis)
            scale = _prod(ins[d] for d in gi[k + 1 :])
            return Regroup("merge", gj[0], repeat=_prod(ins[d] for d in gi[:k]), stride=ins[axis] * scale, scale=scale)
        return None
    return None


def is_reshape(n: fx.Node) -> bool:
    return (n.op == "call_method" and n.target in RESHAPE_METHODS) or (
        n.op == "call_function" and n.target is torch.reshape
    )


def reshape_regroup(n: fx.Node, axis: int | None) -> Regroup | None:
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if x is None or axis is None or not is_reshape(n):
        return None
    ins, outs = tensor_shape(x), tensor_shape(n)
    return regroup(ins, outs, axis) if ins is not None and outs is not None else None


def unit_dims_regroup(n: fx.Node, axis: int | None) -> Regroup | None:
    """squeeze/unsqueeze (method, function or aten overload): size-1 dims dropped or added, so the channel axis keeps
    its size at its new place (a 'keep'); None for any other op, or when the channel axis itself has size 1."""
    name = ops.op_name(n.target).split(".")[0] if n.op in ("call_function", "call_method") else ""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if name not in ops.UNIT_DIMS or x is None or axis is None:
        return None
    ins, outs = tensor_shape(x), tensor_shape(n)
    found = regroup(ins, outs, axis) if isinstance(ins, tuple) and isinstance(outs, tuple) else None
    return found if found is not None and found.kind == "keep" else None


def stack_axis(n: fx.Node, axis: int | None) -> int | None:
    """torch.stack(tensors, dim): where the inputs' channel axis `axis` ends up."""
    if n.op != "call_function" or n.target is not torch.stack or axis is None:
        return None
    out = tensor_shape(n)
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
    if out is None or not isinstance(dim, int):
        return None
    dim %= len(out)
    return axis + 1 if dim <= axis else axis


def split_call(n: fx.Node) -> tuple[str, int] | None:
    """(kind, dim) when `n` splits one tensor into a tuple along `dim` (split/chunk/tensor_split/unbind)."""
    functions = {torch.split: "split", torch.chunk: "chunk", torch.tensor_split: "tensor_split", torch.unbind: "unbind"}
    name = n.target if n.op == "call_method" else functions.get(n.target) if n.op == "call_function" else None
    if name not in SPLITS:
        return None
    if not n.args or not isinstance(n.args[0], fx.Node) or tensor_shape(n.args[0]) is None:
        return None
    at = 1 if name == "unbind" else 2
    dim = n.kwargs.get("dim", n.args[at] if len(n.args) > at else 0)
    rank = len(tensor_shape(n.args[0]))
    return (name, dim % rank) if isinstance(dim, int) else None


def piece_axis(n: fx.Node, axis_of) -> int | None:
    """The channel axis of `tuple[i]` when the tuple comes from a split of a tensor (its input's axis;
    one less past an unbound dimension; None when the channel axis itself was unbound)."""
    import operator

    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return None
    tup = n.args[0]
    found = split_call(tup)
    if found is None:
        return None
    kind, dim = found
    axis = axis_of(tup.args[0])
    if axis is None or (kind == "unbind" and dim == axis):
        return None
    return axis - 1 if kind == "unbind" and dim < axis else axis
