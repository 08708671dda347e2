"""Attention written eagerly, found by what it computes: scores = a product of query and key over the head size
(`q @ k.transpose(-2, -1)`, `torch.matmul`, `bmm`, or an einsum such as 'bhqd,bhkd->bhqk'), then ops on the scores
alone (a scale, an additive mask, soft-capping tanh(x / cap) · cap, casts), a softmax over the keys, dropout or casts,
and a product of the weights with the value. That is the computation scaled_dot_product_attention names, so
analysis.heads treats both alike: each is an `Core` (query, key, value operands; the nodes in between, which no one
else may read; the tensors combined with the scores, which must not differ per head when heads grow; the scale).

A softmax that is not between two such products (a router, a classifier's output) is not an attention and is left
alone; one that is, with something in between the analysis cannot account for, is refused with the node and why.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .head_layout import SDPA, one_axis_slice, op_kind, refuse

PRODUCTS = frozenset({"matmul", "bmm", "einsum", "baddbmm"})  # batched matrix products (`@`: "matmul")
# ops on the scores that act per score (the head axis, when a side tensor has one, is checked): arithmetic with a
# number or a broadcast tensor (scale, additive mask, soft-capping), tanh, masking, casts
# (an in-place op on the scores read by nothing else computes what its out-of-place form does: MPNet's `add_`)
IN_PLACE = frozenset({"add_", "sub_", "mul_", "div_", "masked_fill_"})
ON_SCORES = ops.BINARY_NAMES | ops.IN_PLACE_OPERATORS | ops.SAME_VALUES | IN_PLACE
ON_SCORES |= {"tanh", "masked_fill", "where"}


@dataclass
class Core:
    """The computation between an attention's projected operands and its output."""

    node: fx.Node  # the op producing the attention's output (SDPA, or weights @ value)
    q: fx.Node
    k: fx.Node
    v: fx.Node
    key_axis: int  # the key's axis holding the head size: -1 ((…, tokens, d)) or -2 ((…, d, tokens): q @ kᵀ)
    inner: set[str] = field(default_factory=set)  # nodes from the operands to the output
    sides: list[fx.Node] = field(default_factory=list)  # masks and biases combined with the scores
    scale: float | None = None  # the factor on the scores (None: SDPA's default 1/sqrt(d))
    scale_at: tuple | None = None  # (node, ("args", i), "mul" | "div"): where an eager scale constant is written
    scale_from: tuple[fx.Node, bool] | None = None  # (a scale computed from sizes, divides?): see scale_value
    # columns concatenated after the keys before the softmax and sliced off after it (a learnable attention sink:
    # GPT-OSS's): one entry per query row, which analysis.heads checks is a parameter per head
    sinks: list[fx.Node] = field(default_factory=list)
    # reshapes between the product and the softmax or after it that split or merge the heads with the batch (the
    # product of (batch · heads, tokens, …) tensors: DeBERTa-v2's, BLOOM's bmm/baddbmm): analysis.heads edits their
    # head count; `heads` is then the softmax's heads axis
    regroups: list[fx.Node] = field(default_factory=list)
    heads: int | None = None


def _name(n: fx.Node) -> str:
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):  # an ATen op a capture left
        return n.target.overloadpacket.__name__
    return ops.op_name(n.target) if n.op in ("call_function", "call_method") else ""


def _is_softmax(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), nn.Softmax)
    return (n.op == "call_function" and n.target in (torch.softmax, torch.nn.functional.softmax)) or (
        n.op == "call_method" and n.target == "softmax"
    )


def _softmax_dim(gm: fx.GraphModule, n: fx.Node) -> int | None:
    if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.Softmax):
        dim: object = gm.get_submodule(str(n.target)).dim
    elif _is_softmax(gm, n):
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    else:
        return None
    return dim if isinstance(dim, int) else None


def _einsum(n: fx.Node) -> tuple[list[str], list, str] | None:
    """(the operands' subscripts, operands, output subscripts) of a two-operand einsum."""
    if not n.args:
        return None
    eq, operands = n.args[0], list(n.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(eq, str) or "->" not in eq or len(operands) != 2:
        return None
    ins, out = eq.replace(" ", "").split("->")
    parts = ins.split(",")
    return (parts, operands, out) if len(parts) == 2 else None


def _scores_operands(n: fx.Node) -> tuple[fx.Node, fx.Node, int]:
    """(query, key, the key's head-size axis) of a scores product; NotApplicable when it is not q · kᵀ."""
    if _name(n) == "baddbmm":  # input · beta + (batch1 @ batch2) · alpha: the input is a side (analysis.heads)
        q, k = (n.args[i] if len(n.args) > i else n.kwargs.get(f"batch{i}") for i in (1, 2))
        if not (isinstance(q, fx.Node) and isinstance(k, fx.Node)):
            raise refuse(n, "computes attention scores from a constant, not from projected queries and keys")
        return q, k, -2
    if _name(n) != "einsum":
        q, k = (list(n.args) + [None, None])[:2]
        if not (isinstance(q, fx.Node) and isinstance(k, fx.Node)):
            raise refuse(n, "computes attention scores from a constant, not from projected queries and keys")
        return q, k, -2
    e = _einsum(n)
    if e is not None:
        (a, b), (q, k), out = e
        p = a[:-2]
        if (
            isinstance(q, fx.Node)
            and isinstance(k, fx.Node)
            and len(a) >= 2
            and b[:-2] == p
            and out == p + a[-2] + (b[-1] if b[-2] == a[-1] else b[-2])
        ):
            if b[-1] == a[-1] and b[-2] not in a:
                return q, k, -1  # 'bhqd,bhkd->bhqk'
            if b[-2] == a[-1] and b[-1] not in a:
                return q, k, -2  # 'bhqd,bhdk->bhqk'
    raise refuse(n, f"computes attention scores with einsum '{n.args[0]}', not (…, q, d) · (…, k, d) → (…, q, k)")


def _value_operand(n: fx.Node, weights: fx.Node) -> fx.Node:
    """The value of an output product `weights @ value`; NotApplicable when it is not that."""
    if _name(n) != "einsum":
        if len(n.args) != 2 or n.args[0] is not weights or not isinstance(n.args[1], fx.Node):
            raise refuse(n, "multiplies the attention weights from the right or by a constant, not weights @ value")
        return n.args[1]
    e = _einsum(n)
    if e is not None:
        (a, b), (w, v), out = e
        p = a[:-2]
        if (
            w is weights
            and isinstance(v, fx.Node)
            and b[:-2] == p
            and b[-2] == a[-1]
            and out == p + a[-2] + b[-1]
            and b[-1] not in a
        ):
            return v
    raise refuse(n, f"combines the attention weights with einsum '{n.args[0]}', not (…, q, k) · (…, k, e) → (…, q, e)")


_DONOR_READS = ops.SHAPE_DONORS  # their second operand: dtype or shape


def _written(core: Core, x: fx.Node, n: fx.Node) -> list[fx.Node]:
    """The in-place ops on scores `x` (`x.add_(bias)`, `x.masked_fill_(…)`) before `n` reads it whose results nothing
    reads (fx's spelling: `n` reads `x`): per-score ops on the way, as their out-of-place forms; their tensor operands
    join the core's sides (masks and biases, checked per head)."""
    order = {m: i for i, m in enumerate(x.graph.nodes)}
    found = [
        u
        for u in x.users
        if u is not n and not u.users and u.args and u.args[0] is x and order[u] < order[n]
        if _name(u) in IN_PLACE
    ]
    for w in found:
        core.sides += [a for a in (*w.args[1:], *w.kwargs.values()) if isinstance(a, fx.Node) and tensor_shape(a)]
        core.inner.add(w.name)
    return found


def _only_user(n: fx.Node, but: list[fx.Node] | tuple = ()) -> fx.Node | None:
    """The one op reading `n`'s values (size queries and dtype or shape donors — `x.type_as(n)`,
    `mask.expand_as(n)` — do not count, nor the ops in `but`)."""
    users = [
        u
        for u in n.users
        if u not in but
        and not (u.op == "call_method" and u.target in ops.SHAPE_QUERIES)
        and not (_name(u) in _DONOR_READS and u.args[0] is not n)
    ]
    return users[0] if len(users) == 1 else None


def _back_to_product(x, shape, steps: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the matrix product, the ops after it, last first) that `x` is computed from through tensors of the scores'
    shape, within `steps` ops; None when there is none."""
    if not isinstance(x, fx.Node) or tensor_shape(x) != shape:
        return None
    if _name(x) in PRODUCTS:
        return x, []
    if steps == 0:
        return None
    if _regroups(x):  # (batch · heads, q, k) viewed as (batch, heads, q, k): back to the product of the merged ones
        found = _back_to_product(x.args[0], tensor_shape(x.args[0]), steps - 1)
        return (found[0], [x] + found[1]) if found is not None else None
    if _name(x) == "cat" and isinstance(x.args[0], (list, tuple)) and x.args[0] and isinstance(x.args[0][0], fx.Node):
        first = x.args[0][0]  # scores, then sink columns (cat along the keys)
        dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
        fs = tensor_shape(first)
        if isinstance(dim, int) and dim % len(shape) == len(shape) - 1 and fs is not None and fs[:-1] == shape[:-1]:
            found = _back_to_product(first, fs, steps - 1)
            return (found[0], [x] + found[1]) if found is not None else None
        return None
    for a in (*x.args, *x.kwargs.values()):
        found = _back_to_product(a, shape, steps - 1)
        if found is not None:
            return found[0], [x] + found[1]
    return None


def _core(gm: fx.GraphModule, sm: fx.Node) -> Core | None:
    """The eager attention around softmax `sm`, None when `sm` is not between two matrix products."""
    shape = tensor_shape(sm)
    found = _back_to_product(sm.args[0], shape, 8) if sm.args else None
    if found is None or shape is None or len(shape) < 3:
        return None
    x, chain = found
    scores, after, masks, regroups = x, [sm], [], []
    keys = tensor_shape(scores)[-1]
    out = _only_user(sm)
    while out is not None and _name(out) not in PRODUCTS:
        if _name(out) == "getitem" and shape[-1] > keys and _keeps_keys(out, len(shape), shape[-1], keys):
            pass  # the sink columns sliced off: weights over the keys only
        elif _name(out) in ("masked_fill", "masked_fill_") and out.args[0] is after[-1]:
            masks += [a for a in out.args[1:] if isinstance(a, fx.Node) and tensor_shape(a)]  # CPM-Ant zeroes
        elif _regroups(out):  # the weights merged with the batch again for a bmm with the value (B · heads, q, v)
            regroups.append(out)
        elif op_kind(gm, out) != "same":  # masked weights after the softmax: the mask is checked per head
            break
        after.append(out)
        out = _only_user(out)
    if out is None:  # the weights read twice: an attention if one reader is the product with the value
        users = [u for u in after[-1].users if _name(u) in PRODUCTS]
        if users and len(after[-1].users) > 1:
            other = next(u for u in after[-1].users if u is not users[0])
            raise refuse(
                after[-1], f"holds the attention weights of '{users[0].name}' and is also read by '{other.name}'"
            )
    if out is None or _name(out) not in PRODUCTS:
        return None
    dim = _softmax_dim(gm, sm)
    if dim is None or dim % len(shape) != len(shape) - 1:
        raise refuse(sm, f"normalises attention scores along dim {dim}, not over the keys (the last)")
    q, k, key_axis = _scores_operands(scores)
    core = Core(out, q, k, _value_operand(out, after[-1]), key_axis)
    core.inner = {scores.name, out.name} | {n.name for n in chain + after}
    core.sides += masks + _product_side(scores)
    core.regroups = regroups + [n for n in chain if _regroups(n)] + _zeros_input(scores)
    if core.regroups:
        core.heads, core.scale = shape[-3], _alpha(scores)
    prev = scores
    for n in reversed(chain):  # from the scores to the softmax
        if _name(n) == "cat":  # sink columns after the keys (_back_to_product): checked per head by analysis.heads
            cut = [a for a in after if _keeps_keys(a, len(shape), shape[-1], keys) and tensor_shape(a)[-1] == keys]
            if _only_user(prev) is not n or not cut:
                raise refuse(n, f"concatenates columns to the attention scores of '{out.name}' that are not sliced off")
            core.sinks += [a for a in n.args[0][1:] if isinstance(a, fx.Node)]
            prev = n
            continue
        if _regroups(n):
            if _only_user(prev) is not n:
                raise refuse(prev, f"holds the attention scores of '{out.name}' and is also read elsewhere")
            prev = n
            continue
        if _name(n) not in ON_SCORES or n.op not in ("call_function", "call_method"):
            raise refuse(
                n,
                f"is between the attention scores of '{out.name}' and its softmax, and is not an op "
                "the analysis follows (arithmetic with a number or a mask, tanh, masking, casts)",
            )
        written = _written(core, prev, n)
        if _only_user(prev, written) is not n and not _stabilised(prev, n):
            raise refuse(prev, f"holds the attention scores of '{out.name}' and is also read elsewhere")
        side = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, fx.Node) and a is not prev]
        side = [a for a in side if not _row_max_of(a, prev)]  # x - max(x): computed from the scores themselves
        core.sides += [a for a in side if _name(n) not in ops.CASTS and tensor_shape(a)]
        if prev is scores and core.scale is None:
            core.scale, at = _scale(n, scores)
            core.scale_at, core.scale_from = (None, at) if at and isinstance(at[0], fx.Node) else (at, None)
        prev = n
    _written(core, prev, sm)  # (written in place just before the softmax reads them)
    if core.scale is None and core.scale_from is None:
        core.scale = 1.0
    return core


def _regroups(n: fx.Node) -> bool:
    """`n` reshapes scores or weights between (batch · heads, q, k) and (batch, heads, q, k): the same last two axes,
    the leading ones split or merged."""
    if _name(n) not in ops.RESHAPES or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    a, b = tensor_shape(n.args[0]), tensor_shape(n)
    return a is not None and b is not None and len(a) != len(b) and a[-2:] == b[-2:] and math.prod(a) == math.prod(b)


def _product_side(scores: fx.Node) -> list[fx.Node]:
    """baddbmm's input (a bias added to the product: ALiBi's), unless it is zeros of sizes read at run time (GPT-NeoX
    Japanese's `torch.zeros(batch · heads, q, k)`: the same for every head, and its size follows the heads)."""
    if _name(scores) != "baddbmm":
        return []
    x = scores.args[0] if scores.args else scores.kwargs.get("input")
    if not isinstance(x, fx.Node):
        return []
    sizes = x.args[0] if len(x.args) == 1 and isinstance(x.args[0], (list, tuple)) else x.args
    if _name(x) == "zeros" and all(isinstance(a, fx.Node) for a in sizes):
        return []
    return [x]


def _zeros_input(scores: fx.Node) -> list[fx.Node]:
    """baddbmm's input when it is zeros of sizes read at run time: its batch · heads size may be a constant times the
    batch (`torch.zeros(batch * heads, q, k)`), rewritten as the scores' views are (analysis.heads)."""
    x = scores.args[0] if _name(scores) == "baddbmm" and scores.args else None
    return [x] if isinstance(x, fx.Node) and not _product_side(scores) else []


def _alpha(scores: fx.Node) -> float:
    """The factor on a baddbmm's product (alpha=); 1 for any other product."""
    alpha = scores.kwargs.get("alpha", scores.args[4] if len(scores.args) > 4 else 1.0)
    return float(alpha) if _name(scores) == "baddbmm" and isinstance(alpha, (int, float)) else 1.0


def _keeps_keys(n: fx.Node, rank: int, width: int, keys: int) -> bool:
    """`n` = x[..., :keys] (every other axis whole; maybe a whole slice, as torch.export writes the steps of one):
    the weights over the keys, the sink columns after them off."""
    shape = tensor_shape(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    if _name(n) != "getitem" or shape is None or len(shape) != rank or shape[-1] not in (width, keys):
        return False
    try:
        cut = one_axis_slice(n.args[1], shape)
    except TypeError:  # a bound read at run time: which columns it keeps is not known here
        return False
    return cut is not None and cut[0] == rank - 1 and cut[1] == 0 and cut[2] in (keys, shape[-1])


def _row_max_of(a: fx.Node, x: fx.Node) -> bool:
    """`a` is max(x, -1, keepdim=True) (its values, maybe through getitem): the softmax's stabiliser x - max(x)."""
    if _name(a) == "getitem" and a.args[1] == 0 and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return _name(a) in ("max", "amax") and a.args[0] is x


def _stabilised(x: fx.Node, n: fx.Node) -> bool:
    """`x` is read by `n` = x - max(x) and by that max only."""
    readers = [u for u in x.users if u is not n]
    return _name(n) == "sub" and n.args[0] is x and len(readers) == 1 and _row_max_of(n.args[1], x)


def _scale(n: fx.Node, scores: fx.Node) -> tuple[float | None, tuple | None]:
    """The first op on the scores as a scale: × c or / c with c a number or a 0-d `torch.full([], c)`."""
    if (
        n.op != "call_function"
        or n.target not in ops.MUL_FUNCTIONS
        or n.args[0] is not scores
        and (n.target not in ops.PRODUCT_FUNCTIONS or n.args[1] is not scores)
    ):
        return None, None
    i = 1 if n.args[0] is scores else 0
    c = n.args[i]
    div = n.target in (operator.truediv, torch.div)
    if isinstance(c, fx.Node) and c.op == "call_function" and c.target is torch.full and c.args[:1] in (((),), ([],)):
        n, i, c = c, 1, c.args[1]
    if isinstance(c, fx.Node):
        return None, (c, div)  # computed: analysis.heads evaluates it from the sizes it is read from
    if not isinstance(c, (int, float)) or isinstance(c, bool) or c == 0:
        return None, None
    return (1 / c if div else float(c)), (n.name, ("args", i), "div" if div else "mul")


# what a scale computed from sizes may be made of: arithmetic on Python numbers (math.sqrt(d), d ** -0.5, 1 / …)
_NUMBER_OPS = {getattr(operator, n) for n in ops.BINARY_NAMES if hasattr(operator, n)}
_NUMBER_OPS |= {operator.pow, operator.floordiv, math.sqrt, float, int}


def scale_value(c: fx.Node, read) -> float:
    """The value of a scale computed from sizes (math.sqrt(q.size(-1)), q.shape[-1] ** -0.5), each size read
    `t.size(dim)` / `t.shape[dim]` answered by read(t, dim); ValueError when it is computed some other way."""

    def value(a):
        if not isinstance(a, fx.Node):
            return a
        if a.op == "call_method" and a.target == "size" and len(a.args) == 2:
            return read(a.args[0], a.args[1])
        if a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[1], int):
            shape = a.args[0]
            if isinstance(shape, fx.Node) and shape.op == "call_function" and shape.args[1:] == ("shape",):
                return read(shape.args[0], a.args[1])
            if (
                isinstance(shape, fx.Node)
                and shape.op == "call_method"
                and shape.target == "size"
                and len(shape.args) == 1
            ):
                return read(shape.args[0], a.args[1])  # t.size()[i]
        if a.op == "call_function" and a.target in _NUMBER_OPS and not a.kwargs:
            return a.target(*(value(x) for x in a.args))
        raise ValueError(a.name)

    out = value(c)
    if not isinstance(out, (int, float)) or out == 0:
        raise ValueError(c.name)
    return float(out)


def eager_cores(gm: fx.GraphModule) -> list[Core | NotApplicable]:
    """Every eagerly written attention of the graph (or the reason one cannot be read)."""
    out: list[Core | NotApplicable] = []
    for n in gm.graph.nodes:
        if not _is_softmax(gm, n):
            continue
        try:
            core = _core(gm, n)
        except NotApplicable as e:
            out.append(e)
            continue
        if core is not None:
            out.append(core)
    return out


def sdpa_core(s: fx.Node) -> Core:
    """A scaled_dot_product_attention as a Core (its scale: an explicit scale=, else None: 1/sqrt(d))."""
    names = ("query", "key", "value")
    q, k, v = (s.args[i] if len(s.args) > i else s.kwargs.get(name) for i, name in enumerate(names))
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        raise refuse(s, "has no query, key and value the analysis can read")
    mask = s.args[3] if len(s.args) > 3 else s.kwargs.get("attn_mask")
    scale = s.kwargs.get("scale", s.args[6] if len(s.args) > 6 else None)
    return Core(s, q, k, v, -1, {s.name}, [mask] if isinstance(mask, fx.Node) else [], scale)


def is_sdpa(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is SDPA
