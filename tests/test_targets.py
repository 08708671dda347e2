"""Default targets find the backbone's last (N, C, H, W) feature map, also with channels-last code around it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.analysis.targets import feature_span


class LayerNorm2d(nn.LayerNorm):
    """ConvNeXt's channels-first LayerNorm: permute → LayerNorm → permute."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(
            0, 3, 1, 2
        )


class ConvNeXtish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 4, stride=4)
        self.dw = nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.norm = LayerNorm2d(16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.gamma = nn.Parameter(torch.full((16,), 1e-2))
        self.head_norm = LayerNorm2d(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.stem(x)
        y = self.norm(self.dw(x)).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(y))) * self.gamma
        x = x + y.permute(0, 3, 1, 2)
        x = self.head_norm(F.adaptive_avg_pool2d(x, 1))  # the head works channels-last on (N, C, 1, 1)
        return self.head(x.flatten(1))


class Swinish(nn.Module):
    """Features kept channels-last (N, H, W, C) through the blocks, permuted back before pooling."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 12, 4, stride=4)
        self.norm = nn.LayerNorm(12)
        self.mlp = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)
        x = x + self.mlp(self.norm(x))
        x = x.permute(0, 3, 1, 2)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_convnext_style_head_does_not_hide_the_backbone():
    gm = gg.trace(ConvNeXtish(), (1, 3, 32, 32))
    gg.annotate(gm, (1, 3, 32, 32))
    start, end, _ = feature_span(gm)
    assert end.meta["gg_shape"] == (1, 16, 8, 8)
    r = gg.Pipeline.from_spec("add_residual").run(gm).results[0]
    # one stage, never from the raw image: over the block, from the stem's output to the block's sum
    assert r.targets["start"].startswith("stem [1, 16, 8, 8]") and r.targets["end"].startswith("add [1, 16, 8, 8]")
    assert r.targets["skip"] == "identity × gate (gate = 0)" and r.preservation.eval.ok


def test_swin_style_channels_last_blocks_end_at_the_permuted_back_map():
    gm = gg.trace(Swinish(), (1, 3, 32, 32))
    gg.annotate(gm, (1, 3, 32, 32))
    _, end, _ = feature_span(gm)
    assert end.meta["gg_shape"] == (1, 12, 8, 8)
    r = gg.Pipeline.from_spec("insert_adapter").run(gm).results[0]
    assert r.targets["adapter"] == "Conv2d 12→12, [I | 0]"


def test_squeeze_excitation_pools_are_not_the_head():
    class SE(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Conv2d(8, 8, 1)
            self.out = nn.Conv2d(8, 8, 3, stride=2, padding=1)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            x = self.conv(x)
            x = x * torch.sigmoid(self.fc(F.adaptive_avg_pool2d(x, 1)))
            return self.head(F.adaptive_avg_pool2d(self.out(x), 1).flatten(1))

    gm = gg.trace(SE(), (1, 3, 16, 16))
    gg.annotate(gm, (1, 3, 16, 16))
    assert feature_span(gm)[1].meta["gg_shape"] == (1, 8, 8, 8)
