"""Growing attention heads exactly: the rewrite behind grow_heads (analysis.heads finds what to change).

New sizes per factor (analysis.head_layout): h (key/value heads), r (query heads per key/value head: kept), d
(query/key head size), e (value head size). Every old row or column keeps its values at its new place (the same
head, the same coordinate, in the new strides); what is new is initialised so that the function does not move:
- a new head: random query, key and value rows, and *zero* output-projection columns (the zero last factor: its
  gradient is the new heads' attention output, non-zero at once; the softmax is per head, so old heads do not move);
- a larger query/key head size d → d': new key rows random, new query rows *zero* (every logit keeps its value and
  the new query rows get a gradient at once, through the random key rows). The scale 1/sqrt(d) becomes 1/sqrt(d')
  (SDPA's default from the query's last size, an explicit scale=1/sqrt(d), or an eager attention's × 1/sqrt(d) or
  / sqrt(d) constant); the old query rows are multiplied by
  sqrt(d'/d) so that every logit stays. A custom explicit scale is kept as it is;
- a larger value head size e → e': new value rows random, new output-projection columns zero.
Biases: new entries zero; old query biases scaled with their rows. A mask or bias per head that no parameter holds
(ALiBi's slopes, a bias summed from tables): new heads read copies of old heads' entries (head i mod H's), a cat of
slices of the tensor where the analysis found the heads on one axis (analysis.head_params).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx, nn

from ..analysis.head_layout import SDPA, Axis, FactorEdit
from ..analysis.heads import Attention, Projection
from ..core.errors import NotApplicable
from ..graph.fx_edit import finish
from .tensor_paths import owners as _owners
from .tensor_paths import put_tensor as _set
from .tensor_paths import tensor_at as _tensor

HINT = "grow_heads grows attentions it fully understands; see docs/passes.md, Heads and head size"
_Transposed = nn.modules.conv._ConvTransposeNd


def places(factors: Axis, new: dict[str, int]) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(new index of every old index, the new size, the components of every index of the new axis by factor)."""
    old_sizes = [s for _, s in factors]
    new_sizes = [new.get(f, s) if f else s for f, s in factors]
    strides = [math.prod(new_sizes[i + 1 :]) for i in range(len(new_sizes))]
    comps = torch.stack(torch.meshgrid(*[torch.arange(s) for s in old_sizes], indexing="ij")).reshape(
        len(old_sizes), -1
    )
    old_to_new = (comps * torch.tensor(strides).unsqueeze(1)).sum(0)
    all_comps = torch.stack(torch.meshgrid(*[torch.arange(s) for s in new_sizes], indexing="ij")).reshape(
        len(new_sizes), -1
    )
    return old_to_new, math.prod(new_sizes), all_comps


def _rows(
    p: Projection,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    new: dict[str, int],
    q_scale: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight and bias with rows at their new places and new rows initialised by role."""
    old_to_new, total, comps = places(p.factors, new)
    names = [f for f, _ in p.factors]
    olds = torch.tensor([s for _, s in p.factors]).unsqueeze(1)
    is_new = (comps >= olds).any(0)
    new_head = (comps >= olds)[[i for i, f in enumerate(names) if f in ("h", "r")]].any(0)
    section = comps[names.index("s")] if "s" in names else torch.zeros(total, dtype=torch.long)
    role = [p.roles[int(i)] for i in section]
    scale = torch.tensor([q_scale if r == "q" else 1.0 for r in role], dtype=weight.dtype, device=weight.device)
    w = weight.detach()  # (rows, inputs) of a Linear, (rows, inputs, kernel…) of a convolution
    out = torch.zeros(total, *w.shape[1:], dtype=w.dtype, device=w.device)
    out[old_to_new] = w * scale[old_to_new].view(-1, *[1] * (w.dim() - 1))
    std = w.std() if w.numel() > 1 else torch.ones((), dtype=w.dtype, device=w.device)
    std = torch.where(std > 0, std, torch.full_like(std, 1 / math.sqrt(w[0].numel())))
    random = (
        (is_new & torch.tensor([r != "q" for r in role]) | is_new & new_head).nonzero().squeeze(1)
    )  # new q rows of old heads stay 0
    sample = torch.randn(len(random), *w.shape[1:], generator=generator, dtype=torch.float32).to(w) * std
    out[random.to(w.device)] = sample
    b = None
    if bias is not None:
        b = torch.zeros(total, dtype=bias.dtype, device=bias.device)
        b[old_to_new] = bias.detach() * scale[old_to_new]
    return out, b


def _section_rows(
    p: Projection,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    new: dict[str, int],
    q_scale: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fused projection of unequal sections (analysis.heads: Phi-3's qkv_proj): each section's rows grown as its
    own projection's would be, the sections kept in their order."""
    ws, bs, at = [], [], 0
    for role, factors in zip(p.roles, p.sections):
        size = math.prod(s for _, s in factors)
        part = Projection(p.node, p.weight, p.bias, p.module, factors, (role,))
        w, b = _rows(
            part, weight[at : at + size], None if bias is None else bias[at : at + size], new, q_scale, generator
        )
        ws.append(w)
        bs.append(b)
        at += size
    return torch.cat(ws), None if bias is None else torch.cat(bs)  # type: ignore[arg-type]


def _move_slices(nodes: dict[str, fx.Node], p: Projection, new: dict[str, int]) -> None:
    """The slices that cut a sectioned projection follow its grown sections (x[..., a:b] with the new a and b; an
    open end stays open)."""
    at = 0
    for name, factors in zip(p.slices, p.sections):
        size = math.prod(new.get(f, s) if f else s for f, s in factors)
        n = nodes[name]
        if isinstance(n.args[1], int):  # a piece of split(sizes, -1) (GPT-BigCode's c_attn): its size in the list
            split, i = n.args[0], n.args[1]
            sizes = list(split.args[1])  # type: ignore[union-attr]
            sizes[i] = size
            split.args = (split.args[0], sizes, *split.args[2:])  # type: ignore[union-attr]
            continue
        index = list(n.args[1])
        last = index[-1]
        index[-1] = slice(at if last.start is not None else None, at + size if last.stop is not None else None)
        if last.stop is not None and last.stop > 1 << 40:  # export writes an open end as the largest int64
            index[-1] = slice(index[-1].start, last.stop)
        n.args = (n.args[0], tuple(index))
        at += size


def _columns(p: Projection, weight: torch.Tensor, new: dict[str, int]) -> torch.Tensor:
    old_to_new, total, _ = places(p.factors, new)
    w = weight.detach()
    out = torch.zeros(w.shape[0], total, *w.shape[2:], dtype=w.dtype, device=w.device)
    out[:, old_to_new] = w
    return out


def _put(gm: fx.GraphModule, path: str, value: torch.Tensor, owners: dict[int, list[str]]) -> None:
    old = _tensor(gm, path)
    tied = [q for q in owners.get(id(old), [path]) if q != path]
    if tied:
        raise NotApplicable(
            f"'{path}' is shared with '{tied[0]}' (tied weights): growing one would grow the other", HINT
        )
    _set(
        gm,
        path,
        nn.Parameter(value.contiguous(), requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value,
        old,
    )


def _set_at(node: fx.Node, where: tuple, value) -> None:
    """node.args[i] = value, or node.args[i][j] = value (keeping the list or tuple)."""
    args = list(node.args)
    if len(where) == 2:
        args[where[1]] = value
    else:
        inner = list(args[where[1]])
        inner[where[2]] = value
        args[where[1]] = type(args[where[1]])(inner)
    node.args = tuple(args)


def _get_at(node: fx.Node, where: tuple):
    v = node.args[where[1]]
    return v if len(where) == 2 else v[where[2]]


def _apply_edit(gm: fx.GraphModule, nodes: dict[str, fx.Node], e: FactorEdit, new: dict[str, int]) -> None:
    before = math.prod(s for f, s in e.factors if f in new)
    after = math.prod(new[f] for f, _ in e.factors if f in new)
    value = e.old // before * after
    n = nodes[e.node]
    if e.infer:
        return _set_at(n, e.where, -1)
    if e.via is None:
        return _set_at(n, e.where, value)
    mul = _get_at(n, e.where)  # mul(size, c), maybe shared by other attentions: a copy for this one
    args = list(mul.args)
    args[e.via] = value
    with gm.graph.inserting_before(n):
        copy = gm.graph.call_function(operator.mul, tuple(args))
    _set_at(n, e.where, copy)


def _resize(gm: fx.GraphModule, path: str | None) -> None:
    if path is not None:
        m: Any = gm.get_submodule(path)
        if isinstance(m, _Transposed):  # a transposed convolution reading the heads: (in, out / groups, …)
            m.in_channels, m.out_channels = m.weight.shape[0], m.weight.shape[1] * m.groups
        elif isinstance(m, nn.modules.conv._ConvNd):  # a convolution projecting q/k/v or reading the heads
            m.out_channels, m.in_channels = m.weight.shape[:2]
        else:
            m.out_features, m.in_features = m.weight.shape


def grow_attention(
    gm: fx.GraphModule,
    att: Attention,
    new: dict[str, int],
    generator: torch.Generator,
    weights: bool = True,
    shared: set[str] | None = None,
) -> str:
    """Grow one attention of `gm` in place to the factor sizes `new`; returns what its scale does. `weights=False`:
    its layers were grown already (a layer shared by several attentions: ALBERT's one layer called at every depth),
    only its own graph (reshape constants, scale) changes. `shared`: paths of per-head parameters grown already
    (by another attention that reads them too); this one's are added."""
    shared = set() if shared is None else shared
    nodes = {n.name: n for n in gm.graph.nodes}
    owners = _owners(gm)
    q_scale, how = _scale(nodes[att.node], att, new)
    if not weights:
        for e in att.edits:
            _apply_edit(gm, nodes, e, new)
        return how
    for p in att.projections:
        grow = _section_rows if p.sections else _rows
        w, b = grow(p, _tensor(gm, p.weight), _tensor(gm, p.bias) if p.bias else None, new, q_scale, generator)
        if p.sections:
            _move_slices(nodes, p, new)
        _put(gm, p.weight, w, owners)
        if p.bias is not None:
            _put(gm, p.bias, b, owners)
        _resize(gm, p.module)
    for path, dim, factors, fill in att.per_head:  # entries per head (a sink, a bias table): new heads read theirs
        if path in shared:  # one table read by several attentions (CPM-Ant's position bias): grown once
            continue
        shared.add(path)
        if fill is None:  # a computed tensor per head (ALiBi, a summed bias table): new heads read old heads' copies
            _copy_heads(gm, nodes[path], dim, factors, new)
            continue
        old = _tensor(gm, path)
        old_to_new, total, _ = places(factors, new)
        grown = torch.full((*old.shape[:dim], total, *old.shape[dim + 1 :]), fill, dtype=old.dtype, device=old.device)
        grown.index_copy_(dim, old_to_new.to(old.device), old.detach())
        _put(gm, path, grown, owners)
        owner = gm.get_submodule(path.rpartition(".")[0])
        if isinstance(owner, nn.Embedding):  # a table per head looked up by position (T5's): its width is the heads
            owner.embedding_dim = grown.shape[1]
        if isinstance(owner, nn.modules.batchnorm._BatchNorm):  # a BatchNorm after a conv projection: per channel
            owner.num_features = grown.shape[0]
        if isinstance(owner, nn.Linear):  # a Linear with one output per head (Swin V2's position-bias MLP)
            owner.out_features = grown.shape[0]
    w = _tensor(gm, att.reader.weight)  # a transposed convolution's input channels are its weight's first axis
    flip = att.reader.module is not None and isinstance(gm.get_submodule(att.reader.module), _Transposed)
    _put(
        gm,
        att.reader.weight,
        _columns(att.reader, w.transpose(0, 1), new).transpose(0, 1) if flip else _columns(att.reader, w, new),
        owners,
    )
    _resize(gm, att.reader.module)
    for e in att.edits:
        _apply_edit(gm, nodes, e, new)
    return how


def _copy_heads(gm: fx.GraphModule, src: fx.Node, dim: int, factors: Axis, new: dict[str, int]) -> None:
    """Every reader of `src` reads it grown along `dim` (the heads `factors`): each new head a copy of an old one (its
    index modulo the old count, factor by factor), old heads where they are: a cat of slices of `src`."""
    _, total, comps = places(factors, new)
    olds = torch.tensor([s for _, s in factors]).unsqueeze(1)
    strides = torch.tensor([math.prod(s for _, s in factors[i + 1 :]) for i in range(len(factors))]).unsqueeze(1)
    index = ((comps % olds) * strides).sum(0).tolist()
    runs: list[list[int]] = []  # [start, stop) runs of consecutive old indices
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    readers = list(src.users)
    with gm.graph.inserting_before(readers[0] if len(readers) == 1 else _first(gm, readers)):
        head = (slice(None),) * dim
        parts = [gm.graph.call_function(operator.getitem, (src, (*head, slice(a, b)))) for a, b in runs]
        grown = gm.graph.call_function(torch.cat, (parts, dim))
    for u in readers:
        u.replace_input_with(src, grown)


def _first(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return min(nodes, key=order.__getitem__)


def _scale(s: fx.Node, att: Attention, new: dict[str, int]) -> tuple[float, str]:
    """(the factor for old query rows, what happened to the scale) when the query/key head size grows."""
    d, d2 = att.head_dim, new.get("d", att.head_dim)
    if att.scale_of is not None:  # computed from sizes: old query rows make up for what it does at the new sizes
        f0, f1 = att.scale_of({}), att.scale_of(new)
        if math.isclose(f0, f1, rel_tol=1e-9):
            return 1.0, "unchanged"
        if math.isclose(f0, 1 / math.sqrt(d), rel_tol=1e-6) and math.isclose(f1, 1 / math.sqrt(d2), rel_tol=1e-6):
            return math.sqrt(d2 / d), f"1/sqrt({d}) → 1/sqrt({d2}); old query rows × sqrt({d2}/{d})"
        return f0 / f1, f"computed {f0:.6g} → {f1:.6g}; old query rows × {f0 / f1:.6g}"
    if d2 == d:
        return 1.0, "unchanged"
    if att.scale is None:
        return math.sqrt(d2 / d), f"default 1/sqrt({d2}); old query rows × sqrt({d2}/{d})"
    if abs(att.scale - 1 / math.sqrt(d)) > 1e-6 * att.scale or (att.scale_at is None and s.target is not SDPA):
        return 1.0, f"explicit scale {att.scale:.6g} kept"
    if att.scale_at is not None:  # an eager attention's constant: × 1/sqrt(d) or / sqrt(d) (maybe a torch.full)
        name, where, how = att.scale_at
        node = next(n for n in s.graph.nodes if n.name == name)
        _set_at(node, where, 1 / math.sqrt(d2) if how == "mul" else math.sqrt(d2))
    elif "scale" in s.kwargs:
        s.kwargs = {**s.kwargs, "scale": 1 / math.sqrt(d2)}
    else:
        _set_at(s, ("args", 6), 1 / math.sqrt(d2))
    return math.sqrt(d2 / d), f"1/sqrt({d}) → 1/sqrt({d2}); old query rows × sqrt({d2}/{d})"


def grow_attentions(
    gm: fx.GraphModule, plans: list[tuple[Attention, dict[str, int]]], generator: torch.Generator
) -> list[str]:
    """Grow every planned attention of `gm` in place; the graph is linted and recompiled. Layers shared by several
    attentions (one module called at several depths) are grown once, when every attention that shares them grows
    them alike."""
    grown: dict[str, tuple] = {}  # weight path → (its factors, the new sizes) it was grown with
    tables: set[str] = set()  # per-head parameters grown so far
    hows = []
    for att, new in plans:
        layers = [*att.projections, att.reader]
        done = [p for p in layers if p.weight in grown]
        if done and (len(done) < len(layers) or any(grown[p.weight] != (p.factors, p.sections, new) for p in done)):
            raise NotApplicable(
                f"attention '{att.node}' shares '{done[0].weight}' with another attention but not all of its "
                "layers, or grows it to other sizes",
                HINT,
            )
        hows.append(grow_attention(gm, att, new, generator, weights=not done, shared=tables))
        grown.update((p.weight, (p.factors, p.sections, new)) for p in layers)
    finish(gm)
    return hows
