"""Copies of the residual stream flattened into one vector per token and read by Linear layers (stream.py).

Hyper-connections (DeepSeek-V4, HY-V4) keep n copies of the stream, x of shape (B, T, n, d), and compute the
coefficients that mix them from all of them at once: Linear(flat · rsqrt(mean(flat²) + eps)) or
Linear(flat) · rsqrt(mean(flat²) + eps), flat = x.flatten(-2) of size n·d, the mean square written out without a
weight. Each block of d columns of such a Linear grows as one reader's (Reader.blocks). With the new coordinates 0 the
mean square over n·d' is the old one times d/d': with eps scaled by d/d' the rsqrt grows by sqrt(d'/d) exactly, and
the old columns of every Linear whose result it multiplies once are scaled by sqrt(d/d') to make up for it (replicated
coordinates keep the mean square: nothing to scale). No other fill keeps a mean square, so the copies need zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx, nn

from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .stream_ops import arg, arithmetic, base_name


@dataclass
class FlatRead:
    blocks: int  # n: the copies flattened side by side
    linear: list[tuple[fx.Node, str]] = field(default_factory=list)  # Linear readers and their weight paths
    scaled: bool = False  # a mean square over the flattened copies multiplies their results (old columns rescaled)
    eps: list[tuple[str, int]] = field(default_factory=list)  # (node, argument index) of the mean square's eps


def flat_readers(gm: fx.GraphModule, u: fx.Node, x: fx.Node, axis: int, width: int) -> FlatRead | None:
    """What reads `u`, the stream `x` (B, …, n, d) with its last two axes flattened into n·d, when only Linear layers
    do, directly or through a mean square over the n·d values; else None."""
    xs, us = tensor_shape(x), tensor_shape(u)
    if not xs or not us or len(xs) < 2 or axis != len(xs) - 1 or xs[-1] != width or u.args[0] is not x:
        return None
    if tuple(us) != tuple(xs[:-2]) + (xs[-2] * width,) or base_name(u) not in ops.RESHAPES | ops.FLATTENS:
        return None
    sizes = [a for a in u.args[1:] if isinstance(a, (list, tuple))] or [list(u.args[1:])]
    if base_name(u) in ops.RESHAPES and isinstance(sizes[0][-1], int) and sizes[0][-1] != -1:
        return None  # the size n·d written as a number: not rewritten here
    read = FlatRead(xs[-2])
    root = _mean_square(u, read)
    for v in [v for v in u.users if root is None or v is not root[0]]:
        if _linear(gm, v) is not None and (root is None or _scaled_by(v, root[1])):
            read.linear.append((v, _linear(gm, v)))  # type: ignore[arg-type]
        elif root is not None and arithmetic(v) == "mul" and set(v.args) == {u, root[1]}:
            found = [(w, _linear(gm, w)) for w in v.users]
            if not found or any(p is None for _, p in found):
                return None
            read.linear += found  # type: ignore[arg-type]
        else:
            return None
    if root is not None:  # the rsqrt multiplies the flattened copies or the readers' results, nothing else
        products = {w for v, _ in read.linear for w in v.users} | {
            v for v in u.users if v not in (root[0], *[v for v, _ in read.linear])
        }
        if set(root[1].users) - products:
            return None
    read.scaled = root is not None
    return read if read.linear else None


def _mean_square(u: fx.Node, read: FlatRead) -> tuple[fx.Node, fx.Node] | None:
    """(the square, the rsqrt) of rsqrt(mean(u², -1, keepdim) + eps) among u's users, its eps recorded in `read`."""
    for s in u.users:
        square = base_name(s) == "square" or (base_name(s) == "pow" and arg(s, 1, "exponent") == 2)
        if not square or len(s.users) != 1:
            continue
        m = next(iter(s.users))
        if base_name(m) != "mean" or arg(m, 1, "dim") not in ([-1], -1, (-1,)) or len(m.users) != 1:
            return None
        r = next(iter(m.users))
        if arithmetic(r) == "add" and len(r.users) == 1:
            k = 1 if r.args[0] is m else 0
            if not isinstance(r.args[k], float):
                return None
            read.eps.append((r.name, k))
            r = next(iter(r.users))
        return (s, r) if base_name(r) == "rsqrt" else None
    return None


def _scaled_by(v: fx.Node, r: fx.Node) -> bool:
    """Whether Linear `v`'s result is multiplied by `r` (and read nowhere else)."""
    return len(v.users) == 1 and arithmetic(w := next(iter(v.users))) == "mul" and set(w.args) == {v, r}


def _linear(gm: fx.GraphModule, v: fx.Node) -> str | None:
    """The weight path of `v` when it is a Linear (module or F.linear on a parameter) reading its first argument."""
    if v.op == "call_module" and isinstance(gm.get_submodule(v.target), nn.Linear) and len(v.args) == 1:
        return f"{v.target}.weight"
    w = arg(v, 1, "weight") if v.op == "call_function" and base_name(v) == "linear" else None
    return str(w.target) if isinstance(w, fx.Node) and w.op == "get_attr" else None


def query_reader(u: fx.Node, x: fx.Node, axis: int, width: int) -> tuple[str, int, list[tuple[str, int]]] | None:
    """(the parameter, its hidden dim, the views between it and `u` as (node, axis of the width)) when `u` = q @ x
    contracts x's hidden axis (its second to last) with q a parameter of the hidden size through views, reshape,
    expand or unsqueeze, each read by the next alone (Inkling's depth attention: a learned query dotted with each
    normalised earlier state): the parameter reads the stream as a Linear's weight does."""
    if base_name(u) != "matmul" or len(u.args) != 2 or u.args[1] is not x or axis != len(tensor_shape(x) or ()) - 2:
        return None
    q, views = u.args[0], []
    while isinstance(q, fx.Node) and q.op != "get_attr":
        shape = tensor_shape(q)
        if len(q.users) != 1 or base_name(q) not in ops.RESHAPES | {"expand", "unsqueeze"} or not shape:
            return None
        if shape[-1] != width or any(isinstance(a, fx.Node) and tensor_shape(a) for a in q.args[1:]):
            return None
        views.append((q.name, len(shape) - 1))
        q = q.args[0]
    shape = tensor_shape(q) if isinstance(q, fx.Node) else None
    if not isinstance(q, fx.Node) or not shape or [d for d in shape if d != 1] != [width]:
        return None
    if len(q.users) > 1 and not all(base_name(v) in ops.RESHAPES | {"expand", "unsqueeze"} for v in q.users):
        return None  # read at several places (the same query at each depth): each such read grows it alike
    return str(q.target), [d for d in shape].index(width), views
