"""Attention heads of a transformer, found from the graph: for every attention (a `scaled_dot_product_attention`, or
the same computation written eagerly as matmul + softmax + matmul: analysis.eager_attention), the Linear layers
that project its query, key and value, the one that reads its output, the reshapes between them, and which
constants in those reshapes name the head count or head size — what grow_heads must change.

An attention's projection output is a product of *factors*, outermost first: `s` (the sections of a fused q/k/v
projection: GPT-2's c_attn, timm's qkv, nn.MultiheadAttention's in_proj), `h` (key/value heads; the heads when
there is no grouped-query attention), `r` (query heads per key/value head, grouped-query attention only), `d`
(query/key head size) and `e` (value head size). The analysis follows each tensor's axes as lists of factors
through reshapes, transposes, slices, splits, expands and elementwise ops (RoPE's multiply by cos/sin) up to the
attention, and from its output to the output projection. Factors that grow must stay whole: a reshape constant
over them is rewritten (an edit), a `-1` needs nothing; a side operand (a cos/sin table, a mask) must broadcast
over them. Anything else is refused with the node and the reason: a pass never guesses.

What an attention computes decides, not how it is spelled: a key allocated and filled by copies into its slices is
the concatenation of what is copied (multi-head latent attention); a part of the key that is the same for every head
(broadcast from one) needs no projection of its own; key and value may come in one block per head (then whole heads
grow); a norm may be written out as arithmetic; an output gate computed from a Linear of the input grows rows with
the heads; a learnable per-head sink read with the attention's own scores gets zero entries for new heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph.fx_edit import tensor_shape
from .eager_attention import Core, eager_cores, is_sdpa, scale_value, sdpa_core
from .head_layout import (
    SHAPE_QUERIES,
    Axis,
    FactorEdit,
    Flow,
    Layout,
    broadcasts,
    canon,
    data_args,
    linear_arg,
    op_kind,
    plain,
    refuse,
    size_of,
    words,
    writes,
)


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


@dataclass
class Attention:
    node: str  # the scaled_dot_product_attention, or the eager attention's weights @ value
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    projections: list[Projection]
    reader: Projection  # the output projection: its input columns
    edits: list[FactorEdit] = field(default_factory=list)
    scale: float | None = None  # an explicit scale= or an eager one (None: SDPA's default 1/sqrt(head_dim))
    scale_at: tuple | None = None  # an eager scale's constant: (node, ("args", i), "mul" | "div")
    # an eager scale computed from sizes (math.sqrt(q.size(-1))): its factor on the scores at new factor sizes
    scale_of: Callable[[dict[str, int]], float] | None = None
    # parameters with one entry per head (a learnable sink, a gate bias): (path, factors, new heads' value)
    per_head: list[tuple[str, Axis, float]] = field(default_factory=list)

    def summary(self) -> str:
        gqa = (
            f", {self.kv_heads} key/value head{'s' if self.kv_heads > 1 else ''}" if self.kv_heads != self.heads else ""
        )
        return f"{self.heads} heads × {self.head_dim}{gqa}" + (
            f", value size {self.value_dim}" if self.value_dim != self.head_dim else ""
        )


def _linear_params(gm: fx.GraphModule, n: fx.Node) -> tuple[str, str | None, str | None]:
    """(weight path, bias path, module path) of a Linear node."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        return f"{n.target}.weight", f"{n.target}.bias" if m.bias is not None else None, str(n.target)
    w, b = linear_arg(n, 1), linear_arg(n, 2)  # F.linear(x, weight=…, bias=…) passes them by name (timm's BEiT)
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        raise refuse(n, "takes its weight from a computed tensor")
    if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr"):
        raise refuse(
            n,
            f"takes its bias from a computed tensor ('{b.name if isinstance(b, fx.Node) else b}'): "
            "new heads' bias entries have no parameter to go into",
        )
    return str(w.target), str(b.target) if b is not None else None, None


def _back(gm: fx.GraphModule, start: fx.Node, shared: bool = False) -> tuple[set[str], list[fx.Node]]:
    """Nodes on the way back from an attention operand to its projections: (path, Linear nodes reached).
    `shared`: the walk does not enter a part that is the same for every head (an expand of a size-1 axis, or a
    tensor copied into an allocation's slice by broadcasting): multi-head latent attention's rotary key, computed
    once for all heads from another Linear."""
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
            continue
        seen.add(n.name)
        args = data_args(n)
        if shared and kind == "alloc":
            args = [a for a in args if tensor_shape(a) == _slice_shape(n, a)]
        todo.extend(args)
    return seen, found


def _slice_shape(alloc: fx.Node, source: fx.Node) -> tuple | None:
    """The shape of the slice of `alloc` that `source` is copied into."""
    filled = writes(alloc)
    shape = tensor_shape(alloc)
    for w in filled[1] if filled and shape else []:
        if w.source is source:
            dim = filled[0]
            return shape[:dim] + (w.stop - w.start,) + shape[dim + 1 :]
    return None


def _users_ok(n: fx.Node, allowed: set[str]) -> fx.Node | None:
    """The first user of `n` outside `allowed` that is not a size query, else None."""
    for u in n.users:
        if u.name in allowed or (u.op == "call_method" and u.target in SHAPE_QUERIES):
            continue
        if u.op == "call_function" and u.target is getattr and u.args[1] in SHAPE_QUERIES:
            continue
        return u
    return None


def _factors(role: str, h: int, k: int, d: int, e: int) -> Axis:
    head = (("h", k),) + ((("r", h // k),) if h != k else ())
    return {"q": head + (("d", d),), "k": (("h", k), ("d", d)), "v": (("h", k), ("e", e))}[role]


def find_attentions(gm: fx.GraphModule, growing: set[str], at: str | None = None) -> list[Attention]:
    """Every scaled_dot_product_attention of an annotated graph, with the tensors between it and its projections
    followed for the factors in `growing` (h, r, d, e); NotApplicable naming the node where that is not possible."""
    nodes = list(gm.graph.nodes)
    found: list[Core | NotApplicable] = [n for n in nodes if is_sdpa(n)]  # type: ignore[misc]
    found += eager_cores(gm)
    opaque = [
        n for n in nodes if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.MultiheadAttention)
    ]
    if opaque:
        raise refuse(
            opaque[0],
            "is an nn.MultiheadAttention kept whole (a leaf): its heads are not in the graph",
            "capture the model with torch.export (graphgrow does for nn.TransformerEncoder) so its attention "
            "is decomposed",
        )
    hidden = [
        n
        for n in nodes
        if n.op == "call_module"
        and op_kind(gm, n) is None
        and any(isinstance(m, nn.Linear) for m in gm.get_submodule(str(n.target)).modules())
    ]
    if not found and hidden:  # a leaf the capture kept whole: what it computes is not in the graph
        raise refuse(
            hidden[0],
            f"is a module kept whole by the capture ({type(gm.get_submodule(str(hidden[0].target))).__name__}, a "
            "leaf holding Linear layers): any attention inside it is not in the graph, and the graph has none",
            "capture the model so that the module is traced through (torch.export, or without --leaf for it)",
        )
    if not found:
        raise NotApplicable(
            "the model has no scaled_dot_product_attention and no softmax between two matrix products: "
            "no attention heads found",
            "grow_heads grows attentions written with F.scaled_dot_product_attention (Hugging Face's "
            "default sdpa, timm, nn.MultiheadAttention) or eagerly as softmax(q @ kᵀ · scale + mask) @ v",
        )
    out, failed = [], []
    for n in found:
        try:
            if isinstance(n, NotApplicable):
                raise n
            out.append(_attention(gm, sdpa_core(n) if isinstance(n, fx.Node) else n, growing))
        except NotApplicable as e:
            failed.append(e)
    if at is not None:
        out = [
            a
            for a in out
            if any(p.weight.startswith(f"{at}.") or p.node == at for p in a.projections + [a.reader]) or a.node == at
        ]
    if failed and (at is None or not out):
        first = failed[0]
        raise NotApplicable(
            first.message,
            f"{first.hint}; {len(out)} other attention(s) can grow: pick one with at=" if out else first.hint,
        )
    if not out:
        raise NotApplicable(
            f"no attention at '{at}'",
            "give the module path of an attention (its projections'"
            " parent, e.g. model.layers.0.self_attn), or leave at= out to grow every attention",
        )
    return out


def attention_of(gm: fx.GraphModule, s: fx.Node, growing: set[str]) -> Attention:
    """The attention at scaled_dot_product_attention node `s`, followed for the factors in `growing`;
    NotApplicable naming the node where that is not possible."""
    return _attention(gm, sdpa_core(s), growing)


def _attention(gm: fx.GraphModule, core: Core, growing: set[str]) -> Attention:
    """A fused projection of equal sections holds them outermost (s, h, d: GPT-2's c_attn, timm's qkv) or, per head,
    inside each head (h, s, d: GPT-NeoX's and Persimmon's query_key_value, viewed as heads × 3·head size and split):
    the first layout the flow follows is the one."""
    try:
        return _attention_as(gm, core, growing, interleaved=False)
    except NotApplicable as first:
        try:
            return _attention_as(gm, core, growing, interleaved=True)
        except _NotFused:
            raise first from None
        except NotApplicable as second:
            # the sections-outermost layout broke at the sections themselves: the per-head layout's reason is the one
            raise (second if "q/k/v sections" in first.message else first) from None


class _NotFused(Exception):
    """No fused projection of equal sections: the per-head layout has nothing to try."""


def _attention_as(gm: fx.GraphModule, core: Core, growing: set[str], interleaved: bool) -> Attention:
    s, q, k, v, ka = core.node, core.q, core.k, core.v, core.key_axis
    shapes = [tensor_shape(t) for t in (q, k, v)]
    if any(sh is None or len(sh) < 3 for sh in shapes):
        raise refuse(s, f"takes query/key/value of shapes {shapes}, not (…, heads, tokens, head size)")
    h, kv, d, e = shapes[0][-3], shapes[1][-3], shapes[0][-1], shapes[2][-1]
    region: set[str] = set()
    projs: dict[str, tuple[fx.Node, list[str]]] = {}
    roles: dict[str, fx.Node] = {}
    backs: dict[str, set[str]] = {}
    for role, t in zip("qkv", (q, k, v)):
        seen, found = _back(gm, t)
        if len(found) > 1:  # one Linear projects the heads, the others only a part shared by every head?
            seen, found = _back(gm, t, shared=True)
        backs[role] = seen
        if len(found) != 1:
            what = "no Linear" if not found else f"{len(found)} Linear layers ({', '.join(f.name for f in found)})"
            raise refuse(
                t,
                f"is the {dict(q='query', k='key', v='value')[role]} of '{s.name}' and comes from {what} "
                "through ops the analysis follows",
            )
        region |= seen
        projs.setdefault(found[0].name, (found[0], []))[1].append(role)
        roles[role] = found[0]
    if roles["k"] is not roles["q"] and roles["k"] is not roles["v"]:
        kv = tensor_shape(roles["k"])[-1] // d  # the key's own projection says how many key/value heads (k may be
        # repeated); a key projected with the value is taken as the attention reads it, and the flow checks that
    if h % kv:
        raise refuse(s, f"has {h} query heads and {kv} key/value heads, not a multiple")
    flow = Flow(gm, growing, region)
    projections = []
    fused = False
    blocks: set[str] = set()  # fused per-head blocks: which part is which role needs no telling (whole heads grow)
    for name, (p, rs) in projs.items():
        weight, bias, module = _linear_params(gm, p)
        width = tensor_shape(p)[-1]
        sections: tuple = ()
        if len(rs) == 1:
            factors = _factors(rs[0], h, kv, d, e)
        elif h == kv and d == e and width == len(rs) * h * d:
            factors = (("h", h), ("s", len(rs)), ("d", d)) if interleaved else (("s", len(rs)), ("h", h), ("d", d))
            fused = True
        elif (cut := _sections(p, rs, backs, h, d, e)) is not None:
            factors, sections, kv = (), cut[:2], cut[2]  # the key's section says how many key/value heads
        elif "q" not in rs and width % kv == 0 and len(tensor_shape(p)) >= 1:
            # key and value in one block per head, of any sizes (multi-head latent attention's kv_b_proj: each
            # head's non-rotary key, then its value): whole heads grow, their insides do not
            if growing & {"d", "e"}:
                raise refuse(
                    p,
                    f"projects {'/'.join(rs)} in one block per head ({kv} heads × {width // kv}), the head's parts "
                    "split apart after it: only whole heads can grow",
                    "grow heads (heads=… or by=…)",
                )
            factors = (("h", kv), ("", width // kv))
            blocks.add(name)
        else:
            raise refuse(
                p,
                f"projects {'/'.join(rs)} in one output of width {width}, not {len(rs)} equal sections "
                f"of {h} heads × {d}",
            )
        if sections:  # each slice starts the flow with its section's factors
            order, cuts = sections
            flow.layout[name] = plain(tensor_shape(p))  # (what leads to the cuts: they start the flow)
            for role, cut in zip(order, cuts):
                flow.layout[cut.name] = plain(tensor_shape(cut)[:-1]) + (_factors(role, h, kv, d, e),)
            projections.append(
                Projection(
                    name,
                    weight,
                    bias,
                    module,
                    (),
                    tuple(order),
                    tuple(_factors(r, h, kv, d, e) for r in order),
                    tuple(c.name for c in cuts),
                )
            )
        else:
            if size_of(factors) != width:
                raise refuse(p, f"has {width} outputs, not {words(factors)} (the attention's heads and head size)")
            flow.layout[name] = plain(tensor_shape(p)[:-1]) + (factors,)
            projections.append(Projection(name, weight, bias, module, factors, tuple(rs)))
        bad = _users_ok(p, region)
        if bad is not None:
            raise refuse(p, f"projects the attention '{s.name}' and is also read by '{bad.name}'")
    if interleaved and not fused:
        raise _NotFused()
    for n in [m for m in gm.graph.nodes if m.name in region and op_kind(gm, m) == "alloc"]:
        for w in (writes(n) or (0, []))[1]:  # an allocation's slices and the copies into them
            region |= {w.node.name} | {v.name for v in w.views}
    fed = set(projs)  # the way back also met side inputs (cos/sin tables): keep what the projections feed
    grew = True
    while grew:  # (an allocation is filled after it is made: its sources may come later in the graph)
        grew = False
        for n in gm.graph.nodes:
            if n.name in region and n.name not in fed and any(a.name in fed for a in data_args(n)):
                fed.add(n.name)
                grew = True
    region &= fed
    body = _ordered(gm, region)
    flow.region = region
    flow.run(body)
    for n in body:
        bad = _users_ok(n, region | core.inner)
        if bad is not None:
            raise refuse(n, f"is on the way to the attention '{s.name}' and is also read by '{bad.name}'")
    _fix_roles(flow, [p for p in projections if p.node not in blocks], roles, q, k, v, s)
    lq, lk, lv = (flow.of(t) for t in (q, k, v))
    for t, lay, at in ((q, lq, -1), (k, lk, ka), (v, lv, -1)):
        if any(flow.grows(ax) for i, ax in enumerate(lay) if i - len(lay) not in (-3, at)):
            raise refuse(t, "carries heads or head size on an axis other than the attention's heads or head size")

    def heads(ax: Axis) -> tuple:  # the growing factors only: a key may lack the query's r (SDPA's enable_gqa)
        return tuple(f for f in canon(ax, growing) if f[0] in growing)

    if not heads(lq[-3]) == heads(lk[-3]) == heads(lv[-3]) or canon(lq[-1], growing) != canon(lk[ka], growing):
        raise refuse(s, "gets query, key and value whose heads or head sizes the analysis cannot match up")
    for sink in core.sinks:  # a column per head and query row before the softmax: a parameter per head
        if flow.grows(lq[-3]) and not flow.adopt(sink, lq[-3], 0.0):
            raise refuse(
                sink,
                f"is a column concatenated to the scores of '{s.name}' per head that does not come from a parameter "
                "with one entry per head: new heads would have none",
            )
    for mask in core.sides:
        ms = tensor_shape(mask)
        if ms and len(ms) >= 3 and ms[-3] > 1 and flow.grows(lq[-3]) and not _one_for_all_heads(mask):
            raise refuse(
                mask, f"is a mask or bias per head {tuple(ms)} (ALiBi, relative positions): new heads have none"
            )
    reader, edits, gates, per_head = _reader(gm, core, lq[:-1] + (lv[-1],), growing)
    projections += gates
    att = Attention(s.name, h, kv, d, e, projections, reader, flow.edits + edits, core.scale, core.scale_at)
    att.per_head = per_head + flow.params
    if core.scale_from is not None:
        att.scale_of = _computed_scale(flow, core, region | {q.name, k.name, v.name})
        att.scale = att.scale_of({})
    return att


def _one_for_all_heads(mask: fx.Node) -> bool:
    """A mask the same for every head: expanded to the scores' shape (`mask.expand_as(scores)`, XLM's) from one of
    size 1 on the heads axis; it follows the grown scores."""
    x = mask
    while x.op in ("call_function", "call_method") and _op(x) in ("to", "type_as", "contiguous", "float", "bool"):
        if not isinstance(x.args[0], fx.Node):
            return False
        x = x.args[0]
    if _op(x) != "expand_as" or not isinstance(x.args[0], fx.Node):
        return False
    src = tensor_shape(x.args[0])
    return src is not None and (len(src) < 3 or src[-3] == 1)


def _op(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket.__name__
    return t if isinstance(t, str) else getattr(t, "__name__", "")


def _ordered(gm: fx.GraphModule, region: set[str]) -> list[fx.Node]:
    """The region's nodes in graph order, except that an allocation comes after what is copied into it (its layout
    is theirs) and before its slices and copies."""
    nodes = [n for n in gm.graph.nodes if n.name in region]
    out: list[fx.Node] = []
    done: set[str] = set()

    def put(n: fx.Node) -> None:
        if n.name in done:
            return
        done.add(n.name)
        for a in data_args(n) if op_kind(gm, n) == "alloc" else []:
            if a.name in region:
                put(a)
        out.append(n)

    for n in nodes:
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if first is not None and (op_kind(gm, n) == "write" or op_kind(gm, first) == "alloc"):
            put(first)
        put(n)
    return out


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


def _computed_scale(flow: Flow, core: Core, region: set[str]) -> Callable[[dict[str, int]], float]:
    """An eager scale computed from sizes as a function of the new factor sizes: a size read of a tensor whose axis
    holds heads or head size reads the grown size (the scale follows it, as SDPA's default does). A scale computed
    some other way is kept as it is, unless it reads the attention's tensors (then it is refused)."""
    c, div = core.scale_from  # type: ignore[misc]

    def read(new: dict[str, int]):
        def size(t: fx.Node, dim: int) -> int:
            lay = flow.layout.get(t.name)
            if isinstance(lay, tuple):
                return math.prod(new.get(f, s) if f else s for f, s in lay[dim])
            return tensor_shape(t)[dim]

        return size

    try:
        scale_value(c, read({}))
    except (ValueError, TypeError, IndexError, ZeroDivisionError):  # not arithmetic on sizes the analysis reads
        todo, seen = [c], set()
        while todo:
            n = todo.pop()
            if n.name in region:
                raise refuse(
                    c,
                    f"scales the attention scores of '{core.node.name}' by a value computed from its "
                    "tensors in a way the analysis cannot evaluate",
                ) from None
            seen.add(n.name)
            todo += [a for a in n.all_input_nodes if a.name not in seen]
        return lambda new: 1.0
    return lambda new: (1 / scale_value(c, read(new))) if div else scale_value(c, read(new))


def _fix_roles(flow: Flow, projections: list[Projection], roles: dict, q, k, v, s: fx.Node) -> None:
    """A fused projection's sections in order of its output: which one reaches the query, key and value."""
    for p in projections:
        if len(p.roles) == 1 or p.sections:
            continue
        order = {}
        for role, t in zip("qkv", (q, k, v)):
            if roles[role].name == p.node:
                if t.name not in flow.section:
                    raise refuse(
                        t, f"is the {role} of '{s.name}' but the analysis cannot tell which section of '{p.node}' it is"
                    )
                order[flow.section[t.name]] = role
        p.roles = tuple(order[i] for i in range(len(order)))


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


_DONORS = frozenset({"type_as", "view_as", "reshape_as", "expand_as"})


def _donor_read(u: fx.Node, n: fx.Node) -> bool:
    """`u` reads `n` only for its dtype or shape (x.view_as(n): Beam's gate shaped as the attention's output)."""
    return _op(u) in _DONORS and u.args[0] is not n and n not in u.args[:1]


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


def _reader(
    gm: fx.GraphModule, core: Core, lay: Layout, growing: set[str]
) -> tuple[Projection, list[FactorEdit], list[Projection], list[tuple[str, Axis, float]]]:
    """The output projection reading the attention's output, the tensors between them followed; the Linear layers
    of output gates on the way (their rows follow the heads: new heads' gate rows are random, the output
    projection's new columns zero); and the parameters with one entry per head that a factor on the output
    computed from the attention's own scores reads (a learnable sink: new heads' entries zero)."""
    s = core.node
    flow = Flow(gm, growing, set())
    flow.layout[s.name] = lay
    todo, region, readers = [s], {s.name}, []
    while todo:
        n = todo.pop()
        for u in n.users:
            kind = op_kind(gm, u)
            if kind == "linear" and linear_arg(u, 0) is n:
                readers.append(u)
            elif (
                (u.op == "call_method" and u.target in SHAPE_QUERIES)
                or (u.op == "call_function" and u.target is getattr)
                or _donor_read(u, n)
            ):
                continue
            elif kind is None or kind == "linear":
                raise refuse(u, f"reads the output of attention '{s.name}' before any output projection")
            elif u.name not in region:
                region.add(u.name)
                todo.append(u)
    if len(readers) != 1:
        raise refuse(s, f"has {len(readers)} output projections; the analysis needs one")
    gates: list[Projection] = []
    per_head: list[tuple[str, Axis, float]] = []
    width = size_of(lay[-3] + lay[-1])
    for n in [m for m in gm.graph.nodes if m.name in region and op_kind(gm, m) == "elementwise"]:
        for a in data_args(n):
            found = _gate(gm, n, a, region) if a.name not in region else None
            rows = tensor_shape(found[0])[-1] if found is not None else None
            if found is not None and rows in (width, size_of(lay[-3])):
                # the gate's rows: the heads and value size, flattened as the reader's input, or one per head (a
                # scalar gate per head: Dots's); the flow checks that they meet the output so
                g, path = found
                factors = lay[-3] + lay[-1] if rows == width else lay[-3]
                flow.layout[g.name] = plain(tensor_shape(g)[:-1]) + (factors,)
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
                    one = len(ps) == 1 and ps[0] == size_of(lay[-3]) and ps[0] > 1
                    flow.layout[p.name] = (lay[-3],) if one else plain(ps)
                    if one and flow.grows(lay[-3]):
                        per_head.append((str(p.target), lay[-3], 0.0))
                region |= path
    flow.region = region
    flow.run([n for n in gm.graph.nodes if n.name in region and n is not s])
    r = readers[0]
    x = flow.of(r.args[0])
    if any(flow.grows(ax) for ax in x[:-1]):
        raise refuse(r, "reads heads or head size on an axis other than its input features")
    weight, bias, module = _linear_params(gm, r)
    return Projection(r.name, weight, bias, module, x[-1], ("o",)), flow.edits, gates, per_head + flow.params
