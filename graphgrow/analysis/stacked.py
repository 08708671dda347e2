"""Products with stacked weights: a batched matrix product of an activation with a parameter that holds one weight
matrix per batch entry — the experts of a mixture-of-experts layer stored as one [E, out, in] (or [E, in, out])
tensor, used whole (every expert on its own tokens) or gathered by routing indices (`W[ids]`, `index_select`), then
multiplied with `torch.bmm`, `torch.matmul` / `@` or a two-operand einsum (transformers' `batched_mm` experts,
hand-written ones).

What such a product computes is found by dataflow, not by a module's name: per batch entry it is a Linear layer.
The weight's axis contracted with the activation is its *input* axis, the one that reaches the output alone is its
*output* axis; every other axis of the weight is a batch axis (the experts, or the token-expert pairs a gather made).
The residual-stream analysis (stream.py) reads the input axis as new columns and the output axis as new rows of every
expert alike (grow_hidden); the coupling analysis (coupling_layers.py) sees a source of the output axis and a
consumer of the input axis, so an expert's intermediate width grows in every expert at once (grow_width), the
routing untouched: the router reads the stream, never the experts' width.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from ..graph import ops
from ..graph.fx_edit import tensor_shape

PRODUCTS = frozenset({"bmm", "matmul", "einsum"})  # `@` is operator.matmul ("matmul"); aten overloads by their base
# ops between the parameter and the product that keep each weight entry whole (values, or the same entry at another
# place): casts and copies, transposes, unit dims, broadcasts
_WEIGHT_VIEWS = ops.SAME_VALUES | ops.TRANSPOSES | ops.UNIT_DIMS | ops.BROADCASTS | {"t"}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class StackedProduct:
    """`node` = product of `x` with the parameter `weight` (path) taken through `chain` (the nodes between them)."""

    node: str
    weight: str
    x: fx.Node
    in_axis: int  # the weight's axis contracted with x
    out_axis: int  # the weight's axis that is the output's free axis
    x_axis: int  # x's contracted axis
    y_axis: int  # the output's axis the weight's output axis becomes
    chain: tuple[str, ...]


def base_name(n: fx.Node) -> str:
    """An op's name without an aten overload ('bmm.default' → 'bmm')."""
    return ops.op_name(n.target).split(".")[0] if n.op in ("call_function", "call_method") else ""


def stacked_product(gm: fx.GraphModule, n: fx.Node) -> StackedProduct | None:
    """What `n` computes when it is a batched product of an activation with a stacked parameter, else None."""
    found = _subscripts(n)
    if found is None:
        return None
    (sa, sb), (a, b), out = found
    sides = [(a, sa, b, sb), (b, sb, a, sa)]
    for w, sw, x, sx in sides:
        traced = weight_axes(gm, w)
        if traced is None or not isinstance(x, fx.Node) or weight_axes(gm, x) is not None:
            continue
        path, axes, chain = traced
        if not len(sw) == len(sx) == len(out) or not sw[:-2] == sx[:-2] == out[:-2]:
            return None  # batch axes shared and leading, as bmm's: not a product mixing positions with a table
        contracted = [c for c in sw if c in sx and c not in out]
        free = [c for c in sw if c in out and c not in sx]
        if len(contracted) != 1 or len(free) != 1 or len(set(sw)) != len(sw) or len(set(sx)) != len(sx):
            return None
        pin, pout = axes[sw.index(contracted[0])], axes[sw.index(free[0])]
        if pin is None or pout is None:  # contracted along a gathered axis: not a Linear per entry
            return None
        return StackedProduct(n.name, path, x, pin, pout, sx.index(contracted[0]), out.index(free[0]), chain)
    return None


def _subscripts(n: fx.Node) -> tuple[tuple[str, str], tuple, str] | None:
    """((subscripts of each operand), (operands), output subscripts) of a two-operand product."""
    name = base_name(n)
    if name not in PRODUCTS:
        return None
    if name == "einsum":
        eq, rest = (n.args[0] if n.args else None), list(n.args[1:])
        if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
            rest = list(rest[0])
        if not isinstance(eq, str) or "->" not in eq or "." in eq or len(rest) != 2:
            return None
        ins, out = eq.replace(" ", "").split("->")
        parts = ins.split(",")
        if len(parts) != 2:
            return None
        shapes = [tensor_shape(t) if isinstance(t, fx.Node) else None for t in rest]
        if any(s is None or len(s) != len(p) for s, p in zip(shapes, parts)):
            return None
        return (parts[0], parts[1]), (rest[0], rest[1]), out
    if n.op == "call_method":
        operands = [n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("other", n.kwargs.get("mat2"))]
    else:
        operands = list(n.args[:2]) if len(n.args) >= 2 else []
    if len(operands) != 2 or not all(isinstance(t, fx.Node) for t in operands):
        return None
    ra, rb = (len(tensor_shape(t) or ()) for t in operands)
    if ra < 2 or rb < 2:
        return None
    batch = _LETTERS[: max(ra, rb) - 2]
    sa = batch[len(batch) - (ra - 2) :] + "yz"  # (…, i, k) @ (…, k, j) → (…, i, j), letters y, z, w
    sb = batch[len(batch) - (rb - 2) :] + "zw"
    return (sa, sb), (operands[0], operands[1]), batch + "yw"


def weight_axes(gm: fx.GraphModule, w) -> tuple[str, list[int | None], tuple[str, ...]] | None:
    """(parameter path, the parameter axis each axis of `w` is (None: made by a gather or a new unit dim), the nodes
    on the way) when `w` is a parameter seen through views and gathers along its leading axes, else None."""
    if not isinstance(w, fx.Node):
        return None
    if w.op == "get_attr":
        shape = tensor_shape(w)
        return (str(w.target), list(range(len(shape))), ()) if shape is not None and len(shape) >= 2 else None
    if w.op not in ("call_function", "call_method") or not w.args or len(w.users) != 1:
        return None
    inner = weight_axes(gm, w.args[0])
    if inner is None:
        return None
    path, axes, chain = inner
    name, rank = base_name(w), len(tensor_shape(w) or ())
    moved = _moved(w, name, axes)
    if moved is None or len(moved) != rank:
        return None
    return path, moved, chain + (w.name,)


def _moved(w: fx.Node, name: str, axes: list[int | None]) -> list[int | None] | None:
    """Where op `w` puts its input's axes (`axes`: the parameter axis of each)."""
    rest = list(w.args[1:])
    try:
        if w.target is operator.getitem:  # W[ids] (one index tensor, full slices elsewhere): a gather
            index = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
            tensors = [i for i, x in enumerate(index) if isinstance(x, fx.Node)]
            if len(tensors) != 1 or any(not _full(x) for i, x in enumerate(index) if i != tensors[0]):
                return None
            at, idx = tensors[0], index[tensors[0]]
            return axes[:at] + [None] * len(tensor_shape(idx) or ()) + axes[at + 1 :]
        if name == "index_select":
            dim = int(rest[0]) % len(axes)
            return axes[:dim] + [None] + axes[dim + 1 :]
        if name not in _WEIGHT_VIEWS:
            return None
        if name == "transpose":
            i, j = (int(d) % len(axes) for d in rest[:2])
            out = list(axes)
            out[i], out[j] = axes[j], axes[i]
            return out
        if name == "t":
            return axes[::-1]
        if name == "permute":
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            return [axes[int(d) % len(axes)] for d in dims]
        if name == "unsqueeze":
            dim = int(rest[0]) % (len(axes) + 1)
            return axes[:dim] + [None] + axes[dim:]
        if name == "squeeze":
            shape = tensor_shape(w.args[0]) or ()
            given = rest[0] if rest and isinstance(rest[0], (list, tuple)) else rest[:1]
            dims = [int(d) % len(axes) for d in given] if given else list(range(len(axes)))
            return [a for k, a in enumerate(axes) if not (k in dims and shape[k] == 1)]
        return list(axes)  # casts, copies, expand: every entry where it was
    except (TypeError, ValueError, IndexError):
        return None


def _full(index) -> bool:
    return isinstance(index, slice) and index == slice(None) or index is Ellipsis


def feeds_stacked_weight(gm: fx.GraphModule, n: fx.Node) -> bool:
    """`n` is on the way from a stacked parameter to a product that uses it as its weight (a gather, a view): what
    it does to the weight is in that product's StackedProduct, not a channel of its own."""
    u = n
    while weight_axes(gm, u) is not None and len(u.users) == 1:
        u = next(iter(u.users))
        found = stacked_product(gm, u)
        if found is not None:
            return n.name in found.chain
    return False
