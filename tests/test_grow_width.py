"""grow_width and insert_adapter: exactness, kept layer settings, trainability, symmetry, refusals,
and every torchvision test-bed model through preservation, export and onnxruntime."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torchvision
from conftest import assert_same_snapshot, outputs_both_modes, randomize_bn, rel_err, run_cli, snapshot
from graphgrow.passes.grow_width import GrowWidth
from graphgrow.passes.insert_adapter import InsertAdapter
from torch import nn

import graphgrow as gg
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence


class Odd(nn.Module):
    """Convs with every constructor setting that a careless rebuild loses."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, stride=2, padding=2, dilation=2, bias=False, padding_mode="reflect")
        self.bn = nn.BatchNorm2d(6, eps=1e-3, momentum=0.3)
        self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6, padding_mode="circular")
        self.b = nn.Conv2d(6, 5, 1)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(5 * 8 * 8, 3)  # a: 16×16 → 8×8

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        return self.fc(self.drop(torch.flatten(self.b(self.dw(h) + h), 1)))


def odd_model(dtype=torch.float32):
    torch.manual_seed(0)
    return randomize_bn(Odd()).to(dtype)


def test_rebuilt_layers_keep_all_their_settings_and_dtype():
    model = odd_model(torch.float64)
    r = GrowWidth(target="a", to=10)(gg.trace(model, (1, 3, 16, 16)))
    a, dw, bn = (r.gm.get_submodule(n) for n in ("a", "dw", "bn"))
    assert (a.out_channels, a.stride, a.padding, a.dilation, a.bias, a.padding_mode) == (
        10,
        (2, 2),
        (2, 2),
        (2, 2),
        None,
        "reflect",
    )
    assert (dw.in_channels, dw.out_channels, dw.groups, dw.padding_mode) == (10, 10, 10, "circular")
    assert (bn.num_features, bn.eps, bn.momentum) == (10, 1e-3, 0.3)
    assert a.weight.dtype == dw.weight.dtype == bn.running_var.dtype == torch.float64
    assert r.gm.get_submodule("b").in_channels == 10 and r.gm.get_submodule("fc").in_features == 5 * 64
    assert r.targets["rebuilt"] == "a, bn, dw, b"


@pytest.mark.parametrize("init", ["zero", "net2net"])
@pytest.mark.parametrize("mode", ["group", "adapter"])
def test_exact_in_eval_and_train_mode(init, mode):
    model = odd_model()
    r = GrowWidth(target="b", factor=1.6, mode=mode, init=init)(gg.trace(model, (1, 3, 16, 16)))
    x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    ev0, _ = outputs_both_modes(model, x)
    ev1, _ = outputs_both_modes(r.gm, x)
    assert rel_err(ev0, ev1) <= 1e-5
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    assert r.gm.get_submodule("b").out_channels == 8


def test_zero_init_gives_random_in_and_zero_out_never_zero_on_both_sides():
    r = GrowWidth(target="b", to=8)(gg.trace(odd_model(), (1, 3, 16, 16)))
    b, fc = r.gm.get_submodule("b"), r.gm.get_submodule("fc")
    assert b.weight[5:].abs().sum() > 0  # new units: random incoming
    assert (
        fc.weight.shape[1] == 8 * 64 and fc.weight[:, 5 * 64 :].abs().sum() == 0
    )  # zero outgoing: 64 features per channel
    # trainability as the verifier saw it: outgoing weights learn at once, incoming after one step
    assert r.preservation.trainable["fc.weight"] == 0 and r.preservation.trainable["b.weight"] == 1


def _train_steps(gm, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    gm.train()
    for _ in range(steps):
        x = torch.randn(8, 3, 16, 16, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(gm(x), y).backward()
        opt.step()


@pytest.mark.parametrize("init", ["zero", "net2net"])
def test_no_two_units_stay_identical_after_sgd(init):
    r = GrowWidth(target="b", to=10, init=init)(gg.trace(odd_model(), (1, 3, 16, 16)))
    gm = copy.deepcopy(r.gm)
    if init == "net2net":  # replicas start as exact copies of their source unit
        w = gm.get_submodule("b").weight.detach().flatten(1)
        assert min((w[i] - w[j]).abs().max().item() for i in range(10) for j in range(i + 1, 10)) == 0.0
    _train_steps(gm)
    w = gm.get_submodule("b").weight.detach().flatten(1)
    gaps = [(w[i] - w[j]).abs().max().item() for i in range(10) for j in range(i + 1, 10)]
    assert min(gaps) > 1e-6


def test_input_model_untouched_on_success_and_failure():
    model = odd_model()
    before = snapshot(model)
    gm = gg.trace(model, (1, 3, 16, 16))
    GrowWidth(target="b", to=9)(gm)
    with pytest.raises(gg.NotApplicable):
        GrowWidth(target="b", to=2)(gm)
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize(
    "args, message",
    [
        ({"target": "nope"}, "no node or module named 'nope'"),
        ({"target": "bn"}, "'bn' is BatchNorm2d; grow_width widens a conv or Linear layer"),
        ({"target": "dw"}, "'dw' is a depthwise conv: its width follows its input"),
        ({"target": "b", "to": 4}, "'b' has 5 channels; 4 would narrow it and grow_width only grows"),
        ({"target": "b", "to": 5}, "'b' already has 5 channels"),
        ({"target": "fc"}, "'fc': it is the model's output"),
    ],
)
def test_refusals(args, message):
    with pytest.raises(gg.NotApplicable) as e:
        GrowWidth(**args)(gg.trace(odd_model(), (1, 3, 16, 16)))
    assert message in str(e.value) and e.value.hint


def test_an_op_the_analysis_does_not_understand_freezes_the_group():
    class Cumsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)
            self.head = nn.Conv2d(4, 2, 1)

        def forward(self, x):
            return self.head(self.conv(x).cumsum(1))

    gm = gg.trace(Cumsum(), (1, 3, 4, 4))
    with pytest.raises(gg.NotApplicable, match=r"'cumsum' \(cumsum\) is not understood by the coupling analysis"):
        GrowWidth(target="conv")(gm)
    r = GrowWidth(target="conv", mode="adapter")(gm)  # the way out the hint names
    assert r.preservation.eval.ok


def test_insert_adapter_identity_widening_and_narrowing():
    model = odd_model()
    gm = gg.trace(model, (1, 3, 16, 16))
    same = InsertAdapter(after="relu")(gm)
    ad = same.gm.get_submodule("relu_adapter")
    assert torch.equal(ad.weight.flatten(1), torch.eye(6)) and same.preservation.eval.rel_err == 0.0
    wide = InsertAdapter(after="relu", out_channels=9)(gm)
    assert wide.gm.get_submodule("relu_adapter").weight.shape[:2] == (9, 6)
    assert wide.preservation.eval.ok and wide.preservation.trainable_ok
    assert "relu_adapter" in wide.targets["rebuilt"]
    with pytest.raises(gg.NotApplicable, match="narrowing 'relu' from 6 to 4 channels drops channels"):
        InsertAdapter(after="relu", out_channels=4)(gm)
    narrow = InsertAdapter(after="relu", out_channels=4, allow_narrowing=True)(gm)
    assert narrow.preservation.eval.rel_err > 1e-3  # the function changed, on purpose, and it is reported
    assert any("function changed on purpose" in n for n in narrow.notes)


# --- the torchvision test bed -------------------------------------------------------------------------


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    kwargs = (
        {"image_size": 64} if name.startswith("vit") else {}
    )  # the full ViT-B/16 at 17 tokens, not 197: same layers, quicker
    model = randomize_bn(getattr(torchvision.models, name)(**kwargs), seed=2)
    if name.startswith("vit"):
        nn.init.normal_(model.heads.head.weight, std=0.02)  # torchvision zero-initialises it: checks would see zeros
    return model


def shape_for(name: str):
    return (1, 3, 64, 64)


CASES = [
    ("resnet18", "grow_width", "conv1 (Conv2d, 64 → 128)"),
    ("resnet18", "grow_width(target=layer2.0.conv1,factor=1.5,init=net2net)", "layer2.0.conv1 (Conv2d, 128 → 192)"),
    ("resnet18", "grow_width(target=layer3.1.conv2,to=300,mode=adapter)", "layer3.1.conv2 (Conv2d, 256 → 300)"),
    ("resnet18", "insert_adapter(after=layer2,out_channels=160)", None),
    ("resnet50", "grow_width", "conv1 (Conv2d, 64 → 128)"),
    ("resnet50", "grow_width(target=layer1.0.conv3,to=320,init=net2net)", "layer1.0.conv3 (Conv2d, 256 → 320)"),
    ("resnet50", "insert_adapter", None),
    ("mobilenet_v2", "grow_width", "features.0.0 (Conv2d, 32 → 64)"),
    ("mobilenet_v2", "grow_width(target=features.3.conv.2,to=40,init=net2net)", "features.3.conv.2 (Conv2d, 24 → 40)"),
    (
        "mobilenet_v2",
        "grow_width(target=features.18.0,to=1400,mode=adapter,init=net2net)",
        "features.18.0 (Conv2d, 1280 → 1400)",
    ),
    ("mobilenet_v3_small", "grow_width", "features.0.0 (Conv2d, 16 → 32)"),
    (
        "mobilenet_v3_small",
        "grow_width(target=features.4.block.2.fc1,factor=2)",
        "features.4.block.2.fc1 (Conv2d, 24 → 48)",
    ),
    ("mobilenet_v3_small", "insert_adapter(out_channels=600)", None),
    ("densenet121", "grow_width", "features.conv0 (Conv2d, 64 → 128)"),
    (
        "densenet121",
        "grow_width(target=features.denseblock2.denselayer3.conv2,to=48,init=net2net)",
        "features.denseblock2.denselayer3.conv2 (Conv2d, 32 → 48)",
    ),
    ("densenet121", "insert_adapter(after=features.transition1,out_channels=160)", None),
    ("vit_b_16", "grow_width", "encoder.layers.encoder_layer_0.mlp.0 (Linear, 3072 → 6144)"),
    (
        "vit_b_16",
        "grow_width(target=encoder.layers.encoder_layer_11.mlp.0,to=3200,mode=adapter,init=net2net)",
        "encoder.layers.encoder_layer_11.mlp.0 (Linear, 3072 → 3200)",
    ),
    ("vit_b_16", "insert_adapter(after=encoder.layers.encoder_layer_5)", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, spec, target", CASES, ids=[f"{n}:{s}" for n, s, _ in CASES])
def test_torchvision_growth_is_exact_and_trainable(name, spec, target):
    model = build(name)
    before = snapshot(model)
    result = gg.Pipeline.from_spec(spec).run(gg.trace(model, shape_for(name))).results[0]
    if target is not None:
        assert result.targets["target"] == target
    pres = result.preservation
    assert pres.eval.ok and pres.train.ok and pres.trainable_ok and pres.trainable
    assert not pres.degenerate
    assert result.params_after > result.params_before or spec.startswith("insert_adapter")
    assert_same_snapshot(before, snapshot(model))


EXPORTS = ["resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "densenet121", "vit_b_16"]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPORTS)
def test_grown_models_export_and_match_the_original_in_onnxruntime(name, tmp_path):
    model = build(name).eval()
    shape = shape_for(name)
    result = gg.Pipeline.from_spec("grow_width,insert_adapter").run(gg.trace(model, shape))
    path = tmp_path / "m.onnx"
    export_onnx(result.gm, shape, path, max_ir_version=max_ir_version())
    report = check_equivalence(model, open_session(path, "cpu"), shape, reference="original model")
    assert report.passed, report.to_json()


@pytest.mark.slow
def test_issue_command_resnet50_grow_width_check(tmp_path):
    proc = run_cli(
        "mutate",
        "torchvision.models:resnet50",
        "--pass",
        "grow_width(factor=2)",
        "--check",
        "--input-shape",
        "1,3,224,224",
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    p = report["passes"][0]
    assert p["targets"]["target"] == "conv1 (Conv2d, 64 → 128)"
    assert p["params_after"] > p["params_before"] and p["flops_after"] > p["flops_before"]
    assert report["preservation"]["eval_ok"] and report["equivalence"]["passed"]
    assert report["outputs"] == [str(tmp_path / "resnet50.grown.pt")]


def test_tied_weights_are_refused_not_untied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)
            self.b.weight = self.a.weight  # tied
            self.out = nn.Linear(6, 2)

        def forward(self, x):
            return self.out(torch.relu(self.b(torch.relu(self.a(x)))))

    gm = gg.trace(Tied(), (1, 6))
    with pytest.raises(gg.NotApplicable, match="tied weights"):
        gg.Pipeline.from_spec("grow_width(target=a)").run(gm)


@pytest.mark.parametrize(
    "kind,init", [("gathered_bmm", "net2net"), ("transposed_matmul", "zero"), ("dense_einsum", "zero")]
)
def test_mixture_of_experts_stacked_in_one_weight_grows_every_expert(kind, init):
    """Experts stacked in one parameter, multiplied with bmm, `@` or einsum (tests/moe_models.py): the intermediate
    width grows in every expert alike (the default target), the routing untouched, old entries kept."""
    from moe_models import SPEC, E, H, I, MoEBlock

    from graphgrow.graph.inputs import parse_spec

    gm = gg.trace(MoEBlock(kind), input_shape=parse_spec(SPEC))
    r = GrowWidth(init=init)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    assert "experts stacked in one weight" in r.targets["target"]
    before = dict(gm.named_parameters())
    after = dict(r.gm.named_parameters())
    assert torch.equal(after["moe.router.gate.weight"], before["moe.router.gate.weight"])
    w_in, w_out = ("moe.gate_up", "moe.down") if kind == "gathered_bmm" else ("moe.w_in", "moe.w_out")
    inner = 2 * I if kind == "gathered_bmm" else I  # gate and up: a chunk of one output, both grow
    expected_in = (E, 2 * inner, H) if kind == "gathered_bmm" else (E, H, 2 * I)
    expected_out = (E, H, 2 * I) if kind == "gathered_bmm" else (E, 2 * I, H)
    assert tuple(after[w_in].shape) == expected_in and tuple(after[w_out].shape) == expected_out
    if kind != "gathered_bmm":  # old entries at their places: the first I units of every expert
        assert torch.equal(after[w_in][:, :, :I], before[w_in])
