"""grow_hidden through a position table resized to the image (issue 39: timm naflexvit_base_patch16_gap grow_hidden was
refused, "the residual stream reaches '_upsample_bicubic2d_aa' (_upsample_bicubic2d_aa.vec), which produces stream
values the analysis does not understand"). The table, a (1, H, W, C) parameter, is viewed as a (1, C, H, W) map and
resized (interpolated) to the patch grid: every output is a fixed weighted sum of its own channel's entries, the same
weights for every channel, so the table's new channels (filled as the stream needs) pass through and it grows as a
writer of the stream. Spellings: F.interpolate bicubic with antialias under torch.export (ATen's
_upsample_bicubic2d_aa, NaFlexViT's), F.interpolate bilinear and nearest (by position) under fx.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CASES = [("bicubic", "export"), ("bilinear", "fx"), ("nearest", "fx")]


class Resized(nn.Module):
    """A 4 × 4 grid of 12-wide patches, a 3 × 3 position table resized onto it, a pre-norm block, pooled, classified."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.embed, self.head = nn.Linear(12, 16), nn.Linear(16, 5)
        self.pos = nn.Parameter(torch.randn(1, 3, 3, 16) * 0.1)
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(2))
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        table = self.pos.permute(0, 3, 1, 2)
        if self.spelling == "bicubic":
            table = F.interpolate(table, size=(4, 4), mode="bicubic", antialias=True, align_corners=False)
        elif self.spelling == "bilinear":
            table = F.interpolate(table, size=(4, 4), mode="bilinear", align_corners=False)
        else:
            table = torch.nn.functional.interpolate(table, (4, 4))  # nearest
        h = self.embed(x) + table.permute(0, 2, 3, 1).reshape(1, 16, 16)
        h = h + self.mlp(self.norms[0](h))
        return self.head(self.norms[1](h).mean(1))


@pytest.mark.parametrize(("spelling", "capture"), CASES)
def test_a_resized_position_table_grows(spelling, capture):
    torch.manual_seed(0)
    model = Resized(spelling).eval()
    r = grow_checked(model, "x:1x16x12", "grow_hidden", capture=capture)
    assert r.targets["hidden"].startswith("16 → 24"), r.targets
    assert r.gm.pos.shape == (1, 3, 3, 24)
    x = torch.randn(3, 16, 12)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)
