"""torchvision classification models: add_residual verified, exported, and run in onnxruntime
against the *original* PyTorch model at batch sizes 1 and 3."""

from __future__ import annotations

import pytest
import torch
import torchvision
from conftest import assert_same_snapshot, randomize_bn, snapshot

import graphgrow as gg
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence

pytestmark = pytest.mark.slow

SHAPE = (1, 3, 64, 64)  # small images keep the suite fast; the graphs are the full models


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return randomize_bn(getattr(torchvision.models, name)(), seed=1)


@pytest.mark.parametrize(
    "name, spec, skip",
    [
        ("resnet18", "add_residual", "1×1 conv 256→512 stride 2 + BatchNorm(γ=β=0)"),  # layer3 → layer4
        ("resnet18", "add_residual(start=layer1,end=layer2)", "1×1 conv 64→128 stride 2 + BatchNorm(γ=β=0)"),
        ("resnet18", "add_residual(start=layer3.1,end=layer3.1)", "identity × gate (gate = 0)"),
        ("mobilenet_v2", "add_residual", "1×1 conv 96→1280 stride 2 + BatchNorm(γ=β=0)"),  # features.13 → end
        ("mobilenet_v2", "add_residual(start=features.2,end=features.4)", "1×1 conv 16→32 stride 4 + BatchNorm(γ=β=0)"),
        ("densenet121", "add_residual", "1×1 conv 1024→1024 stride 2 + BatchNorm(γ=β=0)"),  # denseblock3 → end
        (
            "densenet121",
            "add_residual(start=features.transition1,end=features.denseblock2)",
            "1×1 conv 256→512 stride 2 + BatchNorm(γ=β=0)",
        ),
    ],
)
def test_add_residual_on_torchvision(name, spec, skip):
    original = build(name)
    before = snapshot(original)
    gm = gg.trace(original, SHAPE)
    result = gg.Pipeline.from_spec(spec).run(gm).results[0]
    assert result.targets["skip"] == skip
    pres = result.preservation
    assert pres.eval.ok and pres.train.ok and pres.trainable_ok and pres.trainable
    assert_same_snapshot(before, snapshot(original))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "densenet121"])
def test_grown_onnx_matches_the_original_in_onnxruntime(name, tmp_path):
    original = build(name).eval()
    result = gg.Pipeline.from_spec("add_residual").run(gg.trace(original, SHAPE)).results[0]
    path = tmp_path / f"{name}.onnx"
    export_onnx(result.gm, SHAPE, path, max_ir_version=max_ir_version())
    session = open_session(path, "cpu")
    report = check_equivalence(original, session, SHAPE, reference="original model")
    assert report.passed, report.to_json()
    assert sorted({o.shape[0] for o in report.outputs}) == [1, 3]


def test_vit_b_16_grows_exactly():
    original = torchvision.models.vit_b_16(image_size=64)  # every layer of ViT-B/16, on 17 tokens
    gm = gg.trace(original, (1, 3, 64, 64))
    default = gg.Pipeline.from_spec("add_residual").run(gm).results[0]  # over the encoder's token stream
    assert default.targets["skip"] == "identity × gate (gate = 0)" and default.targets["end"].startswith("encoder_ln ")
    assert set(default.preservation.trainable) == {"residual_gate"}
    result = gg.Pipeline.from_spec("add_residual(start=x,end=conv_proj)").run(gm).results[0]
    assert result.targets["skip"] == "1×1 conv 3→768 stride 16 + BatchNorm(γ=β=0)"
    # torchvision zero-initialises the ViT head: nothing else gets a gradient at step 0, where the head moves (as in
    # training); every parameter trains from step 1 and the gradient reaches the new layers now the head has moved;
    # the conv behind the zero BatchNorm γ gets one the step after (argued from the zero factor, verify/zero_factor.py)
    assert result.preservation.trainable == {
        "residual_downsample.1.weight": 1,
        "residual_downsample.1.bias": 1,
        "residual_downsample.0.weight": 2,
    }
