"""Exact growth of LayerNorm-coupled channel groups (ConvNeXt/transformer streams): net2net with an integer
factor replicates every channel equally, so LayerNorm's mean and variance do not move; anything else is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import outputs_both_modes, rel_err
from graphgrow.passes.grow_width import GrowWidth
from test_targets import ConvNeXtish, Swinish
from torch import nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.jobs import workflow


class LayerScaled(nn.Module):
    """A torchvision-ConvNeXt-style block: layer scale as a (C, 1, 1) parameter, an nn.LayerNorm module
    between permutes, and a LayerNorm-free conv head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.norm = nn.LayerNorm(8, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(8, 24), nn.Linear(24, 8)
        self.scale = nn.Parameter(torch.rand(8, 1, 1) + 0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))).permute(0, 3, 1, 2)
        x = x + self.scale * y
        return self.head(x.mean((2, 3)))


class Tokens(nn.Module):
    """ViT-style: patch embedding flattened to (N, C, T) and transposed to tokens (N, T, C), pre-norm MLP
    residual, mean over tokens."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.norm = nn.LayerNorm(8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = t + self.fc2(F.gelu(self.fc1(self.norm(t))))
        return self.head(t.mean(1))


def randomized(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():  # non-trivial affine, so replicas of γ/β are really checked
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) or hasattr(m, "normalized_shape"):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


MODELS = {
    "convnext": (ConvNeXtish, (1, 3, 32, 32)),
    "swin": (Swinish, (1, 3, 32, 32)),
    "layer_scaled": (LayerScaled, (1, 3, 16, 16)),
    "tokens": (Tokens, (1, 3, 16, 16)),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("factor", [2, 3])
def test_net2net_with_an_integer_factor_is_exact(name, factor):
    make, shape = MODELS[name]
    model = randomized(make()).eval()
    gm = gg.trace(model, shape)
    first = next(n.target for n in gm.graph.nodes if n.op == "call_module")  # the stem: its group holds the norms
    r = GrowWidth(target=first, factor=factor, init="net2net")(gm)
    x = torch.randn((5,) + shape[1:], generator=torch.Generator().manual_seed(1))
    for before, after in zip(outputs_both_modes(model, x), outputs_both_modes(r.gm, x)):
        assert rel_err(before, after) <= 1e-5
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    assert norm_widths(r.gm) == [w * factor for w in norm_widths(gg.trace(model, shape))]


def norm_widths(gm) -> list[int]:
    """The width every LayerNorm (module or traced F.layer_norm call) normalises over."""
    widths = []
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.LayerNorm):
            widths.append(gm.get_submodule(n.target).normalized_shape[0])
        elif n.op == "call_function" and n.target is F.layer_norm:
            widths.append(tuple(n.args[1])[0])
    return widths


def test_every_per_channel_tensor_is_replicated_with_its_channel():
    model = randomized(LayerScaled()).eval()
    r = GrowWidth(target="stem", factor=2, init="net2net")(gg.trace(model, (1, 3, 16, 16)))
    stem, norm, scale = r.gm.get_submodule("stem"), r.gm.get_submodule("norm"), r.gm.get_parameter("scale")
    assert stem.out_channels == 16 and norm.normalized_shape == (16,) and scale.shape == (16, 1, 1)
    assert norm.eps == 1e-6 and scale.requires_grad
    old = set(model.norm.weight.tolist())
    assert set(norm.weight.tolist()) == old  # every new γ is a copy of an old one
    for i in range(16):  # copy i replicates channel j: the same stem filter, γ, β and scale
        j = next(k for k in range(8) if torch.equal(stem.weight[i], model.stem.weight[k]))
        assert norm.weight[i] == model.norm.weight[j] and norm.bias[i] == model.norm.bias[j]
        assert scale[i] == model.scale[j]
    assert r.gm.get_submodule("fc1").in_features == 16 and r.gm.get_submodule("head").in_features == 16


def test_the_traced_layer_norm_call_gets_its_new_shape():
    model = randomized(ConvNeXtish()).eval()
    r = GrowWidth(target="stem", factor=2, init="net2net")(gg.trace(model, (1, 3, 32, 32)))
    shapes = [n.args[1] for n in r.gm.graph.nodes if n.op == "call_function" and n.target is F.layer_norm]
    assert shapes and all(tuple(s) == (32,) for s in shapes)
    assert r.gm.get_parameter("gamma").shape == (32,) and r.gm.get_parameter("norm.weight").shape == (32,)


@pytest.mark.parametrize(
    "kwargs, why",
    [
        ({"factor": 1.5, "init": "net2net"}, "cannot replicate every channel equally"),
        ({"factor": 2}, "init=zero adds channels that are not copies"),
        ({"to": 12, "init": "net2net"}, "cannot replicate every channel equally"),
    ],
)
def test_other_growth_of_a_layernorm_group_is_refused_with_the_reason(kwargs, why):
    gm = gg.trace(randomized(LayerScaled()), (1, 3, 16, 16))
    with pytest.raises(gg.NotApplicable, match=why) as e:
        GrowWidth(target="stem", **kwargs)(gm)
    assert "LayerNorm 'norm'" in str(e.value) and "integer factor" in e.value.hint


def test_default_target_skips_layernorm_groups_unless_the_growth_replicates():
    gm = gg.trace(LayerScaled(), (1, 3, 16, 16))
    gg.annotate(gm, (1, 3, 16, 16))
    c = analyze(gm)
    assert c.group("stem").norms == ["norm"] and c.group("stem").tensors == ["scale"]
    targets = {c.args["target"] for c in GrowWidth(init="net2net").candidates(gm)}
    assert "stem" in targets  # replicas keep LayerNorm's statistics: its group is a place
    assert "stem" not in {c.args["target"] for c in GrowWidth().candidates(gm)}
    assert GrowWidth()(gm).targets["target"].startswith("fc1 ")  # zero init: the hidden MLP width, no LayerNorm


def test_a_layer_scale_read_elsewhere_freezes_the_group():
    class Reused(LayerScaled):
        def forward(self, x):
            return super().forward(x) + self.scale.sum()

    gm = gg.trace(Reused(), (1, 3, 16, 16))
    gg.annotate(gm, (1, 3, 16, 16))
    c = analyze(gm)
    assert c.why_frozen(c.group_of["stem"]) and "scale" not in c.group("stem").tensors
    with pytest.raises(gg.NotApplicable, match="cannot grow the 8-channel group"):
        GrowWidth(target="stem", init="net2net")(gm)


def test_the_channel_axis_is_followed_through_flatten_transpose_and_token_mean():
    gm = gg.trace(Tokens(), (1, 3, 16, 16))
    gg.annotate(gm, (1, 3, 16, 16))
    c = analyze(gm)
    grp = c.group("embed")
    assert grp.sources == ["embed", "fc2"] and sorted(grp.consumers) == ["fc1", "head"] and not c.why_frozen(grp.id)


def test_channels_last_linear_is_known_by_its_axis():
    """(N, H, W, C) tensors from a permute are channels-last: the Linear reading them is a consumer."""
    gm = gg.trace(Swinish(), (1, 3, 32, 32))
    gg.annotate(gm, (1, 3, 32, 32))
    c = analyze(gm)
    grp = c.group("embed")
    assert "mlp_0" in grp.consumers and "mlp_2" in grp.sources and grp.norms == ["norm"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, shape", [("zoo:convnext_atto", "1,3,64,64"), ("torchvision.models:convnext_tiny", "1,3,64,64")]
)
def test_real_convnext_residual_streams_grow_exactly(source, shape, tmp_path):
    """timm's and torchvision's ConvNeXt: LayerNorm2d (traced F.layer_norm), channels-last block LayerNorms,
    layer scales, drop-path; the grown ONNX model equals the original module in eval mode."""
    if source.startswith("zoo:"):
        pytest.importorskip("timm")
    report = workflow.mutate(
        source,
        ["grow_width(init=net2net)"],
        out=str(tmp_path / "g.pt"),
        onnx_out=str(tmp_path / "g.onnx"),
        check=True,
        input_shape=shape,
    )
    targets = report["passes"][0]["targets"]
    assert "every channel replicated ×2" in targets["layernorm"], targets
    assert report["equivalence"]["passed"] and report["equivalence"]["vs_original"]["passed"]
