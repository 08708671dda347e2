"""What a verified growth event costs (issue 27, items 3–4), and that the cheaper checks still catch what they caught.

Forwards are counted with a global module hook (calls of a traced model) and by wrapping fx.Interpreter.run
(shape recordings); meta-device runs (size estimates) do not count.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import mlp, small_cnn
from torch import fx, nn

import graphgrow as gg
from graphgrow.core.protocol import TRAIN_PROTOCOL
from graphgrow.core.threads import check_threads
from graphgrow.graph import reference
from graphgrow.graph.graph_meta import META_KEY
from graphgrow.graph.shapes import example_input
from graphgrow.rewrite import Rewrite, add_module, copy_graph_module, finish, inserting_after, replace_uses
from graphgrow.verify import zero_factor
from graphgrow.verify.preserve import train_forward

SHAPE = (1, 3, 32, 32)
PASSES = ("grow_width", "insert_adapter", "add_residual", "add_branch", "deepen")


def traced() -> fx.GraphModule:
    gm = gg.trace(small_cnn().eval(), SHAPE)
    gg.annotate(gm, SHAPE)  # as a pipeline's later passes find it
    return gm


class Forwards:
    """Counts forwards of graphgrow's traced models (not of their submodules) and backward passes."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, bool]] = []  # (how, with grad)
        self.backwards = 0
        top = lambda m: isinstance(m, fx.GraphModule) and META_KEY in m.meta  # noqa: E731
        self.hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: self.calls.append(("call", torch.is_grad_enabled())) if top(m) else None
        )
        run, backward = fx.Interpreter.run, torch.Tensor.backward

        def counted_run(interp, *args, **kwargs):
            if top(interp.module) and not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                self.calls.append(("interpreter", torch.is_grad_enabled()))
            return run(interp, *args, **kwargs)

        def counted_backward(t, *args, **kwargs):
            self.backwards += 1
            return backward(t, *args, **kwargs)

        monkeypatch.setattr(fx.Interpreter, "run", counted_run)
        monkeypatch.setattr(torch.Tensor, "backward", counted_backward)

    def close(self) -> None:
        self.hook.remove()


@pytest.fixture
def forwards(monkeypatch):
    f = Forwards(monkeypatch)
    yield f
    f.close()


@pytest.mark.parametrize("spec", PASSES)
def test_a_verified_pass_runs_one_training_step(spec, forwards):
    gm = traced()
    forwards.calls.clear()
    result = gg.Pipeline.from_spec(spec).run(gm).results[0]
    pres = result.preservation
    assert pres is not None and pres.eval.ok and pres.train.ok and pres.trainable_ok
    # annotation (batch 1, also verification's second batch size), eval at batch 2, one train forward with its
    # backward; the model before the pass is not run at all (its eval and train outputs were left by the trace's
    # fidelity check). A default placed at a stage end or on a main-path layer costs one forward with gradients
    # more (analysis.hearing: are the candidates heard by the output? autograd.grad, not backward()): the price of
    # never defaulting to a place verification would refuse as deaf
    probe = 1 if spec in ("grow_width", "insert_adapter", "deepen", "add_branch") else 0
    grads = [g for _, g in forwards.calls].count(True)
    assert len(forwards.calls) == 3 + probe and grads == 1 + probe, forwards.calls
    assert forwards.backwards == 1


@pytest.mark.parametrize("spec", PASSES)
def test_the_argued_step_is_the_step_the_sgd_steps_find(spec, monkeypatch):
    gm = traced()
    argued = gg.Pipeline.from_spec(spec).run(gm).results[0].preservation.trainable
    monkeypatch.setattr(zero_factor.ZeroFactors, "argue", lambda self, params, got, step: {})
    stepped = gg.Pipeline.from_spec(spec).run(gm).results[0].preservation.trainable
    assert argued == stepped
    assert (1 in argued.values()) == (spec != "insert_adapter")  # the adapter is one zero factor alone


def _new_path(gm: fx.GraphModule, cut) -> fx.GraphModule:
    """A new path output + dead_out(cut(relu(dead_in(x)))): random incoming weights, zero outgoing ones."""
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    last = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    a, b = nn.Linear(20, 8), nn.Linear(8, 5)
    nn.init.zeros_(b.weight)
    nn.init.zeros_(b.bias)
    na, nb = add_module(gm, "dead_in", a), add_module(gm, "dead_out", b)
    with inserting_after(last):
        h = cut(gm.graph, gm.graph.call_function(torch.relu, (gm.graph.call_module(na, (x,)),)))
        s = gm.graph.call_function(operator.add, (last, gm.graph.call_module(nb, (h,))))
    replace_uses(last, s, keep=[s])
    return finish(gm)


@gg.register_pass
@dataclass(frozen=True)
class _DetachedFirstFactor(gg.Pass):
    """The zero last factor learns, but the first factor's output is detached: it never gets a gradient."""

    name: ClassVar[str] = "test_detached_first_factor"

    def apply(self, gm, generator):
        return Rewrite(_new_path(copy_graph_module(gm), lambda g, h: g.call_method("detach", (h,))))


@gg.register_pass
@dataclass(frozen=True)
class _ZeroedFirstFactor(gg.Pass):
    """The first factor's output is multiplied by 0 and shifted: its gradient is zero, the last factor's is not."""

    name: ClassVar[str] = "test_zeroed_first_factor"

    def apply(self, gm, generator):
        return Rewrite(
            _new_path(
                copy_graph_module(gm),
                lambda g, h: g.call_function(operator.add, (g.call_function(operator.mul, (h, 0.0)), 1.0)),
            )
        )


@pytest.mark.parametrize("spec", ["test_detached_first_factor", "test_zeroed_first_factor"])
def test_a_first_factor_that_cannot_learn_is_still_refused(spec):
    gm = gg.trace(mlp(), (1, 20))
    with pytest.raises(gg.PreservationError, match="get no gradient.*dead_in.weight"):
        gg.Pipeline.from_spec(spec).run(gm)


@gg.register_pass
@dataclass(frozen=True)
class _TrainOnlyChange(gg.Pass):
    """A BatchNorm that is the identity in eval mode (running mean 0, var 1) but normalises in train mode."""

    name: ClassVar[str] = "test_train_only_change"

    def apply(self, gm, generator):
        gm = copy_graph_module(gm)
        first = next(n for n in gm.graph.nodes if n.op == "call_module")
        bn = nn.BatchNorm2d(3)
        bn.running_var.fill_(1 - bn.eps)  # the identity in eval mode, within rounding
        node = add_module(gm, "train_only_bn", bn)
        with inserting_after(first.args[0]):
            normed = gm.graph.call_module(node, (first.args[0],))
        first.replace_input_with(first.args[0], normed)
        return Rewrite(finish(gm))


def test_a_change_in_train_mode_only_is_caught_with_the_traces_reference():
    gm = traced()
    x = example_input(gm, SHAPE, batch=2)
    assert reference.recall(gm, f"{TRAIN_PROTOCOL} 0", x) is not None  # the reference verification will use
    with pytest.raises(gg.PreservationError, match="train-mode output"):
        gg.Pipeline.from_spec("test_train_only_change").run(gm)


def test_the_trace_keeps_the_train_reference_only_where_verification_would_compute_the_same():
    gm = traced()
    x = example_input(gm, SHAPE, batch=2)
    kept = reference.recall(gm, f"{TRAIN_PROTOCOL} 0", x)
    assert kept is not None and torch.equal(kept, train_forward(gm, x, 0))
    dropping = gg.trace(mlp(), (1, 20))  # Dropout(0.3): fidelity draws masks, verification turns dropout off
    assert reference.recall(dropping, f"{TRAIN_PROTOCOL} 0", example_input(dropping, (1, 20), batch=2)) is None


def test_a_small_model_is_checked_with_one_thread_and_the_setting_comes_back():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        model = small_cnn().eval()
        model[0].register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        gg.trace(model, SHAPE)  # the fidelity check runs the model
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        with check_threads(nn.Linear(2000, 1100), (1, 2000)):  # 2.2 M parameters: not small
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_a_failed_check_on_named_inputs_is_reported_not_a_crash():
    """The float64 re-check recasts a tensor input; named inputs (a dict of token ids) keep the fp32 verdict."""
    from graphgrow.verify.preserve import compare_mode

    m = torch.nn.Identity()
    x = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    check = compare_mode(m, m, x, "eval", 0, torch.zeros(1, 3), torch.ones(1, 3))
    assert not check.ok and check.fp64_ok is None


class TokenHeads(nn.Module):
    """Token ids → embedding → the difference of two near-equal heads (an output ~1e-3 of its terms); `fused`
    computes the same difference as one head (W_a − W_b): equal in real arithmetic, not in float32."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fused, self.emb, self.a, self.b = fused, nn.Embedding(50, 32), nn.Linear(32, 8), nn.Linear(32, 8)
        with torch.no_grad():
            self.emb.weight.mul_(30)
            self.b.load_state_dict({k: v * (1 + 1e-3) for k, v in self.a.state_dict().items()})

    def forward(self, input_ids):
        h = self.emb(input_ids)
        if self.fused:
            return nn.functional.linear(h, self.a.weight - self.b.weight, self.a.bias - self.b.bias)
        return self.a(h) - self.b(h)


def test_named_inputs_are_measured_again_in_float64():
    """A growth on token ids whose float32 output moved by reassociation alone (sweep: CPM-Ant grow_hidden, max|Δ|
    3.6e-4 for a limit of 3.2e-4) is judged in float64 like a tensor input's: the ids are kept, the float tensors
    and the models recast."""
    from graphgrow.verify.preserve import compare_mode, eval_forward

    old, new = TokenHeads(False).eval(), TokenHeads(True).eval()
    x = {"input_ids": torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))}
    check = compare_mode(old, new, x, "eval", 0, eval_forward(old, x), eval_forward(new, x))
    assert not check.fp32_ok and check.fp64_ok and check.ok and check.fp64_rel_err < 1e-9
