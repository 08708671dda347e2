"""Parameters read per head (analysis.head_flow): a tensor that meets an attention's heads axis and is computed from
one parameter alone (through views, lookups and elementwise functions of it) — a learnable sink or gate bias (one
entry per head), a scale of the query per head and coordinate (Dory's sqk), a per-head bias of the query or value
(DeBERTa's q_bias of heads × head size, viewed per head), a relative-position bias table with one column per head
looked up by position buckets (CPM-Ant's, T5's `F.embedding(buckets, table)`) — grows with the heads: the parameter
gets entries for the new heads along the axis that holds them (a `fill` that only new heads read: zero for a term,
one for a factor), and the old heads read what they read before.

Which axis of the parameter holds the heads is found by following it: each way the heads could sit in it (an axis of
the heads' size, or the outer or inner part of a flat one) is run forward through the ops between the parameter and
the tensor that meets the attention, and the one that puts the heads where they meet is taken; none: not adopted.
It is its own module because head_flow follows the projections' tensors; this follows a side operand back to where
it comes from, and is tried and rolled back as a whole.
"""

from __future__ import annotations

from typing import Protocol

from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .head_layout import HEAD_FACTORS, POINTWISE, SAME, Axis, Layout, _name, canon, plain, size_of


class Flow(Protocol):
    """What adopt uses of head_flow.Flow (which calls it: named here, not imported, to keep imports one way)."""

    gm: fx.GraphModule
    growing: set[str]
    layout: dict[str, object]
    edits: list
    params: list[tuple[str, int, Axis, float]]

    def step(self, n: fx.Node): ...

    def of(self, a: fx.Node) -> Layout: ...

    def grows(self, axis: Axis) -> bool: ...


# ops from the parameter to the tensor that meets the heads: the same data in another shape or order, or a lookup
CHAIN = ops.UNIT_DIMS | SAME | ops.RESHAPES | ops.TRANSPOSES | ops.INDEXING | {"expand"}
LOOKUPS = ops.LOOKUPS


def adopt(flow: Flow, side: fx.Node, axis: Axis, fill: float, at: int) -> bool:
    """`side` meets the heads axis `axis` at its axis `at` (from the end). True when it is computed from one parameter
    through CHAIN ops and lookups and the heads sit on one axis of it: then the layouts of the chain are set, its
    reshape constants recorded, and (parameter path, its axis, the heads' factors, `fill`) added to flow.params."""
    if any(f in flow.growing and f not in HEAD_FACTORS for f, _ in axis):
        return False  # head sizes: a bias on the query would need the query's rescaling too; not taken here
    chain, x = [], side
    while x.op != "get_attr" and not _embedding(flow.gm, x):
        name, tensors = _name(x), [a for a in x.args if isinstance(a, fx.Node)]
        src = x.args[1] if name in LOOKUPS and len(x.args) > 1 else x.args[0] if x.args else None
        if name in ops.BINARY_NAMES and len(tensors) == 1 and all(isinstance(a, (int, float)) for a in x.args[1:]):
            src = tensors[0]  # the parameter times a number (Dory's sqk · scale): still one value per entry
        elif name not in CHAIN | LOOKUPS | POINTWISE or not isinstance(src, fx.Node):
            return False
        chain.append(x)
        x = src
    table = flow.gm.get_submodule(str(x.target)).weight if x.op == "call_module" else None  # nn.Embedding: a lookup
    path = f"{x.target}.weight" if table is not None else str(x.target)
    ps, rank = tuple(table.shape) if table is not None else tensor_shape(x), len(tensor_shape(side) or ())
    if ps is None or rank == 0:
        return False
    for dim, lay in _placements(ps, axis):
        saved, edits = dict(flow.layout), len(flow.edits)
        try:
            flow.layout[x.name] = _rows(flow, x.args[0], lay) if table is not None else lay
            for m in reversed(chain):
                flow.layout[m.name] = _lookup(flow, m) if _name(m) in LOOKUPS else flow.step(m)
            got = flow.of(side)
            ok = len(got) == rank and canon(got[at], flow.growing) == canon(axis, flow.growing)
            ok = ok and not any(flow.grows(a) for i, a in enumerate(got) if i != at % rank)
        except NotApplicable:
            ok = False
        if ok:
            flow.params.append((path, dim, lay[dim], fill))
            return True
        flow.layout, flow.edits = saved, flow.edits[:edits]
    return False


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
