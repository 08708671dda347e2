"""Faithful tracing: the graph graphgrow grows computes what the user's module computes, in eval and train mode."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import StochasticDepth

import graphgrow as gg
from graphgrow.capture.fidelity import check_fidelity
from graphgrow.capture.trace import trace_report
from graphgrow.graph.shapes import validate_batch_sizes


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    """timm's drop_path: Python control flow on `training`."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return drop_path(x, self.p, self.training)


class Block(nn.Module):
    """conv-BN-ReLU with a residual whose branch is dropped at random in train mode."""

    def __init__(self, c, drop):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.drop = drop

    def forward(self, x):
        return x + self.drop(F.relu(self.bn(self.conv(x))))


class DepthNet(nn.Module):
    def __init__(self, drop_factory):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(Block(8, drop_factory()), Block(8, drop_factory()))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def sd_net():
    torch.manual_seed(0)
    return DepthNet(lambda: StochasticDepth(0.5, "row"))


def dp_net():
    torch.manual_seed(0)
    return DepthNet(lambda: DropPath(0.5))


SHAPE = (1, 3, 8, 8)


def test_stochastic_depth_keeps_its_runtime_switch():
    model = sd_net()  # a factory's model is in train mode
    gm = gg.trace(model, SHAPE)
    # the flag is read at run time (a get_attr of the module's flag), not frozen as True
    reads = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith(".training")]
    assert reads == ["blocks.0.drop.training", "blocks.1.drop.training"]
    x = torch.randn(4, 3, 8, 8)
    gm.eval()
    model.eval()
    assert torch.equal(gm(x), gm(x)), "the eval-mode graph must be deterministic"
    assert torch.allclose(gm(x), model(x), atol=0, rtol=0)
    assert trace_report(gm)["fidelity"] == ["eval@2", "eval@3", "train@2", "train@3"]


def test_drop_path_that_branches_on_training_is_merged_with_every_path_live():
    model = dp_net()
    gm = gg.trace(model, SHAPE)
    report = trace_report(gm)
    assert report["auto_leaves"] == {}
    assert report["merged_blocks"] == ["blocks.0.drop", "blocks.1.drop"]
    assert report["live_attributes"] == ["blocks.0.drop.p", "blocks.1.drop.p"]
    switches = [n.target for n in gm.graph.nodes if n.op == "call_module" and "mode_switch" in n.target]
    assert switches == ["blocks.0.drop.mode_switch_0", "blocks.1.drop.mode_switch_0"]
    x = torch.randn(4, 3, 8, 8)
    for p in (0.5, 0.0, 0.9):  # `if drop_prob == 0. or not training`: three paths, each taken
        for mode in (True, False):
            model.train(mode)
            gm.train(mode)
            for i in (0, 1):
                model.blocks[i].drop.p = p
                gm.get_submodule(f"blocks.{i}.drop").p = p  # the graph reads the attribute at run time
            torch.manual_seed(3)
            want = model(x)
            torch.manual_seed(3)
            assert torch.equal(gm(x), want), (p, mode)


class NoisyBlock(nn.Module):
    """Train-only work that calls a submodule: beyond a run-time switch of tensor functions."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.noise = nn.Dropout(0.1)

    def forward(self, x):
        x = self.conv(x)
        if self.training:
            x = self.noise(x) + x
        return x


def test_a_block_whose_one_mode_work_calls_a_submodule_stays_a_leaf_with_the_reason():
    model = nn.Sequential(NoisyBlock(), nn.Conv2d(3, 2, 1))
    gm = gg.trace(model, SHAPE)
    auto = trace_report(gm)["auto_leaves"]
    assert set(auto) == {"0"}
    assert "branches on self.training" in auto["0"] and "noise" in auto["0"]


class MaybeNoisy(NoisyBlock):
    """NoisyBlock's train-only work behind a flag of its own."""

    def __init__(self, noisy: bool, width: int):
        super().__init__()
        self.noisy, self.width = noisy, width

    def forward(self, x):
        x = self.conv(x)
        if self.training and self.noisy:
            x = self.noise(x) + x
        return x


def test_blocks_of_one_class_and_settings_that_cannot_be_merged_become_leaves_in_one_retry(monkeypatch):
    """timm's efficientnet_b0 has 49 BatchNormAct2d: one retrace per block took 52 traces of the model (98 s)."""
    import graphgrow.capture.trace as trace_module

    attempts = []
    attempt = trace_module._Plan.attempt
    monkeypatch.setattr(trace_module._Plan, "attempt", lambda self: attempts.append(1) or attempt(self))
    model = nn.Sequential(*[MaybeNoisy(noisy=i % 3 != 2, width=8 * i) for i in range(9)], nn.Conv2d(3, 2, 1))
    gm = gg.trace(model, SHAPE)  # widths differ; flags: six noisy blocks, three quiet ones
    auto = trace_report(gm)["auto_leaves"]
    assert set(auto) == {str(i) for i in range(9) if i % 3 != 2}  # the quiet ones still merge: a flag is a setting
    assert all("branches on self.training" in why for why in auto.values())
    assert len(attempts) <= 4, len(attempts)
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(gm.eval()(x), model.eval()(x))


def test_without_automatic_leaves_an_unmergeable_branch_is_a_trace_error_naming_the_module():
    with pytest.raises(gg.TraceError, match=r"cannot merge the train- and eval-mode code of 0 \(NoisyBlock\)"):
        gg.trace(nn.Sequential(NoisyBlock(), nn.Conv2d(3, 2, 1)), SHAPE, auto_leaves=False)


@pytest.mark.parametrize("factory", [sd_net, dp_net])
@pytest.mark.parametrize("spec", ["add_residual", "grow_width", "deepen", "add_branch", "insert_adapter"])
def test_every_pass_on_a_drop_path_model_gives_the_eval_module_in_onnx(factory, spec, tmp_path):
    import onnxruntime as ort

    model = factory()
    gm = gg.trace(model, SHAPE)
    grown = gg.Pipeline.from_spec(spec).run(gm).gm
    proto = gg.export_onnx(grown, SHAPE, tmp_path / "m.onnx")
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, 8, 8)
    model.eval()
    with torch.no_grad():
        ref = model(x)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert torch.allclose(torch.from_numpy(got), ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


class TopLevelBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        x = self.conv(x)
        if self.training:
            x = x * 2
        return x.mean((2, 3))


def test_top_level_branch_on_training_is_caught_by_the_fidelity_check():
    with pytest.raises(gg.TraceError) as e:
        gg.trace(TopLevelBranch(), SHAPE)
    assert "top-level forward of TopLevelBranch branches on self.training" in e.value.message
    assert "train mode" in e.value.message
    assert "--trace-mode train" in e.value.hint


class HiddenMode(nn.Module):
    """Reads its flag behind the tracer's back: nothing but the fidelity check can see it."""

    def forward(self, x):
        return x * 3 if self.__dict__["training"] else x


class HiddenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.inner = nn.Sequential(nn.ReLU(), HiddenMode())

    def forward(self, x):
        return self.inner(self.conv(x)).mean((2, 3))


def test_hidden_mode_dependence_in_a_submodule_is_named_by_the_fidelity_check():
    model = HiddenNet().train()  # traced while training: x * 3 is frozen in
    with pytest.raises(gg.TraceError) as e:
        gg.trace(model, SHAPE)
    assert "in eval mode" in e.value.message
    assert "first at submodule 'inner.1' (HiddenMode)" in e.value.message
    assert "--leaf" in e.value.hint
    gm = gg.trace(model, SHAPE, leaves=["inner.1"])  # the way out the hint gives
    assert trace_report(gm)["fidelity"][-1] == "train@3"


class FrozenRandom(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x).mean((2, 3)) * (1 + random.random())  # Python-level randomness is frozen by fx


def test_python_state_frozen_at_trace_time_is_a_trace_error():
    with pytest.raises(gg.TraceError, match="the traced graph is not FrozenRandom in eval mode"):
        gg.trace(FrozenRandom(), SHAPE)


class Aux(nn.Module):
    """Auxiliary classifier output in train mode only (googlenet/inception style)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)
        self.aux = nn.Linear(4, 2)

    def forward(self, x):
        f = self.conv(x).mean((2, 3))
        if self.training:
            return self.head(f), self.aux(f)
        return self.head(f)


def test_auxiliary_outputs_trace_the_eval_structure_by_default(tmp_path):
    model = Aux()
    gm = gg.trace(model, SHAPE)
    report = trace_report(gm)
    assert report["top_level_mode_dependent"] and report["mode"] == "eval"
    assert any("traced its eval-mode code" in n for n in report["notes"])
    assert any("returns 2 output tensors" in n for n in report["notes"])
    out = gm.train()(torch.randn(2, 3, 8, 8))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 2)
    proto = gg.export_onnx(gm, SHAPE, tmp_path / "aux.onnx")
    assert len(proto.graph.output) == 1


def test_auxiliary_outputs_in_train_mode_when_asked():
    gm = gg.trace(Aux(), SHAPE, mode="train")
    out = gm.train()(torch.randn(2, 3, 8, 8))
    assert isinstance(out, tuple) and len(out) == 2
    assert any("returns 1 output tensors" in n for n in trace_report(gm)["notes"])


class TopDropout(nn.Module):
    """Functional dropout on the top level's own flag: traced as a runtime switch, no branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return F.dropout(self.conv(x).mean((2, 3)), p=0.5, training=self.training)


def test_functional_dropout_on_the_top_level_flag_follows_the_mode():
    model = TopDropout()
    gm = gg.trace(model, SHAPE)
    assert not trace_report(gm)["top_level_mode_dependent"]
    x = torch.randn(4, 3, 8, 8)
    gm.eval()
    assert torch.equal(gm(x), gm(x))
    gm.train()
    torch.manual_seed(0)
    a = gm(x)
    assert (a == 0).any(), "dropout must be active in train mode"


class Untraceable(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent: fx cannot trace it
            return x * 2
        return x


class WithUntraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Sequential(nn.ReLU(), Untraceable())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_untraceable_submodule_becomes_a_leaf_innermost_first():
    gm = gg.trace(WithUntraceable(), SHAPE)
    auto = trace_report(gm)["auto_leaves"]
    assert list(auto) == ["block.1"] and "cannot be traced" in auto["block.1"]
    r = gg.Pipeline.from_spec("add_residual").run(gm)
    assert r.results[0].preservation.eval.ok


class OptionalArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x, mask=None, scale: float = 1.0, return_features: bool = False):
        y = self.out(torch.relu(self.lin(x))) * scale
        if mask is not None:
            y = y + mask
        return (y, x) if return_features else y


def test_optional_forward_arguments_are_not_inputs():
    gm = gg.trace(OptionalArgs(), (1, 6))
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 1
    assert "optional forward arguments fixed to their defaults" in " ".join(trace_report(gm)["notes"])
    r = gg.Pipeline.from_spec("grow_width").run(gm)
    assert r.results[0].preservation.eval.ok


class FoldBatch(nn.Module):
    """Attention-style reshapes that fold the batch into other dimensions."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # x: (B, N, 8)
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)  # (3, B, heads, N, d)
        q, k, v = qkv.unbind(0)
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b * n, c)  # (B·N, C)
        return self.proj(y).reshape(b, n, c)


def test_batch_folded_into_other_dimensions_is_accepted():
    gm = gg.trace(FoldBatch(), (1, 5, 8))
    gg.annotate(gm, (1, 5, 8))
    validate_batch_sizes(gm, (1, 5, 8))


class MixesExamples(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) - self.lin(x).mean(0, keepdim=True)  # depends on the other examples


def test_examples_that_influence_each_other_are_refused():
    gm = gg.trace(MixesExamples(), (2, 4))
    with pytest.raises(gg.ValidationError, match="examples in a batch influence each other"):
        validate_batch_sizes(gm, (2, 4))


def test_fidelity_check_leaves_module_and_graph_untouched():
    from conftest import assert_same_snapshot, snapshot

    model = sd_net()
    before = snapshot(model)
    gm = gg.trace(model, SHAPE)
    check_fidelity(model, gm, SHAPE)
    assert_same_snapshot(before, snapshot(model))
    assert model.training and all(m.training for m in model.modules())


def test_cli_reports_an_unfaithful_trace_as_a_trace_problem(tmp_path):
    from conftest import ROOT, run_cli

    env = {"PYTHONPATH": str(ROOT / "tests")}
    proc = run_cli(
        "mutate",
        "test_trace_fidelity:TopLevelBranch",
        "--pass",
        "add_residual",
        "--input-shape",
        "1,3,8,8",
        "-o",
        str(tmp_path / "g.pt"),
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "top-level forward of TopLevelBranch branches on self.training" in lines[0]
    assert "bug in the pass" not in proc.stderr and not (tmp_path / "g.pt").exists()


def test_cli_trace_mode_train_keeps_the_auxiliary_outputs(tmp_path):
    from conftest import ROOT, run_cli

    env = {"PYTHONPATH": str(ROOT / "tests")}
    proc = run_cli(
        "inspect",
        "test_trace_fidelity:Aux",
        "--input-shape",
        "1,3,8,8",
        "--trace-mode",
        "train",
        "--json",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    import json

    trace = json.loads(proc.stdout)["trace"]
    assert trace["mode"] == "train" and any("traced its train-mode code" in n for n in trace["notes"])
