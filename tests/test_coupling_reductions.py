"""Reductions the coupling analysis reads by what they compute: a vector norm over space keeps each channel apart
(ConvNeXt-V2's GRN computes ‖x‖₂ per channel), so the group grows exactly; a norm across the channels (nGPT's
x / ‖x‖ over the hidden units) makes every channel depend on all of them, so the group is refused naming the op.
Each in two spellings."""

from __future__ import annotations

import pytest
import torch
from conftest import grown
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze


class SpaceNormConv(nn.Module):
    """NCHW: each channel gated by its own spatial L2 norm (x.norm over H, W)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h * torch.sigmoid(h.norm(p=2, dim=(2, 3), keepdim=True)))


class SpaceNormLast(nn.Module):
    """Channels last, as GRN: torch.linalg.vector_norm over H, W of a [B, H, W, C] map."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x.permute(0, 2, 3, 1)))
        g = torch.linalg.vector_norm(h, ord=2, dim=(1, 2), keepdim=True)
        return self.b(h + h * g)


@pytest.mark.parametrize("model", [SpaceNormConv, SpaceNormLast])
def test_a_norm_over_space_keeps_each_channel(model):
    r = grown(model().eval(), (1, 3, 4, 4), target="a", factor=2.0)
    w = r.gm.get_submodule("a")
    assert (w.out_channels if isinstance(w, nn.Conv2d) else w.out_features) == 16


class SumSquares(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h * torch.rsqrt((h * h).sum(-1, keepdim=True) + 1e-6))


class NormDivide(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h / h.norm(dim=-1, keepdim=True))


@pytest.mark.parametrize("model", [SumSquares, NormDivide])
def test_a_norm_across_channels_is_refused_naming_the_op(model):
    gm = gg.trace(model().eval(), (2, 8))
    c = analyze(gm)
    up = next(n.name for n in gm.graph.nodes if n.target == "up")
    why = " ".join(c.why_frozen(c.group_of[up]))
    assert "reduces across these 16 channels" in why and "not understood" not in why
    from graphgrow.passes.grow_width import GrowWidth

    from graphgrow.core.errors import NotApplicable

    with pytest.raises(NotApplicable, match=r"first main-path one, of 'up' \(16 channels\): .* reduces across"):
        GrowWidth()(gm)  # the refusal names the op, not only "no layer can grow"


class SubNorm(nn.Module):
    """BitNet's MLP: the hidden channels normalised across themselves before the down projection."""

    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.functional:
            h = torch.nn.functional.layer_norm(h, (16,), self.norm.weight, self.norm.bias)
        else:
            h = self.norm(h)
        return self.down(h) + x


@pytest.mark.parametrize("functional", [False, True])
def test_only_groups_under_a_norm_is_a_stated_impossibility_for_init_zero(functional):
    from graphgrow.passes.grow_width import GrowWidth

    from graphgrow.core.errors import NotApplicable

    gm = gg.trace(SubNorm(functional).eval(), (2, 8))
    with pytest.raises(NotApplicable, match="normalised across its channels .* would not be exact"):
        GrowWidth()(gm)
    grown(SubNorm(functional).eval(), (2, 8), init="net2net")  # copies keep the statistics: exact


class TokenScan(nn.Module):
    """An embedding's stream, and an inner width run through a scan over the tokens written as a matmul (as a
    selective scan is): no group can grow, each for its own reason."""

    def __init__(self):
        super().__init__()
        self.emb, self.up, self.down = nn.Embedding(10, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, ids):
        x = self.emb(ids)
        h = self.up(x)
        h = torch.matmul(torch.tril(torch.ones(h.shape[1], h.shape[1])), h) * h
        return self.down(h) + x


def test_a_refusal_names_the_op_that_stops_an_inner_width_as_well():
    """Was 'no layer in this model has a channel group that can grow': the stream was passed over where the embedding
    makes it, and the inner width, which no layer reads past the matmul, was not looked at."""
    gm = gg.trace(TokenScan(), input_shape={"ids": ((1, 5), torch.int64)})
    with pytest.raises(
        gg.NotApplicable,
        match=r"of 'down' \(8 channels\): 'emb': Embedding .*; the first the analysis "
        r"does not follow, of 'up' \(16 channels\): 'up': 'matmul_1' \(matmul\) is not understood",
    ):
        gg.get_pass("grow_width")()(gm)


def test_a_refusal_names_the_leaf_that_holds_the_layers():
    """LeViT's residual layers kept whole by the capture: the refusal said only that no group can grow."""
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), nn.ReLU())
    gm = gg.trace(model, (1, 8), leaves=["0"])
    with pytest.raises(gg.NotApplicable, match=r"the layers of '0' \(Sequential\) are inside a module the capture"):
        gg.get_pass("grow_width")()(gm)
