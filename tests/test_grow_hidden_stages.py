"""grow_hidden on a CNN-style last stage (ConvNeXt, EdgeNeXt, DaViT, FocalNet, GCViT in timm): channels first, a norm
over the channels written as permute → LayerNorm → permute, a layer scale γ broadcast onto the channels, then a head
that pools, normalises, flattens and classifies. Each spelling below is one way published models write the pieces
(timm's nn.Flatten and γ.reshape(1, -1, 1, 1) were refused before: 'head_flatten … reads it in a way the analysis
does not understand', 'mul … produces stream values the analysis does not understand'). Grown ×2 (a depthwise conv
on the stream meets a LayerNorm's input: replication) and verified in both modes, every new parameter learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

C = 8
SPEC = "x:1x3x8x8"


class ChannelNorm(nn.LayerNorm):
    """timm's LayerNorm2d: a LayerNorm over the channels of (N, C, H, W)."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias).permute(0, 3, 1, 2)


class Stage(nn.Module):
    """stem conv → x + γ · mlp(norm(dwconv(x))) → pool → norm → flatten → Linear."""

    def __init__(self, scale: str, pool: str, flat: str):
        super().__init__()
        self.scale, self.pool_kind, self.flat = scale, pool, flat
        self.stem = nn.Conv2d(3, C, 2, stride=2)
        self.dw = nn.Conv2d(C, C, 3, padding=1, groups=C)
        self.norm = ChannelNorm(C)
        self.fc1, self.fc2 = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        self.gamma = nn.Parameter(torch.rand(C) + 0.5)
        self.pool, self.flatten = nn.AdaptiveAvgPool2d(1), nn.Flatten(1)
        self.head_norm, self.head = ChannelNorm(C), nn.Linear(C, 5)

    def layer_scale(self):
        g = self.gamma
        return {
            "reshape": lambda: g.reshape(1, -1, 1, 1),
            "view with the width written": lambda: g.view(1, C, 1, 1),
            "index": lambda: g[:, None, None],
            "unsqueeze": lambda: g.unsqueeze(-1).unsqueeze(-1),
        }[self.scale]()

    def pooled(self, x):
        if self.pool_kind == "module":
            return self.pool(x)
        if self.pool_kind == "function":
            return F.adaptive_avg_pool2d(x, 1)
        return x.mean((2, 3), keepdim=True)

    def flattened(self, x):
        return {
            "module": lambda: self.flatten(x),
            "method": lambda: x.flatten(1),
            "view": lambda: x.view(x.size(0), -1),
            "reshape": lambda: torch.reshape(x, (x.shape[0], -1)),
        }[self.flat]()

    def forward(self, x):
        x = self.stem(x)
        h = self.norm(self.dw(x)).permute(0, 2, 3, 1)
        h = self.fc2(F.gelu(self.fc1(h))).permute(0, 3, 1, 2)
        x = x + self.layer_scale() * h
        return self.head(self.flattened(self.head_norm(self.pooled(x))))


SPELLINGS = {
    "γ.reshape(1, -1, 1, 1), AdaptiveAvgPool2d, nn.Flatten": ("reshape", "module", "module"),
    "γ.view(1, C, 1, 1), F.adaptive_avg_pool2d, x.flatten(1)": ("view with the width written", "function", "method"),
    "γ[:, None, None], mean over H and W, x.view(N, -1)": ("index", "mean", "view"),
    "γ unsqueezed twice, AdaptiveAvgPool2d, torch.reshape": ("unsqueeze", "module", "reshape"),
}


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_a_channels_first_stage_and_its_pooled_head_grow(name, capture):
    torch.manual_seed(0)
    model = Stage(*SPELLINGS[name])
    gm = gg.trace(model, input_shape=parse_spec(SPEC), capture=capture)
    r = gg.get_pass("grow_hidden")()(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    assert r.targets["hidden"].startswith(f"{C} → {2 * C}")
    assert r.gm.get_submodule("stem").out_channels == 2 * C and r.gm.get_submodule("head").in_features == 2 * C
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(r.gm.eval()(x), model.eval()(x), atol=1e-5)


def test_a_flatten_that_merges_the_channels_with_space_is_refused():
    """nn.Flatten of (N, C, H, W) with H·W > 1 mixes each channel with the positions: a Linear reading it reads
    C·H·W features, no hidden axis to grow there."""

    class Unpooled(Stage):
        def forward(self, x):
            x = self.stem(x)
            x = x + self.layer_scale() * self.norm(self.dw(x))
            return nn.functional.linear(self.flatten(self.head_norm(x)), torch.ones(5, C * 16))

    gm = gg.trace(Unpooled("reshape", "module", "module"), input_shape=parse_spec(SPEC), capture="fx")
    with pytest.raises(gg.NotApplicable, match="mixes the hidden axis with others"):
        gg.get_pass("grow_hidden")()(gm)


class Gated(nn.Module):
    """Tokens (N, T, D) → x + fc(LayerNorm(x)), then x · σ(a·stat(x) + b) with stat(x) a mean or an extremum over the
    hidden axis (CBAM's spatial attention, CSATv2's: the channels' mean and max), → head(LayerNorm(x)). New
    coordinates equal to the old ones' mean keep every such statistic, so the stream grows by any size."""

    def __init__(self, stat: str):
        super().__init__()
        self.stat, self.embed = stat, nn.Embedding(20, C)
        self.norm, self.fc, self.norm2, self.head = nn.LayerNorm(C), nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, 3)
        self.mix = nn.Linear(2, 1)

    def statistics(self, x):
        return {
            "x.mean(-1), x.amax(-1)": lambda: torch.cat([x.mean(-1, keepdim=True), x.amax(-1, keepdim=True)], -1),
            "torch.mean, torch.max(…)[0]": lambda: torch.cat(
                [torch.mean(x, dim=2, keepdim=True), torch.max(x, dim=2, keepdim=True)[0]], -1
            ),
            "x.mean() over every axis, .min(-1).values": lambda: torch.cat(
                [x.mean().expand(x.shape[0], x.shape[1], 1), x.min(-1, keepdim=True).values], -1
            ),
        }[self.stat]()

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.fc(self.norm(x))
        x = x * torch.sigmoid(self.mix(self.statistics(x)))
        return self.head(self.norm2(x))


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize(
    "stat", ["x.mean(-1), x.amax(-1)", "torch.mean, torch.max(…)[0]", "x.mean() over every axis, .min(-1).values"]
)
def test_a_mean_or_extremum_over_the_hidden_axis_reads_the_mean_fill(stat, capture):
    torch.manual_seed(0)
    gm = gg.trace(Gated(stat), input_shape=parse_spec("ids:1x5:int64"), capture=capture)
    r = gg.get_pass("grow_hidden")(to=11)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    assert "mean of the old ones" in r.targets["rule"]


def test_a_sum_over_the_hidden_axis_is_still_refused():
    """A sum over the hidden axis grows with the width (no fill keeps it but zeros, and a LayerNorm's input needs the
    mean): refused, not guessed."""

    class Summed(Gated):
        def statistics(self, x):
            return torch.cat([x.sum(-1, keepdim=True), x.amax(-1, keepdim=True)], -1)

    gm = gg.trace(Summed("x.mean(-1), x.amax(-1)"), input_shape=parse_spec("ids:1x5:int64"), capture="fx")
    with pytest.raises(gg.NotApplicable, match="sum"):
        gg.get_pass("grow_hidden")(to=11)(gm)


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    """timm's drop_path, as written there: under torch.fx its branches become a mode switch fed keep_prob."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.drop_prob = p

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class Windows(nn.Module):
    """Tokens of an H×W grid padded up to whole windows (DaViT, Swin: F.pad with pads computed from the sizes, or
    written as numbers), a Linear per token, cropped back; each block's branch behind timm's drop-path."""

    def __init__(self, computed: bool):
        super().__init__()
        self.computed, self.window = computed, 4
        self.stem, self.norm, self.fc = nn.Conv2d(3, C, 1), nn.LayerNorm(C), nn.Linear(C, C)
        self.drop_path, self.norm2, self.head = DropPath(0.1), nn.LayerNorm(C), nn.Linear(C, 3)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)  # (N, H, W, C)
        _, h, w, _ = x.shape
        y = self.norm(x)
        if self.computed:
            y = F.pad(
                y,
                (
                    0,
                    0,
                    0,
                    (self.window - w % self.window) % self.window,
                    0,
                    (self.window - h % self.window) % self.window,
                ),
            )
        else:
            y = F.pad(y, (0, 0, 0, 2, 0, 2))
        x = x + self.drop_path(self.fc(y)[:, :h, :w, :])
        return self.head(self.norm2(x).mean((1, 2)))


@pytest.mark.parametrize("computed", [True, False])
def test_window_padding_and_timm_drop_path_carry_the_stream(computed):
    torch.manual_seed(0)
    gm = gg.trace(Windows(computed), input_shape=parse_spec("x:1x3x6x6"), capture="fx")
    r = gg.get_pass("grow_hidden")(to=13)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    assert r.gm.get_submodule("head").in_features == 13
