"""Default targets a practitioner would pick (issue: sensible defaults), and the candidates behind them."""

from __future__ import annotations

import re

import pytest
import torch
import torchvision

import graphgrow as gg
from graphgrow.analysis.stages import main_path, stages

SHAPE = (1, 3, 64, 64)
PASSES = ("add_residual", "add_branch", "grow_width", "insert_adapter", "deepen")


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name.startswith("timm:"):
        timm = pytest.importorskip("timm")
        return timm.create_model(name[5:], pretrained=False).eval()
    return getattr(torchvision.models, name)().eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "timm:resnet26d", "timm:efficientnet_b0"])
def test_each_default_is_a_named_place_within_a_quarter_of_the_model(name):
    gm = gg.trace(build(name), SHAPE)
    total = sum(p.numel() for p in gm.parameters())
    raw = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    for spec in PASSES:
        r = gg.Pipeline.from_spec(spec).run(gm).results[0]
        added = r.params_after - r.params_before
        assert 0 < added <= 0.25 * total, f"{name} {spec}: +{added:,} of {total:,}"
        chosen = r.targets["chosen"]
        assert re.search(r"'[\w.]+'|\([\w.]+, \d", chosen), f"{name} {spec}: no module path in {chosen!r}"
        assert "stage" in chosen or spec == "grow_width" and "'" in chosen
        for key in ("start", "after"):
            assert not str(r.targets.get(key, "")).startswith(f"{raw} "), f"{name} {spec} starts at the raw input"
        if spec == "add_branch":  # beside a conv on a feature map, not a pooled one
            assert "1×1)" not in chosen


def test_add_residual_spans_one_stage_with_its_downsampling():
    gm = gg.trace(build("resnet18"), (1, 3, 224, 224))
    r = gg.Pipeline.from_spec("add_residual").run(gm).results[0]
    assert r.targets["start"] == "layer3_1_relu_1 [1, 256, 14, 14]"
    assert r.targets["end"] == "layer4_1_relu_1 [1, 512, 7, 7]"
    assert r.targets["skip"] == "1×1 conv 256→512 stride 2 + BatchNorm(γ=β=0)"
    assert "stage 4 of 5 (layer3.1.relu, 14×14)" in r.targets["chosen"]


def test_add_branch_never_lands_on_graphgrows_own_modules():
    gm = gg.trace(build("resnet18"), SHAPE)
    grown = gg.Pipeline.from_spec("add_residual,add_branch").run(gm)
    branch = grown.results[1]
    assert "residual_downsample" not in branch.targets["span"] and "'layer4.1.conv2'" in branch.targets["chosen"]
    assert grown.log[0]["modules_added"] == ["residual_downsample"]
    assert not any(
        "residual_downsample" in c.args["at"] for c in gg.get_pass("add_branch")().candidates(grown.results[0].gm)
    )


def test_grow_width_skips_squeeze_excitation_bottlenecks():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    gm = gg.trace(timm.create_model("ghostnet_050", pretrained=False).eval(), SHAPE)
    r = gg.Pipeline.from_spec("grow_width").run(gm).results[0]
    assert ".se." not in r.targets["target"] and "main-path layer" in r.targets["chosen"]


def test_main_path_and_stages_of_a_transformer():
    gm = gg.trace(torchvision.models.vit_b_16(image_size=64).eval(), SHAPE)
    gg.annotate(gm, SHAPE)
    found = stages(gm)
    assert found[-1].resolution == (17,) and found[-1].nodes[-1].name == "encoder_ln"
    path = [n.name for n in main_path(gm)]
    assert (
        sum(n.startswith("add") for n in path) == 1 + 2 * 12
    )  # position embedding, then each block's two residual adds
    assert not any("ln_1" in n or "mlp" in n or "self_attention" in n for n in path)  # nothing inside a block
    r = gg.Pipeline.from_spec("add_residual").run(gm).results[0]
    assert r.targets["skip"] == "identity × gate (gate = 0)" and r.targets["end"].startswith("encoder_ln ")


def test_candidates_list_the_default_and_what_each_adds(runner):
    from graphgrow.cli import main

    res = runner.invoke(
        main,
        [
            "targets",
            "torchvision.models:resnet18",
            "--pass",
            "add_branch(op=sepconv3x3)",
            "--input-shape",
            "1,3,64,64",
            "--json",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    import json

    report = json.loads(res.output)
    defaults = [c for c in report["candidates"] if c["default"]]
    assert len(defaults) == 1 and defaults[0]["spec"] == "add_branch(op=sepconv3x3,at=layer4.1.conv2)"
    assert all(c["params"] > 0 and "stage" in c["where"] for c in report["candidates"])
    # the default candidate is what the pass does without a target, and adds what it said
    gm = gg.trace(build("resnet18"), SHAPE)
    r = gg.Pipeline.from_spec("add_branch(op=sepconv3x3)").run(gm).results[0]
    assert r.params_after - r.params_before == defaults[0]["params"]
    gg.annotate(gm, SHAPE)
    for name in ("add_residual", "grow_width", "insert_adapter", "deepen"):
        found = gg.get_pass(name)().candidates(gm)
        assert sum(c.default for c in found) == 1, name


def test_dry_run_writes_nothing(runner, tmp_path, monkeypatch):
    from graphgrow.cli import main

    monkeypatch.chdir(tmp_path)
    res = runner.invoke(
        main,
        [
            "mutate",
            "factories:small_cnn",
            "--pass",
            "insert_adapter",
            "--input-shape",
            "1,3,16,16",
            "--onnx",
            "m.onnx",
            "--dry-run",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert "dry run: no model written (would write" in res.output and "insert_adapter" in res.output
    assert list(tmp_path.iterdir()) == []


def test_a_channel_shuffle_does_not_end_the_backbone():
    """Found on torchvision's shufflenet: the shuffle's 5-D view lies on the main path; the backbone goes on to
    conv5."""
    gm = gg.trace(build("shufflenet_v2_x0_5"), (1, 3, 96, 96))
    r = gg.Pipeline.from_spec("add_residual").run(gm).results[0]
    assert r.targets["end"].startswith("conv5_2 [1, 1024, 3, 3]"), r.targets
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
