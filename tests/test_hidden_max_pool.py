"""grow_hidden through max pooling of the stream's map (issue 39: timm mvitv2_tiny and nest_tiny grow_hidden were
refused, "the residual stream reaches 'stages_3_blocks_0_shortcut_pool_attn' / 'levels_2_pool_pool' (module …), which
produces stream values the analysis does not understand"). Tokens viewed as a (B, C, H, W) map and max-pooled: each
channel's largest value over a window, the channel alone, so a new coordinate held at 0 pools to 0 (padding is -inf)
and a copy pools to a copy; the mean of the old ones does not pool to the mean of their maxima, so both sides of the
pool take the zero fill (or every coordinate is replicated where a LayerNorm's input needs the mean). Spellings:
nn.MaxPool2d with padding, F.max_pool2d, F.adaptive_max_pool2d, nn.AdaptiveMaxPool2d after a reshape; under LayerNorms
(replicated) and RMSNorms (zero fill). An average pool of the map (nn.AvgPool2d, F.avg_pool2d without counting the
padding: PoolFormer's token mixer) is linear and the same for every channel: any fill passes (+50 % under LayerNorms).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["module", "function", "adaptive", "adaptive module", "avg module", "avg function"]


class Levels(nn.Module):
    """A 4 × 4 map of 16-wide tokens, a block, max pooling to 2 × 2, a block, a final norm and a classifier."""

    def __init__(self, spelling: str, norm: type):
        super().__init__()
        self.spelling = spelling
        self.embed, self.head = nn.Linear(12, 16), nn.Linear(16, 5)
        self.norms = nn.ModuleList(norm(16) for _ in range(3))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
        self.pool = nn.MaxPool2d(3, 2, padding=1) if spelling == "module" else nn.AdaptiveMaxPool2d(2)
        self.pool = nn.AvgPool2d(2) if spelling == "avg module" else self.pool

    def forward(self, x):
        b = x.shape[0]
        h = self.embed(x)
        h = h + self.mlps[0](self.norms[0](h))
        m = h.transpose(1, 2).reshape(b, 16, 4, 4)
        if self.spelling == "function":
            m = F.max_pool2d(m, 2)
        elif self.spelling == "adaptive":
            m = F.adaptive_max_pool2d(m, (2, 2))
        elif self.spelling == "avg function":
            m = F.avg_pool2d(m, 3, 2, 1, count_include_pad=False)
        else:
            m = self.pool(m)
        h = m.flatten(2).transpose(1, 2)
        h = h + self.mlps[1](self.norms[1](h))
        return self.head(self.norms[2](h).mean(1))


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_a_max_pooled_stream_grows(spelling, norm):
    torch.manual_seed(0)
    model = Levels(spelling, norm).eval()
    r = grow_checked(model, "x:1x16x12", "grow_hidden")
    # a LayerNorm before a max pool: its input needs the mean, the pool zeros (replicated); an average pool is linear,
    # the same for every channel: any fill passes
    new = 32 if norm is nn.LayerNorm and "avg" not in spelling else 24
    assert r.targets["hidden"].startswith(f"16 → {new}"), r.targets
    assert r.gm.embed.out_features == new and r.gm.head.in_features == new
    x = torch.randn(3, 16, 12)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)
