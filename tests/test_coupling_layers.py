"""Coupling through parameters and layers written as calls (issue 28 item 4): `F.linear` / `F.conv2d` on a
layer's own parameters, GroupNorm (new channels as whole new groups), a token stream with a class token
(`expand` + `cat`), a position table added to it and class-token pooling (`x[:, 0]`), attention head sizes
(q/k and v/output channels of `scaled_dot_product_attention`), and weight-standardised convs (refused on their
input side with the reason). Each rule: exact growth in eval and train mode through grow_width's verification
(`grown`), and an onnxruntime check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import grown, randomize_bn
from graphgrow.passes.add_branch import AddBranch, branch_sites
from graphgrow.passes.grow_width import GrowWidth
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence

IMAGE = (1, 3, 8, 8)


class CallLinear(nn.Linear):
    """timm's Linear: a subclass whose forward is the function call (traced through, not a leaf)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class CallConv(nn.Conv2d):
    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class StdConv(nn.Conv2d):
    """Weight standardisation as timm's StdConv2d computes it."""

    def forward(self, x):
        w = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0, eps=1e-6
        ).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class GroupNormAct(nn.GroupNorm):
    """timm's GroupNormAct: the norm as a call, then an activation."""

    def forward(self, x):
        return torch.relu(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class Calls(nn.Module):
    """A residual stream fed by a module conv and a called conv, read by a called classifier."""

    def __init__(self):
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.b = CallConv(8, 8, 3, padding=1)
        self.head = CallLinear(8, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        h = h + self.b(h)  # the called conv reads and writes the stream: its rows and columns grow
        # dropout as a call on the flag (timm's classifier): verification's train mode switches it off, as a layer's
        return self.head(F.dropout(h.mean((2, 3)), 0.2, self.training))


class GroupNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.gn = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.b, self.gn2 = nn.Conv2d(8, 12, 3, padding=1), GroupNormAct(3, 12)
        self.c = nn.Conv2d(12, 4, 1)

    def forward(self, x):
        h = torch.relu(self.gn(self.a(x)))
        return self.c(self.gn2(self.b(h))).mean((2, 3))


class Attention(nn.Module):
    """timm's: one fused qkv, reshape (B, N, 3, H, D), permute, unbind; or separate q/k/v projections."""

    def __init__(self, dim, heads, fused=True):
        super().__init__()
        self.h, self.d, self.fused = heads, dim // heads, fused  # head size a constant, as timm's
        if fused:
            self.qkv = nn.Linear(dim, 3 * dim)
        else:
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).reshape(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (p(x).reshape(b, n, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, -1))


class TinyViT(nn.Module):
    def __init__(self, dim=16, heads=2, fused=True):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim))
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, fused)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 3)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = x + self.attn(self.norm1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x)[:, 0])


class Standardised(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 1), StdConv(8, 8, 3, padding=1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_called_linear_and_conv_grow_their_own_parameters():
    r = grown(
        Calls(), IMAGE, target="a", to=24
    )  # 8 → 24: enough for other dropout masks, were dropout not switched off
    b, head = r.gm.get_submodule("b"), r.gm.get_submodule("head")
    assert tuple(b.weight.shape) == (24, 24, 3, 3) and tuple(b.bias.shape) == (24,)  # traced through: parameters only
    assert tuple(head.weight.shape) == (5, 24)
    assert head.weight[:, 8:].abs().sum() == 0  # new input columns: zero
    assert b.weight[8:].abs().sum() > 0  # new output rows of the called conv: random, so they learn


def test_group_norm_grows_by_whole_new_groups_and_says_which_increments_work():
    r = grown(GroupNorms(), IMAGE, target="a", to=12)  # 2 channels per group: two new groups
    gn = r.gm.get_submodule("gn")
    assert (gn.num_groups, gn.num_channels) == (6, 12)
    r = grown(GroupNorms(), IMAGE, target="b", to=20)  # the called group_norm: 4 per group, 2 new groups; G rewritten
    assert r.gm.get_submodule("gn2").weight.shape == (20,)
    assert any(n.target is F.group_norm and 5 in n.args for n in r.gm.graph.nodes)
    with pytest.raises(gg.NotApplicable, match=r"whole GroupNorm groups.*grow by a multiple of 4 \(e\.g\. to=16\)"):
        GrowWidth(target="b", to=14)(gg.trace(GroupNorms(), IMAGE))
    with pytest.raises(gg.NotApplicable, match="new channels form new groups"):
        GrowWidth(target="a", to=16, init="net2net")(gg.trace(GroupNorms(), IMAGE))


class PoolFormerish(nn.Module):
    """GroupNorm(1, C) (one group over every channel) and a layer scale viewed with the channel count as a literal."""

    def __init__(self):
        super().__init__()
        self.stem, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(1, 8)
        self.mix, self.scale = nn.Conv2d(8, 8, 1), nn.Parameter(torch.rand(8) + 0.5)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.scale.view(8, 1, 1) * self.mix(self.norm(h))
        return self.head(h).mean((2, 3))


def test_one_group_norm_grows_by_a_second_group_and_a_layer_scale_view_follows():
    r = grown(PoolFormerish(), IMAGE, target="stem", to=16)  # the one group of 8 stays; 8 new channels form a second
    assert (r.gm.get_submodule("norm").num_groups, r.gm.get_parameter("scale").shape) == (2, (16,))
    assert any(n.op == "call_method" and n.target == "view" and n.args[1:] == (16, 1, 1) for n in r.gm.graph.nodes)


@pytest.mark.parametrize("target,init,to", [("patch", "net2net", 32), ("attn.qkv", "zero", 60), ("fc1", "zero", 40)])
def test_token_stream_with_class_token_position_table_and_heads(target, init, to):
    r = grown(TinyViT(), IMAGE, target=target, init=init, to=to)
    if target == "patch":  # the stream (under LayerNorms): every channel replicated, tokens and tables with it
        assert r.gm.get_parameter("cls_token").shape == (1, 1, 32) and r.gm.get_parameter("pos_embed").shape == (
            1,
            5,
            32,
        )
    if target == "attn.qkv":  # 2 heads × (8 → 10) for q, k and v; the output projection reads 20
        assert r.gm.get_submodule("attn.proj").in_features == 20


def test_separate_projections_grow_query_key_or_value_head_size():
    r = grown(TinyViT(fused=False), IMAGE, target="attn.q", to=20)  # q and k: head size 8 → 10, v kept
    assert r.gm.get_submodule("attn.k").out_features == 20 and r.gm.get_submodule("attn.v").out_features == 16
    r = grown(TinyViT(fused=False), IMAGE, target="attn.v", to=24)  # value size 8 → 12, read by the output projection
    assert r.gm.get_submodule("attn.proj").in_features == 24 and r.gm.get_submodule("attn.q").out_features == 16
    with pytest.raises(gg.NotApplicable, match="grow by a multiple of 2"):
        GrowWidth(target="attn.q", to=17)(gg.trace(TinyViT(fused=False), IMAGE))
    with pytest.raises(gg.NotApplicable, match="fresh units only"):
        GrowWidth(target="attn.v", factor=2, init="net2net")(gg.trace(TinyViT(fused=False), IMAGE))


class MixedStandardisation(nn.Conv2d):
    """Standardised across filters (over dim 0): a new filter would move the old ones."""

    def forward(self, x):
        w = self.weight - self.weight.mean(0, keepdim=True)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def test_weight_standardised_conv_grows_its_outputs_and_refuses_its_inputs_with_the_reason():
    gm = gg.trace(Standardised(), IMAGE)
    c = analyze(gm)
    reasons = c.why_frozen(c.group_of["a"])
    assert any("exact growth is impossible unless the new channels are identically zero" in r for r in reasons), reasons
    with pytest.raises(gg.NotApplicable, match="standardises its weight"):
        GrowWidth(target="a", factor=2)(gm)
    assert {"target": "b"} in [cand.args for cand in GrowWidth().candidates(gm)]
    r = grown(Standardised(), IMAGE, target="b", to=12)  # new filters standardised on their own; the reshape's 8 → 12
    assert r.gm.get_parameter("b.weight").shape == (12, 8, 3, 3) and r.gm.get_submodule("c").in_channels == 12
    assert any(n.op == "call_method" and n.target == "reshape" and 12 in n.args for n in r.gm.graph.nodes)
    mixed = Standardised()
    mixed.b = MixedStandardisation(8, 8, 3, padding=1)
    with pytest.raises(gg.NotApplicable, match="mixes filters"):
        GrowWidth(target="b", to=12)(gg.trace(mixed, IMAGE))


def test_add_branch_sees_a_weight_standardised_conv_as_a_conv():
    torch.manual_seed(0)
    gm = gg.trace(Standardised(), IMAGE)
    gg.annotate(gm, IMAGE)
    sites = [n.name for *_, n, _ in branch_sites(gm, "conv3x3", 1)]
    assert sites == ["conv2d", "c"], sites  # the standardised conv is a site (before: only c, the plain 1×1)
    r = AddBranch(at="conv2d")(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    assert r.targets["span"].startswith("relu [1, 8, 8, 8] → conv2d [1, 8, 8, 8]"), r.targets


@pytest.mark.slow  # ONNX exports: make test runs it, not the edit loop
def test_grown_calls_group_norms_and_token_stream_match_in_onnxruntime(tmp_path):
    for model, kw in (
        (Calls(), dict(target="a", to=12)),
        (GroupNorms(), dict(target="b", to=20)),
        (TinyViT(), dict(target="attn.qkv", to=60)),
        (TinyViT(), dict(target="patch", to=32, init="net2net")),
        (Standardised(), dict(target="b", to=12)),
    ):
        model = randomize_bn(model).eval()
        r = GrowWidth(**kw)(gg.trace(model, IMAGE))
        path = tmp_path / f"{type(model).__name__}.onnx"
        export_onnx(r.gm, IMAGE, path, max_ir_version=max_ir_version())
        report = check_equivalence(model, open_session(path, "cpu"), IMAGE, reference="original model")
        assert report.passed, report.to_json()
