"""grow_hidden on a stream whose norms torch.export leaves as ATen ops (issue 39: timm gemma4_vit_167m grow_hidden was
refused, "the residual stream reaches 'rms_norm_112' (rms_norm.default), which reads it in a way the analysis does not
understand"). F.rms_norm and torch.rms_norm are captured as aten.rms_norm.default, which takes the arguments of
F.rms_norm at the same places; F.layer_norm's ATen op likewise. They are the norms the analysis knows, read as such.
Spellings: F.rms_norm, torch.rms_norm (by keyword too), F.layer_norm with a bias; weights as parameters of the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["F.rms_norm", "torch.rms_norm", "keywords", "F.layer_norm"]


class Norm(nn.Module):
    def __init__(self, spelling: str, width: int):
        super().__init__()
        self.spelling = spelling
        self.weight, self.bias = nn.Parameter(torch.rand(width) + 0.5), nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x):
        w = self.weight.shape
        if self.spelling == "F.rms_norm":
            return F.rms_norm(x, w, self.weight, 1e-6)
        if self.spelling == "torch.rms_norm":
            return torch.rms_norm(x, w, self.weight, 1e-5)
        if self.spelling == "keywords":
            return F.rms_norm(x, normalized_shape=w, weight=self.weight, eps=1e-6)
        return F.layer_norm(x, w, self.weight, self.bias, 1e-5)


class Encoder(nn.Module):
    """Patches → 16 wide stream, two pre-norm MLP blocks, a final norm, a pooled classifier."""

    def __init__(self, spelling: str):
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.norms = nn.ModuleList(Norm(spelling, 16) for _ in range(3))
        self.up, self.down = (
            nn.ModuleList(nn.Linear(16, 32) for _ in range(2)),
            nn.ModuleList(nn.Linear(32, 16) for _ in range(2)),
        )
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.embed(x)
        for norm, up, down in zip(self.norms, self.up, self.down, strict=False):
            h = h + down(F.gelu(up(norm(h))))
        return self.head(self.norms[2](h).mean(1))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_aten_norms_on_the_stream_grow(spelling):
    torch.manual_seed(0)
    model = Encoder(spelling).eval()
    r = grow_checked(model, "x:1x6x12", "grow_hidden", capture="export")
    assert r.targets["hidden"].startswith("16 → 24"), r.targets
    assert r.targets["stream"].endswith("3 norms (" + ("LayerNorm)" if "layer" in spelling else "RMSNorm)")), r.targets
    assert r.gm.embed.out_features == 24 and r.gm.head.in_features == 24
    x = torch.randn(3, 6, 12)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)
