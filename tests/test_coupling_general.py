"""Coupling beyond plain convs: grouped convs (channels per group), slices and splits along channels
(offsets followed like cat's), stacks, reshapes that split channels into blocks (heads, radix), and the
analysis on a graph that shapes.annotate has not seen. Each rule: exact growth in eval and train mode
through grow_width's verification, and one onnxruntime check."""

from __future__ import annotations

import pytest
import torch
from conftest import grown, randomize_bn
from graphgrow.passes.grow_width import GrowWidth
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence

SHAPE = (1, 3, 8, 8)


class ResNeXtish(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8)
        self.b, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, groups=4), nn.BatchNorm2d(8)
        self.c, self.head = nn.Conv2d(8, 6, 1), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        h = torch.relu(self.bn2(self.b(h)))
        return self.head(self.c(h).mean((2, 3)))


class Slices(nn.Module):
    """Ghost module (cat + a slice that keeps every channel), a slice of a part, narrow, split, chunk,
    tensor_split, and an unbind along another axis."""

    def __init__(self):
        super().__init__()
        self.primary, self.cheap = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.stem = nn.Conv2d(3, 8, 1)
        self.p0, self.p1, self.p2 = nn.Conv2d(3, 3, 1), nn.Conv2d(5, 4, 1), nn.Conv2d(4, 4, 1)
        self.q = nn.Conv2d(6, 6, 1)
        self.head = nn.Conv2d(8 + 3 + 4 + 4 + 2 + 3 + 6, 5, 1)

    def forward(self, x):
        a = self.primary(x)
        ghost = torch.cat([a, self.cheap(a)], 1)[:, :8] + self.stem(x)
        s0, s1 = torch.split(ghost, [3, 5], 1)
        c0, c1 = ghost.chunk(2, dim=1)
        t0, _ = torch.tensor_split(ghost, [2], dim=1)
        q = self.q(torch.cat([ghost[:, 2:5], ghost.narrow(1, 5, 3)], 1))
        pieces = q.unbind(2)  # along height: every channel kept
        rows = torch.stack([pieces[i] for i in range(8)], 2)
        out = torch.cat([ghost, self.p0(s0), self.p1(s1), self.p2(c0) + c1, t0, ghost[:, 1:4], rows], 1)
        return self.head(out)


class SplitAttention(nn.Module):
    """Selective-kernel / radix split attention: branch outputs stacked, a conv's output reshaped into
    (radix, C) blocks, a softmax over the radix axis, weighted sum over it; a heads reshape and back."""

    def __init__(self, c=8, radix=2):
        super().__init__()
        self.radix = radix
        self.paths = nn.ModuleList([nn.Conv2d(3, c, 3, padding=1 + i, dilation=1 + i) for i in range(radix)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(c) for _ in range(radix)])
        self.fc1, self.fc2 = nn.Conv2d(c, 4, 1), nn.Conv2d(4, c * radix, 1)
        self.grouped = nn.Conv2d(c, c * radix, 1, groups=radix)
        self.mix = nn.Conv2d(c, c, 1)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        paths = torch.stack([torch.relu(bn(p(x))) for p, bn in zip(self.paths, self.bns)], dim=1)
        gap = paths.sum(1).mean((2, 3), keepdim=True)
        attn = self.fc2(torch.relu(self.fc1(gap)))
        b, rc, h, w = attn.shape
        attn = torch.softmax(attn.view(b, self.radix, rc // self.radix, h, w), dim=1)
        y = (paths * attn).sum(1)
        r = self.grouped(y)
        n, _, hh, ww = r.shape
        r = r.reshape(n, self.radix, -1, hh, ww).sum(1)  # radix split of a grouped conv's output
        heads = self.mix(r).reshape(n, 2, 4, hh * ww).softmax(-1).reshape(n, 8, hh, ww)  # 2 heads of 4
        return self.head(heads + y)


def test_a_group_through_a_grouped_conv_grows_per_group_and_says_which_increments_work():
    r = grown(ResNeXtish(), SHAPE, target="a", to=12)  # 4 groups × 1 new input channel each
    b = r.gm.get_submodule("b")
    assert (b.in_channels, b.out_channels, b.groups, tuple(b.weight.shape)) == (12, 8, 4, (8, 3, 3, 3))
    assert b.weight[:, 2].abs().sum() == 0  # the new input channel of each group: zero outgoing weights
    r = grown(ResNeXtish(), SHAPE, target="b", to=16)  # the grouped conv itself: 2 more outputs per group
    assert r.gm.get_submodule("b").out_channels == 16 and r.gm.get_submodule("c").in_channels == 16
    with pytest.raises(
        gg.NotApplicable,
        match=r"spread evenly over 4 blocks \(grouped conv 'b' \(groups=4\)\); "
        r"grow by a multiple of 4 \(e\.g\. to=12\)",
    ):
        GrowWidth(target="a", to=10)(gg.trace(ResNeXtish(), SHAPE))


@pytest.mark.parametrize("target", ["primary", "stem", "p1", "q"])
def test_slices_and_splits_follow_channel_offsets(target):
    r = grown(Slices(), SHAPE, target=target, factor=2)
    if target == "stem":  # the ghost cat repeats the primary conv's channels: its group grows per half
        assert r.gm.get_submodule("primary").out_channels == 8 and r.gm.get_submodule("p1").in_channels == 13


def test_ghost_stream_and_split_pieces_are_growable():
    gm = gg.trace(Slices(), SHAPE)
    gg.annotate(gm, SHAPE)
    c = analyze(gm)
    stream = c.group("stem")
    assert not c.why_frozen(stream.id) and c.step(stream.id) == 2  # new channels land in both halves of the cat
    assert not c.why_frozen(c.group_of["primary"])


@pytest.mark.parametrize("target", ["paths.0", "fc2", "grouped", "mix"])
def test_stack_radix_split_and_heads_reshape_grow_exactly(target):
    r = grown(SplitAttention(), SHAPE, target=target, factor=2)
    if target == "paths.0":  # every stacked branch and the attention's radix blocks grow together
        assert r.gm.get_submodule("paths.1").out_channels == 16 and r.gm.get_submodule("fc2").out_channels == 32


@pytest.mark.slow  # ONNX exports: make test runs it, not the edit loop
def test_grown_split_attention_and_slices_match_in_onnxruntime(tmp_path):
    for model, target in ((SplitAttention(), "paths.0"), (Slices(), "stem"), (ResNeXtish(), "a")):
        model = randomize_bn(model).eval()
        r = GrowWidth(target=target, factor=2)(gg.trace(model, SHAPE))
        path = tmp_path / f"{type(model).__name__}.onnx"
        export_onnx(r.gm, SHAPE, path, max_ir_version=max_ir_version())
        report = check_equivalence(model, open_session(path, "cpu"), SHAPE, reference="original model")
        assert report.passed, report.to_json()


def test_analyze_annotates_an_unannotated_graph_or_says_what_is_missing():
    gm = gg.trace(ResNeXtish(), input_shape=SHAPE, check=False)
    assert analyze(gm).group("a").consumers == ["b"]  # annotated on demand from the traced input shape
    bare = torch.fx.symbolic_trace(ResNeXtish())
    with pytest.raises(gg.GraphgrowError, match="not made by graphgrow.trace"):
        analyze(bare)


class LearnedActivation(nn.Module):
    """An MLP whose activation has learned scalars, written as published (xIELU, Apertus): comparisons, `where`,
    `min` with a scalar buffer, `expm1`, and products with one-element parameters — elementwise in every channel."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 6)
        self.alpha_p, self.alpha_n = nn.Parameter(torch.tensor([0.3])), nn.Parameter(torch.tensor([0.2]))
        self.register_buffer("beta", torch.tensor(0.5))
        self.register_buffer("eps", torch.tensor(-1e-6))

    def forward(self, x):
        h = self.up(x)
        a_p, a_n = nn.functional.softplus(self.alpha_p), self.beta + nn.functional.softplus(self.alpha_n)
        pos = a_p * h * h + self.beta * h
        neg = (torch.expm1(torch.min(h, self.eps)) - h) * a_n + self.beta * h
        return x + self.down(torch.where(h > 0, pos, neg))


def test_an_activation_with_learned_scalars_is_elementwise():
    gm = gg.trace(LearnedActivation(), (2, 5, 6))
    group = analyze(gm).group("up")
    assert not analyze(gm).why_frozen(group.id) and group.consumers == ["down"]
    r = GrowWidth(target="up", to=12)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok


class FlatTable(nn.Module):
    """A 2-D table reshaped from a flat vector (DeepSeek-V4's per-group mixing written as `v[:n].reshape(g, g)`):
    a reshape to two dims whose input has no channel axis."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 6)
        self.flat = nn.Parameter(torch.randn(40) * 0.1)

    def forward(self, x):
        mix = self.flat[:36].reshape(6, 6)
        return x + self.down(torch.relu(self.up(x))) + x @ mix


def test_a_reshape_to_two_dims_of_a_vector_is_not_a_channel_flatten():
    gm = gg.trace(FlatTable(), (1, 5, 6))
    r = GrowWidth(target="up", to=12)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok


class SplitGates(nn.Module):
    """FocalNet's modulation: one projection split into query, context and one-channel gates, each gate
    `gates[:, l:l+1]` broadcast over every context channel, a pooled context times the last gate."""

    def __init__(self):
        super().__init__()
        self.proj, self.ctx = nn.Conv2d(3, 8 + 8 + 3, 1), nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.mix, self.out = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        q, ctx, gates = torch.split(self.proj(x), (8, 8, 3), 1)
        ctx = self.ctx(ctx)
        mixed = ctx * gates[:, 0:1] + ctx.mean((2, 3), keepdim=True) * gates[:, 2:]
        return self.out(q * self.mix(mixed) + gates[:, 1:2])


class HeadGate(nn.Module):
    """A per-head output gate (DeepSeek-V3.2-style attention): sigmoid(gate(x)) viewed [B, T, H, 1] times the heads'
    outputs [B, T, H, D], then the heads merged: the gate's channels are heads, the product's are D."""

    def __init__(self):
        super().__init__()
        self.v, self.gate, self.o = nn.Linear(6, 4 * 5), nn.Linear(6, 4), nn.Linear(4 * 5, 6)

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.v(x).view(b, t, 4, 5)
        g = torch.sigmoid(self.gate(x)).view(b, t, 4, 1)
        return x + self.o((heads * g).reshape(b, t, 20))


@pytest.mark.parametrize(
    "model, shape, frozen, free",
    [
        (SplitGates, SHAPE, "proj", "mix"),  # growing 'proj' at its end adds gate channels; 'mix' grows q's section
        (HeadGate, (1, 5, 6), "gate", "v"),  # the gate's channels (heads) sit on a non-channel axis of the product
    ],
)
def test_a_broadcast_gate_keeps_its_channel_count(model, shape, frozen, free):
    """A gate broadcast along the channels it multiplies was grown as channels: the grown model could not be sized
    ('mul' of (1, 64, 1, 1) and (1, 132, 8, 8); sweep: focalnet, dots3_note_text grow_width). Its group is frozen
    with the reason, and the other operand's channels still grow."""
    gm = gg.trace(model(), shape)
    c = analyze(gm)
    assert any("broadcasts it over" in r for r in c.why_frozen(c.group_of[frozen]))
    with pytest.raises(gg.NotApplicable, match="broadcasts it over"):
        GrowWidth(target=frozen, factor=2)(gg.trace(model(), shape))
    grown(model(), shape, target=free, factor=2)
