"""A block whose forward asks one flag or number value several times is traced through, not kept whole (issue 39: timm
deepseek_vit_412m's 'encoder' was a leaf, "branches on self.training and its branches have more than 16 paths", so
grow_width, grow_heads and add_residual saw nothing inside it). Its rotary embedding computes `augment =
self.training and self.aug_active`, which is the flag itself when it is False, and asks `if augment:` in the helpers
it calls: every ask was a new branch, explored both ways, 2^5 paths, most of them impossible (the flag True at one
`if`, False at the next). One value asked again has the answer it was given: a read of the same module's `training`
or of the same number attribute, and the same arithmetic of them, is one value while a forward runs. Spellings: the
flag handed on through `and`, `self.training` read at every `if`, and a live number compared at every `if`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.graph.graph_meta import trace_report
from tests.conftest import grow_checked

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.fast]  # conftest.py


class Rope(nn.Module):
    """A table the block reads through a method (not forward): the asks belong to the block that calls it."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling, self.aug_active, self.jitter = spelling, False, 0.0  # augmentation off, as timm ships it
        self.register_buffer("bands", torch.linspace(0.1, 1.0, 8), persistent=False)

    def ask(self, augment):
        return self.training if self.spelling == "training" else self.jitter > 0

    def build(self, x: torch.Tensor, augment) -> torch.Tensor:  # each ask at an `if` of its own: paths multiply
        emb = torch.sin(x[..., :8] * self.bands)
        if self.spelling == "and":  # asked one after another with no work between (timm's _build_embed)
            for s in [s if augment else None for s in (0.1, 0.2, 0.3, 0.4, 0.5)]:
                emb = emb if s is None else emb + s * torch.randn_like(emb)
            return emb
        if self.ask(augment):
            emb = emb + 0.01 * torch.randn_like(emb)
        emb = torch.cos(emb)
        if self.ask(augment):
            emb = emb.flip(-1)
        emb = torch.cos(emb)
        if self.ask(augment):
            emb = emb * 2.0
        emb = torch.cos(emb)
        if self.ask(augment):
            emb = emb - 1.0
        emb = torch.cos(emb)
        if self.ask(augment):
            emb = emb.roll(1, -1)
        return emb

    def get_embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.build(x, augment=self.training and self.aug_active)


class Block(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.rope = Rope(spelling)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        emb = self.rope.get_embed(x)
        h = torch.cat([x[..., :8] * emb, x[..., 8:]], -1)
        h = F.dropout(h, p=0.1 if self.training else 0.0)  # a mode difference of its own (timm's AttentionRope's)
        return x + self.fc2(self.drop(torch.relu(self.fc1(h))))


class Net(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.encoder = nn.Sequential(Block(spelling), Block(spelling))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


@pytest.mark.parametrize("spelling", ["and", "training", "number"])
def test_a_value_asked_again_is_traced_through(spelling):
    torch.manual_seed(0)
    model = Net(spelling)
    model.get_submodule("encoder.1.rope").jitter = 0.5  # the number spelling: one block's path is the other one
    gm = gg.trace(model, input_shape=(2, 5, 16))
    report = trace_report(gm)
    assert not report.get("auto_leaves"), report.get("auto_leaves")
    assert {str(n.target) for n in gm.graph.nodes if n.op == "call_module"} >= {"encoder.0.fc1", "encoder.1.fc2"}
    x = torch.randn(3, 5, 16)
    for train in (True, False):  # each mode's path, every ask answered alike (the same draws in the same order)
        outs = []
        for f in (Net.train(model, train), gm.train(train)):
            torch.manual_seed(1)
            outs.append(f(x))
        assert torch.allclose(*outs, atol=1e-6)


@pytest.mark.parametrize("spelling", ["and", "training", "number"])
def test_the_block_grows_and_both_modes_stay(spelling):
    torch.manual_seed(0)
    model = Net(spelling)
    r = grow_checked(model, "x:2x5x16", "grow_width", target="encoder.0.fc1")
    assert r.gm.get_submodule("encoder.0.fc1").out_features > 32
