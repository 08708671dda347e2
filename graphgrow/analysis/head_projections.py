"""The projections of an attention (analysis.heads): the Linear layers that make its query, key and value, found by
walking back from each operand; the parameters each one reads; and how a fused projection of unequal sections
(Phi-3's qkv_proj, GPT-BigCode's multi-query c_attn) is cut by slices or a split of its last axis into q, k and v.
It is apart from analysis.heads so that both the input side (heads) and the output side (head_output) can name a
Projection and read a Linear's parameters without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..core.errors import NotApplicable
from ..graph.fx_edit import tensor_shape
from .head_layout import (
    HINT,
    Axis,
    _name,
    broadcasts,
    channel_axis,
    conv_blocks,
    data_args,
    linear_arg,
    op_kind,
    refuse,
    size_of,
    words,
    writes,
)


def _op(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return t if isinstance(t, str) else getattr(t, "__name__", "")


@dataclass
class Projection:
    node: str
    weight: str
    bias: str | None
    module: str | None  # the nn.Linear's path (None: F.linear on parameters)
    factors: Axis  # of its output's last axis (its weight's rows)
    roles: tuple[str, ...]  # per section: q | k | v (one entry when not fused)
    # a fused projection of unequal sections (Phi-3's qkv_proj: q of all heads, k and v of the key/value heads),
    # cut by slices of its last axis: each section's factors, in the order of its rows, and the slice nodes
    sections: tuple[Axis, ...] = ()
    slices: tuple[str, ...] = ()


def _linear_params(gm: fx.GraphModule, n: fx.Node, pieces: bool = False) -> tuple[str, str | None, str | None]:
    """(weight path, bias path, module path) of a Linear node. `pieces`: a bias concatenated from parameters
    (bias_pieces) is taken, as no bias path (the caller grows its pieces)."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        return f"{n.target}.weight", f"{n.target}.bias" if m.bias is not None else None, str(n.target)
    w, b = linear_arg(n, 1), linear_arg(n, 2)  # F.linear(x, weight=…, bias=…) passes them by name (timm's BEiT)
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        raise refuse(n, "takes its weight from a computed tensor")
    if pieces and bias_pieces(n) is not None:
        return str(w.target), None, None
    if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr"):
        raise refuse(
            n,
            f"takes its bias from a computed tensor ('{b.name if isinstance(b, fx.Node) else b}'): "
            "new heads' bias entries have no parameter to go into",
        )
    return str(w.target), str(b.target) if b is not None else None, None


def _back(
    gm: fx.GraphModule, start: fx.Node, shared: bool = False, stops: list[fx.Node] | None = None
) -> tuple[set[str], list[fx.Node]]:
    """Nodes on the way back from an attention operand to its projections: (path, projections reached: Linear layers
    and convolutions of one group). `shared`: the walk does not enter a part that is the same for every head (an
    expand of a size-1 axis, or a tensor copied into an allocation's slice by broadcasting): multi-head latent
    attention's rotary key, computed once for all heads from another Linear. `stops`: the nodes where the walk ended
    without a projection (parameters, inputs, ops it does not follow) are added to it."""
    seen: set[str] = set()
    found: list[fx.Node] = []
    todo = [start]
    while todo:
        n = todo.pop()
        if n.name in seen:
            continue
        kind = op_kind(gm, n)
        if kind == "linear":
            found += [n] if n not in found else []
            continue
        if kind is None or (shared and broadcasts(n)):
            if kind is None and stops is not None and n not in stops:
                stops.append(n)
            continue
        seen.add(n.name)
        args = data_args(n)
        if shared and kind == "alloc":
            args = [a for a in args if tensor_shape(a) == _slice_shape(n, a)]
        todo.extend(args)
    return seen, found


def unprojected(gm: fx.GraphModule, operands: list[tuple[fx.Node, fx.Node]], role: str) -> NotApplicable:
    """Why the `role` operands of attentions ((operand, attention) pairs) come from no projection: the first op that
    stops the way back from one of them (a grouped convolution, a norm or a pooling the analysis does not follow),
    named; where every way back ends at parameters and inputs only, a learned query (or key) over the states
    themselves (depth attention): no heads to add."""
    for t, s in operands:
        stops: list[fx.Node] = []
        _back(gm, t, stops=stops)
        for n in (n for n in stops if n.op not in ("get_attr", "placeholder")):
            what = type(gm.get_submodule(str(n.target))).__name__ if n.op == "call_module" else _name(n)
            why = conv_blocks(gm, n) or f"is not an op the analysis follows back to a projection ({what})"
            return refuse(
                n,
                f"is on the way back from the {role} of '{s.name}' to a projection (a Linear, or a convolution of one "
                f"group), and {why}",
            )
    names = ", ".join(s.name for _, s in operands[:3])
    return NotApplicable(
        f"the attentions of this model ({names}) have no Linear projecting their {role} (nor a convolution: a "
        f"learned {role} over the states themselves): no heads to add",
        "grow the model with other passes (grow_hidden grows the states such an attention reads)",
    )


def _slice_shape(alloc: fx.Node, source: fx.Node) -> tuple | None:
    """The shape of the slice of `alloc` that `source` is copied into."""
    filled = writes(alloc)
    shape = tensor_shape(alloc)
    for w in filled[1] if filled and shape else []:
        if w.source is source:
            dim = filled[0]
            return shape[:dim] + (w.stop - w.start,) + shape[dim + 1 :]
    return None


def _sections(p: fx.Node, roles: list[str], backs: dict[str, set[str]], h: int, d: int, e: int):
    """A fused projection read only through slices of its last axis that cut it into contiguous sections, each
    reaching one of `roles` and as wide as that role's heads × head size (the key's and value's sections of one
    number of key/value heads, which divides the query heads: the key may be repeated after its slice): (the roles
    in row order, the slice nodes in row order, the key/value heads); else None."""
    width, rank = tensor_shape(p)[-1], len(tensor_shape(p))
    cuts = _split_cuts(p, width)
    for u in p.users if cuts is None else []:
        bounds = last_axis_slice(u, rank, width)
        if bounds is None:
            return None
        cuts = (cuts or []) + [(bounds, u)]
    if not cuts:
        return None
    cuts.sort(key=lambda c: c[0])
    widths = {r: stop - start for (start, stop), u in cuts for r in roles if u.name in backs[r]}
    kv = widths.get("k", 0) // d
    if kv < 1 or h % kv:
        return None
    size = {"q": h * d, "k": kv * d, "v": kv * e}
    order, at = [], 0
    for (start, stop), u in cuts:
        role = [r for r in roles if u.name in backs[r]]
        if start != at or len(role) != 1 or stop - start != size[role[0]]:
            return None
        order.append(role[0])
        at = stop
    if at != width or sorted(order) != sorted(roles):
        return None
    return order, [u for _, u in cuts], kv


def _split_cuts(p: fx.Node, width: int) -> list[tuple[tuple[int, int], fx.Node]] | None:
    """((start, stop), piece) for each piece of a split of `p`'s last axis into sizes (`qkv.split((q, kv, kv), -1)`,
    maybe after unsqueezes that leave the last axis last, as GPT-BigCode's multi-query attention), else None."""
    x = p
    while len(x.users) == 1 and _op(next(iter(x.users))) == "unsqueeze":
        u = next(iter(x.users))
        if u.args[1] in (-1, len(tensor_shape(x))):
            return None
        x = u
    if len(x.users) != 1:
        return None
    (sp,) = x.users
    dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
    rank = len(tensor_shape(x))
    sizes = sp.args[1] if len(sp.args) > 1 else None
    if _op(sp) != "split" or not isinstance(dim, int) or dim % rank != rank - 1 or not isinstance(sizes, (list, tuple)):
        return None
    if sum(sizes) != width or not all(_op(g) == "getitem" and isinstance(g.args[1], int) for g in sp.users):
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [((starts[g.args[1]], starts[g.args[1]] + sizes[g.args[1]]), g) for g in sp.users]


def last_axis_slice(n: fx.Node, rank: int, width: int) -> tuple[int, int] | None:
    """(start, stop) of `n` = x[..., a:b] (every other axis whole, step 1), else None."""
    import operator

    if not (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], tuple)):
        return None
    index = n.args[1]
    if any(i is Ellipsis for i in index):
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (rank - len(index) + 1) + index[k + 1 :]
    if len(index) != rank or any(i != slice(None) for i in index[:-1]):
        return None
    last = index[-1]
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    start, stop, _ = last.indices(width)
    return start, stop


def beside(p: fx.Node, role: str, factors: Axis, width: int, growing: set[str]) -> Axis:
    """A projection of one role wider than its heads × head size by a multiple of its heads: each head's rows one
    block, the role's part and something else beside it (Qwen3-Next's q_proj: query and output gate per head, cut apart
    after a view per head). The flow checks that the blocks are cut per head; only whole heads can grow."""
    if growing & {"d", "e"}:
        raise refuse(
            p,
            f"projects the {role} in one block per head with another part beside it ({width} outputs, "
            f"{words(factors)} of them the {role}'s), cut apart after it: only whole heads can grow",
            "grow heads (heads=… or by=)",
        )
    return factors[:-1] + (("", width // size_of(factors[:-1])),)


def bias_pieces(n: fx.Node) -> list[fx.Node | None] | None:
    """The parameters or buffers an F.linear's bias is concatenated from (timm BEiT's and EVA's qkv bias:
    cat((q_bias, k_bias, v_bias)), k_bias a zero buffer), None for a piece of zeros shaped as another piece
    (zeros_like(v_bias): its size follows that piece's); None when the bias is not such a concatenation."""
    b = linear_arg(n, 2)
    if not (isinstance(b, fx.Node) and _op(b) == "cat" and isinstance(b.args[0], (list, tuple))):
        return None
    if (b.args[1] if len(b.args) > 1 else b.kwargs.get("dim", 0)) not in (0, -1):
        return None
    params = [a for a in b.args[0] if isinstance(a, fx.Node) and a.op == "get_attr"]
    out: list[fx.Node | None] = []
    for a in b.args[0]:
        if isinstance(a, fx.Node) and a.op == "get_attr" and len(tensor_shape(a) or ()) == 1:
            out.append(a)
        elif isinstance(a, fx.Node) and _op(a) == "zeros_like" and a.args and a.args[0] in params:
            out.append(None)
        else:
            return None
    return out


def section_biases(p: fx.Node, factors: Axis, growing: set[str]) -> list[tuple[str, int, Axis, float]]:
    """A fused projection's bias concatenated from one parameter per q/k/v section (bias_pieces): each grows as a
    parameter with an entry per head and coordinate (new heads' entries 0)."""
    pieces = bias_pieces(p)
    if pieces is None:
        return []
    if not factors or factors[0][0] != "s" or len(pieces) != factors[0][1] or growing - {"h", "r"}:
        raise refuse(
            p,
            f"takes its bias from a concatenation of {len(pieces)} parameters that are not its q/k/v sections laid "
            "out outermost, or the head size grows (a query bias would need rescaling)",
            "grow heads (heads=…)" if growing - {"h", "r"} else HINT,
        )
    section = factors[1:]
    if any(a is not None and tensor_shape(a) != (size_of(section),) for a in pieces):
        raise refuse(p, f"takes its bias from parameters that are not {words(section)} each")
    return [(str(a.target), 0, section, 0.0) for a in pieces if a is not None]


def head_axes(gm: fx.GraphModule, core) -> list[int]:
    """The query's axes that may hold its heads, most likely first. Operands of rank 4 or less are (…, heads, tokens,
    head size); of rank 5 and more every axis between the batch and the tokens is a batch axis to the attention
    (Hiera's and NesT's (batch, heads, windows, tokens, head size)), so the heads are where the projection's channels
    go: first an axis as large as the projection's width says (its q/k/v sections × heads × head size), then the one
    before the tokens, then the others. The flow follows the factors by the data, not by size: a wrong axis is refused
    (the heads land elsewhere), and the next is tried."""
    shape = tensor_shape(core.q)
    if shape is None or len(shape) <= 4 or core.heads is not None:
        return [-3]
    axes = list(range(-3, -len(shape), -1))
    found = _back(gm, core.q)[1]
    if len(found) == 1 and tensor_shape(found[0]) is not None:
        p = found[0]
        roles = sum(1 for t in (core.q, core.k, core.v) if found[0] in _back(gm, t)[1])
        width, d = tensor_shape(p)[channel_axis(gm, p)], shape[-1]
        if d and width % (roles * d) == 0:
            h = width // (roles * d)
            axes.sort(key=lambda i: shape[i] != h)  # (stable: -3 first among equals)
    return axes
