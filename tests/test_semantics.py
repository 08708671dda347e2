"""The coupling analysis knows layers by behaviour: subclasses of standard layers and opaque leaves are probed."""

from __future__ import annotations

import torch
from test_trace_fidelity import DropPath
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.analysis.probe import module_is_channelwise


class BatchNormAct(nn.BatchNorm2d):
    """timm-style BatchNorm with a fused activation, constructed with extra arguments."""

    def __init__(self, c, act_layer=nn.ReLU):
        super().__init__(c)
        self.act = act_layer()

    def forward(self, x):
        if self.training:  # forces a leaf: the forward branches on the mode
            return self.act(super().forward(x))
        return self.act(super().forward(x))


class MixChannels(nn.Module):
    def forward(self, x):
        return x.softmax(1)


def net(act=nn.SiLU, extra=None):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        BatchNormAct(8, act),
        extra or DropPath(0.3),
        nn.Conv2d(8, 4, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


def test_probe_tells_per_example_drops_from_per_element_dropout():
    assert module_is_channelwise(DropPath(0.5), (2, 8, 4, 4), 1)
    assert not module_is_channelwise(nn.Dropout(0.5), (2, 8, 4, 4), 1)
    assert not module_is_channelwise(MixChannels(), (2, 8, 4, 4), 1)


def test_subclass_with_fused_activation_grows_and_keeps_its_class_and_activation():
    gm = gg.trace(net(), (1, 3, 8, 8))
    report = gm.meta["graphgrow"]["trace"]
    assert "1" in report["auto_leaves"] and "2" in report["merged_blocks"]  # DropPath: every path merged
    r = gg.Pipeline.from_spec("grow_width(target=0)").run(gm).results[0]
    bn = r.gm.get_submodule("1")
    assert type(bn) is BatchNormAct and isinstance(bn.act, nn.SiLU) and bn.num_features == 16
    assert r.preservation.eval.ok and r.preservation.train.ok


def test_an_opaque_channel_mixing_leaf_freezes_its_group_and_names_itself():
    gm = gg.trace(net(extra=MixChannels()), (1, 3, 8, 8), leaves=["2"])
    gg.annotate(gm, (1, 3, 8, 8))
    coupling = analyze(gm)
    reasons = coupling.why_frozen(coupling.group_of["_0"])
    assert any("'2' (MixChannels) is not understood" in r for r in reasons)
