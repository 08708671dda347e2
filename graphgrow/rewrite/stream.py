"""Growing a transformer's residual stream (its hidden size) d → d + k, exactly: the rewrite behind grow_hidden.

Pre-norm streams (analysis.stream finds one fill per tensor; any k):
- writers (Linear/conv rows and biases, Embedding columns, position embeddings, class tokens) give their new
  coordinates the *mean* of their old ones where a LayerNorm reads the stream, *zero* where an RMSNorm does. By
  linearity every stream tensor then has new coordinates equal to the mean (or 0) of its old ones.
- a LayerNorm's mean is then unchanged and its variance is σ²·d/(d+k); an RMSNorm's mean square is ms·d/(d+k).
  With eps' = eps·d/(d+k) the normaliser is sqrt(d/(d+k))·sqrt(σ² + eps), so old outputs are exact with
  γ'_old = γ·sqrt(d/(d+k)). New outputs are γ'_new·0 + β'_new = 0 with β'_new = 0; γ'_new = the mean |γ'_old|.
- readers (Linear input columns) of a norm's output (new inputs 0) get random new columns: exact, and they start
  learning once β'_new moves (β'_new gets a gradient at once). Readers of a stream whose new coordinates are the
  mean get zero columns (their gradient is the mean, non-zero).
Post-norm streams (a LayerNorm's output added to a sublayer's output): only replicating every coordinate the same
number of times is exact (an integer factor): writers' rows are copied, norms' γ and β copied (mean, variance and
mean square do not move; eps unchanged), readers' columns split among the replicas in random shares (net2net).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx, nn

from ..analysis.stream import Stream
from ..analysis.stream_ops import base_name
from ..core.errors import NotApplicable
from ..graph.fx_edit import finish
from .size_reads import hold_size_reads
from .stream_ties import shares_on_norms
from .tensor_paths import owners as _owners
from .tensor_paths import put_tensor as _set
from .tensor_paths import tensor_at as _tensor
from .widen import Insertion, Layout, columns, make_layout, rows

HINT = "grow_hidden grows a stream it fully understands; grow the layers around it with grow_width"


def plan_layout(stream: Stream, new: int, generator: torch.Generator, replicate: bool = False) -> tuple[Layout, str]:
    """The layout of the new coordinates (appended at the end) and the rule: 'mean/zero' or 'replicate'.
    `replicate`: replicate a pre-norm stream too where the new size is a multiple of the old (grow_stream)."""
    d = stream.width
    if new <= d:
        raise NotApplicable(f"the hidden size is {d}; {new} does not grow it", f"give to= larger than {d} (or by= > 0)")
    k = new - d
    if stream.conflict is None and not (replicate and new % d == 0):
        return make_layout(d, [Insertion(d, k, [None] * k)]), "mean/zero"
    if new % d:
        raise NotApplicable(
            f"cannot grow the hidden size {d} → {new} exactly: {stream.conflict}",
            f"such a stream stays exact only when every coordinate is replicated equally: to={2 * d}, {3 * d}, …",
        )
    perm = torch.randperm(d, generator=generator).tolist()
    return make_layout(d, [Insertion(d, k, [perm[j % d] for j in range(k)])]), "replicate"


def grow_along(t: torch.Tensor, dim: int, layout: Layout, how: str, generator: torch.Generator) -> torch.Tensor:
    """`t` with its dimension `dim` grown by the layout: new entries are the 'mean' of the old ones, 'zero',
    'copy' (of the replicated coordinate), 'shares' (net2net split of input columns) or 'random'."""
    t = t.detach()
    if t.dim() == 1 and how in ("shares", "random"):  # a vector read as a weight (a learned query): one row
        return grow_along(t[None], 1, layout, how, generator)[0]
    if how in ("mean", "zero", "copy"):
        moved = t.movedim(dim, 0)
        return rows(
            moved, layout, "net2net" if how == "copy" else "zero", generator, how if how != "copy" else "zero"
        ).movedim(0, dim)
    moved = t.movedim(dim, 1)
    if how == "shares":
        return columns(moved, layout, "net2net", generator).movedim(1, dim)
    grown = columns(moved, layout, "zero", generator)
    if how == "random":
        std = moved.std() if moved.numel() > 1 else torch.ones((), device=t.device, dtype=t.dtype)
        std = torch.where(std > 0, std, torch.full_like(std, 1 / math.sqrt(layout.new)))
        shape = list(grown.shape)
        shape[1] = len(layout.new_slots)
        sample = torch.randn(shape, generator=generator, dtype=torch.float32).to(grown) * std
        grown[:, layout.new_slots] = sample
    return grown.movedim(1, dim)


def plan_tensors(stream: Stream, rule: str) -> dict[str, list[tuple[int, str, str]]]:
    """Parameter path → [(dim, how, role)] for every writer and reader of the stream."""
    plans: dict[str, list[tuple[int, str, str]]] = {}
    for w in stream.writers:
        how = "copy" if rule == "replicate" else stream.fill[w.out]
        how = "mean" if w.what == "scale" and how == "zero" else how  # a per-channel factor on zeros: any value
        for path, dim in w.params:
            plans.setdefault(path, []).append((dim, how, f"written by '{w.node}'"))
    for r in stream.readers:
        if r.blocks > 1:  # grown block by block (_grow_blocks)
            continue
        how = "shares" if rule == "replicate" else {"mean": "zero", "zero": "random"}[stream.fill[r.input]]
        for path, dim in r.params:
            plans.setdefault(path, []).append((dim, how, f"read by '{r.node}'"))
    return plans


def _merge(path: str, steps: list[tuple[int, str, str]]) -> list[tuple[int, str]]:
    """One rule per dimension; a tensor tied between a writer and a reader must agree on its new entries (a
    reader of new coordinates that are 0 accepts anything: it multiplies zero)."""
    out: dict[int, tuple[str, str]] = {}
    for dim, how, role in steps:
        if dim not in out or out[dim][0] == how or (out[dim][0] == "random" and how in ("mean", "zero")):
            out[dim] = (how, role)
        elif how != "random":
            raise NotApplicable(
                f"'{path}' is {out[dim][1]} and {role} (tied weights): they need different new "
                f"entries ({out[dim][0]} and {how})",
                HINT,
            )
    return [(dim, how) for dim, (how, _) in sorted(out.items(), reverse=True)]  # columns before rows


def grow_stream(gm: fx.GraphModule, stream: Stream, new: int, generator: torch.Generator) -> str:
    """Grow `gm`'s stream (found on `gm` itself) to `new` in place; returns the rule used.

    A bfloat16/float16 pre-norm stream grown by a multiple of its size is replicated, not zero-filled: the zero fill
    rescales the norms' γ by sqrt(d/d'), which the half dtype rounds (2^-9 relative), while replication copies rows,
    keeps γ, β and eps, and splits readers' columns in shares that sum exactly in the dtype (channel_fill): the
    stored values then compute the old function. Tied weights that would need both a copy and shares keep the
    zero fill."""
    half = any(p.dtype in (torch.bfloat16, torch.float16) for p in gm.parameters())
    half = half and not any(n.l2 for n in stream.norms)  # replication would change an L2 norm's sum of squares
    layout, rule = plan_layout(stream, new, generator, replicate=half)
    owners = _owners(gm)
    plans = plan_tensors(stream, rule)
    if rule == "replicate" and stream.conflict is None and not _tie_free(plans, owners, gm):
        layout, rule = plan_layout(stream, new, generator)
        plans = plan_tensors(stream, rule)
    scaled = shares_on_norms(gm, stream, plans, owners) if rule == "replicate" else set()  # tied LM heads
    allowed = set(plans) | {p for n in stream.norms for p in (n.weight, n.bias) if p}
    done: set[str] = set()  # paths already grown (a tied tensor is grown once, under its first path)
    for path, steps in plans.items():
        if path in done:
            continue
        old = _tensor(gm, path)
        tied = [p for p in owners.get(id(old), [path]) if p != path]
        strangers = [p for p in tied if p not in allowed]
        if strangers:
            raise NotApplicable(f"'{path}' is shared with '{strangers[0]}', which is not on the stream", HINT)
        value = old.detach()
        for dim, how in _merge(path, steps + [s for p in tied for s in plans.get(p, [])]):
            value = grow_along(value, dim, layout, how, generator)
        value = (
            nn.Parameter(value.contiguous(), requires_grad=old.requires_grad)
            if isinstance(old, nn.Parameter)
            else value
        )
        for p in [path] + tied:  # one tensor for all its paths: a tie stays a tie
            _set(gm, p, value, old)
            done.add(p)
    allowed |= _grow_blocks(gm, stream, plans, owners, layout, rule, generator)
    norms_done: set = set()  # a norm module (or its parameters) called at several places is grown once
    for norm in stream.norms:
        key = norm.module or (norm.weight, norm.bias)
        if norm.module is None and norm.weight is None and norm.bias is None:
            key = norm.node
        if key in norms_done:
            continue
        norms_done.add(key)
        _grow_norm(gm, stream, norm, layout, rule, generator)
        for q in (norm.weight, norm.bias) if norm.node in scaled else ():  # its reader's shares (stream_ties)
            if q is None:  # a norm without a bias (ESMC's LayerNorm(bias=False)) or without a weight
                continue
            _set(gm, q, _tensor(gm, q).detach() * (layout.old / layout.new), _tensor(gm, q))
    _resize_modules(gm, {p.rpartition(".")[0] for p in allowed})
    _grow_views(gm, stream, new)
    for name, i in stream.eps if rule != "replicate" else ():  # a mean square over flattened copies (stream_blocks)
        node = next(n for n in gm.graph.nodes if n.name == name)
        node.args = (*node.args[:i], node.args[i] * stream.width / new, *node.args[i + 1 :])
    hold_size_reads(gm, {t: (axis, stream.width) for t, axis in stream.axes.items()})
    finish(gm)
    return rule


def _grow_blocks(gm, stream: Stream, plans: dict, owners: dict, layout: Layout, rule: str, generator) -> set[str]:
    """Readers of stream tensors concatenated along the hidden axis (Reader.blocks > 1: DINOv2's head reads the class
    token beside the patches' mean): each block of their input columns grows as one reader's; returns their paths."""
    done = set()
    for r in stream.readers:
        if r.blocks == 1:
            continue
        how = "shares" if rule == "replicate" else {"mean": "zero", "zero": "random"}[stream.fill[r.input]]
        for path, dim in (q for q in r.params if q[0] not in done):  # a weight read at several places: grown once
            old = _tensor(gm, path)
            if path in plans or len(owners.get(id(old), [path])) > 1:
                raise NotApplicable(f"'{path}' reads the stream in {r.blocks} blocks and is used elsewhere too", HINT)
            t = old.detach().movedim(dim, -1)  # (…, blocks · d) → (… · blocks, d): each block a matrix's columns
            rows = grow_along(t.reshape(-1, layout.old), 1, layout, how, generator)
            if r.rms and rule != "replicate":  # the mean square's rsqrt grows by sqrt(d'/d) (stream_blocks)
                rows[:, layout.old_to_new] *= math.sqrt(layout.old / layout.new)
            value = rows.reshape(*t.shape[:-1], r.blocks * layout.new).movedim(-1, dim).contiguous()
            _set(
                gm,
                path,
                nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value,
                old,
            )
            done.add(path)
    return done


def _tie_free(plans: dict[str, list[tuple[int, str, str]]], owners: dict, gm: fx.GraphModule) -> bool:
    """Whether every tensor tied between paths of `plans` takes one rule per dimension (_merge does not refuse)."""
    for path, steps in plans.items():
        tied = [p for p in owners.get(id(_tensor(gm, path)), [path]) if p != path]
        try:
            _merge(path, steps + [s for p in tied for s in plans.get(p, [])])
        except NotApplicable:
            return False
    return True


def _grow_norm(gm: fx.GraphModule, stream: Stream, norm, layout: Layout, rule: str, generator: torch.Generator) -> None:
    d, new = layout.old, layout.new
    ratio = d / new
    if norm.l2:  # onto the unit sphere: zero new coordinates keep the sum of squares, nothing to rescale
        return
    if rule != "replicate" and norm.weight is None:
        raise NotApplicable(
            f"norm '{norm.node}' has no affine weight to absorb the factor sqrt({d}/{new}) its old "
            "outputs would change by",
            "give the norm elementwise_affine=True, or grow by an integer factor in a post-norm model",
        )
    for path, is_weight in ((norm.weight, True), (norm.bias, False)):
        if path is None:
            continue
        old = _tensor(gm, path)
        if rule == "replicate":
            value = grow_along(old, 0, layout, "copy", generator)
        else:
            value = grow_along(old * math.sqrt(ratio) if is_weight else old, 0, layout, "zero", generator)
            if is_weight:  # γ'_new: the scale of the old ones (it multiplies 0 at first; learns once the stream moves)
                scale = value[:d].abs().mean()
                value[d:] = torch.where(scale > 0, scale, torch.full_like(scale, math.sqrt(ratio)))
        _set(gm, path, value, old)
    if norm.inner:  # written out without a weight (replicated: its mean square keeps): nothing to resize
        return
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    eps = eps if rule == "replicate" else eps * ratio
    node = next(n for n in gm.graph.nodes if n.name == norm.node)
    if norm.module is not None:
        m: Any = gm.get_submodule(norm.module)
        m.normalized_shape, m.eps = (new,), eps
        return
    args = list(node.args)
    if len(args) > 1:
        args[1] = (new,)
    else:
        node.kwargs = {**node.kwargs, "normalized_shape": (new,)}
    eps_at = 3 if norm.rms else 4
    if len(args) > eps_at:
        args[eps_at] = eps
    else:
        node.kwargs = {**node.kwargs, "eps": eps}
    node.args = tuple(args)


def _resize_modules(gm: fx.GraphModule, paths: set[str]) -> None:
    """Size attributes follow the grown weights (in_features, embedding_dim, out_channels, …)."""
    for path in paths:
        try:
            m = gm.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, nn.RNNBase):  # an LSTM reading the stream: its first layer's input columns
            m.input_size = int(m.weight_ih_l0.shape[1])
        w = getattr(m, "weight", None)
        if w is None:
            continue
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = w.shape
        elif isinstance(m, nn.Embedding):
            m.embedding_dim = w.shape[1]
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.num_features = w.shape[0]
        elif isinstance(m, nn.GroupNorm):  # of one group over the stream (analysis.stream_channels)
            m.num_channels = w.shape[0]
        elif isinstance(m, nn.modules.conv._ConvNd):
            if m.groups > 1 and m.groups == m.in_channels == m.out_channels:  # depthwise: a filter per channel
                m.groups = m.in_channels = w.shape[0]
            m.out_channels, m.in_channels = w.shape[0], w.shape[1] * m.groups  # a conv reading the stream: its input


def _grow_views(gm: fx.GraphModule, stream: Stream, new: int) -> None:
    """reshape/view/expand on the stream with the width written as a constant, a functional depthwise conv's
    `groups`: the new width."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, axis in stream.read_views:  # a parameter read as a weight through views (stream_blocks.query_reader)
        n = nodes[name]
        packed = len(n.args) == 2 and isinstance(n.args[1], (list, tuple))
        shape = list(n.args[1]) if packed else list(n.args[1:])
        if base_name(n) != "unsqueeze" and len(shape) > axis and shape[axis] == stream.width:
            shape[axis] = new
            n.args = (n.args[0], type(n.args[1])(shape)) if packed else (n.args[0], *shape)
    for name in stream.grouped:  # F.conv1d(x, w, b, stride, padding, dilation, groups)
        n = nodes[name]
        if len(n.args) > 6:
            n.args = (*n.args[:6], new, *n.args[7:])
        else:
            n.kwargs = {**n.kwargs, "groups": new}
    for name in stream.views:
        n, axis = nodes[name], stream.axes[name]
        if n.op == "call_function":  # torch.reshape(x, shape)
            shape = list(n.args[1])
            if shape[axis] == stream.width:
                shape[axis] = new
                n.args = (n.args[0], tuple(shape), *n.args[2:])
            continue
        packed = len(n.args) == 2 and isinstance(n.args[1], (list, tuple))
        shape = list(n.args[1]) if packed else list(n.args[1:])
        if len(shape) > axis and shape[axis] == stream.width:
            shape[axis] = new
            n.args = (n.args[0], type(n.args[1])(shape)) if packed else (n.args[0], *shape)
