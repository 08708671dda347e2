"""Channel-coupling analysis on small graphs whose answer is known."""

from __future__ import annotations

import torch
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.rewrite.widen import Insertion, make_layout, plan_growth


def analyzed(model, shape):
    gm = gg.trace(model, shape)
    gg.annotate(gm, shape)
    return gm, analyze(gm)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.stem(x)))
        return self.head(self.dw(h + self.conv(h)))


def test_residual_add_batchnorm_and_depthwise_join_one_group():
    _, c = analyzed(Residual(), (1, 3, 8, 8))
    g = c.group("stem")
    assert set(g.members) == {"stem", "bn", "relu", "conv", "add", "dw"}
    assert g.sources == ["stem", "conv"] and g.consumers == ["conv", "head"] and g.channelwise == ["bn", "dw"]
    assert g.growable and not c.why_frozen(g.id)
    assert c.group("head").frozen == ["'head': it is the model's output"]
    assert "it is the model's input" in c.group("x").frozen[0]


class SqueezeExcite(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Conv2d(8, 2, 1)
        self.fc2 = nn.Conv2d(2, 8, 1)
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        h = self.conv(x)
        s = torch.sigmoid(self.fc2(torch.relu(self.fc1(h.mean((2, 3), keepdim=True)))))
        return self.out(h * s)


def test_squeeze_excitation_multiply_couples_the_gate_with_the_features():
    _, c = analyzed(SqueezeExcite(), (1, 3, 8, 8))
    g = c.group("conv")
    assert {"conv", "mean", "fc2", "sigmoid", "mul"} <= set(g.members)
    assert g.sources == ["conv", "fc2"] and g.consumers == ["fc1", "out"]


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 6, 1)
        self.mix = nn.Conv2d(10, 5, 1)
        self.fc = nn.Linear(5 * 2 * 2, 3)

    def forward(self, x):
        h = self.mix(torch.cat([self.a(x), self.b(x)], 1))
        return self.fc(torch.flatten(h, 1))


def test_cat_offsets_and_flatten_scales_carry_growth_to_the_right_places():
    _, c = analyzed(Concat(), (1, 3, 2, 2))
    plan = plan_growth(c, c.group_of["a"], 2)
    cat_gid = c.group_of["cat"]
    assert [(i.pos, i.count) for i in plan[cat_gid]] == [(4, 2)]  # a's channels end at offset 4 of the cat
    plan_b = plan_growth(c, c.group_of["b"], 3)
    assert [(i.pos, i.count) for i in plan_b[cat_gid]] == [(10, 3)]  # b's end at 4 + 6
    plan_mix = plan_growth(c, c.group_of["mix"], 1)
    assert [(i.pos, i.count) for i in plan_mix[c.group_of["flatten"]]] == [(20, 4)]  # 1 channel × 2·2 features


def test_layouts_place_old_and_new_channels():
    lay = make_layout(5, [Insertion(2, 2, [None, None]), Insertion(5, 1, [0])])
    assert (
        lay.old_to_new == [0, 1, 4, 5, 6] and lay.new_slots == [2, 3, 7] and lay.new == 8 and lay.src == [None, None, 0]
    )


def test_layernorm_grouped_conv_and_unknown_ops_freeze_with_reasons():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 1)
            self.gconv = nn.Conv2d(8, 8, 1, groups=2)
            self.lin = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8)
            self.lin2 = nn.Linear(8, 2)

        def forward(self, x):
            h = self.gconv(self.conv(x)).mean((2, 3))
            return self.lin2(self.ln(self.lin(h)).cumsum(1))

    _, c = analyzed(Frozen(), (1, 3, 4, 4))
    # a grouped conv ties its input channels to its 2 groups: they grow in steps of 2, one per group
    assert c.step(c.group_of["conv"]) == 2 and c.group("conv").block_reasons == ["grouped conv 'gconv' (groups=2)"]
    # a LayerNorm over the channels joins its group (growable by equal replication only) ...
    assert c.group_of["lin"] == c.group_of["ln"] and c.group("lin").norms == ["ln"]
    # ... and the unknown op after it freezes the whole group
    assert any(
        "'cumsum' (cumsum) is not understood by the coupling analysis" in r for r in c.why_frozen(c.group_of["ln"])
    )
