"""add_residual: golden graph, exactness in eval and train mode (checked here, not only by verify),
trainability, the skip kinds, refusals, and the input left untouched."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import assert_same_snapshot, mlp, outputs_both_modes, randomize_bn, rel_err, small_cnn, snapshot
from graphgrow.passes.add_residual import AddResidual, add_residual
from torch import nn

import graphgrow as gg

GOLDEN = Path(__file__).parent / "golden"


def grow(model, shape, **args):
    gm = gg.trace(model, shape)
    return gm, AddResidual(**args)(gm)


def test_default_span_on_the_issue_example_is_one_stage_with_its_downsampling(cnn):
    _, r = grow(cnn, (1, 3, 32, 32))
    assert r.targets["start"] == "_5 [1, 64, 16, 16]"  # the end of the stage before the last, not the raw image
    assert r.targets["end"] == "_8 [1, 128, 8, 8]"
    assert r.targets["skip"] == "1×1 conv 64→128 stride 2 + BatchNorm(γ=β=0)"
    assert "from '5', stage 2 of 3 (5, 16×16), 64 channels to the end of stage 3 of 3 (8, 8×8)" in r.targets["chosen"]
    conv = r.gm.get_submodule("residual_downsample.0")
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride) == (64, 128, (1, 1), (2, 2))
    assert r.params_after - r.params_before == 64 * 128 + 2 * 128
    assert r.flops_after > r.flops_before
    assert "params: 94,986 → 103,434" in r.summary()


def test_golden_graph(cnn):
    _, r = grow(cnn, (1, 3, 32, 32))
    golden = (GOLDEN / "add_residual_small_cnn.txt").read_text()
    assert r.gm.code.strip() == golden.strip()


@pytest.mark.parametrize("seed", [0, 1])
def test_exact_in_eval_and_train_mode(cnn, seed):
    gm, r = grow(cnn, (1, 3, 32, 32))
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    ev0, tr0 = outputs_both_modes(cnn, x)
    ev1, tr1 = outputs_both_modes(r.gm, x)
    assert rel_err(ev0, ev1) <= 1e-6 and rel_err(tr0, tr1) <= 1e-6
    assert not torch.allclose(ev0, tr0)  # the two modes really differ, so both checks mean something
    assert r.preservation.eval.ok and r.preservation.train.ok


def test_new_parameters_learn(cnn):
    _, r = grow(cnn, (1, 3, 32, 32))
    m = copy.deepcopy(r.gm).train()
    x = torch.randn(4, 3, 32, 32)
    m(x).pow(2).sum().backward()
    bn = m.get_submodule("residual_downsample.1")
    conv = m.get_submodule("residual_downsample.0")
    assert bn.weight.grad.abs().sum() > 0 and bn.bias.grad.abs().sum() > 0  # the zero last factor: at once
    assert conv.weight.grad.abs().sum() == 0  # behind γ = 0 ...
    with torch.no_grad():
        for p in (bn.weight, bn.bias):
            p -= 0.1 * p.grad
    m.zero_grad()
    m(x).pow(2).sum().backward()
    assert conv.weight.grad.abs().sum() > 0  # ... and learns after one step
    assert r.preservation.trainable == {
        "residual_downsample.1.weight": 0,
        "residual_downsample.1.bias": 0,
        "residual_downsample.0.weight": 1,
    }


def test_same_shape_uses_a_zero_gate():
    model = randomize_bn(small_cnn())
    _, r = grow(model, (1, 3, 32, 32), start="_4", end="_5")
    assert r.targets["skip"] == "identity × gate (gate = 0)"
    gate = [n for n, _ in r.gm.named_parameters() if n.startswith("residual_gate")]
    assert gate == ["residual_gate"] and r.gm.residual_gate.item() == 0.0
    assert r.preservation.trainable == {"residual_gate": 0}


def test_module_path_means_its_input_and_output():
    import torchvision

    gm, r = grow(torchvision.models.resnet18(), (1, 3, 64, 64), start="layer2", end="layer3")
    assert r.targets["start"].startswith("layer1_1_relu_1 [1, 64, 16, 16]")
    assert r.targets["end"].startswith("layer3_1_relu_1 [1, 256, 4, 4]")
    assert "stride 4" in r.targets["skip"]


def test_non_integer_ratio_pools_adaptively():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 3)
    )
    _, r = grow(model, (1, 3, 12, 12), start="input_1", end="_3")  # 12×12 → 4×4 is integer: stride 3
    assert "stride 3" in r.targets["skip"]
    _, r = grow(model, (1, 3, 11, 11), start="_1", end="_3")  # 9×9 → 4×4 is not
    assert r.targets["skip"].startswith("adaptive avg pool 9×9→4×4")
    assert r.preservation.eval.ok and r.preservation.train.ok


def test_a_video_network_gets_a_3d_skip_over_its_last_stage():
    """Volumes (N, C, D, H, W) of a Conv3d stack are feature maps with stages: the default skip spans the last
    one with its downsampling (a strided 1×1×1 Conv3d + BatchNorm3d), not the stem to the classifier."""
    torch.manual_seed(0)

    def block(cin, cout, stride):
        return nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1), nn.BatchNorm3d(cout), nn.ReLU())

    model = nn.Sequential(
        block(3, 4, 1),
        block(4, 4, 1),
        block(4, 8, 2),
        block(8, 8, 1),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    randomize_bn(model)
    _, r = grow(model, (1, 3, 4, 8, 8))
    assert r.targets["start"] == "_1_2 [1, 4, 4, 8, 8]" and r.targets["end"] == "_3_2 [1, 8, 2, 4, 4]"
    assert r.targets["skip"] == "1×1 conv (3-D) 4→8 stride 2 + BatchNorm(γ=β=0)"
    assert isinstance(r.gm.get_submodule("residual_downsample.0"), nn.Conv3d)
    assert r.preservation.eval.ok and r.preservation.train.ok


def test_2d_features_get_a_zero_linear():
    model = mlp()
    _, r = grow(model, (1, 20))
    assert r.targets["skip"] == "Linear 32→5 (zero weights)"  # from the first hidden layer, not the raw input
    assert r.preservation.train.ok  # dropout draws the same masks in both runs
    assert set(r.preservation.trainable) == {"residual_proj.weight", "residual_proj.bias"}


@pytest.mark.parametrize(
    "args, message",
    [
        ({"start": "_8", "end": "_8"}, "start and end are the same tensor '_8'"),
        ({"start": "_8", "end": "_2"}, "start '_8' comes after end '_2'"),
        ({"start": "nope", "end": "_8"}, "no node or module named 'nope'"),
        ({"start": "_11", "end": "_11"}, "same tensor"),
        ({"start": "_8", "end": "_11"}, "differ in rank"),
    ],
)
def test_refusals_are_typed_and_explain(cnn, args, message):
    gm = gg.trace(cnn, (1, 3, 32, 32))
    before = snapshot(gm)
    with pytest.raises(gg.NotApplicable) as e:
        AddResidual(**args)(gm)
    assert message in str(e.value)
    assert e.value.hint  # always says what to do instead
    assert_same_snapshot(before, snapshot(gm))


def test_upsampling_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2), nn.Conv2d(4, 4, 3, padding=1))
    gm = gg.trace(model, (1, 3, 8, 8))
    with pytest.raises(gg.NotApplicable, match="only downsamples"):
        AddResidual(start="_0", end="_2")(gm)


def _annotated(gm):
    gg.annotate(gm, (1, 3, 32, 32))
    return gm


def test_input_model_untouched_on_success_and_failure(cnn):
    cnn.train()
    before = snapshot(cnn)
    gm = gg.trace(cnn, (1, 3, 32, 32))
    AddResidual()(gm)
    assert_same_snapshot(before, snapshot(cnn))
    with pytest.raises(gg.NotApplicable):
        AddResidual(start="_9", end="_3")(gm)
    assert_same_snapshot(before, snapshot(cnn))
    assert cnn.training


def test_plain_function_is_functional(cnn):
    gm = _annotated(gg.trace(cnn, (1, 3, 32, 32)))
    code = gm.code
    rw = add_residual(gm)
    assert rw.gm is not gm and gm.code == code and "residual_downsample" in rw.gm.code


def test_seed_makes_new_weights_reproducible(cnn):
    gm = gg.trace(cnn, (1, 3, 32, 32))
    w = [AddResidual()(gm, seed=s).gm.get_submodule("residual_downsample.0").weight for s in (3, 3, 4)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])


def test_a_skip_from_the_input_of_an_in_place_relu_gets_the_values_before_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1))
    gm = gg.trace(model, (1, 3, 8, 8))
    r = gg.Pipeline.from_spec("add_residual(start=_0,end=_2)").run(gm).results[0]
    grown = r.gm
    gate = next(n for n, p in grown.named_parameters() if "gate" in n)
    with torch.no_grad():
        dict(grown.named_parameters())[gate].fill_(1.0)
        x = torch.randn(2, 3, 8, 8)
        pre = model[0](x)  # the value at the start node: before the ReLU
        expected = model[2](torch.relu(pre)) + pre
        assert torch.allclose(grown.eval()(x), expected, atol=1e-6)
