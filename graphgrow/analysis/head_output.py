"""The output side of an attention (analysis.heads): from the attention's output to the one Linear that reads it, the
tensors between them followed (head_flow.Flow); output gates on the way (sigmoid(gate_proj(x)): their rows follow
the heads); and per-head parameters that a factor computed from the attention's own scores reads (a learnable sink,
new heads' entries zero). It is its own module because it is one job, done once per attention after its inputs
are understood, and analysis.heads stays small enough to read.
"""

from __future__ import annotations

from torch import fx

from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .eager_attention import Core
from .head_flow import Flow
from .head_layout import (
    SHAPE_QUERIES,
    Axis,
    FactorEdit,
    Layout,
    channel_axis,
    channels_laid,
    conv_blocks,
    data_args,
    linear_arg,
    op_kind,
    plain,
    refuse,
    size_of,
    transposed_reader,
)
from .head_projections import Projection, _back, _linear_params, _op


def _gate(gm: fx.GraphModule, n: fx.Node, a: fx.Node, region: set[str]) -> tuple[fx.Node, set[str]] | None:
    """(its Linear, the nodes after it) when operand `a` of op `n` on the attention's output is computed from one
    Linear through ops on single values (an output gate, sigmoid(gate_proj(x)): AFMoE's, Qwen3-Next's), each read
    only on the way to `n`; else None."""
    seen, found = _back(gm, a)
    if len(found) != 1 or found[0].name in region:
        return None
    fed = {found[0].name}  # (what the walk met beside: a per-head bias parameter's views, which the flow adopts)
    on_path = []
    for m in gm.graph.nodes:
        if m.name in seen and any(x.name in fed for x in data_args(m)):
            fed.add(m.name)
            on_path.append(m)
    seen &= fed
    path = seen | {found[0].name}
    for m in on_path:
        if op_kind(gm, m) not in ("same", "pointwise", "layout", "elementwise"):
            return None
        if any(u.name not in path | {n.name} for u in m.users if not _donor_read(u, m)):
            return None
    if a.name not in seen or any(u.name not in path for u in found[0].users):
        return None
    return found[0], seen


def _donor_read(u: fx.Node, n: fx.Node) -> bool:
    """`u` reads `n` only for its dtype or shape (x.view_as(n): Beam's gate shaped as the attention's output)."""
    return _op(u) in ops.SHAPE_DONORS and u.args[0] is not n and n not in u.args[:1]


def _from_scores(gm: fx.GraphModule, a: fx.Node, core: Core, region: set[str]):
    """(the nodes after them, the scores read, the parameters read) when `a` is computed from the attention's own
    scores and parameters only, through ops the flow follows (Granite's sink scale sigmoid(logsumexp(scores) -
    sinks), which multiplies each head's output); else None."""
    seen: set[str] = set()
    scores, params, todo = [], [], [a]
    shape = tensor_shape(core.node)
    while todo:
        n = todo.pop()
        if n.name in seen or n.name in region:
            continue
        if n.name in core.inner:
            if n is core.node or tensor_shape(n) is None or len(tensor_shape(n)) != len(shape):
                return None
            scores.append(n)
            continue
        if n.op == "get_attr":
            params.append(n)
            continue
        if op_kind(gm, n) in (None, "linear", "alloc", "write"):
            return None
        seen.add(n.name)
        todo += [x for x in n.all_input_nodes if x.op != "get_attr" or tensor_shape(x) is not None]
    return (seen, scores, params) if scores else None


def gate_tail(gm: fx.GraphModule, flow: Flow, body: list[fx.Node], region: set[str], core: Core) -> dict[str, Layout]:
    """The part of a projection that goes beside the attention to its output (an output gate made with the query:
    Qwen3-Next's q_proj viewed per head and chunked into query and gate): the nodes from a tensor of the input side
    read outside it and outside the attention, through ops the flow follows, up to the ops that read the attention's
    output too; their layouts, followed by `flow`. Empty where something else reads them (the input side's check
    then refuses as before); _reader checks that they meet the output before its projection."""
    inside = region | core.inner
    starts = [u for n in body for u in n.users if u.name not in inside and not _size_read(u)]
    if not starts:
        return {}
    after: set[str] = set()
    todo = [core.node]
    while todo:  # everything computed from the attention's output
        for u in todo.pop().users:
            if u.name not in after:
                after.add(u.name)
                todo.append(u)
    tail: set[str] = set()
    todo = [u for u in starts if u.name not in after]
    while todo:
        u = todo.pop()
        if u.name in tail:
            continue
        if op_kind(gm, u) not in ("same", "pointwise", "layout", "elementwise"):
            return {}
        tail.add(u.name)
        todo += [w for w in u.users if w.name not in after and not _size_read(w)]
    order = [n for n in gm.graph.nodes if n.name in tail]
    for n in order:
        firsts = data_args(n) if op_kind(gm, n) != "elementwise" else []
        if any(a.name not in inside and a.name not in tail for a in firsts):
            return {}
    flow.run(order)
    return {n.name: flow.of(n) for n in order}


def _size_read(u: fx.Node) -> bool:
    return (u.op == "call_method" and u.target in SHAPE_QUERIES) or (u.op == "call_function" and u.target is getattr)


def _reader(
    gm: fx.GraphModule,
    core: Core,
    lay: Layout,
    growing: set[str],
    beside: dict[str, Layout] | None = None,
    hx: int = -3,
) -> tuple[Projection, list[FactorEdit], list[Projection], list[tuple[str, int, Axis, float | None]]]:
    """The output projection reading the attention's output, the tensors between them followed; the Linear layers
    of output gates on the way (their rows follow the heads: new heads' gate rows are random, the output
    projection's new columns zero); and the parameters with one entry per head that a factor on the output
    computed from the attention's own scores reads (a learnable sink: new heads' entries zero)."""
    s = core.node
    flow = Flow(gm, growing, set())
    flow.layout[s.name] = lay
    beside = beside or {}
    flow.layout.update(beside)
    todo, region, readers = [s], {s.name}, []
    while todo:
        n = todo.pop()
        for u in n.users:
            kind = op_kind(gm, u)
            if (kind == "linear" and linear_arg(u, 0) is n) or (transposed_reader(gm, u) and u.args[0] is n):
                readers.append(u)
            elif (
                (u.op == "call_method" and u.target in SHAPE_QUERIES)
                or (u.op == "call_function" and u.target is getattr)
                or _donor_read(u, n)
            ):
                continue
            elif kind is None or kind == "linear":
                why = conv_blocks(gm, u)  # a layer that is not a projection the analysis grows: which and why
                raise refuse(
                    u,
                    f"reads the output of attention '{s.name}' before any output projection"
                    + (f", and {why}" if why else ""),
                )
            elif u.name not in region:
                region.add(u.name)
                todo.append(u)
    if len(readers) != 1:
        raise refuse(s, f"has {len(readers)} output projections; the analysis needs one")
    nodes = {n.name: n for n in gm.graph.nodes}
    for t in beside:  # a part beside the attention meets its output before the output projection, nowhere else
        out = [u for u in nodes[t].users if u.name not in beside and u.name not in region and not _size_read(u)]
        if out:
            raise refuse(
                out[0],
                f"reads '{t}', a part of the attention '{s.name}''s projection beside its query, key or value, "
                "and is not between the attention's output and its output projection",
            )
    gates: list[Projection] = []
    per_head: list[tuple[str, int, Axis, float | None]] = []
    width = size_of(lay[hx] + lay[-1])
    for n in [m for m in gm.graph.nodes if m.name in region and op_kind(gm, m) == "elementwise"]:
        for a in (a for a in data_args(n) if a.name not in beside):
            found = _gate(gm, n, a, region) if a.name not in region else None
            rows = tensor_shape(found[0])[channel_axis(gm, found[0])] if found is not None else None
            if found is not None and rows in (width, size_of(lay[hx])):
                # the gate's rows: the heads and value size, flattened as the reader's input, or one per head (a
                # scalar gate per head: Dots's); the flow checks that they meet the output so
                g, path = found
                factors = lay[hx] + lay[-1] if rows == width else lay[hx]
                flow.layout[g.name] = channels_laid(gm, g, factors)
                region |= path
                weight, bias, module = _linear_params(gm, g)
                gates.append(Projection(g.name, weight, bias, module, factors, ("g",)))
                continue
            fed = _from_scores(gm, a, core, region) if a.name not in region else None
            if fed is not None:  # per head: the scores' heads axis is the query's
                path, scores, params = fed
                for sc in scores:
                    flow.layout[sc.name] = lay[:-1] + plain(tensor_shape(sc)[-1:])
                for p in params:
                    ps = tensor_shape(p)
                    one = len(ps) == 1 and ps[0] == size_of(lay[hx]) and ps[0] > 1
                    flow.layout[p.name] = (lay[hx],) if one else plain(ps)
                    if one and flow.grows(lay[hx]):
                        per_head.append((str(p.target), 0, lay[hx], 0.0))
                region |= path
    flow.region = region
    flow.run([n for n in gm.graph.nodes if n.name in region and n is not s])
    r = readers[0]
    x = flow.of(r.args[0])
    at = (transposed_reader(gm, r) or channel_axis(gm, r)) % len(x)  # a Linear's last axis, a convolution's channels
    if any(flow.grows(ax) for i, ax in enumerate(x) if i != at):
        raise refuse(r, "reads heads or head size on an axis other than its input features")
    weight, bias, module = _linear_params(gm, r)
    return Projection(r.name, weight, bias, module, x[at], ("o",)), flow.edits, gates, per_head + flow.params
