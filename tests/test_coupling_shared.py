"""A module with parameters called several times (shared weights) has one weight for all its calls: its MLP's hidden
width grows once, with the same new channels at every call, and the growth stays exact. Two spellings: ALBERT's one
layer run in a loop, and a recurrent block listed twice in a ModuleList (HRM's cycles)."""

from __future__ import annotations

import pytest
import torch
from conftest import grown
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze


class Layer(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.ffn, self.out, self.norm = nn.Linear(d, h), nn.Linear(h, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.out(torch.nn.functional.gelu(self.ffn(x))))


class Looped(nn.Module):
    """ALBERT: one layer object, called at every depth."""

    def __init__(self):
        super().__init__()
        self.proj, self.layer, self.head = nn.Linear(8, 16), Layer(), nn.Linear(16, 3)

    def forward(self, x):
        h = self.proj(x)
        for _ in range(3):
            h = self.layer(h)
        return self.head(h)


class Cycled(nn.Module):
    """A recurrent block listed twice in a ModuleList (one object, two entries)."""

    def __init__(self):
        super().__init__()
        block = Layer()
        self.proj, self.blocks, self.head = nn.Linear(8, 16), nn.ModuleList([block, block]), nn.Linear(16, 3)

    def forward(self, x):
        h = self.proj(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.mark.parametrize("model", [Looped, Cycled])
def test_a_shared_layer_grows_once_for_every_call(model):
    gm = gg.trace(model().eval(), (2, 5, 8))
    c = analyze(gm)
    calls = [n.name for n in gm.graph.nodes if n.op == "call_module" and str(n.target).endswith("ffn")]
    assert len(calls) >= 2 and len({c.group_of[n] for n in calls}) == 1  # every call's hidden channels: one group
    assert not c.why_frozen(c.group_of[calls[0]])
    r = grown(model().eval(), (2, 5, 8), target=calls[0], factor=1.5)
    layer = r.gm.get_submodule(next(n.target for n in r.gm.graph.nodes if n.name == calls[0]))
    assert layer.out_features == 48  # grown once, not once per call
