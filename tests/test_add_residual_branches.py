"""add_residual's default on a backbone whose branches exchange features in every block, so that no one tensor lies
on every path from the input to the output (issue 39: timm crossvit_tiny_240 was refused, 'no two main-path tensors
of the backbone (1 stage(s) of one tensor each) can be connected'; its two token branches meet only through cross
attention on their class tokens). The default is then a gated skip over one whole block of a branch: from the
output of the block before to the last residual add (y = x + f(x)) of the same shape. Exact, and the gate learns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class TwoBranches(nn.Module):
    """Two token branches of widths 8 and 12, two blocks each; after each block each branch's first token gets a
    projection of the other branch's first token (CrossViT's fusion). `spelling`: how the residual adds are written."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.stem = nn.Linear(6, 6)  # one tensor every path passes through: one stage of one tensor
        self.embed = nn.ModuleList([nn.Linear(6, 8), nn.Linear(6, 12)])
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for d in (8, 12)])
            for _ in range(2)
        )
        self.cross = nn.ModuleList(nn.ModuleList([nn.Linear(12, 8), nn.Linear(8, 12)]) for _ in range(2))
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(12, 3)])

    def residual(self, x, f):
        if self.spelling == "operator":
            return x + f(x)
        if self.spelling == "torch.add":
            return torch.add(x, f(x))
        y = f(x)  # in place, the block's output first
        y += x
        return y

    def forward(self, x):
        x = self.stem(x)
        xs = [e(x) for e in self.embed]
        for blocks, cross in zip(self.blocks, self.cross):
            xs = [self.residual(t, b) for t, b in zip(xs, blocks)]
            c0, c1 = xs[0][:, :1] + cross[0](xs[1][:, :1]), xs[1][:, :1] + cross[1](xs[0][:, :1])
            xs = [torch.cat([c0, xs[0][:, 1:]], dim=1), torch.cat([c1, xs[1][:, 1:]], dim=1)]
        return (self.heads[0](xs[0][:, 0]) + self.heads[1](xs[1][:, 0])) / 2


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("spelling", ["operator", "torch.add", "in place"])
def test_parallel_branches_get_a_skip_over_one_block(spelling, capture):
    gm = gg.trace(TwoBranches(spelling), input_shape=(2, 5, 6), capture=capture)
    r = gg.get_pass("add_residual")()(gm)
    assert "over one block" in r.targets["chosen"] and r.targets["skip"].startswith("identity × gate")
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    (start, s_shape), (end, e_shape) = (r.targets[k].split(" ", 1) for k in ("start", "end"))
    assert start != end and s_shape == e_shape  # two block outputs of one branch, not the input


class Chain(nn.Module):
    """One branch: its main path has the stage spans add_residual took before (unchanged by the fallback)."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Linear(6, 8), nn.LayerNorm(8)
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.embed(x)
        for fc in self.fcs:
            x = x + fc(self.norm(x))
        return self.head(x.mean(1))


def test_a_single_chain_keeps_its_stage_span():
    r = gg.get_pass("add_residual")()(gg.trace(Chain(), input_shape=(2, 5, 6)))
    assert "over one block" not in r.targets["chosen"]
