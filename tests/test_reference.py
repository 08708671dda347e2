"""Outputs kept between verifications (graphgrow.graph.reference): reused only while the model is unchanged."""

from __future__ import annotations

import torch
from torch import nn

import graphgrow as gg
from graphgrow.graph import reference
from graphgrow.graph.shapes import example_input
from graphgrow.verify import verify as verify_module
from graphgrow.verify.preserve import eval_forward

SHAPE = (1, 3, 8, 8)


def small() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )
    return gg.trace(model.eval(), SHAPE)


def test_the_trace_leaves_the_reference_output_and_it_is_the_models():
    gm = small()
    x = example_input(gm, SHAPE, batch=2)
    kept = reference.recall(gm, "eval", x)
    assert kept is not None
    assert torch.equal(kept, eval_forward(gm, x))
    assert reference.recall(gm, "eval", x + 1) is None  # another input: nothing


def test_any_change_to_the_model_forgets_its_outputs():
    gm = small()
    x = example_input(gm, SHAPE, batch=2)
    with torch.no_grad():
        gm.get_submodule("0").weight.mul_(1.0)  # an in-place write, even one that keeps the values
    assert reference.recall(gm, "eval", x) is None
    reference.remember(gm, "eval", x, eval_forward(gm, x))
    gm.get_submodule("0").stride = (2, 2)  # a module setting, no tensor touched
    assert reference.recall(gm, "eval", x) is None
    reference.remember(gm, "eval", x, eval_forward(gm, x))
    gm.get_submodule("3").weight = nn.Parameter(gm.get_submodule("3").weight.detach().clone())  # a swapped tensor
    assert reference.recall(gm, "eval", x) is None


def test_a_pipeline_runs_the_model_before_each_pass_only_where_nothing_was_kept(monkeypatch):
    gm = small()
    calls: list[str] = []
    real = reference.recall

    def counting(model, protocol, x):
        out = real(model, protocol, x)
        calls.append(f"{protocol.split(',')[0]}:{'hit' if out is not None else 'miss'}")
        return out

    monkeypatch.setattr(verify_module, "recall", counting)
    result = gg.Pipeline.from_spec("insert_adapter,add_residual,deepen").run(gm)
    assert all(r.preservation is not None and r.preservation.eval.ok for r in result.results)
    # first pass: both from the trace's fidelity check (no dropout to turn off);
    # then from the previous pass's verification
    assert calls == ["eval:hit", "train:hit"] * 3
