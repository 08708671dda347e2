"""Layers graphgrow itself puts into graphs. They are allow-listed for safe loading
(graphgrow's outputs reload without --trust), so they must stay plain and small."""

from __future__ import annotations

import torch
from torch import nn


class AverageMerge(nn.Module):
    """out = main + mean_i(gate_i · branch_i), one learnable gate per branch, each starting at 0.

    The old research code merged `out + 0.2·mean(branches)`; per-branch gates that
    start at zero keep that shape and make every insertion exact. Adding a branch
    rescales the existing gates by (n+1)/n so the mean stays the same function.
    """

    def __init__(self, branches: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.gates = nn.Parameter(torch.zeros(branches, device=device, dtype=dtype))

    @property
    def branches(self) -> int:
        return self.gates.numel()

    def forward(self, main: torch.Tensor, *branches: torch.Tensor) -> torch.Tensor:
        total = branches[0] * self.gates[0]
        for i in range(1, len(branches)):
            total = total + branches[i] * self.gates[i]
        return main + total / len(branches)

    def extra_repr(self) -> str:
        return f"branches={self.branches}"


GRAPHGROW_LAYERS = (AverageMerge,)
# The names files written before graphgrow's layers became subpackages (issue 21) give these classes: such files
# still load safely (torch's weights-only loader maps the old name to the class; nothing is imported by it).
FORMER_NAMES = ((AverageMerge, "graphgrow.layers.AverageMerge"),)
