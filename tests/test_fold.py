"""fold: every rule, every refusal, and exactness on the output of every growth pass, with non-zero
gates and trained-looking BatchNorm statistics, in torch and in onnxruntime."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from conftest import assert_same_snapshot, randomize_bn, run_cli, small_cnn, snapshot, trained_looking
from torch import nn

import graphgrow as gg
from graphgrow.capture.trace import input_shape_of


def grow(model: nn.Module, shape, spec: str) -> torch.fx.GraphModule:
    gm = gg.Pipeline.from_spec(spec).run(gg.trace(model, shape)).gm
    return trained_looking(gm)


def folded(gm):
    before = snapshot(gm)
    r = gg.fold(gm)
    assert_same_snapshot(before, snapshot(gm))  # fold works on a copy
    assert r.preservation is not None and r.preservation.eval.ok and r.preservation.train is None
    x = torch.randn(3, *input_shape_of(gm)[1:], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, got = gm.eval()(x), r.gm(x)
    assert torch.allclose(ref, got, rtol=1e-4, atol=1e-5 * ref.abs().max().item()), (ref - got).abs().max()
    assert not r.gm.training
    return r


def kinds(gm) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            k = type(gm.get_submodule(n.target)).__name__
            out[k] = out.get(k, 0) + 1
    return out


CNN = (1, 3, 32, 32)


@pytest.mark.parametrize("op", ["conv3x3", "sepconv3x3", "avgpool3x3", "identity"])
def test_linear_branches_fold_into_the_main_conv(op):
    gm = grow(small_cnn(), CNN, f"add_branch(op={op},count=2)")
    r = folded(gm)
    assert "AverageMerge" not in kinds(r.gm) and "BatchNorm2d" not in kinds(r.gm)
    assert kinds(r.gm)["Conv2d"] == 3  # as many convs as the model had before growing
    assert not r.targets.get("kept"), r.targets


def test_a_conv5x5_branch_enlarges_the_main_conv_only_when_asked():
    gm = grow(small_cnn(), CNN, "add_branch(op=conv5x5)")
    r = folded(gm)
    assert sorted(m.kernel_size for m in r.gm.modules() if isinstance(m, nn.Conv2d)) == [(3, 3)] * 3 + [(5, 5)]
    assert "grow_kernels=true" in " ".join(r.targets["kept"])
    r = gg.fold(gm, grow_kernels=True)
    enlarged = [m for m in r.gm.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (5, 5)]
    assert len(enlarged) == 1 and enlarged[0].padding == (2, 2) and kinds(r.gm)["Conv2d"] == 3
    assert r.preservation.eval.ok and r.flops_after < r.flops_before and not r.targets.get("kept")


def test_a_non_linear_branch_stays_and_the_report_says_why():
    gm = grow(small_cnn(), CNN, "add_branch(op=maxpool3x3)")
    r = folded(gm)
    kept = " ".join(r.targets.get("kept", []))
    assert "merge 'merge'" in kept and "MaxPool2d" in kept and "not linear" in kept, r.targets


def test_a_sepconv_branch_folds_into_a_dense_main_conv():
    r = folded(grow(small_cnn(), CNN, "add_branch(op=sepconv3x3)"))
    assert kinds(r.gm)["Conv2d"] == 3 and not r.targets.get("kept")


def test_a_sepconv_branch_beside_a_depthwise_conv_is_not_made_dense():
    """depthwise 3×3 + (depthwise 3×3 → 1×1) as one dense 3×3 would cost 9·C² multiply-adds per pixel, not 18·C + C²."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1, groups=32),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 4),
    )
    r = folded(grow(model, (1, 3, 16, 16), "add_branch(at=_3,op=sepconv3x3)"))
    assert any(isinstance(m, nn.Conv2d) and m.groups == 32 and m.kernel_size == (3, 3) for m in r.gm.modules())
    assert not any(
        isinstance(m, nn.Conv2d) and m.groups == 1 and m.kernel_size == (3, 3) and m.in_channels == 32
        for m in r.gm.modules()
    )
    assert "cost more multiply-adds" in " ".join(r.targets.get("kept", [])), r.targets
    assert r.flops_after <= r.flops_before


def test_zero_gates_drop_their_branch():
    gm = gg.Pipeline.from_spec("add_branch(op=maxpool3x3,count=2)").run(gg.trace(small_cnn(), CNN)).gm  # gates stay 0
    r = folded(gm)
    assert "MaxPool2d" not in kinds(r.gm) and "AverageMerge" not in kinds(r.gm)
    assert any("gate 0" in n for n in r.notes)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_gate_behind_a_relu_moves_into_the_conv_and_a_negative_one_subtracts(sign):
    gm = grow(small_cnn(), CNN, "deepen")
    gate = next(n for n, p in gm.named_parameters() if n.endswith("_gate"))
    with torch.no_grad():
        gm.get_parameter(gate).copy_(torch.tensor(0.7 * sign))
    r = folded(gm)
    targets = [n.target for n in r.gm.graph.nodes if n.op == "call_function"]
    assert not any(n.op == "get_attr" for n in r.gm.graph.nodes)  # the gate is in the weights now
    import operator

    assert (operator.sub in targets) == (sign < 0)
    assert sum(1 for n in r.gm.graph.nodes if n.op == "call_function" and n.target is operator.mul) == 0
    assert "deepen" in " ".join(r.targets.get("kept", [])) and "ReLU" in " ".join(r.targets["kept"])


def test_batchnorm_folds_into_grouped_and_plain_convs():
    torch.manual_seed(0)
    model = randomize_bn(
        nn.Sequential(
            nn.Conv2d(8, 16, 3, padding=1, groups=4),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False),
            nn.BatchNorm2d(16),
            nn.Flatten(),
            nn.Linear(16 * 8 * 8, 3),
            nn.BatchNorm1d(3),
        ),
        4,
    )
    r = folded(gg.trace(model, (1, 8, 8, 8)))
    convs = [m for m in r.gm.modules() if isinstance(m, nn.Conv2d)]
    assert [c.groups for c in convs] == [4, 16] and all(c.bias is not None for c in convs)
    assert "BatchNorm2d" not in kinds(r.gm) and "BatchNorm1d" not in kinds(r.gm)


def test_adapters_fold_into_the_conv_before_and_through_pooling_into_the_classifier():
    model = small_cnn()
    gm = grow(model, CNN, "insert_adapter(after=_0),insert_adapter(after=_8)")
    r = folded(gm)
    assert kinds(r.gm)["Conv2d"] == 3 and kinds(r.gm)["Linear"] == 1
    assert any("before global pooling" in t for t in r.targets["folded"]) and any(
        "_0_adapter" in t for t in r.targets["folded"]
    )


def test_an_adapter_before_a_conv_folds_into_it():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1, bias=False), nn.Conv2d(8, 4, 3, padding=1)
    )
    r = folded(trained_looking(gg.trace(model, (1, 3, 8, 8))))
    assert kinds(r.gm)["Conv2d"] == 2


def test_a_mode_adapter_widening_folds_back_to_the_original_width():
    model = small_cnn()
    gm = grow(model, CNN, "grow_width(target=_3,to=96,mode=adapter,init=net2net)")
    assert gm.get_submodule("3").out_channels == 96
    r = folded(gm)
    widths = [m.out_channels for m in r.gm.modules() if isinstance(m, nn.Conv2d)]
    assert widths == [32, 64, 128] and r.params_after < r.params_before


def test_identities_dropout_and_double_relus_go():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.ReLU(), nn.Dropout(0.5), nn.Identity(), nn.Linear(8, 2))
    r = folded(gg.trace(model, (1, 6)))
    assert kinds(r.gm) == {"Linear": 2, "ReLU": 1}


def test_stochastic_depth_kept_as_a_runtime_switch_is_removed():
    model = torchvision.models.efficientnet_b0(stochastic_depth_prob=0.3)
    gm = gg.trace(randomize_bn(model, 2), (1, 3, 32, 32))
    r = folded(gm)
    names = {getattr(n.target, "__name__", "") for n in r.gm.graph.nodes if n.op == "call_function"}
    assert "stochastic_depth" not in names and "BatchNorm2d" not in kinds(r.gm)


def test_fold_is_idempotent_and_logged():
    gm = grow(small_cnn(), CNN, "add_branch(op=conv3x3)")
    once = gg.fold(gm)
    twice = gg.fold(once.gm)
    assert twice.targets["folded"] == "nothing to fold"
    assert len(list(once.gm.graph.nodes)) == len(list(twice.gm.graph.nodes))
    assert [e["pass"] for e in twice.gm.meta["graphgrow"]["log"]][-3:] == ["add_branch", "fold", "fold"]


EVERY_PASS = [
    "add_residual",
    "add_residual(start=_2,end=_5)",
    "grow_width",
    "grow_width(init=net2net,factor=2)",
    "insert_adapter(out_channels=160)",
    "deepen",
    "add_branch(op=dilconv3x3,count=2)",
    "add_branch(op=maxpool3x3,count=2),remove_branch(index=0,allow_change=true)",
    "add_branch(op=conv3x3),add_branch(op=identity),deepen,insert_adapter,add_residual",
]


def test_every_growth_pass_and_a_pipeline_fold_exactly():
    for spec in EVERY_PASS:
        folded(grow(small_cnn(), CNN, spec))


@pytest.mark.slow
def test_every_growth_pass_folds_exactly_in_onnxruntime(tmp_path):
    from graphgrow.io.export import export_onnx
    from graphgrow.io.runtime import max_ir_version, open_session
    from graphgrow.verify.equivalence import check_equivalence

    for i, spec in enumerate(EVERY_PASS):
        gm = grow(small_cnn(), CNN, spec)
        r = folded(gm)
        path = tmp_path / f"{i}.onnx"
        export_onnx(r.gm, CNN, path, max_ir_version=max_ir_version())
        report = check_equivalence(gm.eval(), open_session(path, "cpu"), CNN, reference="grown model")
        assert report.passed, (spec, report.to_json())


@pytest.mark.slow
def test_linear_growth_of_resnet18_deploys_as_the_same_kernels_in_onnxruntime(tmp_path):
    """Branches (conv, identity, average pooling), an adapter and an adapter-mode widening: after fold
    the ONNX graph onnxruntime runs has exactly the original's op histogram, and the outputs agree."""
    from graphgrow.io.export import export_onnx
    from graphgrow.io.runtime import max_ir_version, open_session, optimized_op_counts
    from graphgrow.verify.equivalence import check_equivalence

    shape = (1, 3, 64, 64)
    model = randomize_bn(torchvision.models.resnet18(), 5).eval()
    spec = (
        "add_branch(op=conv3x3),add_branch(op=identity),add_branch(op=avgpool3x3),insert_adapter,"
        "grow_width(target=layer2.0.conv1,to=160,mode=adapter)"
    )
    gm = grow(model, shape, spec)
    r = folded(gm)
    paths = {}
    for name, m in (("original", gg.trace(model, shape)), ("grown", gm), ("folded", r.gm)):
        paths[name] = tmp_path / f"{name}.onnx"
        export_onnx(m, shape, paths[name], max_ir_version=max_ir_version())
    counts = {k: optimized_op_counts(str(p)) for k, p in paths.items()}
    assert counts["folded"] == counts["original"], counts
    assert counts["grown"] != counts["original"]
    report = check_equivalence(gm.eval(), open_session(paths["folded"], "cpu"), shape, reference="grown model")
    assert report.passed, report.to_json()


@pytest.mark.slow
def test_cli_fold_and_export_fold(tmp_path, cnn_file):
    grown = tmp_path / "g.pt"
    proc = run_cli(
        "mutate",
        str(cnn_file),
        "--input-shape",
        "1,3,32,32",
        "--pass",
        "add_branch(op=conv3x3,count=2)",
        "-o",
        str(grown),
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("fold", str(grown), "--onnx", str(tmp_path / "f.onnx"), "--check", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["outputs"] == [str(tmp_path / "g.folded.pt"), str(tmp_path / "f.onnx")]
    assert report["equivalence"]["passed"] and report["passes"][0]["name"] == "fold"
    assert report["passes"][0]["preservation"]["train_ok"] is None
    log = gg.load_model(tmp_path / "g.folded.pt").module.meta["graphgrow"]["log"]
    assert [e["pass"] for e in log] == ["add_branch", "fold"]
    proc = run_cli("fold", str(grown), "--grow-kernels", "-o", str(tmp_path / "k.pt"), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["passes"][0]["args"] == {"grow_kernels": True}, proc.stderr
    proc = run_cli("export", str(grown), "--fold", "-o", str(tmp_path / "e.onnx"))
    assert proc.returncode == 0, proc.stderr
    assert "folded: params" in proc.stdout
    proc = run_cli("fold", str(grown), "-o", str(tmp_path / "x.pt"), "--onnx", str(tmp_path / "x.pt"))
    assert proc.returncode == 2 and not (tmp_path / "x.pt").exists()


def test_a_relu_after_a_shift_or_a_negative_scale_is_kept():
    """relu(relu(x) − 1) and relu(−2·relu(x)) are not relu(x) − 1 and −2·relu(x): only non-negative inputs lose
    their ReLU."""

    class Shifted(nn.Module):
        def forward(self, x):
            r = torch.relu(x)
            return torch.relu(r - 1.0) + torch.relu(r + (-1.0)) + torch.relu(r * -2.0) + torch.relu(r * 3.0)

    r = folded(gg.trace(Shifted(), (1, 4)))
    relus = sum(1 for n in r.gm.graph.nodes if n.op == "call_function" and n.target is torch.relu)
    assert relus == 4  # the first, and the three after a shift or a negative scale; relu(3·r) is dropped


class TokenHead(nn.Module):
    """ViT-like: tokens (N, T, C), a final LayerNorm, the class token selected, a Linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.fc = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = self.ln(t + torch.relu(self.fc(t)))
        return self.head(t[:, 0])


def test_a_per_token_adapter_moves_through_the_token_select_into_the_head():
    gm = grow(TokenHead(), (1, 3, 16, 16), "insert_adapter(after=ln)")
    r = folded(gm)
    assert "ln_adapter (per-token Linear before a token select) → head" in " ".join(r.targets["folded"])
    assert "ln_adapter" not in kinds_by_target(r.gm) and not r.targets.get("kept")
    assert r.params_after == sum(p.numel() for p in TokenHead().parameters())


def test_growth_that_stays_is_reported_by_module():
    gm = grow(TokenHead(), (1, 3, 16, 16), "deepen(after=ln)")
    r = folded(gm)
    kept = " ".join(r.targets.get("kept", []))
    assert "deepen_linear_relu" in kept and "ReLU" in kept, r.targets


def kinds_by_target(gm) -> set[str]:
    return {str(n.target).split(".")[0] for n in gm.graph.nodes if n.op == "call_module"}
