"""Issue 37 item 1: everything graphgrow adds stays growable. Branches, deepen's blocks, skips and adapters are
inlined as their layers' calls (graph.inline), so the coupling analysis sees their convs, depthwise convs and
BatchNorms: a channel group that a new branch reads from or writes into grows with the branch's own layers."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torchvision
from conftest import ROOT, outputs_both_modes, randomize_bn, rel_err, run_cli
from graphgrow.passes.add_branch import OPS, AddBranch, RemoveBranch
from graphgrow.passes.add_residual import AddResidual
from graphgrow.passes.deepen import Deepen
from graphgrow.passes.grow_width import GrowWidth
from graphgrow.passes.insert_adapter import InsertAdapter
from torch import fx, nn

import graphgrow as gg
from graphgrow.analysis.coupling import analyze
from graphgrow.graph.inline import inline_call, inline_containers
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence

SHAPE = (1, 3, 16, 16)


def nine_layer_cnn() -> nn.Sequential:
    """The issue's plain CNN: 3 conv/BN/ReLU blocks, pooling, Linear (nodes _0 … _12; _7 is the last conv)."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 8),
        *block(8, 16),
        nn.MaxPool2d(2),
        *block(16, 16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()


def traced() -> fx.GraphModule:
    torch.manual_seed(0)
    return gg.trace(randomize_bn(nine_layer_cnn()), SHAPE)


def not_understood(gm: fx.GraphModule) -> list[str]:
    return [why for g in analyze(gm).groups for why in g.frozen if "not understood" in why]


def assert_exact(before: fx.GraphModule, r) -> None:
    p = r.preservation
    assert p.eval.ok and p.train.ok and p.trainable_ok, p
    x = torch.randn(3, *SHAPE[1:])
    for a, b in zip(outputs_both_modes(before, x), outputs_both_modes(r.gm, x)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.slow
def test_the_issues_five_pass_pipeline_passes_through_the_cli(tmp_path):
    """add_branch ×2, grow_width, deepen, add_residual with --check (step 3 was refused: every group frozen by
    'branch_conv5x5 (Sequential) is not understood'); the result loads without --trust and every group but the
    model's input and output can grow."""
    model, grown = tmp_path / "cnn.pt", tmp_path / "cnn.grown.pt"
    torch.save(randomize_bn(nine_layer_cnn()), model)
    proc = run_cli(
        "mutate",
        str(model),
        "--input-shape",
        "1,3,16,16",
        "--pass",
        "add_branch(op=sepconv3x3)",
        "--pass",
        "add_branch(op=conv5x5)",
        "--pass",
        "grow_width",
        "--pass",
        "deepen",
        "--pass",
        "add_residual",
        "--check",
        "--json",
        "-o",
        str(grown),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [p["name"] for p in report["passes"]] == ["add_branch", "add_branch", "grow_width", "deepen", "add_residual"]
    assert all(
        p["preservation"]["eval_ok"] and p["preservation"]["train_ok"] and p["preservation"]["trainable_ok"]
        for p in report["passes"]
    )
    assert report["equivalence"]["passed"]
    assert "branch_sepconv3x3" in report["passes"][2]["targets"]["rebuilt"]  # the widened group runs through a branch
    proc = run_cli("inspect", str(grown), "--groups", "--json")  # no --trust: a safe file
    assert proc.returncode == 0, proc.stderr
    groups = json.loads(proc.stdout)["groups"]
    assert all(g["frozen"] == [] for g in groups[1:-1]), [g["frozen"] for g in groups]
    assert "not understood" not in proc.stdout


# add_branch beside the last conv ('_7': reads _6, the group of conv _3; writes the group of _7), 1 to 3 times
MATRIX = [
    (("sepconv3x3",), "_3"),
    (("conv5x5",), "_7"),
    (("dilconv3x3",), "_7"),
    (("avgpool3x3",), "_7"),
    (("sepconv3x3", "conv5x5"), "_3"),
    (("sepconv5x5", "identity"), "_7"),
    (("conv3x3", "maxpool3x3"), "_7"),
    (("sepconv3x3", "conv5x5", "dilconv3x3"), "_3"),
    (("sepconv3x3", "conv5x5", "dilconv3x3"), "_7"),
]


@pytest.mark.parametrize("ops, target", MATRIX, ids=[f"{'+'.join(o)}-{t}" for o, t in MATRIX])
def test_grow_width_after_branches_grows_through_them(ops, target, tmp_path):
    gm = traced()
    for op in ops:
        gm = AddBranch(at="_7", op=op)(gm).gm
    assert not_understood(gm) == []
    r = GrowWidth(target=target)(gm)
    assert_exact(gm, r)
    rebuilt = r.targets["rebuilt"].split(", ")
    for name, module in gm.named_modules():  # every conv of a branch on the grown side is rebuilt
        if name.startswith("branch_") and isinstance(module, nn.Conv2d):
            reads = target == "_3" and (
                module.groups > 1 or name.endswith(".1")
            )  # first conv or depthwise: the input side
            writes = (
                target == "_7" and module.out_channels == 16 and module.groups == 1
            )  # the conv writing into the merge
            if reads or writes:
                assert name in rebuilt, (name, rebuilt)
    for name, module in r.gm.named_modules():
        if name.startswith("branch_") and isinstance(module, nn.Conv2d) and module.groups > 1 and target == "_3":
            assert module.groups == module.in_channels == 32  # a depthwise conv grows by whole groups
    path = gg.save_model(r.gm, tmp_path / "m.pt")
    loaded = gg.load_model(path).module  # no trust: the safe format
    x = torch.randn(2, *SHAPE[1:])
    for a, b in zip(outputs_both_modes(r.gm, x), outputs_both_modes(loaded, x)):
        assert torch.equal(a, b)
    assert not_understood(loaded) == []


@pytest.mark.parametrize("count", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_onnx_agrees_after_branches_and_growth(count, tmp_path):
    gm = traced()
    original = gm
    for op in OPS[:count]:
        gm = AddBranch(at="_7", op=op)(gm).gm
    grown = GrowWidth(target="_7")(GrowWidth(target="_3")(gm).gm).gm
    path = tmp_path / "m.onnx"
    export_onnx(grown, SHAPE, path, max_ir_version=max_ir_version())
    report = check_equivalence(original, open_session(path, "cpu"), SHAPE, reference="original model")
    assert report.passed, report.to_json()


@pytest.mark.parametrize("insert", ["deepen", "add_residual", "insert_adapter"])
def test_grow_width_through_deepen_residual_and_adapter(insert):
    gm = traced()
    added = {
        "deepen": Deepen(after="_9"),
        "add_residual": AddResidual(start="_5", end="_9"),
        "insert_adapter": InsertAdapter(after="_9", out_channels=24),
    }[insert](gm).gm
    assert not_understood(added) == []
    r = GrowWidth(target="_7")(added)
    assert_exact(added, r)
    own = {"deepen": "deepen_conv_bn_relu.0", "add_residual": "residual_downsample.0", "insert_adapter": "_9_adapter"}[
        insert
    ]
    assert own in r.targets["rebuilt"].split(", ")


def test_a_second_branch_joins_the_merge_of_inlined_branches():
    r = AddBranch(at="_7", op="sepconv3x3")(traced())
    r2 = AddBranch(at="_7", op="identity")(r.gm)  # the merge's input is found from the inlined branch's nodes
    assert "1 → 2 branches" in r2.targets["merge"] and r2.preservation.eval.ok
    merge = next(n for n in r2.gm.graph.nodes if n.target == "merge")
    assert merge.args[2].target == "branch_identity" and merge.args[2].args[0].name == "_6"  # reads the span's input
    gone = RemoveBranch(index=0)(r2.gm)
    assert gone.targets["removed"].startswith("branch 0 (branch_sepconv3x3)")
    assert not any(str(n.target).startswith("branch_sepconv3x3") for n in gone.gm.graph.nodes)


@pytest.mark.slow
def test_gradmax_aims_a_branch_then_inlines_it():
    def data():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(8, *SHAPE[1:], generator=g),), lambda out: out.square().mean()

    r = AddBranch(at="_7", op="conv3x3", init="gradmax", data=data)(traced())
    assert r.targets["gain"] > 0 and r.preservation.eval.ok
    assert {n.target for n in r.gm.graph.nodes if n.op == "call_module"} >= {"branch_conv3x3.1", "branch_conv3x3.2"}


class TrainOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x) if self.training else x


def test_inline_keeps_what_it_cannot_look_through():
    gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 3, 1)))
    gm.add_module("block", TrainOnly())  # its forward differs by mode: one graph cannot hold both
    gm.add_module("seq", nn.Sequential(nn.ReLU(), nn.Sequential(nn.Identity(), nn.ReLU())))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        b = gm.graph.call_module("block", (out.args[0],))
        s = gm.graph.call_module("seq", (b,))
        c = gm.graph.call_module("0", (s,))  # a leaf layer: nothing to look through
    out.args = (c,)
    assert inline_call(gm, b) is None and inline_call(gm, c) is None
    assert inline_containers(gm, ["seq"]) == ["seq"]
    gm.recompile()
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [
        "0",
        "block",
        "seq.0",
        "seq.1.0",
        "seq.1.1",
        "0",
    ]


@pytest.mark.slow
def test_resnet18_grows_through_its_new_branches():
    torch.manual_seed(0)
    gm = gg.trace(randomize_bn(torchvision.models.resnet18(), seed=3).eval(), (1, 3, 64, 64))
    for op in ("sepconv3x3", "conv5x5"):
        gm = AddBranch(at="layer3.0.conv2", op=op)(gm).gm
    assert not_understood(gm) == []
    r = GrowWidth(target="layer3.0.conv2")(gm)  # the group the branches write into: the residual stream of layer3
    p = r.preservation
    assert p.eval.ok and p.train.ok and p.trainable_ok
    rebuilt = r.targets["rebuilt"].split(", ")
    assert {"branch_sepconv3x3.2", "branch_sepconv3x3.3", "branch_conv5x5.1", "layer3.1.conv1"} <= set(rebuilt)


@pytest.mark.slow
def test_darts_network_grows_through_a_branch_inside_a_cell():
    sys.path.insert(0, str(ROOT / "examples"))
    import darts_net as dn

    gm = gg.trace(dn.small_darts(layers=5, C=8).eval(), (1, 3, 32, 32))
    r = AddBranch(op="sepconv3x3")(gm)
    conv = r.targets["chosen"].split("'")[1]  # the cell conv the branch runs beside
    gm = AddBranch(at=conv, op="conv5x5")(r.gm).gm
    assert not_understood(gm) == []
    grown = GrowWidth(target=conv)(gm)
    p = grown.preservation
    assert p.eval.ok and p.train.ok and p.trainable_ok
    assert {"branch_sepconv3x3.2", "branch_conv5x5.1"} <= set(grown.targets["rebuilt"].split(", "))


def test_a_file_saved_with_opaque_branches_grows_through_them_once_loaded(tmp_path, monkeypatch):
    """Files written before passes inlined their blocks hold each branch as one container call: loading looks
    through the modules the log says graphgrow added, so grow_width grows through the branch again."""
    import graphgrow.passes.add_branch as add_branch_module

    import graphgrow.rewrite.pass_base as pass_base

    with monkeypatch.context() as m:  # the old behaviour: the branch stays one call_module node
        m.setattr(pass_base, "inline_containers", lambda gm, paths: [])
        m.setattr(add_branch_module, "inline_containers", lambda gm, paths: [])
        old = AddBranch(op="sepconv3x3")(traced()).gm
    assert any("branch_sepconv3x3" in why for why in not_understood(old))
    path = gg.save_model(old, tmp_path / "old.pt")
    loaded = gg.load_model(path).module
    assert not not_understood(loaded)
    x = torch.randn(2, 3, 16, 16)
    old.eval(), loaded.eval()
    assert torch.equal(old(x), loaded(x))
    r = GrowWidth(target="branch_sepconv3x3.2")(loaded)
    assert_exact(loaded, r)
    assert "branch_sepconv3x3.3" in r.targets["rebuilt"]
