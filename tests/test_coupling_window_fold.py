"""Windows folded into the batch (Hiera's unroll, Swin-like partitions): a channels-last map is viewed as windows,
permuted, and the window dims flattened *into the batch*, before the channel axis. Each channel stays apart, so
grow_width widens through it; before, every group was frozen at the flatten ("not understood by the coupling
analysis"). Several spellings of the fold: the method with positional dims, torch.flatten with keywords, a
negative end dim, and a reshape back."""

from __future__ import annotations

import pytest
import torch
from conftest import grow_checked
from torch import nn


def fold(x: torch.Tensor, how: str) -> torch.Tensor:
    b, h, w, c = x.shape
    x = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 2, 4, 1, 3, 5)  # (B, 2, 2, h/2, w/2, C)
    if how == "method":
        return x.flatten(0, 2)
    if how == "function":
        return torch.flatten(x, start_dim=0, end_dim=2)
    return x.flatten(0, -4)  # the same three dims, counted from the end


class Unroll(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)  # (B, H, W, C)
        b = x.shape[0]
        t = fold(x, self.how)  # (4B, H/2, W/2, C)
        t = t + self.mlp(self.norm(t))
        return self.head(t.reshape(b, -1, t.shape[-1]).mean(1))


@pytest.mark.parametrize("how", ["method", "function", "negative"])
def test_width_grows_through_windows_folded_into_the_batch(how):
    r = grow_checked(
        Unroll(how), "x:2x3x8x8", "grow_width", target="stem", init="net2net", to=16
    )  # a LayerNorm reads it
    assert r.changed


def test_a_flatten_that_merges_the_channel_axis_still_couples_by_scale():
    """flatten(1) of (N, C, H, W) merges the channels with the map: the classifier's input grows by H·W per channel."""

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.fc = nn.Linear(4 * 8 * 8, 5)

        def forward(self, x):
            return self.fc(self.conv(x).flatten(1))

    r = grow_checked(Classifier(), "x:2x3x8x8", "grow_width", target="conv")
    assert r.changed
