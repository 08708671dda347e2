"""Parameters read per head (analysis.head_flow): a tensor that meets an attention's heads axis and is computed from
one parameter alone (through views, lookups and elementwise functions of it) — a learnable sink or gate bias (one
entry per head), a scale of the query per head and coordinate (Dory's sqk), a per-head bias of the query or value
(DeBERTa's q_bias of heads × head size, viewed per head), a relative-position bias table with one column per head
looked up by position buckets (CPM-Ant's, T5's `F.embedding(buckets, table)`) or gathered by a tensor of positions
(BEiT's and Swin's `table[index]`, `table[:, index]`, `index_select`, `gather`: a gather's index, which has a row per
head, gives new heads a copy of an old head's row) — grows with the heads: the parameter
gets entries for the new heads along the axis that holds them (a `fill` that only new heads read: zero for a term,
one for a factor), and the old heads read what they read before. A per-head tensor that no one parameter holds
(ALiBi's slopes × positions, computed or from a buffer; a bias summed from two tables; a mask combined with it) is
exact with any entries for new heads (their outputs enter the output projection through zero columns): new heads
read a copy of an old head's, taken where the heads first sit on one axis, if it is computed without a Linear or a
matrix product (another attention's scores grow by themselves).

Which axis of the parameter holds the heads is found by following it: each way the heads could sit in it (an axis of
the heads' size, or the outer or inner part of a flat one) is run forward through the ops between the parameter and
the tensor that meets the attention, and the one that puts the heads where they meet is taken; none: not adopted.
It is its own module because head_flow follows the projections' tensors; this follows a side operand back to where
it comes from, and is tried and rolled back as a whole.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .eager_attention import PRODUCTS, is_sdpa
from .head_layout import (
    ELEMENTWISE,
    HEAD_FACTORS,
    POINTWISE,
    SAME,
    Axis,
    Layout,
    _name,
    canon,
    op_kind,
    plain,
    size_of,
)
from .head_projections import _linear_params


class Flow(Protocol):
    """What adopt uses of head_flow.Flow (which calls it: named here, not imported, to keep imports one way)."""

    gm: fx.GraphModule
    growing: set[str]
    layout: dict[str, object]
    edits: list
    params: list[tuple[str, int, Axis, float | None]]

    def step(self, n: fx.Node): ...

    def of(self, a: fx.Node) -> Layout: ...

    def grows(self, axis: Axis) -> bool: ...


# ops from the parameter to the tensor that meets the heads: the same data in another shape or order, or a lookup
CHAIN = ops.UNIT_DIMS | SAME | ops.RESHAPES | ops.TRANSPOSES | ops.INDEXING | ops.TILES | {"expand"}
LOOKUPS = ops.LOOKUPS


def adopt(flow: Flow, side: fx.Node, axis: Axis, fill: float, at: int) -> bool:
    """`side` meets the heads axis `axis` at its axis `at` (from the end). True when it is computed from one parameter
    through CHAIN ops and lookups and the heads sit on one axis of it: then the layouts of the chain are set, its
    reshape constants recorded, and (parameter path, its axis, the heads' factors, `fill`) added to flow.params.
    Otherwise, when the heads sit on one axis of a tensor on the way that does not depend on the attention's tensors
    (ALiBi's slopes × positions, a bias table gathered and summed, a mask and a bias combined): new heads read a copy
    of an old head's entries there ((node name, its axis, the heads' factors, None) in flow.params). Either is exact:
    new heads' outputs enter the output projection through zero columns."""
    if any(f in flow.growing and f not in HEAD_FACTORS for f, _ in axis):
        return False  # head sizes: a bias on the query would need the query's rescaling too; not taken here
    chain, x = [], side
    while x.op != "get_attr" and not _embedding(flow.gm, x):
        same = x.op == "call_module" and op_kind(flow.gm, x) == "same"  # a dropout module (timm's Mlp's drop2)
        src = x.args[0] if same and isinstance(x.args[0], fx.Node) else _source(x)
        if src is None:
            break
        chain.append(x)
        x = src
    if not tensor_shape(side):
        return False
    if x.op == "get_attr" or _embedding(flow.gm, x):
        table = flow.gm.get_submodule(str(x.target)).weight if x.op == "call_module" else None  # nn.Embedding
        path = f"{x.target}.weight" if table is not None else str(x.target)
        ps = tuple(table.shape) if table is not None else tensor_shape(x)
        for dim, lay in _placements(ps or (), axis):
            try:
                start = _rows(flow, x.args[0], lay) if table is not None else lay
            except NotApplicable:
                continue
            if _follows(flow, x, start, chain, side, axis, at):
                flow.params.append((path, dim, lay[dim], fill))
                return True
        if x.op == "get_attr":
            x = chain.pop() if chain else x
    if _learned_table(flow, x, chain, side, axis, at):
        return True
    for c in [x, *chain[::-1]] if x.op != "get_attr" else []:  # where the heads first sit on one axis
        later = chain[: chain.index(c)] if c in chain else chain
        for dim, lay in _placements(tensor_shape(c) or (), axis):
            if _free(flow, c, later, side) and _follows(flow, c, lay, later, side, axis, at):
                flow.params.append((c.name, dim, lay[dim], None))
                return True
    return False


def _learned_table(flow: Flow, x: fx.Node, chain: list, side: fx.Node, axis: Axis, at: int) -> bool:
    """`x` is a Linear with one output per head computed from the model's parameters and buffers alone (Swin V2's
    continuous position bias: an MLP over the relative coordinates, then looked up per query and key): its rows
    (weight and bias) grow with the heads, new rows zero (any entries are exact for new heads: their outputs enter the
    output projection through zero columns; the new rows learn as the others do)."""
    if op_kind(flow.gm, x) != "linear" or not (x.op == "call_module" or x.target is F.linear):
        return False
    if x.op == "call_module" and not isinstance(flow.gm.get_submodule(str(x.target)), nn.Linear):
        return False
    shape = tensor_shape(x)
    if not shape or shape[-1] != size_of(axis) or not _constant(flow, x):
        return False
    try:
        weight, bias, _ = _linear_params(flow.gm, x)
    except NotApplicable:
        return False
    if not _follows(flow, x, plain(shape[:-1]) + (axis,), chain, side, axis, at):
        return False
    flow.params += [(p, 0, axis, 0.0) for p in (weight, bias) if p is not None]
    return True


def _constant(flow: Flow, c: fx.Node) -> bool:
    """`c` is computed from parameters, buffers and constants only: no input of the model, no tensor the flow
    follows (so no attention's projections, scores or outputs)."""
    todo, seen = [c], set()
    while todo:
        n = todo.pop()
        if n.name in flow.layout or n.op == "placeholder":
            return False
        seen.add(n.name)
        todo += [a for a in n.all_input_nodes if a.name not in seen]
    return True


def _source(x: fx.Node) -> fx.Node | None:
    """The operand whose values `x` carries, element by element or rearranged (None: none, or several)."""
    name, tensors = _name(x), [a for a in x.args if isinstance(a, fx.Node)]
    if name in LOOKUPS and len(x.args) > 1:
        src = x.args[1]
    elif name in ops.TABLE_READS:  # table.index_select(d, idx), table.gather(d, idx): entries of the table
        src = x.args[0] if x.args else None
    elif name in ops.BINARY_NAMES and len(tensors) == 1 and all(isinstance(a, (int, float)) for a in x.args[1:]):
        src = tensors[0]  # the parameter times a number (Dory's sqk · c): still one value per entry
    elif name in CHAIN | POINTWISE or (name in ops.BOUNDS and len(tensors) == 1):  # clamp(x, max=c): x's values
        src = x.args[0] if x.args else None
    elif name in ELEMENTWISE:  # a bias with a mask broadcast over the heads (T5's where(mask, bias, min)): the bias
        full = [a for a in tensors if tensor_shape(a) == tensor_shape(x)]
        src = full[0] if len(full) == 1 else None
    else:
        src = None
    return src if isinstance(src, fx.Node) else None


def _follows(flow: Flow, x: fx.Node, start: Layout, chain: list, side: fx.Node, axis: Axis, at: int) -> bool:
    """With `x` laid out as `start`, the chain (nearest `side` first) puts the heads `axis` at `side`'s axis `at` and
    nowhere else; its layouts and edits are kept then, rolled back otherwise."""
    saved, edits, rank = dict(flow.layout), len(flow.edits), len(tensor_shape(side) or ())
    params = len(flow.params)
    try:
        flow.layout[x.name] = start
        for m in reversed(chain):
            flow.layout[m.name] = _step(flow, m)
        got = flow.of(side)
        ok = len(got) == rank and canon(got[at], flow.growing) == canon(axis, flow.growing)
        ok = ok and not any(flow.grows(a) for i, a in enumerate(got) if i != at % rank)
    except NotApplicable:
        ok = False
    if not ok:
        flow.layout, flow.edits, flow.params = saved, flow.edits[:edits], flow.params[:params]
    return ok


def _step(flow: Flow, m: fx.Node) -> Layout:
    """The layout of `m`, on the way from a parameter to a tensor that meets the heads."""
    if _name(m) in LOOKUPS:
        return _lookup(flow, m)
    by_index = _by_index(flow, m)
    return by_index if by_index is not None else flow.step(m)


def _by_index(flow: Flow, m: fx.Node) -> Layout | None:
    """The layout of entries of a table picked by a tensor of integer indices (None: `m` picks none so): x[idx] or
    x[:, idx] (the index's dims in place of the indexed one), x.index_select(d, idx) (the index's length there),
    x.gather(d, idx) (the index's shape; along every other dim it reads the table's entry at the same place, so a dim
    holding heads holds them in the index too: new heads read a copy of an old head's index row). The indexed dim
    must not grow: which entries new indices would pick is not known."""
    name, args = _name(m), m.args
    if name == "getitem" and len(args) == 2 and isinstance(args[0], fx.Node):
        items = args[1] if isinstance(args[1], tuple) else (args[1],)
        nodes = [i for i in items if isinstance(i, fx.Node)]
        if not nodes:
            return None
        idx = nodes[0]
        if len(nodes) > 1 or any(i is not idx and i != slice(None) for i in items):
            raise NotApplicable("an index mixing tensors with other indices", "")
        dim = items.index(idx)
        shape = tensor_shape(idx)
    elif name in ops.TABLE_READS and len(args) == 3 and isinstance(args[1], int) and isinstance(args[2], fx.Node):
        idx, shape = args[2], tensor_shape(args[2])
        dim = args[1] % len(tensor_shape(args[0]) or (0,))
    else:
        return None
    dt = idx.meta.get("gg_dtype")
    lay = flow.of(args[0])  # type: ignore[arg-type]
    if shape is None or dt is None or dt.is_floating_point or dt == torch.bool or dim >= len(lay):
        raise NotApplicable("an index that is not a tensor of integers", "")
    if flow.grows(lay[dim]):
        raise NotApplicable("a lookup along a growing axis", "")
    if name != "gather":
        return lay[:dim] + plain(shape) + lay[dim + 1 :]
    table = tensor_shape(args[0])  # type: ignore[arg-type]
    if table is None or len(shape) != len(lay):
        raise NotApplicable("a gather whose index does not match its table", "")
    out = []
    for k, (s, axis) in enumerate(zip(shape, lay)):
        if k == dim or not flow.grows(axis):
            out.append(plain((s,))[0])
            continue
        if s != table[k] or not _apart(flow, idx):
            raise NotApplicable("a gather along heads whose index cannot take rows for new heads", "")
        flow.params.append((idx.name, k, axis, None))  # new heads' index rows: copies of old heads'
        out.append(axis)
    return tuple(out)


def _free(flow: Flow, c: fx.Node, later: list, side: fx.Node) -> bool:
    """`c` can take a copy of old heads for new ones: it is computed without a Linear or matrix product (so from no
    attention's projections, scores or outputs, which may grow themselves: RealFormer's scores handed on), and what
    reads it and the chain after it is the chain, or the ops that read `side` (one bias read by every layer)."""
    if not _apart(flow, c):
        return False
    readers = {u.target for u in side.users}
    if len(readers) != 1:
        return False
    inner, todo = {m.name for m in later if m is not side}, [c]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.name in inner or (u is not side and _name(u) in CHAIN):
                todo.append(u)
            elif u is not side and u.target not in readers:
                return False
    return True


def _apart(flow: Flow, c: fx.Node) -> bool:
    """`c` is computed without a Linear or matrix product and without a tensor the flow follows."""
    todo, seen = [c], set()
    while todo:
        n = todo.pop()
        if n.name in flow.layout or op_kind(flow.gm, n) == "linear" or _name(n) in PRODUCTS or is_sdpa(n):
            return False
        seen.add(n.name)
        todo += [a for a in n.all_input_nodes if a.name not in seen]
    return True


def _placements(shape: tuple, axis: Axis) -> list[tuple[int, Layout]]:
    """Each way the heads `axis` may sit in a parameter of `shape`: an axis of its size, or the outer or inner part
    of an axis that is a multiple of it (a flat heads × head size)."""
    heads, out = size_of(axis), []
    for i, s in enumerate(shape):
        if heads < 2 or s % heads:
            continue
        rest = s // heads
        for a in [axis] if rest == 1 else [axis + (("", rest),), (("", rest),) + axis]:
            out.append((i, plain(shape[:i]) + (a,) + plain(shape[i + 1 :])))
    return out


def _embedding(gm: fx.GraphModule, n: fx.Node) -> bool:
    return n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.Embedding)


def _lookup(flow: Flow, n: fx.Node) -> Layout:
    """F.embedding(ids, table): one row of the table per index, its columns last."""
    return _rows(flow, n.args[0], flow.of(n.args[1]))


def _rows(flow: Flow, ids, table: Layout) -> Layout:
    """The layout of rows of a table laid out as `table`, looked up by the indices `ids`."""
    shape = tensor_shape(ids) if isinstance(ids, fx.Node) else None
    if shape is None or len(table) != 2 or flow.grows(table[0]):
        raise NotApplicable("a lookup along a growing axis", "")
    return plain(shape) + (table[1],)


def one_for_all_heads(mask: fx.Node) -> bool:
    """A mask the same for every head: expanded to the scores' shape (`mask.expand_as(scores)`, XLM's) from one of
    size 1 on the heads axis; it follows the grown scores."""
    x = mask
    while x.op in ("call_function", "call_method") and _name(x) in ("to", "type_as", "contiguous", "float", "bool"):
        if not isinstance(x.args[0], fx.Node):
            return False
        x = x.args[0]
    if _name(x) != "expand_as" or not isinstance(x.args[0], fx.Node):
        return False
    src = tensor_shape(x.args[0])
    return src is not None and (len(src) < 3 or src[-3] == 1)
