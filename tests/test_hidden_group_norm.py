"""grow_hidden under a GroupNorm of one group (issue 39: timm poolformerv2_m36 grow_hidden was refused, "the residual
stream reaches 'group_norm_71' (group_norm), which reads it in a way the analysis does not understand"). PoolFormer's
norm runs over the channels and the map together: new channels at 0, or at the old channels' mean at each position,
change its mean or variance, while copies of the old channels keep both; each channel's γ and β are copied with it.
So the stream grows by replication (an integer factor, ×2 by default) and other sizes are refused with the reason.
Spellings: nn.GroupNorm(1, C), F.group_norm(x, 1, γ) without a bias (timm's GroupNorm1NoBias), F.group_norm by
keywords; a channels-first stream (convs, a pooling token mixer, a per-channel layer scale), a LayerNorm at the head.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import NotApplicable
from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["module", "no bias", "keywords"]


class Norm(nn.Module):
    def __init__(self, spelling: str, c: int):
        super().__init__()
        self.spelling = spelling
        self.norm = nn.GroupNorm(1, c) if spelling == "module" else None
        self.weight = nn.Parameter(torch.rand(c) + 0.5) if spelling != "module" else None
        self.bias = nn.Parameter(torch.randn(c) * 0.1) if spelling == "keywords" else None

    def forward(self, x):
        if self.spelling == "module":
            return self.norm(x)
        if self.spelling == "no bias":
            return F.group_norm(x, 1, self.weight, None, 1e-5)
        return F.group_norm(x, num_groups=1, weight=self.weight, bias=self.bias, eps=1e-6)


class PoolFormer(nn.Module):
    """A 3 × 8 × 8 image → a 16-channel map by a strided conv, two blocks, pooled, LayerNorm, classified."""

    def __init__(self, spelling: str):
        super().__init__()
        self.stem, self.head_norm, self.head = nn.Conv2d(3, 16, 2, 2), nn.LayerNorm(16), nn.Linear(16, 5)
        self.norms = nn.ModuleList(Norm(spelling, 16) for _ in range(2))
        self.pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.scale = nn.Parameter(torch.rand(16) + 0.5)
        self.mlp = nn.Sequential(nn.Conv2d(16, 32, 1), nn.GELU(), nn.Conv2d(32, 16, 1))

    def forward(self, x):
        h = self.stem(x)
        y = self.norms[0](h)
        h = h + (self.pool(y) - y) * self.scale.view(16, 1, 1)
        h = h + self.mlp(self.norms[1](h))
        return self.head(self.head_norm(h.mean((2, 3))))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_stream_under_a_one_group_norm_grows_by_copies(spelling):
    torch.manual_seed(0)
    model = PoolFormer(spelling).eval()
    r = grow_checked(model, "x:1x3x8x8", "grow_hidden")
    assert r.targets["hidden"].startswith("16 → 32"), r.targets
    assert "replicated 2×" in r.targets["rule"] and "GroupNorm of one group" in r.targets["rule"], r.targets
    assert r.gm.stem.out_channels == 32 and r.gm.head.in_features == 32
    if spelling == "module":
        assert r.gm.get_submodule("norms.0.norm").num_channels == 32
    x = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_other_sizes_are_refused_with_the_reason():
    gm = gg.trace(PoolFormer("module").eval(), input_shape=(1, 3, 8, 8))
    with pytest.raises(NotApplicable, match="GroupNorm of one group"):
        gg.get_pass("grow_hidden")(by=8)(gm)
