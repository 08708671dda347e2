"""grow_heads: add attention heads, or grow the head size, exactly, in eval and train mode.

Every attention (or the one at `at=`), written with `scaled_dot_product_attention` or eagerly as softmax(q @ kᵀ ·
scale + mask) @ v (soft-capping, dropout and einsum spellings included), is found from the graph with the Linear
layers that project its query, key and value and the one that reads its output (graphgrow.analysis.heads), the
reshapes between them followed, so fused projections (GPT-2's c_attn, timm's qkv, nn.MultiheadAttention's in_proj),
grouped-query attention and rotary embeddings are understood. A projection is a learned linear map over the channel
axis: an nn.Linear or F.linear, or a convolution of one group over a channels-first map (timm's Conv2d 1×1 q/k/v,
SqueezeBERT's Conv1d), whose new heads are new output channels (a BatchNorm after it grows with them). Anything else
is refused with the node and the reason (for a query no projection makes, the op that stops the way back).

- `heads=` / `by=`: new heads get random query, key and value rows and zero output-projection columns (the softmax is
  per head: old heads do not move). Grouped-query attention keeps its ratio: key/value heads grow by heads / ratio.
- `head_dim=`: the query/key head size (and the value head size with it, unless `value_dim=` says otherwise): new
  key rows random, new query rows zero, the 1/sqrt(d) scale moved to the new size with the old query rows
  compensating. Refused under rotary embeddings (their frequencies depend on the head size).
- `value_dim=`: the value/output head size only: new value rows random, new output-projection columns zero; exact
  with rotary embeddings too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    Requirement,
    begin,
    eager_cores,
    find_attentions,
    grow_attentions,
    pass_function,
)


@pass_function  # the arguments' defaults and allowed values: GrowHeads's declaration
def grow_heads(
    gm: fx.GraphModule,
    heads: int | None,
    by: int | None,
    head_dim: int | None,
    value_dim: int | None,
    at: str | None,
    generator: torch.Generator | None = None,
) -> Rewrite:
    """Grow the attentions of `gm`: heads to `heads` (or by `by`), head size to `head_dim`, value size to `value_dim`;
    with no argument, +50 % heads (rounded to keep a grouped-query ratio)."""
    gm, generator = begin(gm, generator)
    growing = _growing(heads, by, head_dim, value_dim)
    attentions = find_attentions(gm, growing, at)
    plans = [(a, new_sizes(a, heads, by, head_dim, value_dim)) for a in attentions]
    hows = grow_attentions(gm, plans, generator)
    first, new = plans[0]
    targets = {
        "attentions": f"{len(plans)} ({'at ' + at if at else 'every one'})",
        "heads": _change(
            first.heads,
            new["h"] * new["r"],
            heads is None and by is None and head_dim is None and value_dim is None,
        ),
        "head_dim": _change(first.head_dim, new["d"]),
        "value_dim": _change(first.value_dim, new["e"]),
        "scale": hows[0],
        "each": "; ".join(
            f"{attention_path(a) or a.node}: {a.heads}×{a.head_dim} → {n['h'] * n['r']}×{n['d']}"
            + (f" (value {a.value_dim} → {n['e']})" if n["e"] != a.value_dim else "")
            for a, n in plans
        ),
    }
    if first.kv_heads != first.heads:
        targets["kv_heads"] = _change(first.kv_heads, new["h"]) + f" (grouped-query: {new['r']} query heads each)"
    notes = []
    if any(len(p.roles) > 1 for a, _ in plans for p in a.projections) and new["d"] != first.head_dim:
        notes.append(
            "fused q/k/v projections hold equal sections: the value head size grew with the query/key head size"
        )
    return Rewrite(gm, targets, notes)


def _has_attention(gm: fx.GraphModule) -> bool:
    """A scaled_dot_product_attention, an nn.MultiheadAttention or another module holding Linear layers kept whole
    (find_attentions says why its heads cannot be seen), or an eagerly written attention (a softmax between two
    matrix products)."""
    return any(
        (n.op == "call_function" and n.target is F.scaled_dot_product_attention)
        or (n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.MultiheadAttention))
        or (
            n.op == "call_module"
            and not isinstance(gm.get_submodule(str(n.target)), nn.Linear)
            and any(isinstance(m, nn.Linear) for m in gm.get_submodule(str(n.target)).modules())
        )
        for n in gm.graph.nodes
    ) or bool(eager_cores(gm))


def _change(old: int, new: int, default: bool = False) -> str:
    return f"{old} → {new}" + (" (default: +50 %)" if default else "") if new != old else f"{old} (kept)"


def _growing(heads, by, head_dim, value_dim) -> set[str]:
    grow = set()
    if heads is not None or by is not None or (head_dim is None and value_dim is None):
        grow.add("h")
    if head_dim is not None:
        grow |= {"d", "e"}
    if value_dim is not None:
        grow.add("e")
    return grow


def new_sizes(a, heads: int | None, by: int | None, head_dim: int | None, value_dim: int | None) -> dict[str, int]:
    """The attention's new factor sizes (h: key/value heads, r: query heads per key/value head, d, e)."""
    h, kv, d, e = a.heads, a.kv_heads, a.head_dim, a.value_dim
    ratio = 1 if a.one_kv else h // kv  # one key/value head that cannot grow: every new query head shares it
    if heads is not None and by is not None and heads != h + by:
        raise NotApplicable(
            f"heads={heads} and by={by} disagree (attention '{a.node}' has {h} heads)", "give one of them"
        )
    target = heads if heads is not None else h + by if by is not None else None
    if target is None and head_dim is None and value_dim is None:
        target = h + max(ratio, -(-h // 2 // ratio) * ratio)
    target = h if target is None else int(target)
    where = f"attention '{a.node}' ({a.summary()})"
    if target < h:
        raise NotApplicable(f"{where}: heads={target} would remove heads", f"give heads= above {h}")
    if target % ratio:
        raise NotApplicable(
            f"{where}: {h} query heads share {kv} key/value head{'s' if kv > 1 else ''} ({ratio} each); "
            f"{target} query heads "
            "cannot keep that ratio",
            f"heads={h + ratio}, {h + 2 * ratio}, … (key/value heads grow by heads / {ratio})",
        )
    # q/k/v in equal sections of one projection grow together (unequal sections, or key and value in one block per
    # head as multi-head latent attention projects them, grow apart or not at all: the analysis says which)
    fused = any(len(p.roles) > 1 and any(f == "s" for f, _ in p.factors) for p in a.projections)
    d2 = int(head_dim) if head_dim is not None else d
    e2 = int(value_dim) if value_dim is not None else d2 if head_dim is not None and e == d else e
    if d2 < d or e2 < e:
        raise NotApplicable(
            f"{where}: head_dim={d2}, value_dim={e2} would shrink heads", "give sizes above the current ones"
        )
    if fused and d2 != e2:
        raise NotApplicable(
            f"{where}: its query, key and value come from one fused projection in equal sections, so "
            f"their head sizes grow together",
            f"give head_dim={max(d2, e2)} (query, key and value)",
        )
    if (target, d2, e2) == (h, d, e):
        raise NotApplicable(
            f"{where}: nothing to grow", "give heads= (or by=), head_dim= or value_dim= above the current sizes"
        )
    if a.one_kv:
        return {"h": 1, "r": target, "d": d2, "e": e2}
    return {"h": target // ratio, "r": ratio if ratio > 1 else 1, "d": d2, "e": e2}


def attention_path(a) -> str:
    """The module holding an attention's projections (their longest common module path)."""
    paths = [(p.module.split(".")[:-1] if p.module else p.weight.split(".")[:-1]) for p in a.projections + [a.reader]]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


@dataclass(frozen=True)
class GrowHeads(Pass):
    """Add attention heads or grow the head size, exactly: q/k/v rows, output-projection columns, reshapes, scale."""

    name: ClassVar[str] = "grow_heads"
    function = grow_heads
    requires = (
        Requirement(
            "an attention (F.scaled_dot_product_attention, or softmax(q @ kᵀ) @ v written eagerly)",
            lambda gm: _has_attention(gm),
            "the model has no scaled_dot_product_attention and no softmax between two matrix products: "
            "no attention heads found",
            "grow_heads grows attentions written with F.scaled_dot_product_attention "
            "(Hugging Face's default sdpa, timm, "
            "nn.MultiheadAttention) or eagerly as softmax(q @ kᵀ · scale + mask) @ v",
        ),
    )
    ensures = (ADDS_PARAMETERS,)
    heads: int | None = arg(
        None,
        "the new number of query heads in every attention (default: +50 %; grouped-query attention keeps its ratio)",
        low=1,
    )
    by: int | None = arg(None, "query heads to add (instead of heads=)", low=1)
    head_dim: int | None = arg(
        None,
        "the new query/key head size (the value head size grows with it unless value_dim= "
        "is given); refused under rotary embeddings",
        low=1,
    )
    value_dim: int | None = arg(None, "the new value/output head size only (exact with rotary embeddings)", low=1)
    at: str | None = arg(None, "module path of one attention (e.g. model.layers.0.self_attn); default: every attention")

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """Every attention, with what these arguments (or the default) would make of it."""
        try:
            atts = find_attentions(gm, _growing(self.heads, self.by, self.head_dim, self.value_dim), self.at)
        except NotApplicable:
            return []
        out: list[Candidate] = []
        for a in atts:
            try:
                new = new_sizes(a, self.heads, self.by, self.head_dim, self.value_dim)
            except NotApplicable:
                continue
            path = attention_path(a)
            out.append(
                Candidate(
                    {"at": path} if path else {},
                    f"{a.node} ({path}): {a.summary()} → {new['h'] * new['r']} heads × {new['d']}",
                    _added(gm, a, new),
                )
            )
        if len(out) > 1 and self.at is None:
            out.insert(0, Candidate({}, f"every attention ({len(out)})", sum(c.params for c in out), True))
        elif out:
            out[0].default = True
        return out


def _added(gm: fx.GraphModule, a, new: dict[str, int]) -> int:
    """Parameters the growth adds to one attention: new rows of its projections, new columns of its reader."""
    grown = lambda f: math.prod(new.get(n, s) if n else s for n, s in f) - math.prod(s for _, s in f)  # noqa: E731
    params = dict(gm.named_parameters())
    rows = sum(grown(p.factors) * (params[p.weight].shape[1] + (p.bias is not None)) for p in a.projections)
    return rows + grown(a.reader.factors) * params[a.reader.weight].shape[0]
