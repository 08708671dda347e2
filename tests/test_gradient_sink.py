"""The trainability check reads large step-0 gradients as backward makes them and frees them (issue 27: grow_hidden's
verification held one gradient per weight, 3.2x the grown weights at 1 B parameters). The same answers either way;
step 0 runs again, keeping the gradients, only when an SGD step must follow (a model whose own zero head blocks
every gradient at first); and while backward runs, no more than the zero factors' gradients are alive at once."""

from __future__ import annotations

import pytest
import torch
from conftest import small_cnn
from torch import nn

import graphgrow as gg
from graphgrow.verify import gradient_sink, preserve
from graphgrow.verify.gradient_sink import GradientSink

SHAPE = (1, 3, 16, 16)
SETTLE = preserve._settled_lean


def zero_head_cnn() -> nn.Module:
    """A classifier whose own head starts at zero (as torchvision's ViT): the lean step 0 is not tried (SGD steps
    will follow, and it would run twice)."""
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    nn.init.zeros_(m[-1].weight)
    return m


class Gated(nn.Module):
    """features → a zero gate multiplied in → classifier: nothing before the gate gets a gradient at step 0, so
    SGD steps must follow."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        )
        self.gate = nn.Parameter(torch.zeros(8))  # one-dimensional: not a zero weight the check watches at step 0
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        return self.head(self.features(x) * self.gate.view(1, 8, 1, 1))


def pixel_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5)
    )


CASES = {
    "deepen": (small_cnn, "deepen"),
    "grow_width": (small_cnn, "grow_width"),
    "insert_adapter": (small_cnn, "insert_adapter"),
    "blocked by its own zero head": (zero_head_cnn, "deepen"),
    "gated": (Gated, "deepen(after=features.1)"),
    "deepen an MLP": (pixel_mlp, "deepen"),
}


def _run(build, spec: str, lean_bytes: int, monkeypatch) -> tuple[dict, list[bool]]:
    """The preservation report's trainability answers, and what each lean step 0 decided (settled or not)."""
    decisions: list[bool] = []

    def recorded(*args, **kw):
        decisions.append(SETTLE(*args, **kw))
        return decisions[-1]

    monkeypatch.setattr(gradient_sink, "LEAN_BYTES", lean_bytes)
    monkeypatch.setattr(preserve, "_settled_lean", recorded)
    gm = gg.trace(build().eval(), SHAPE)
    report = gg.Pipeline.from_spec(spec).run(gm).results[0].preservation
    assert report is not None
    return {"trainable": report.trainable, "dead": report.dead, "cancelled": report.cancelled}, decisions


@pytest.mark.parametrize("case", sorted(CASES))
def test_reading_gradients_as_they_come_gives_the_same_answers(case, monkeypatch):
    build, spec = CASES[case]
    held, never = _run(build, spec, 1 << 62, monkeypatch)
    lean, decisions = _run(build, spec, 0, monkeypatch)
    assert never == [], "the lean step runs only past LEAN_BYTES"
    assert lean == held
    assert held["trainable"] and not held["dead"]
    if case == "blocked by its own zero head":
        assert decisions == []  # SGD steps follow anyway: step 0 is not run twice
    elif case == "gated":
        assert decisions == [False]  # an SGD step had to follow: step 0 ran again with its gradients kept
        assert max(held["trainable"].values()) >= 1
    else:
        assert decisions[0] is True  # settled at step 0 (directly or by the zero-factor argument): no SGD step


def test_while_backward_runs_only_the_kept_gradients_are_alive(monkeypatch):
    """After every gradient a hook of its own, counting the parameters that still hold one: never more than the zero
    factors kept for the step-1 argument (without the sink, all watched ones are alive at the end)."""
    alive: list[int] = []
    sizes: list[tuple[int, int]] = []
    init = GradientSink.__init__

    def counting(self, params, watched, old_shapes, keep):
        init(self, params, watched, old_shapes, keep)
        sizes.append((len(watched), len(keep & watched)))
        for n in watched:
            self.handles.append(
                params[n].register_post_accumulate_grad_hook(
                    lambda p: alive.append(sum(q.grad is not None for q in params.values()))
                )
            )

    monkeypatch.setattr(GradientSink, "__init__", counting)
    _run(small_cnn, "deepen", 0, monkeypatch)
    ((watched, kept),) = sizes
    assert watched > kept + 1 and alive
    assert max(alive) <= kept


class GatedBranch(nn.Module):
    """A zero head, and a branch behind a zero one-dimensional gate: step 1 (the head has moved) still gives a layer
    grown in the branch no gradient, so an SGD step follows and step 1 is taken again with every gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.gate = nn.Parameter(torch.zeros(8))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
        nn.init.zeros_(self.head[-1].weight)

    def forward(self, x):
        f = self.features(x)
        return self.head(f + self.branch(f) * self.gate.view(1, 8, 1, 1))


NARROW_CASES = {
    "gate and zero head, insert_adapter": (GatedBranch, "insert_adapter(after=branch.1)"),
    "zero head, deepen": (zero_head_cnn, "deepen"),
    "zero head, grow_width": (zero_head_cnn, "grow_width(target=0)"),
    "zero head, insert_adapter": (zero_head_cnn, "insert_adapter"),
    "gated, deepen": (Gated, "deepen(after=features.1)"),
    "gated, grow_width": (Gated, "grow_width(target=features.0)"),
}


def _watched_per_backward(build, spec: str, narrow: bool, monkeypatch) -> tuple[dict, list[tuple[int, int]]]:
    """The trainability answers, and for each backward of the check (parameters requiring a gradient, all of them)."""
    monkeypatch.setattr(preserve, "NARROW_STEPS", narrow)
    models: list[nn.Module] = []
    seen: list[tuple[int, int]] = []
    check, backward = preserve.check_trainability, torch.Tensor.backward

    def keeping(new, *args, **kw):
        models.append(new)
        return check(new, *args, **kw)

    def counted(t, *args, **kw):
        params = list(models[-1].parameters()) if models else []
        seen.append((sum(p.requires_grad for p in params), len(params)))
        return backward(t, *args, **kw)

    monkeypatch.setattr("graphgrow.verify.verify.check_trainability", keeping)
    monkeypatch.setattr(torch.Tensor, "backward", counted)
    gm = gg.trace(build().eval(), SHAPE)
    report = gg.Pipeline.from_spec(spec).run(gm).results[0].preservation
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    assert report is not None
    return {"trainable": report.trainable, "dead": report.dead, "cancelled": report.cancelled}, seen


@pytest.mark.parametrize("case", sorted(NARROW_CASES))
def test_training_everything_a_step_first_takes_only_the_new_parameters_gradients(case, monkeypatch):
    """A model whose own zero weights block its gradients at first trains every parameter from step 1; the step is
    first taken with the new parameters' gradients alone (the same gradients), and again with all only when an SGD
    step follows."""
    build, spec = NARROW_CASES[case]
    full, full_seen = _watched_per_backward(build, spec, False, monkeypatch)
    narrow, narrow_seen = _watched_per_backward(build, spec, True, monkeypatch)
    assert narrow == full and full["trainable"] and not full["dead"]
    assert max(full["trainable"].values()) >= 1  # steps were taken: the case trains everything
    assert all(watched == total for watched, total in full_seen[1:])  # without it, every step after 0 takes all
    if case.startswith("zero head"):  # its zero weights moved in step 0: step 1 settles with the new gradients alone
        assert narrow_seen[0] == full_seen[0] and all(watched < total for watched, total in narrow_seen[1:])
        assert len(narrow_seen) == len(full_seen)
    elif case.startswith("gate and zero head"):  # step 1 narrow, not settled: again with all; step 2 narrow settles
        assert [watched < total for watched, total in narrow_seen[1:]] == [True, False, True]
        assert len(narrow_seen) == len(full_seen) + 1
    else:  # a one-dimensional gate is not such a weight: steps after 0 take every gradient, as before
        assert narrow_seen == full_seen
