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

from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph.fx_edit import tensor_shape
from .eager_attention import Core, eager_cores, is_sdpa, scale_value, sdpa_core
from .head_flow import Flow
from .head_layout import (
    SHAPE_QUERIES,
    Axis,
    FactorEdit,
    canon,
    channel_axis,
    channels_laid,
    data_args,
    op_kind,
    plain,
    refuse,
    size_of,
    words,
    writes,
)
from .head_output import _reader, gate_tail
from .head_params import one_for_all_heads
from .head_projections import (
    Projection,
    _back,
    _linear_params,
    _sections,
    beside,
    head_axes,
    section_biases,
    unprojected,
)
from .head_sizes import regroup_edits


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
    # parameters with entries per head (a learnable sink, a gate bias, a position table): (path, the axis holding the
    # heads, its factors, new heads' value); value None: a computed tensor (node name) whose old heads new ones copy
    per_head: list[tuple[str, int, Axis, float | None]] = field(default_factory=list)
    one_kv: bool = False  # one key/value head for all query heads that cannot grow: query heads grow alone (r)

    def summary(self) -> str:
        gqa = (
            f", {self.kv_heads} key/value head{'s' if self.kv_heads > 1 else ''}" if self.kv_heads != self.heads else ""
        )
        return f"{self.heads} heads × {self.head_dim}{gqa}" + (
            f", value size {self.value_dim}" if self.value_dim != self.head_dim else ""
        )


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
    out, failed, bare = [], [], []
    for n in found:
        try:
            if isinstance(n, NotApplicable):
                raise n
            core = sdpa_core(n) if isinstance(n, fx.Node) else n
            if not _back(gm, core.q)[1]:  # a query no projection makes (a learned query over the states: depth
                bare.append((core.q, core.node))  # attention; or one behind an op the way back does not follow):
                continue  # the attention is left as it is; if none grows, the refusal says which it is
            out.append(_attention(gm, core, growing))
        except NotApplicable as e:
            failed.append(e)
    if bare and not out and not failed:
        raise unprojected(gm, bare, "query")
    if at is not None:
        every = out
        out = [
            a
            for a in out
            if any(p.weight.startswith(f"{at}.") or p.node == at for p in a.projections + [a.reader]) or a.node == at
        ]
        left = {t[0]: a for a in every if a not in out for t in a.per_head}
        for t in (t for a in out for t in a.per_head if t[0] in left):
            raise NotApplicable(
                f"'{t[0]}' holds an entry per head for the attention at '{at}' and for '{left[t[0]].node}' too: "
                "growing the heads of one would give the other a table of the wrong size",
                "leave at= out to grow every attention that reads it",
            )
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
    """The attention at the first heads axis whose reading the flow follows (head_axes)."""
    errors = []
    for hx in head_axes(gm, core):
        try:
            return _attention_at(gm, core, growing, hx)
        except NotApplicable as e:
            errors.append(e)
    raise errors[0]  # (the likeliest axis's reason)


def _attention_at(gm: fx.GraphModule, core: Core, growing: set[str], hx: int) -> Attention:
    """The attention, query heads on axis `hx`, key/value heads growing with them (the grouped-query ratio kept); where
    that cannot be followed and the key and value are one head for all query heads (multi-query attention: a size-1
    heads axis broadcast over the query heads, GPT-BigCode's), the query heads grow alone, sharing it."""
    try:
        return _attention_layouts(gm, core, growing, hx)
    except NotApplicable as first:
        if "h" not in growing:
            raise
        try:
            att = _attention_layouts(gm, core, (growing - {"h"}) | {"r"}, hx)
        except NotApplicable:
            raise first from None
        if att.kv_heads != 1 or att.heads == 1:  # one head in all: no query heads to grow alone either
            raise first from None
        att.one_kv = True
        return att


def _attention_layouts(gm: fx.GraphModule, core: Core, growing: set[str], hx: int = -3) -> Attention:
    """A fused projection of equal sections holds them outermost (s, h, d: GPT-2's c_attn, timm's qkv) or, per head,
    inside each head (h, s, d: GPT-NeoX's and Persimmon's query_key_value, viewed as heads × 3·head size and split):
    the first layout the flow follows is the one."""
    try:
        return _attention_as(gm, core, growing, False, hx)
    except NotApplicable as first:
        try:
            return _attention_as(gm, core, growing, True, hx)
        except _NotFused:
            raise first from None
        except NotApplicable as second:
            # the sections-outermost layout broke at the sections themselves: the per-head layout's reason is the one
            raise (second if "q/k/v sections" in first.message else first) from None


class _NotFused(Exception):
    """No fused projection of equal sections: the per-head layout has nothing to try."""


def _attention_as(gm: fx.GraphModule, core: Core, growing: set[str], interleaved: bool, hx: int = -3) -> Attention:
    s, q, k, v, ka = core.node, core.q, core.k, core.v, core.key_axis
    shapes = [tensor_shape(t) for t in (q, k, v)]
    if any(sh is None or len(sh) < 3 for sh in shapes):
        raise refuse(s, f"takes query/key/value of shapes {shapes}, not (…, heads, tokens, head size)")
    h, kv, d, e = shapes[0][hx], shapes[1][hx], shapes[0][-1], shapes[2][-1]
    if core.heads is not None:  # heads merged with the batch (batch · heads, tokens, d): the softmax's heads axis
        h = kv = core.heads
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
            if not found:  # the op that stops the way back to a projection, or none (a learned query or key)
                raise unprojected(gm, [(t, s)], dict(q="query", k="key", v="value")[role])
            raise refuse(
                t,
                f"is the {dict(q='query', k='key', v='value')[role]} of '{s.name}' and comes from {len(found)} "
                f"projections ({', '.join(f.name for f in found)}) through ops the analysis follows",
            )
        region |= seen
        projs.setdefault(found[0].name, (found[0], []))[1].append(role)
        roles[role] = found[0]
    if roles["k"] is not roles["q"] and roles["k"] is not roles["v"]:
        w = tensor_shape(roles["k"])[channel_axis(gm, roles["k"])]  # the key's projection: how many key/value heads
        kv = w // d if w % d == 0 and w >= d and h % (w // d) == 0 else kv  # (k may be repeated: grouped-query; not
        # where a head's width is not the head size: channel attention); a key projected with the value is taken as
        # the attention reads it (the flow checks)
    if h % kv:
        raise refuse(s, f"has {h} query heads and {kv} key/value heads, not a multiple")
    flow = Flow(gm, growing, region)
    projections = []
    fused = False
    blocks: set[str] = set()  # fused per-head blocks: which part is which role needs no telling (whole heads grow)
    for name, (p, rs) in projs.items():
        weight, bias, module = _linear_params(gm, p, pieces=True)
        width = tensor_shape(p)[ax := channel_axis(gm, p)]  # a Linear's last axis, a convolution's channels
        sections: tuple = ()
        if len(rs) == 1:
            factors = _factors(rs[0], h, kv, d, e)
            if width != size_of(factors) and width % size_of(factors[:-1]) == 0 and width > size_of(factors):
                factors = beside(p, rs[0], factors, width, growing)  # a part per head beside (an output gate)
                blocks.add(name)
            elif width != size_of(factors) and width % size_of(factors[:-1]) == 0 and not growing & {"d", "e"}:
                factors = factors[:-1] + (("", width // size_of(factors[:-1])),)  # channel attention: see below
        elif h == kv and d == e and width == len(rs) * h * d:
            factors = (("h", h), ("s", len(rs)), ("d", d)) if interleaved else (("s", len(rs)), ("h", h), ("d", d))
            fused = True
        elif ax == -1 and (cut := _sections(p, rs, backs, h, d, e)) is not None:
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
        elif h == kv and not growing & {"d", "e"} and width % (len(rs) * h) == 0:
            # each head's part of another width than the attention's head size: channel attention (XCiT's, EdgeNeXt's,
            # DaViT's: a head's channels are what it attends over, its scores q · kᵀ summed over the positions). Whole
            # heads grow; the flow checks where that part goes
            x = ("", width // (len(rs) * h))
            factors = (("h", h), ("s", len(rs)), x) if interleaved else (("s", len(rs)), ("h", h), x)
            fused = True
        else:  # (rank 5 and more: the heads read on axis hx, head_axes says which are tried)
            raise refuse(
                p,
                f"projects {'/'.join(rs)} in one output of width {width}, not {len(rs)} equal sections "
                f"of {h} heads × {d}"
                + f" (the attention's operands {shapes[0]} read with their heads on axis {hx})"
                * (len(shapes[0]) > 4),
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
            flow.layout[name] = channels_laid(gm, p, factors)
            projections.append(Projection(name, weight, bias, module, factors, tuple(rs)))
        flow.params += section_biases(p, factors, growing)  # a bias made of q/k/v parameters (timm's BEiT)
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
    tail = gate_tail(gm, flow, body, region, core)  # a part beside the query that goes to the output (a gate)
    region |= set(tail)
    for n in body:
        bad = _users_ok(n, region | core.inner)
        if bad is not None:
            raise refuse(n, f"is on the way to the attention '{s.name}' and is also read by '{bad.name}'")
    _fix_roles(flow, [p for p in projections if p.node not in blocks], roles, q, k, v, s)
    lq, lk, lv = (flow.of(t) for t in (q, k, v))
    for t, lay, at in ((q, lq, -1), (k, lk, ka), (v, lv, -1)):
        if any(flow.grows(ax) for i, ax in enumerate(lay) if i - len(lay) not in (hx, at)) or any(
            f in ("h", "r") and f in growing for f, _ in lay[at]
        ):  # heads on the head-size axis (one head's factor beside its size): a new head would widen the head
            raise refuse(t, "carries heads or head size on an axis other than the attention's heads or head size")

    def heads(ax: Axis) -> tuple:  # the growing factors only: a key may lack the query's r (SDPA's enable_gqa)
        return tuple(f for f in canon(ax, growing) if f[0] in growing)

    # key and value hold the query's heads, or only the key/value heads with the query heads broadcast over them
    # (SDPA's enable_gqa, or a size-1 axis): only then may they lack the query's r
    grown = heads(lq[hx])
    kv_only = tuple(f for f in grown if f[0] != "r")
    if any(
        heads(lay[hx]) != grown and (heads(lay[hx]) != kv_only or size_of(lay[hx]) not in (1, size_of(kv_only)))
        for lay in (lk, lv)
    ) or canon(lq[-1], growing) != canon(lk[ka], growing):
        raise refuse(s, "gets query, key and value whose heads or head sizes the analysis cannot match up")
    for sink in core.sinks:  # a column per head and query row before the softmax: a parameter per head
        if flow.grows(lq[hx]) and not flow.adopt(sink, lq[hx], 0.0, hx):
            raise refuse(
                sink,
                f"is a column concatenated to the scores of '{s.name}' per head that does not come from a parameter "
                "with one entry per head: new heads would have none",
            )
    for mask in core.sides:
        ms = tensor_shape(mask)
        if (
            ms
            and len(ms) >= -hx
            and ms[hx] > 1
            and flow.grows(lq[hx])
            and not one_for_all_heads(mask)
            and not flow.adopt(mask, lq[hx], 0.0, hx)  # a bias per head read from a table: new heads' entries 0
        ):
            raise refuse(
                mask, f"is a mask or bias per head {tuple(ms)} (ALiBi, relative positions): new heads have none"
            )
    out = lq[:-1] + (lv[-1],)
    shape = tensor_shape(s)
    if core.regroups and shape is not None and len(shape) != len(out):  # merged q · k, the weights split again @ v
        out = plain(shape[:-3]) + (tuple(f for f in lq[-3] if f[0]),) + plain(shape[-2:-1]) + (lv[-1],)
    reader, edits, gates, per_head = _reader(gm, core, out, growing, tail, hx)
    projections += gates
    edits += [e for n in core.regroups for e in regroup_edits(gm, n, lq[hx], growing)]
    att = Attention(s.name, h, kv, d, e, projections, reader, flow.edits + edits, core.scale, core.scale_at)
    att.per_head = per_head + flow.params
    if core.scale_from is not None:
        att.scale_of = _computed_scale(flow, core, region | {q.name, k.name, v.name})
        att.scale = att.scale_of({})
    return att


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
