"""Where to grow, ranked by the data: the first-order loss decrease a unit of growth at each place can give.

For each candidate place a pass lists, the pass runs once with init=gradmax on the given batch (not
verified, not kept); the place's gain is the squared gradient norm on the zero last factor at the aimed
directions: per new unit on the new outgoing weights (grow_width, insert_adapter, deepen's transformer
block), per new block on its zero gate (add_branch, deepen) — one SGD step of learning rate lr on that
factor lowers the loss by lr × gain per unit (or block), to first order. A starved layer (a bottleneck)
has the largest gain. Gains compare places of one pass, not passes with each other.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ..analysis.targets import Candidate
from ..core.errors import GraphgrowError, NotApplicable
from .gradmax import Data, load_data
from .pass_base import Pass


def ranks_by_gain(p: Pass) -> bool:
    """Whether pass `p` can aim its growth from data (has init=gradmax and a data argument)."""
    names = {f.name for f in dataclasses.fields(p)}
    return {"init", "data"} <= names and "gradmax" in str(p.argument_types().get("init"))


def rank_by_gain(
    gm: fx.GraphModule, p: Pass, candidates: list[Candidate], data: Data, seed: int = 0
) -> list[tuple[Candidate, float | None, str | None]]:
    """(candidate, gain, why none) for every candidate, the largest gain first; a place the pass
    refuses gets None and the reason, last."""
    if not ranks_by_gain(p):
        raise NotApplicable(
            f"{p.name} has no data-driven init, so its places cannot be ranked by gain",
            "rank the places of a pass with init=gradmax (grow_width, insert_adapter, add_branch, "
            "deepen); other passes list their places without --data",
        )
    load_data(data, p.name)  # a bad data function is refused once, not once per place
    ranked = []
    for c in candidates:
        aimed = dataclasses.replace(p, init="gradmax", data=data, **c.args)  # type: ignore[call-arg]
        try:
            rw = aimed.apply(gm, torch.Generator().manual_seed(seed))
            ranked.append((c, float(rw.targets["gain"]), None))
        except GraphgrowError as e:
            ranked.append((c, None, e.message))
    return sorted(ranked, key=lambda r: -r[1] if r[1] is not None else float("inf"))
