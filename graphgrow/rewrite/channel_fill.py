"""Where old channels go and what fills the new ones, for any tensor whose dim 0 (rows: a layer's outputs) or dim 1
(columns: its inputs) takes a channel layout: old values moved to their new places, new rows random / zero / one /
the mean / net2net copies, new columns zero or net2net shares of their source column."""

from __future__ import annotations

from typing import Literal

import torch

from ..analysis.growth import Layout
from .initializers import kaiming_

Init = Literal["zero", "net2net"]


def _like(t: torch.Tensor) -> dict:
    return {"device": t.device, "dtype": t.dtype}


def _shares(count: int, generator: torch.Generator) -> torch.Tensor:
    """Random positive shares summing to one (never equal: equal shares keep replicas symmetric)."""
    w = torch.rand(count, generator=generator, dtype=torch.float64) + 0.5
    return w / w.sum()


def _exact_shares(column: torch.Tensor, count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """`count` pieces of a half-precision `column` that sum to it exactly in its own dtype: each piece takes a random
    fraction in [1/2, 1) of what is left, rounded, and the rest is left over. Subtracting a piece that is between
    half and all of what is left is exact in binary floating point (Sterbenz's lemma), so no rounding is lost."""
    pieces, rest = [], column
    for t in (torch.rand(count - 1, generator=generator, dtype=torch.float64) * 0.5 + 0.5).tolist():
        piece = (rest.float() * t).to(column.dtype)
        pieces.append(piece)
        rest = rest - piece
    return [*pieces, rest]


def rows(old: torch.Tensor, layout: Layout | None, init: Init, generator: torch.Generator, fresh: str) -> torch.Tensor:
    """Place old rows (dim 0) and fill new ones: random ('kaiming'), 'zero', 'one', the old rows' 'mean',
    or copies for net2net."""
    if layout is None:
        return old
    new = torch.empty((layout.new,) + tuple(old.shape[1:]), **_like(old))
    new[layout.old_to_new] = old
    copies = [(slot, src) for slot, src in zip(layout.new_slots, layout.src) if init == "net2net" and src is not None]
    filled = [slot for slot, src in zip(layout.new_slots, layout.src) if not (init == "net2net" and src is not None)]
    if copies:
        new[[slot for slot, _ in copies]] = old[[src for _, src in copies]]
    if filled:
        if fresh == "kaiming":  # one draw for all of them: the generator yields the same values as row by row
            shape = (len(filled),) + (tuple(old.shape[1:]) or (1,))  # a row of a 1-d tensor has fan-in 1
            new[filled] = kaiming_(torch.empty(shape, **_like(old)), generator).view(
                (len(filled),) + tuple(old.shape[1:])
            )
        elif fresh == "mean":
            new[filled] = old.mean(0)
        else:
            new[filled] = {"zero": 0.0, "one": 1.0}[fresh]
    return new


def columns(old: torch.Tensor, layout: Layout | None, init: Init, generator: torch.Generator) -> torch.Tensor:
    """Place old input columns (dim 1); new columns are zero, or net2net shares of their source column."""
    if layout is None:
        return old
    shape = list(old.shape)
    shape[1] = layout.new
    new = torch.zeros(shape, **_like(old))
    new[:, layout.old_to_new] = old
    if init == "net2net":
        replicas: dict[int, list[int]] = {}
        for slot, src in zip(layout.new_slots, layout.src):
            if src is not None:
                replicas.setdefault(src, []).append(slot)
        half = old.dtype in (torch.bfloat16, torch.float16)
        for src, slots in replicas.items():
            if half:  # shares stored in the half dtype must still sum to the column exactly: _exact_shares
                for slot, piece in zip(
                    [layout.old_to_new[src], *slots], _exact_shares(old[:, src], len(slots) + 1, generator)
                ):
                    new[:, slot] = piece
                continue
            share = _shares(len(slots) + 1, generator).to(old.dtype)
            column = old[:, src]
            new[:, layout.old_to_new[src]] = column * share[0]
            for s, slot in zip(share[1:], slots):
                new[:, slot] = column * s
    return new
