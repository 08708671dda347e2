"""Growth one layer at a time (graphgrow/jobs/layerwise.py), in one process: the windows, the plan, and the
layer-by-layer growth of an unsharded model (what a sharded job computes; tests/test_fsdp.py runs it sharded)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.jobs import layerwise as lw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import grow_fsdp as ex  # noqa: E402


@pytest.fixture(scope="module")
def decoder():
    return ex.traced()


def test_a_window_is_the_model_with_one_layer_of_its_stack(decoder):
    """The stack is found in run order with each layer's stream in and out; a window keeps the parts outside the stack
    and one layer (sharing its tensors), and runs: with layer 1 alone it computes embedding → layer 1 → head."""
    layers = lw.Layers.find(decoder)
    assert layers.stack == "layers" and layers.paths == ["layers.0", "layers.1"]
    assert layers.layers[1].x_in is layers.layers[0].x_out
    win = layers.window(decoder, "layers.1")
    names = {n for n, _ in win.named_parameters()}
    assert not any(n.startswith("layers.0.") for n in names) and "layers.1.mlp.0.weight" in names
    assert win.get_parameter("embed_tokens.weight") is decoder.get_parameter("embed_tokens.weight")
    x = torch.randint(0, 96, (2, 16))
    none = layers.window(decoder, None)
    assert {n for n, _ in none.named_parameters()} == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    with torch.no_grad():
        assert torch.equal(none(x), decoder.lm_head(decoder.norm(decoder.embed_tokens(x))))
        assert win(x).shape == decoder(x).shape and not torch.equal(win(x), none(x))


@pytest.mark.parametrize(
    ("spec", "runs"),
    [
        ("grow_hidden(by=8)", ["layers.0", "layers.1"]),
        ("grow_width(factor=2)", ["layers.0"]),  # its default target: one group of layer 0
        ("deepen(block=transformer)", ["layers.1"]),  # the new block (outside the stack) from the last layer's window
    ],
)
def test_growth_layer_by_layer_is_exact_and_grows_only_what_the_plan_changes(decoder, spec, runs):
    """The plan (meta device) names the windows to grow; the grown model has the planned architecture, computes what
    the old one did in eval and train mode, keeps the parts no pass changes bit for bit and logs `layerwise`."""
    passes = gg.build_pipeline(spec)
    plan = lw.plan(lw.meta_copy(decoder), passes, seed=5)
    assert plan.runs == runs
    grown = lw.grow_plain(decoder, passes, seed=5)
    whole = gg.Pipeline(passes, seed=5).run(decoder).gm
    assert {n: p.shape for n, p in grown.named_parameters()} == {n: p.shape for n, p in whole.named_parameters()}
    x, y = ex.batch(3)
    with torch.no_grad():
        for mode in (False, True):
            decoder.train(mode), grown.train(mode)
            assert ex.loss_of(grown, x, y).item() == pytest.approx(ex.loss_of(decoder, x, y).item(), rel=1e-6)
    old = dict(decoder.named_parameters())
    for name, p in grown.named_parameters():
        untouched = plan.owner(name) not in plan.runs and (plan.owner(name) != lw.OUTSIDE or not plan.outside_from)
        if untouched and name in old:
            assert torch.equal(p, old[name]), name
    assert grown.meta["graphgrow"]["log"][-1]["layerwise"] is True


def test_what_does_not_fit_is_said_and_grows_as_a_whole():
    """A model with no stack of numbered layers is NotLayerwise (an InputError) at planning, before any tensor is
    read; so is a growth whose window would choose otherwise than the whole model (checked on the meta device)."""
    mlp = gg.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), input_shape=(2, 4))
    with pytest.raises(lw.NotLayerwise, match="no stack of numbered layers"):
        lw.plan(lw.meta_copy(mlp), gg.build_pipeline("grow_width"), seed=0)
    assert issubclass(lw.NotLayerwise, gg.InputError)
    meta = lw.meta_copy(ex.traced())
    plan = lw.plan(meta, gg.build_pipeline("grow_width(factor=2)"), seed=0)
    plan.shapes = copy.copy(plan.shapes)
    plan.shapes["layers.0.self_attn.q_proj.weight"] = torch.Size([48, 32])  # pretend the whole model chose otherwise
    why = lw._disagreement(plan, meta, "layers.0", gg.build_pipeline("grow_width(factor=2)"), 0, outside=False)
    assert why is not None and "layers.0.self_attn.q_proj.weight" in why


def test_layers_alike_are_planned_once(monkeypatch):
    """Planning runs the passes on one window per distinct layer (its nodes, modules, tensor shapes and planned
    shapes, its path written out): four identical layers are planned in one window; a layer whose norm differs only by
    eps is planned in a window of its own."""
    calls: list[str] = []
    real = lw._disagreement

    def counted(p, meta, run, *args, **kwargs):
        calls.append(run)
        return real(p, meta, run, *args, **kwargs)

    monkeypatch.setattr(lw, "_disagreement", counted)
    model = ex.Decoder(layers=4)
    meta = lw.meta_copy(gg.trace(model, input_shape={"input_ids": ((2, ex.CONTEXT), torch.int64)}))
    plan = lw.plan(meta, gg.build_pipeline("grow_hidden(by=8)"), seed=0)
    assert plan.runs[:4] == [f"layers.{i}" for i in range(4)] and calls == ["layers.0"], calls
    model.layers[2].input_layernorm.eps = 1e-5
    calls.clear()
    meta = lw.meta_copy(gg.trace(model, input_shape={"input_ids": ((2, ex.CONTEXT), torch.int64)}))
    lw.plan(meta, gg.build_pipeline("grow_hidden(by=8)"), seed=0)
    assert calls == ["layers.0", "layers.2"], calls
