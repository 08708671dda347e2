"""Growth behind the model's own zero gain (issue 39: timm swinv2_tiny_window8_256 grow_width broke, exit 1, "no new
parameter gets a gradient at insertion although the layers before it do: the new contribution is dead").

Swin V2 adds each block's work through a post-norm whose γ is zero-initialised (x + norm1(attn(x))): every layer in a
block is silent at insertion while the patch embedding before gets a gradient through the skip. The new units'
outgoing weights start at zero and their gradient waits for γ to move, which training does at its first step, as for
a zero-initialised head. Verification trains everything then (as it does for a zero head) and the new units learn
at step 1. Spellings: nn.LayerNorm post-norm with γ = 0, F.layer_norm on parameters with γ = 0, a zero layer scale
(x + γ · mlp(x)). The strict side: a widening whose new units have zero incoming and outgoing weights behind the same
zero gain stays refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import NotApplicable, PreservationError
from graphgrow.graph.inputs import as_spec
from graphgrow.verify.verify import verify

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["post-norm", "functional", "layer scale"]


class Block(nn.Module):
    def __init__(self, spelling: str, hidden: int = 32):
        super().__init__()
        self.spelling = spelling
        self.fc1, self.fc2 = nn.Linear(16, hidden), nn.Linear(hidden, 16)
        self.norm = nn.LayerNorm(16)
        self.w, self.b = nn.Parameter(torch.zeros(16)), nn.Parameter(torch.zeros(16))
        nn.init.zeros_(self.norm.weight)  # timm's Swin V2 res-post-norm init

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        if self.spelling == "post-norm":
            return x + self.norm(y)
        if self.spelling == "functional":
            return x + F.layer_norm(y, (16,), self.w, self.b)
        return x + self.w * y


class Net(nn.Module):
    """Patches embedded, two post-norm blocks, a final norm, pooled, classified (Swin V2's outline)."""

    def __init__(self, spelling: str, hidden: int = 32):
        super().__init__()
        self.embed, self.head, self.final = nn.Linear(12, 16), nn.Linear(16, 5), nn.LayerNorm(16)
        self.blocks = nn.Sequential(Block(spelling, hidden), Block(spelling, hidden))

    def forward(self, x):
        return self.head(self.final(self.blocks(self.embed(x))).mean(1))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_grow_width_behind_a_zero_gain_verifies(spelling):
    torch.manual_seed(0)
    gm = gg.trace(Net(spelling).eval(), input_shape=(1, 6, 12))
    r = gg.get_pass("grow_width")()(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    assert r.preservation.trainable and not r.preservation.dead
    assert max(r.preservation.trainable.values()) >= 1  # learns once the gain has moved, not at insertion


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_new_units_zero_both_ways_behind_a_zero_gain_still_fail(spelling):
    """blocks.0.fc1/fc2 widened 32 → 48 with the new rows and columns both zero: dead whatever trains, so never
    verified (refused as a place the output does not hear at init, as behind a zero head, or as dead units)."""
    torch.manual_seed(0)
    old = Net(spelling).eval()
    new = Net(spelling).eval()
    new.blocks[0].fc1, new.blocks[0].fc2 = nn.Linear(16, 48), nn.Linear(48, 16)
    with torch.no_grad():
        for p in new.parameters():
            p.zero_()
        for name, p in old.named_parameters():
            q = dict(new.named_parameters())[name]
            q[tuple(slice(0, s) for s in p.shape)] = p
    spec = as_spec((1, 6, 12))
    with pytest.raises((PreservationError, NotApplicable), match="no gradient|does not depend on"):
        verify(gg.trace(old, input_shape=(1, 6, 12)), gg.trace(new, input_shape=(1, 6, 12)), spec)
