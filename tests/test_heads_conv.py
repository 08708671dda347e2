"""grow_heads on attentions whose query, key and value come from a convolution (issue 39's sweep: timm's coatnet,
lowformer, iformer, edgenext, mobilenetv5, cpubone, haloregnet and Hugging Face SqueezeBERT were refused with "the
attentions of this model have no Linear projecting their query (a learned query over the states themselves)"). A
convolution of one group is a projection as a Linear is, over the channel axis (dim 1) instead of the last: new
heads are new output channels of the q/k/v convolutions (head-sized blocks where the layout puts them, fused
sections included) and new input channels of the output convolution, zero. Spellings: Conv2d 1×1 q/k/v apart or
fused (sections outermost, or per head as coatnet's head_first), Conv1d (SqueezeBERT), F.conv2d on parameters, the
map read as heads by a reshape or by flatten + transpose, scaled_dot_product_attention or matmul + softmax; fx and
torch.export. A grouped convolution is refused saying so; a query no projection makes is refused naming what stops
the way back (never "a learned query" when a convolution is there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import grow_checked
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import NotApplicable

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

C, HEADS, D = 16, 2, 8


def _attend(q, k, v, eager: bool):
    """(B, heads, N, d) operands."""
    if eager:
        return (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1) @ v
    return F.scaled_dot_product_attention(q, k, v)


class ConvAttention(nn.Module):
    """Self-attention over a (B, C, H, W) map (or a (B, C, N) sequence for conv1d), 2 heads of 8."""

    def __init__(self, spelling: str, eager: bool = False, groups: int = 1):
        super().__init__()
        self.spelling, self.eager = spelling, eager
        conv = nn.Conv1d if spelling == "conv1d" else nn.Conv2d
        self.q, self.k, self.v = (conv(C, C, 1, groups=groups) for _ in range(3))
        self.qkv = nn.Conv2d(C, 3 * C, 1)
        self.proj = conv(C, C, 1)
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(C, C, 1, 1) * 0.2) for _ in range(3))
        self.bq = nn.Parameter(torch.randn(C) * 0.1)
        self.norms = nn.ModuleList(nn.BatchNorm2d(C) for _ in range(3))
        for bn in self.norms:  # statistics and an affine of their own, as after training
            bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2), bn.weight.data.uniform_(0.5, 2)

    def forward(self, x):
        b, c = x.shape[:2]
        s = self.spelling
        if s == "conv1d":  # SqueezeBERT: (B, C, N), heads by a view and a permute
            n = x.shape[2]
            q, k, v = (f(x).view(b, HEADS, D, n).permute(0, 1, 3, 2) for f in (self.q, self.k, self.v))
            out = _attend(q, k, v, self.eager).permute(0, 1, 3, 2).contiguous().view(b, c, n)
            return self.proj(out)
        h, w = x.shape[2:]
        if s == "separate":  # reshape per head, tokens last, transposed
            q, k, v = (f(x).reshape(b, HEADS, D, h * w).transpose(-1, -2) for f in (self.q, self.k, self.v))
        elif s == "conv+bn":  # each projection a conv and a BatchNorm (timm's ConvNorm: iformer, cpubone)
            q, k, v = (
                bn(f(x)).reshape(b, HEADS, D, -1).transpose(-1, -2)
                for f, bn in zip((self.q, self.k, self.v), self.norms)
            )
        elif s == "functional":  # F.conv2d on parameters, the query with a bias
            q, k, v = (
                F.conv2d(x, wt, bias).reshape(b, HEADS, D, -1).transpose(-1, -2)
                for wt, bias in ((self.wq, self.bq), (self.wk, None), (self.wv, None))
            )
        elif s == "fused":  # sections outermost: reshape(B, 3, heads, d, N).unbind(1) (coatnet, head_first=False)
            q, k, v = self.qkv(x).reshape(b, 3, HEADS, D, -1).unbind(1)
            q, k, v = q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)
        elif s == "fused per head":  # per head q, k, v: view(B, heads, 3·d, N).chunk(3, dim=2) (coatnet's default)
            q, k, v = self.qkv(x).view(b, HEADS, 3 * D, -1).chunk(3, dim=2)
            q, k, v = q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)
        else:  # "flatten": flatten(2).transpose(1, 2) into tokens × channels, then viewed as heads
            q, k, v = (
                f(x).flatten(2).transpose(1, 2).view(b, h * w, HEADS, D).transpose(1, 2)
                for f in (self.q, self.k, self.v)
            )
            out = _attend(q, k, v, self.eager).transpose(1, 2).reshape(b, h * w, c)
            return self.proj(out.transpose(1, 2).reshape(b, c, h, w))
        out = _attend(q, k, v, self.eager).transpose(-1, -2).reshape(b, c, h, w)
        return self.proj(out)


SPELLINGS = ["separate", "conv+bn", "functional", "fused", "fused per head", "flatten", "conv1d"]


def _input(spelling: str) -> str:
    return "x:2x16x12" if spelling == "conv1d" else "x:2x16x3x4"


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("eager", [False, True], ids=["sdpa", "eager"])
def test_conv_projected_heads_grow_exactly(spelling, eager):
    torch.manual_seed(0)
    r = grow_checked(ConvAttention(spelling, eager), _input(spelling), "grow_heads", heads=3)
    assert r.targets["heads"].startswith("2 → 3")
    gm = r.gm
    assert gm.proj.weight.shape[:2] == (C, C + D) and gm.proj.in_channels == C + D
    if spelling == "functional":
        assert gm.wq.shape == (C + D, C, 1, 1) and gm.bq.shape == (C + D,)
        assert torch.equal(gm.bq[C:], torch.zeros(D))  # new heads' bias entries 0
    elif spelling.startswith("fused"):
        assert gm.qkv.weight.shape[0] == 3 * (C + D) and gm.qkv.out_channels == 3 * (C + D)
    else:
        assert gm.q.weight.shape[0] == C + D and gm.q.out_channels == C + D
    if spelling == "conv+bn":
        bn = gm.get_submodule("norms.0")
        assert bn.num_features == C + D and bn.running_var.shape == (C + D,)
        assert torch.equal(bn.running_var[C:], torch.ones(D)) and torch.equal(bn.weight[C:], torch.ones(D))
    assert torch.equal(gm.proj.weight[:, C:], torch.zeros_like(gm.proj.weight[:, C:]))  # the zero last factor


@pytest.mark.parametrize("spelling", ["separate", "fused per head", "conv1d"])
def test_conv_projected_heads_grow_through_export(spelling):
    torch.manual_seed(0)
    r = grow_checked(ConvAttention(spelling), _input(spelling), "grow_heads", capture="export", by=2)
    assert r.targets["heads"].startswith("2 → 4")


def test_conv_projected_head_size_grows_exactly():
    torch.manual_seed(0)
    r = grow_checked(ConvAttention("separate"), "x:2x16x3x4", "grow_heads", head_dim=12)
    assert r.gm.q.weight.shape[0] == HEADS * 12 and r.gm.proj.in_channels == HEADS * 12


def test_a_head_size_through_a_batchnorm_is_refused_saying_why():
    gm = gg.trace(ConvAttention("conv+bn"), input_shape=(2, 16, 3, 4))
    with pytest.raises(NotApplicable, match="normalises each channel of a growing head size"):
        gg.get_pass("grow_heads")(head_dim=12)(gm)


def test_a_grouped_conv_projection_is_refused_saying_so():
    gm = gg.trace(ConvAttention("separate", groups=2), input_shape=(2, 16, 3, 4))
    with pytest.raises(NotApplicable, match="grouped convolution \\(2 groups\\)") as e:
        gg.get_pass("grow_heads")(heads=3)(gm)
    assert "learned query" not in str(e.value)


class PooledQuery(nn.Module):
    """A query max-pooled after its projection (`pooled`), or an output reshaped to the input's shape read whole."""

    def __init__(self, pooled: bool):
        super().__init__()
        self.pooled = pooled
        self.q, self.k, self.v, self.proj = (nn.Conv2d(C, C, 1) for _ in range(4))

    def forward(self, x):
        b = x.shape[0]
        q = F.max_pool2d(self.q(x), 3, 1, 1) if self.pooled else self.q(x)
        q, k, v = (t.reshape(b, HEADS, D, -1).transpose(-1, -2) for t in (q, self.k(x), self.v(x)))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(x.shape))


def test_a_query_behind_an_op_the_analysis_does_not_follow_is_refused_naming_it():
    gm = gg.trace(PooledQuery(pooled=True), input_shape=(2, 16, 3, 4))
    with pytest.raises(
        NotApplicable, match="'max_pool2d' \\(max_pool2d\\), which is on the way back from the query"
    ) as e:
        gg.get_pass("grow_heads")(heads=3)(gm)
    assert "learned query" not in str(e.value)


def test_heads_reshaped_to_a_shape_read_whole_at_run_time_are_refused():
    gm = gg.trace(PooledQuery(pooled=False), input_shape=(2, 16, 3, 4))
    with pytest.raises(NotApplicable, match="a whole shape read at run time"):
        gg.get_pass("grow_heads")(heads=3)(gm)
