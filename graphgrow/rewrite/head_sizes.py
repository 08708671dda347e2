"""grow_width on channels that are an attention's head size: the coupling marks the groups of a
`scaled_dot_product_attention`'s query/key and value/output channels (analysis.coupling_layers); growing one
means growing the head size of every attention they belong to, which the attention rewrite does exactly
(new key rows random, new query rows zero, the scale kept; new value rows random, new output columns zero).
Every layer the coupling's plan reaches must be one of those attentions' projections or output projections.
"""

from __future__ import annotations

import torch
from torch import fx

from ..analysis.coupling import Coupling
from ..analysis.growth import Insertion
from ..analysis.heads import attention_of
from ..core.errors import NotApplicable
from .heads import grow_attention

HINT = "grow the attention's projections with grow_width(init=zero), or use grow_heads(head_dim=…, value_dim=…)"


def grow_head_sizes(
    gm: fx.GraphModule, coupling: Coupling, plan: dict[int, list[Insertion]], init: str, generator: torch.Generator
) -> list[str]:
    """Grow the head sizes the plan's insertions amount to; returns the rebuilt parameter paths."""
    nodes = {n.name: n for n in gm.graph.nodes}
    added: dict[str, dict[str, int]] = {}  # attention → {"d": new query/key coordinates, "e": new value ones}
    for g, insertions in plan.items():
        grp = coupling.groups[g]
        for s in grp.attentions:
            q, v = nodes[s].args[0], nodes[s].args[2]
            roles = [r for r, t in (("d", q), ("e", v)) if isinstance(t, fx.Node) and t.name in grp.members]
            for r in roles:
                added.setdefault(s, {})[r] = sum(i.count for i in insertions)
    where = ", ".join(sorted(added))
    if init != "zero":
        raise NotApplicable(
            f"these channels are the head size of attention {where}: they grow with fresh units only "
            f"(init={init} would change the attention scores)",
            "use init=zero",
        )
    attentions, covered = [], set()
    for s, grows in added.items():
        att = attention_of(gm, nodes[s], {"d", "e"} if "d" in grows else {"e"})
        new = {
            "h": att.kv_heads,
            "r": att.heads // att.kv_heads,
            "d": att.head_dim + grows.get("d", 0),
            "e": att.value_dim + grows.get("e", 0),
        }
        fused = any(len(p.roles) > 1 for p in att.projections)
        if fused and new["d"] - att.head_dim != new["e"] - att.value_dim:
            raise NotApplicable(
                f"attention '{s}' takes query, key and value from one fused projection: their head "
                "sizes must grow together",
                HINT,
            )
        attentions.append((att, new))
        covered |= {p.node for p in att.projections} | {att.reader.node}
    for g in plan:
        grp = coupling.groups[g]
        extra = [n for n in grp.sources + grp.consumers if n not in covered] + grp.channelwise + grp.norms + grp.tensors
        if extra:
            raise NotApplicable(
                f"the head-size channels of attention {where} also reach '{extra[0]}', which the "
                "attention rewrite does not change",
                HINT,
            )
    rebuilt: list[str] = []
    for att, new in attentions:
        grow_attention(gm, att, new, generator)
        rebuilt += [p.module or p.weight for p in att.projections] + [att.reader.module or att.reader.weight]
    return rebuilt
