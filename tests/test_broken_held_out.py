"""Issue 39: the two held-out timm models that broke (exit 3 and exit 1) are verified or refused with a reason.

A. gMLP's spatial gating unit: a Linear across the tokens (v.transpose(-1, -2) → Linear(seq, seq)) whose output
   multiplies the other channel half. grow_width read it as a channel Linear and stopped with an internal error
   ("value tensor of shape [196, 196] cannot be broadcast to indexing result of shape [384, 196]"). Now a Linear
   whose input has its channels elsewhere than last maps another axis: channel c stays c (analysis/axes.across_axis).
B. add_branch's default place beside a weight-standardised conv whose block output is scaled by a zero gain
   (NF-ResNet's last conv, gain 0) was dead: "no new parameter gets a gradient at insertion" (exit 1). Now the
   default skips places no gradient reaches (verify/dead_ends.py), and a given one is refused naming the zero gain.
C. CoaT (sweep, add_branch exit 1 'the new contribution is dead'): the default sat beside a conv whose output reaches
   only image tokens after the last token mixing, and the head reads the class token. No zero weight, so the probe
   did not run; it now also runs when the model keeps part of a tensor (x[:, 0], x[:, :1], select, gather).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.verify.dead_ends import dead_places

timm = pytest.importorskip("timm")


def _gmlp():
    from timm.layers import GatedMlp
    from timm.models.mlp_mixer import MlpMixer, SpatialGatingBlock

    torch.manual_seed(0)
    model = MlpMixer(
        img_size=64,
        patch_size=16,
        num_blocks=2,
        embed_dim=32,
        mlp_ratio=6,
        block_layer=SpatialGatingBlock,
        mlp_layer=GatedMlp,
        num_classes=10,
    ).eval()
    return gg.trace(model, (1, 3, 64, 64))


def _verified(result) -> bool:
    p = result.preservation
    return p is not None and p.train is not None and not p.dead


@pytest.mark.slow
def test_a_token_mixing_linear_keeps_the_channels_it_maps():
    gm = _gmlp()
    c = analyze(gm)
    proj = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("gate.proj"))
    group = c.group(proj.name)
    assert proj.name not in group.sources and proj.name not in group.consumers  # not a channel layer
    assert group.size == 96 and c.group(proj.args[0].name) is group  # the gate half's channels pass through it
    fc1 = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "blocks.0.mlp_channels.fc1")
    assert not c.why_frozen(c.group_of[fc1.name])


@pytest.mark.slow
def test_gmlp_grows_its_gated_channels_exactly_or_says_why():
    gm = _gmlp()
    # the gate's norm: init=zero cannot keep it exact, and the refusal names it
    with pytest.raises(gg.NotApplicable, match=r"normalised across its channels \('blocks_0_norm'"):
        gg.get_pass("grow_width")()(gm)
    r = gg.get_pass("grow_width")(init="net2net")(gm)  # verified in eval and train mode by the pass
    assert _verified(r) and "blocks.0.mlp_channels.fc1" in r.targets["target"]
    assert "blocks.0.mlp_channels.gate.norm" in r.targets["rebuilt"]
    with pytest.raises(gg.NotApplicable, match="maps another axis"):  # the token Linear is no channel layer
        gg.get_pass("grow_width")(target="blocks.0.mlp_channels.gate.proj", init="net2net")(gm)


@pytest.mark.slow
def test_mlp_mixer_stream_grows_through_its_token_mlps():
    """The same rule on MLP-Mixer: its token MLPs read transposed features; the stream now grows through them."""
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(0)
    gm = gg.trace(MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=16, num_classes=5).eval(), (1, 3, 32, 32))
    r = gg.get_pass("grow_width")(target="stem.proj", init="net2net")(gm)
    assert _verified(r) and "blocks.1.mlp_channels.fc2" in r.targets["rebuilt"]
    assert "mlp_tokens" not in r.targets["rebuilt"]  # the token MLPs' weights do not change


class _ZeroGainBlock(nn.Module):
    """x + conv2(relu(conv1(x))), conv2 a weight-standardised conv whose gain starts at zero (skipinit-style)."""

    def __init__(self, c: int):
        super().__init__()
        from timm.layers import ScaledStdConv2d

        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = ScaledStdConv2d(c, c, 1, gain_init=0.0)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.conv1(x)))


def test_dead_places_finds_what_a_zero_gain_blocks_and_names_it():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), _ZeroGainBlock(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    )
    gm = gg.trace(model, (1, 3, 16, 16))
    gg.annotate(gm, (1, 3, 16, 16))
    by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    dead = dead_places(gm, [by_target["0"], by_target["1.conv1"]])
    assert list(dead) == [by_target["1.conv1"].name]  # the stem reaches the output through the residual
    assert "'1.conv2.gain' is all zeros" in dead[by_target["1.conv1"].name]
    with torch.no_grad():
        gm.get_submodule("1.conv2").gain.fill_(0.5)
    assert not dead_places(gm, [by_target["1.conv1"]])  # a gain that moved: alive again


def _nf_resnet():
    from timm.models.nfnet import NormFreeNet, _nfres_cfg

    torch.manual_seed(0)
    model = NormFreeNet(_nfres_cfg(depths=(1, 1, 1, 1), channels=(32, 64, 96, 128)), num_classes=10).eval()
    return gg.trace(model, (1, 3, 64, 64))


@pytest.mark.slow
def test_add_branch_default_place_skips_convs_a_zero_gain_kills():
    r = gg.get_pass("add_branch")()(_nf_resnet())  # was exit 1: the default sat beside a dead conv
    assert _verified(r)
    assert "skipped" in r.targets["chosen"] and "gain' is all zeros" in r.targets["chosen"]


@pytest.mark.slow
def test_add_branch_at_a_dead_conv_is_refused_naming_the_zero_gain():
    with pytest.raises(gg.NotApplicable, match=r"would be dead: .*'stages\.3\.0\.conv3\.gain' is all zeros"):
        gg.get_pass("add_branch")(at="stages.3.0.conv2")(_nf_resnet())


class _ClassTokenHead(nn.Module):
    """CoaT's idiom (timm coat_tiny, add_branch exit 1 'the new contribution is dead'): a conv position encoding on
    the image tokens after the last token mixing, and a head that reads the class token only (x[:, 0]). Nothing the
    last conv computes reaches the output, with no zero weight anywhere."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem, self.conv = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.cls_token = nn.Parameter(torch.randn(1, 1, c))
        self.mix = nn.Linear(c, c)
        self.pos = nn.Conv2d(c, c, 3, padding=1)
        self.head = nn.Linear(c, 4)

    def forward(self, x):
        x = self.conv(self.stem(x))
        B, C, H, W = x.shape
        x = torch.cat((self.cls_token.expand(B, -1, -1), x.flatten(2).transpose(1, 2)), dim=1)
        x = x + self.mix(x).mean(1, keepdim=True)  # the image tokens reach the class token here, not after
        cls, img = x[:, :1], x[:, 1:]
        img = img + self.pos(img.transpose(1, 2).reshape(B, C, H, W)).flatten(2).transpose(1, 2)
        return self.head(torch.cat((cls, img), dim=1)[:, 0])


def test_add_branch_skips_a_conv_whose_output_the_head_drops():
    torch.manual_seed(0)
    gm = gg.trace(_ClassTokenHead(), (1, 3, 8, 8))
    r = gg.get_pass("add_branch")()(gm)  # was exit 1: the default sat beside 'pos'
    assert _verified(r) and "'conv'" in r.targets["chosen"] and "skipped 1 conv" in r.targets["chosen"]
    with pytest.raises(gg.NotApplicable, match=r"a branch at 'pos' would be dead: .*no gradient reaches its output"):
        gg.get_pass("add_branch")(at="pos")(gm)


def test_timm_coat_add_branch_is_verified():
    from timm.models.coat import CoaT

    torch.manual_seed(0)
    model = CoaT(
        img_size=64,
        patch_size=4,
        embed_dims=(64, 64, 64, 64),
        serial_depths=(1, 1, 1, 1),
        parallel_depth=1,
        num_heads=8,
        mlp_ratios=(2, 2, 2, 2),
        num_classes=10,
    ).eval()
    r = gg.get_pass("add_branch")()(gg.trace(model, (1, 3, 64, 64)))
    assert _verified(r) and "skipped" in r.targets["chosen"]
