"""grow_hidden: grow a transformer's hidden (residual-stream) size d → d', exactly, in eval and train mode.

The stream is found from the graph (graphgrow.analysis.stream): every tensor carrying the hidden size, its writers
(token and position embeddings, class tokens, patch embedding, every output projection added into the stream), its
readers (the Linear layers after the norms, the LM head) and its norms. Heads, head size and MLP width do not change:
q/k/v and the MLP's first layers only gain input columns, the output projections only gain output rows.

Pre-norm streams (GPT-2, LLaMA, ViT, nn.TransformerEncoder with norm_first=True) grow by any increment: new
coordinates start as the mean of the old ones where LayerNorms read the stream (zero where RMSNorms do), each norm's
eps and old γ are rescaled by d/d' and sqrt(d/d') so its old outputs do not move, and its new outputs start at β = 0
(rewrite/stream.py has the algebra). Post-norm streams (BERT, norm_first=False) grow only by an integer factor
(every coordinate replicated equally, readers' columns split in random shares); other sizes are refused with the
reason. Tied input/output embeddings get their new columns once, right for both uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import ADDS_PARAMETERS, begin, find_stream, grow_stream, pass_function


@pass_function  # the arguments' defaults and allowed values: GrowHidden's declaration
def grow_hidden(
    gm: fx.GraphModule, to: int | None, by: int | None, generator: torch.Generator | None = None
) -> Rewrite:
    """Grow the hidden size to `to` (or by `by`); default: +50 % (pre-norm), ×2 (post-norm)."""
    gm, generator = begin(gm, generator)
    stream = find_stream(gm)
    new, chosen = target_width(stream.width, stream.conflict is None, to, by)
    rule = grow_stream(gm, stream, new, generator)
    fills = sorted(set(stream.fill.values()))
    how = (
        f"new coordinates start as {' or '.join(FILLS[f] for f in fills)}; norms' eps and old γ rescaled, new norm "
        "outputs β = 0"
        if rule == "mean/zero"
        else f"every coordinate replicated {new // stream.width}× ({stream.conflict})"
    )
    targets = {"hidden": f"{stream.width} → {new} ({chosen})", "rule": how, "stream": stream.summary()}
    notes = []
    dropped = [
        n
        for n in gm.graph.nodes
        if n.name in stream.axes
        and n.op == "call_module"
        and isinstance(gm.get_submodule(n.target), nn.Dropout)
        and gm.get_submodule(n.target).p > 0
    ]
    if dropped and rule == "mean/zero" and any(v == "mean" for v in stream.fill.values()):
        notes.append(
            f"dropout on the stream ({dropped[0].target}, …) drops new coordinates on their own: exact in eval "
            "mode and in train mode with dropout off (as verified); with dropout on, the new coordinates are dropped "
            "independently of the old ones, so a LayerNorm after it sees slightly other statistics"
        )
    return Rewrite(gm, targets, notes)


FILLS = {"mean": "the mean of the old ones (read by LayerNorms)", "zero": "zero (read by RMSNorms, or after a norm)"}


def target_width(d: int, any_size: bool, to: int | None, by: int | None) -> tuple[int, str]:
    if to is not None and by is not None and to != d + by:
        raise NotApplicable(f"to={to} and by={by} disagree (the hidden size is {d})", "give one of them")
    if to is not None:
        return int(to), "given"
    if by is not None:
        return d + int(by), "given"
    if any_size:
        return d + max(d // 2, 1), "default: +50 %"
    return 2 * d, "default: ×2 (this stream stays exact only replicated: an integer factor)"


@dataclass(frozen=True)
class GrowHidden(Pass):
    """Grow a transformer's hidden (residual-stream) size, exactly: embeddings, norms, every reader and writer."""

    name: ClassVar[str] = "grow_hidden"
    function = grow_hidden
    ensures = (ADDS_PARAMETERS,)
    to: int | None = arg(None, "the new hidden size (default: +50 %, or ×2 on a post-norm stream)", low=1)
    by: int | None = arg(None, "hidden units to add (instead of to=)", low=1)

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """The model's residual stream, at the size this pass's arguments (or the default) give."""
        try:
            stream = find_stream(gm)
            new, chosen = target_width(stream.width, stream.conflict is None, self.to, self.by)
        except NotApplicable:
            return []
        added = sum(p.numel() for p in gm.parameters()) * (new - stream.width) // max(stream.width, 1)  # roughly
        return [
            Candidate(
                {"to": str(new)}, f"residual stream {stream.width} → {new} ({chosen}); {stream.summary()}", added, True
            )
        ]
