"""add_branch, remove_branch, deepen, five-pass pipelines with replay, and growth during training."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torchvision
from conftest import ROOT, assert_same_snapshot, outputs_both_modes, randomize_bn, rel_err, run_cli, small_cnn, snapshot
from graphgrow.passes.add_branch import OPS, AddBranch, RemoveBranch
from graphgrow.passes.deepen import Deepen
from torch import nn

import graphgrow as gg
from graphgrow.graph.layers import AverageMerge
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence


def traced():
    return gg.trace(randomize_bn(small_cnn()), (1, 3, 32, 32))


@pytest.mark.parametrize("op", OPS)
def test_every_branch_op_is_exact_and_learns(op):
    gm = traced()
    r = AddBranch(at="_3", op=op)(gm)  # _2 (32×32×32) → _3 (64×16×16): stride 2 and a channel change
    x = torch.randn(4, 3, 32, 32)
    for a, b in zip(outputs_both_modes(gm, x), outputs_both_modes(r.gm, x)):
        assert rel_err(a, b) <= 1e-6
    pres = r.preservation
    assert pres.trainable["merge.gates"] == 0 and pres.trainable_ok
    merge = r.gm.get_submodule("merge")
    assert isinstance(merge, AverageMerge) and merge.branches == 1 and merge.gates.abs().sum() == 0


def test_branches_do_not_stay_identical_under_sgd():
    r = AddBranch(at="_3", op="conv3x3", count=2)(traced())
    gm = copy.deepcopy(r.gm).train()
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(gm(x), y).backward()
        opt.step()
    a, b = gm.get_submodule("branch_conv3x3.1").weight, gm.get_submodule("branch_conv3x3_1.1").weight
    assert (a - b).abs().max() > 1e-3
    gates = gm.get_submodule("merge").gates
    assert gates.abs().min() > 0 and (gates[0] - gates[1]).abs() > 0


def test_adding_to_a_merge_extends_it_exactly_even_with_trained_gates():
    r = AddBranch(at="_3", op="conv3x3")(traced())
    with torch.no_grad():
        r.gm.get_submodule("merge").gates.fill_(0.7)  # as after training: the branch contributes
    gm = gg.trace(r.gm)
    r2 = AddBranch(at="_3", op="maxpool3x3")(gm)
    merges = [
        n
        for n in r2.gm.graph.nodes
        if n.op == "call_module" and isinstance(r2.gm.get_submodule(n.target), AverageMerge)
    ]
    assert len(merges) == 1 and len(merges[0].args) == 3  # main + 2 branches, not a nested merge
    assert torch.allclose(r2.gm.get_submodule("merge").gates, torch.tensor([1.4, 0.0]))
    assert r2.preservation.eval.ok and r2.preservation.train.ok
    assert "1 → 2 branches" in r2.targets["merge"]


def test_remove_branch_exact_at_zero_refused_otherwise():
    r = AddBranch(at="_3", op="conv5x5", count=2)(traced())
    gone = RemoveBranch()(r.gm)  # gates are 0: exact
    assert gone.preservation.eval.rel_err == 0.0 and gone.gm.get_submodule("merge").branches == 1
    both = RemoveBranch()(gone.gm)
    assert not any(isinstance(m, AverageMerge) for m in both.gm.modules()) and both.targets["left"] == "merge removed"
    with torch.no_grad():
        r.gm.get_submodule("merge").gates.copy_(torch.tensor([0.5, 0.3]))
    gm = gg.trace(r.gm)
    before = snapshot(gm)
    with pytest.raises(gg.NotApplicable, match="contributes .*removing it changes the function"):
        RemoveBranch(index=0)(gm)
    assert_same_snapshot(before, snapshot(gm))
    changed = RemoveBranch(index=0, allow_change=True)(gm)
    assert changed.preservation.eval.rel_err > 0 and any("function changed on purpose" in n for n in changed.notes)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"at": "_3", "op": "conv7x7"}, "must be one of conv3x3"),
        ({"at": "_11"}, "add_branch needs 4-D feature maps"),
        ({"at": "nope"}, "no node or module named 'nope'"),
        ({"at": "_3", "count": 0}, r"add_branch\(count=\.\.\.\) must be in \[1, 16\]"),
    ],
)
def test_add_branch_refusals(args, message):
    with pytest.raises((gg.NotApplicable, gg.SpecError), match=message):
        spec = "add_branch(" + ",".join(f"{k}={v}" for k, v in args.items()) + ")"
        gg.Pipeline.from_spec(spec).run(traced())


@pytest.mark.parametrize("after, block", [("_8", "conv_bn_relu"), ("_10", "linear_relu"), (None, "conv_bn_relu")])
def test_deepen_is_exact_in_both_modes_and_learns(after, block):
    gm = traced()
    r = Deepen(after=after)(gm)
    assert r.targets["block"].startswith(block)
    x = torch.randn(4, 3, 32, 32)
    for a, b in zip(outputs_both_modes(gm, x), outputs_both_modes(r.gm, x)):
        assert rel_err(a, b) <= 1e-6
    gate = [n for n in r.preservation.trainable if n.endswith("_gate")]
    assert len(gate) == 1 and r.preservation.trainable[gate[0]] == 0 and r.preservation.trainable_ok


def test_deepen_refuses_the_wrong_block():
    with pytest.raises(gg.NotApplicable, match="linear_relu needs"):
        Deepen(after="_8", block="linear_relu")(traced())


def build(name):
    torch.manual_seed(0)
    kwargs = (
        {"image_size": 64} if name.startswith("vit") else {}
    )  # the full ViT-B/16 at 17 tokens: same layers, quicker
    model = randomize_bn(getattr(torchvision.models, name)(**kwargs), seed=3)
    if name.startswith("vit"):
        nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


TV = [
    (
        "resnet18",
        (1, 3, 64, 64),
        "add_branch(at=layer3,op=sepconv3x3),add_branch(at=layer3,op=avgpool3x3),deepen(after=layer2),remove_branch",
    ),
    ("mobilenet_v2", (1, 3, 64, 64), "add_branch(at=features.5:features.7,op=dilconv3x3,count=2),deepen"),
    ("vit_b_16", (1, 3, 64, 64), "deepen(after=encoder.layers.encoder_layer_3)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, shape, spec", TV, ids=[t[0] for t in TV])
def test_torchvision_branches_and_depth_export_and_match(name, shape, spec, tmp_path):
    model = build(name).eval()
    before = snapshot(model)
    result = gg.Pipeline.from_spec(spec).run(gg.trace(model, shape))
    for r in result.results:
        assert (
            r.preservation.eval.ok
            and r.preservation.train.ok
            and r.preservation.trainable_ok
            and not r.preservation.degenerate
        )
    assert_same_snapshot(before, snapshot(model))
    path = tmp_path / "m.onnx"
    export_onnx(result.gm, shape, path, max_ir_version=max_ir_version())
    report = check_equivalence(model, open_session(path, "cpu"), shape, reference="original model")
    assert report.passed, report.to_json()


@pytest.mark.slow
def test_five_pass_cli_pipeline_verifies_each_and_replays_bit_identically(tmp_path, cnn_file):
    grown, onnx_path = tmp_path / "grown.pt", tmp_path / "grown.onnx"
    proc = run_cli(
        "mutate",
        str(cnn_file),
        "--input-shape",
        "1,3,32,32",
        "--pass",
        "grow_width,add_residual",
        "--pass",
        "add_branch(op=sepconv3x3,count=2)",
        "--pass",
        "deepen",
        "--pass",
        "insert_adapter(out_channels=160)",
        "-o",
        str(grown),
        "--onnx",
        str(onnx_path),
        "--check",
        "--json",
        "--seed",
        "5",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [p["name"] for p in report["passes"]] == [
        "grow_width",
        "add_residual",
        "add_branch",
        "deepen",
        "insert_adapter",
    ]
    assert all(p["preservation"]["eval_ok"] and p["preservation"]["trainable_ok"] for p in report["passes"])
    assert report["equivalence"]["passed"]
    for log_from in (grown, onnx_path):  # the log is in the .pt and in the ONNX metadata
        out = tmp_path / f"replayed_{log_from.suffix[1:]}.pt"
        proc = run_cli("replay", str(cnn_file), str(log_from), "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        a, b = gg.load_model(grown).module, gg.load_model(out).module
        assert a.code == b.code
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_replay_needs_a_log(tmp_path, cnn_file):
    proc = run_cli("replay", str(cnn_file), str(cnn_file), "-o", str(tmp_path / "x.pt"))
    assert proc.returncode == 2 and "has no mutation log" in proc.stderr


@pytest.mark.slow
def test_growth_during_training_example(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import grow_during_training as example

    summary = example.run(tmp_path / "plot.png", log=lambda *a: None)
    assert [e["pass"].split("(")[0] for e in summary["events"]] == [
        "grow_width",
        "add_residual",
        "add_branch",
        "deepen",
    ]
    for e in summary["events"]:
        for mode in ("eval", "train"):
            before, after = e[f"loss_{mode}"], e[f"loss_{mode}_after"]
            assert abs(after - before) <= 1e-5 * abs(before), e
    assert summary["final_acc_grown"] > summary["final_acc_base"]
    assert summary["params_grown"] > summary["params_base"]
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_deepen_after_logits_is_never_silenced_by_the_relu():
    """Found by the fuzzer: a Linear → ReLU block after the classifier could be all-negative on the
    check batch, leaving the gate without gradient. Paired units (w, −w) make that impossible."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.Flatten(), nn.Linear(2 * 8 * 8, 4))
    for seed in range(20):
        r = Deepen(after="_2")(gg.trace(model, (1, 3, 8, 8)), seed=seed)
        assert r.preservation.trainable_ok and r.preservation.trainable["deepen_linear_relu_gate"] == 0
        w = r.gm.get_submodule("deepen_linear_relu.0").weight
        assert torch.equal(w[2:], -w[:2])
