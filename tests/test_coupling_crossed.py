"""An elementwise op whose operands have the output's shape but their channels on different dims of it: a gated
norm's heads output [B, T, H, D] (an accumulator of a chunked kernel: its channels are the heads) times a Linear's
output viewed [B, T, -1, D] (its channels are D). Joined by shape, the Linear's group reached nothing and grew
alone, and the view's -1 turned the new channels into new heads (sweep: hf bailing_hybrid grow_width, exit 1: "node
'mul_579' fails on inputs of shapes [(3, 16, 4, 16), (3, 16, 8, 16)]"). Both sides are frozen with the reason now;
the other layers of the model still grow exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import grown
from graphgrow.passes.grow_width import GrowWidth
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze

SHAPE = (1, 5, 6)


class HeadsTimesGate(nn.Module):
    """`spell`: how the gate is cut into heads (view / reshape / torch.reshape with -1, or view with the head count
    written out); `op`: how the two meet (a * b, torch.mul(b, a), a.mul(b), a + b)."""

    def __init__(self, spell: str = "view", op: str = "mul") -> None:
        super().__init__()
        self.v, self.g, self.o = nn.Linear(6, 20), nn.Linear(6, 20), nn.Linear(20, 6)
        self.up, self.down = nn.Linear(6, 12), nn.Linear(12, 6)
        self.spell, self.op = spell, op

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.v(x).view(b, t, 4, 5).transpose(1, 2)
        acc = torch.zeros(b, 4, 1, t, 5, dtype=x.dtype)  # a chunked kernel's output buffer: (B, H, chunks, C, D)
        heads = (acc + heads.reshape(b, 4, 1, t, 5)).reshape(b, 4, t, 5)[:, :, :t].transpose(1, 2)
        g = torch.sigmoid(self.g(x))
        if self.spell == "view":
            g = g.view(b, t, -1, 5)
        elif self.spell == "reshape":
            g = g.reshape(b, t, -1, 5)
        elif self.spell == "torch.reshape":
            g = torch.reshape(g, (b, t, -1, 5))
        else:
            g = g.view(b, t, 4, 5)
        if self.op == "mul":
            y = heads * g
        elif self.op == "torch.mul":
            y = torch.mul(g, heads)  # the Linear's side first: the product takes its channel axis
        elif self.op == "method":
            y = heads.mul(g)
        else:
            y = heads + g
        x = x + self.o(y.reshape(b, t, 20))
        return x + self.down(torch.relu(self.up(x)))


CASES = [
    ("view", "mul"),
    ("reshape", "torch.mul"),
    ("torch.reshape", "method"),
    ("heads written", "mul"),
    ("view", "add"),
]


@pytest.mark.parametrize("spell, op", CASES)
def test_operands_with_channels_on_different_dims_are_frozen_not_joined(spell, op):
    gm = gg.trace(HeadsTimesGate(spell, op), SHAPE)
    c = analyze(gm)
    why = c.why_frozen(c.group_of["g"])
    assert any("cannot grow together" in r for r in why), why
    with pytest.raises(gg.NotApplicable, match="cannot grow together"):
        GrowWidth(target="g", factor=2)(gg.trace(HeadsTimesGate(spell, op), SHAPE))


@pytest.mark.parametrize("spell, op", CASES[:2])
def test_the_rest_of_the_model_still_grows_exactly(spell, op):
    r = grown(HeadsTimesGate(spell, op), SHAPE, factor=2)  # the default place: the MLP after the gated heads
    assert r.gm.get_submodule("up").out_features == 24 and r.gm.get_submodule("down").in_features == 24


def test_operands_with_their_channels_on_the_same_dim_still_grow_together():
    """Both sides' channels are D (the heads come from a view of a Linear, as in a gated attention output): joined as
    before, the gate's Linear grows with the values' Linear."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v, self.g, self.o = nn.Linear(6, 20), nn.Linear(6, 20), nn.Linear(20, 6)

        def forward(self, x):
            b, t, _ = x.shape
            heads = self.v(x).view(b, t, 4, 5)
            return x + self.o((heads * torch.sigmoid(self.g(x)).view(b, t, -1, 5)).reshape(b, t, 20))

    c = analyze(gg.trace(Gated(), SHAPE))
    assert not c.why_frozen(c.group_of["g"])
    r = grown(Gated(), SHAPE, target="g", to=40)
    assert r.gm.get_submodule("v").out_features == 40 and r.gm.get_submodule("o").in_features == 40
