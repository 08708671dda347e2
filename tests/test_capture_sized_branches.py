"""Layers fx cannot reach: a submodule whose forward branches on a tensor's size (TensorFlow-style "same" padding
computed from the input's height and width, a check of the channel count that raises) cannot be traced
symbolically, and was kept whole as a leaf with its conv, norm and activation inside (issue 39: hf mobilenet_v1 and
mobilenet_v2 grow_width were refused, 'no layer in this model has a channel group that can grow'). With an example
input, capture "auto" then captures with torch.export, which fixes those sizes to the example's; the padding
becomes F.pad, which the coupling analysis follows (a pad of the channel dim is frozen with the reason)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.graph.graph_meta import trace_report

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def same_pad_if(x, k: int, s: int):
    """TF "SAME" padding as HF MobileNet writes it: shape read as x.shape[-2:], branches on divisibility."""
    h, w = x.shape[-2:]
    ph = max(k - s, 0) if h % s == 0 else max(k - h % s, 0)
    pw = max(k - s, 0) if w % s == 0 else max(k - w % s, 0)
    return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), "constant", 0.0)


def same_pad_ceil(x, k: int, s: int):
    """The same padding written with x.size() and a ceiling division (timm's get_same_padding, without its fx
    wrapping)."""
    pads = []
    for size in (x.size(-1), x.size(-2)):
        total = max((-(-size // s) - 1) * s + k - size, 0)
        pads += [total // 2, total - total // 2]
    return nn.functional.pad(x, pads)


class SameConv(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, s: int, spelling: str):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, k, s), nn.BatchNorm2d(cout)
        self.k, self.s, self.spelling = k, s, spelling

    def forward(self, x):
        if self.spelling == "checks its channels":  # LeViT's patch embedding: a size check that raises
            if x.shape[1] != self.conv.in_channels:
                raise ValueError("wrong number of channels")
            x = F.pad(x, (1, 1, 1, 1))
        elif self.spelling == "x.shape and if":
            x = same_pad_if(x, self.k, self.s)
        else:
            x = same_pad_ceil(x, self.k, self.s)
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.a, self.b = SameConv(3, 8, 3, 2, spelling), SameConv(8, 16, 3, 1, spelling)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.b(self.a(x)).mean((2, 3)))


SPELLINGS = ["x.shape and if", "x.size() and a ceiling division", "checks its channels"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_layers_inside_a_size_branching_module_are_captured_and_grow(spelling):
    torch.manual_seed(0)
    gm = gg.trace(Net(spelling), input_shape=(2, 3, 9, 9))
    report = trace_report(gm)
    assert report["capture"] == "export" and "symbolic tracing kept 2 submodules holding layers" in str(report)
    r = gg.get_pass("grow_width")()(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    assert any(r.gm.get_submodule(p).out_channels > c for p, c in (("a.conv", 8), ("b.conv", 16)))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_leaves_the_user_names_and_the_fx_capture_stay_as_asked(spelling):
    torch.manual_seed(0)
    assert trace_report(gg.trace(Net(spelling), (2, 3, 9, 9), leaves=["a"], auto_leaves=True))["capture"] == "fx"
    gm = gg.trace(Net(spelling), (2, 3, 9, 9), capture="fx")
    assert trace_report(gm)["capture"] == "fx" and set(trace_report(gm)["auto_leaves"]) == {"a", "b"}


class ChannelPad(nn.Module):
    """conv → pad → conv: the pad `how` adds zeros around the map or two zero channels in front of the channels."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b = how, nn.Conv2d(3, 8, 3), nn.Conv2d(10 if "channel" in how else 8, 4, 3)

    def forward(self, x):
        y = torch.relu(self.a(x))
        if self.how == "F.pad of the channel dim":
            y = F.pad(y, (0, 0, 0, 0, 2, 0))
        elif self.how == "torch.constant_pad_nd of the channel dim":
            y = torch.constant_pad_nd(y, (0, 0, 0, 0, 2, 0))
        elif self.how == "nn.ZeroPad2d":
            y = nn.functional.pad(y, (1, 1, 1, 1))
        else:  # torch.constant_pad_nd around the map
            y = torch.constant_pad_nd(y, (1, 1, 1, 1), 0.0)
        return self.b(y)


@pytest.mark.parametrize(
    "how, capture",
    [
        ("F.pad of the channel dim", "fx"),
        ("F.pad of the channel dim", "export"),
        ("torch.constant_pad_nd of the channel dim", "export"),  # fx keeps torch.constant_pad_nd: export's spelling
        ("nn.ZeroPad2d", "fx"),
        ("nn.ZeroPad2d", "export"),
        ("torch.constant_pad_nd around the map", "export"),
    ],
)
def test_a_pad_keeps_channels_unless_it_pads_them(how, capture):
    torch.manual_seed(0)
    gm = gg.trace(ChannelPad(how), (2, 3, 8, 8), capture=capture)
    c = analyze(gm)
    conv_a = next(n.name for n in gm.graph.nodes if "a" in str(n.target).split(".") or n.name in ("a", "conv2d"))
    group = c.group(conv_a)
    if "channel dim" in how:
        assert not group.growable and any("pads the channel dim by [2, 0]" in f for f in group.frozen), group.frozen
    else:
        assert group.growable, group.frozen
        r = gg.get_pass("grow_width")(target="a")(gm)
        assert r.gm.get_submodule("a").out_channels > 8 and r.preservation.eval.ok and r.preservation.trainable_ok
