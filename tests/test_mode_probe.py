"""capture/mode_probe.py: a model whose forward does the same in train and eval mode is exported once for both
(sweep speed: each torch.export of a chunked linear attention with symbolic sizes is minutes of CPU); one whose
forward depends on the mode, in whatever spelling, is still exported in both modes and merged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow.capture.export_capture as ec
from graphgrow.capture.export_capture import capture_by_export
from graphgrow.capture.mode_probe import same_in_both_modes
from graphgrow.graph.inputs import parse_spec


class Plain(nn.Module):
    """No mode anywhere (an MLP with a norm and a residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ZeroDropoutArg(Plain):
    """The mode read but nothing it changes reaches a call: attention's dropout_p written `0.0 if not training`."""

    def forward(self, x):
        p = 0.0 if not self.training else 0.0
        q = self.up(self.norm(x)).unflatten(-1, (2, 8)).transpose(1, 2)
        return x + F.scaled_dot_product_attention(q, q, q, dropout_p=p).transpose(1, 2).flatten(2)[..., :8]


class DropoutModule(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(x))))


class DropoutFunctional(Plain):
    def forward(self, x):
        return x + F.dropout(self.down(F.gelu(self.up(x))), p=0.1, training=self.training)


class Branch(Plain):
    """A stochastic-depth-like branch: other calls in train mode."""

    def forward(self, x):
        h = self.down(F.gelu(self.up(x)))
        if self.training:
            h = h * (torch.rand(x.shape[0], 1, 1) > 0.1) / 0.9
        return x + h


class ConstantByMode(Plain):
    """The same calls, one argument's value taken from the mode."""

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x))) * (0.5 if self.training else 1.0)


class PickedByMode(Plain):
    """The same calls in both modes; which computed value is returned depends on the mode."""

    def forward(self, x):
        a, b = self.up(x)[..., :8], self.down(F.gelu(self.up(x)))
        return a if self.training else b


class RoutedByMode(Plain):
    """The same calls with the same shapes in both modes; which computed tensor the next call reads depends on the
    mode (the two halves of one projection)."""

    def forward(self, x):
        h = self.up(x)
        a, b = h[..., :8], h.flip(-1)[..., :8]
        return x + self.down(F.gelu(torch.cat([a if self.training else b] * 2, -1)))


class BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)


def _exports(monkeypatch, model) -> tuple[list[bool], torch.fx.GraphModule]:
    modes: list[bool] = []
    real = ec._export

    def counted(m, inputs, train, fixed):
        modes.append(train)
        return real(m, inputs, train, fixed)

    monkeypatch.setattr(ec, "_export", counted)
    gm = capture_by_export(model, parse_spec("x:2x6x8:float32"), True, [])  # True: fidelity in both modes
    return modes, gm


@pytest.mark.parametrize("cls", [Plain, ZeroDropoutArg])
def test_a_model_that_does_the_same_in_both_modes_is_exported_once(monkeypatch, cls):
    torch.manual_seed(0)
    model = cls()
    modes, gm = _exports(monkeypatch, model)
    assert modes == [False]
    notes = gm.meta["graphgrow"]["trace"]["notes"]
    assert any("exported once for both modes" in n for n in notes)
    x = torch.randn(3, 5, 8)
    for train in (False, True):
        assert torch.allclose(gm.train(train)(x=x), model.train(train)(x), atol=1e-6)


@pytest.mark.parametrize("cls", [DropoutModule, DropoutFunctional, Branch, BatchNormed])
def test_a_model_whose_calls_depend_on_the_mode_is_exported_in_both(monkeypatch, cls):
    torch.manual_seed(0)
    model = cls()
    modes, gm = _exports(monkeypatch, model)
    assert modes == [False, True]
    assert not any("exported once" in n for n in gm.meta["graphgrow"]["trace"]["notes"])


@pytest.mark.parametrize("cls", [ConstantByMode, PickedByMode, RoutedByMode])
def test_an_argument_or_a_returned_value_taken_from_the_mode_is_not_the_same(cls):
    """Same calls in the same order: one argument's value differs (the merge refuses it, naming the op), the output
    is another call's result, or a call reads another call's result of the same shape (no call differs at all)."""
    x = {"x": torch.randn(2, 6, 8)}
    assert same_in_both_modes(Plain(), x)
    assert not same_in_both_modes(cls(), x)


def test_the_probe_leaves_buffers_generator_and_mode_as_they_were():
    model, x = BatchNormed().eval(), {"x": torch.randn(2, 6, 8)}
    stats = model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone()
    state = torch.random.get_rng_state()
    assert not same_in_both_modes(model, x)
    assert torch.equal(model.bn.running_mean, stats[0]) and torch.equal(model.bn.num_batches_tracked, stats[1])
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not model.training


def test_a_forward_that_fails_in_one_mode_is_not_the_same():
    class TrainOnly(Plain):
        def forward(self, x):
            if not self.training:
                raise RuntimeError("eval needs labels")
            return self.up(x)

    assert not same_in_both_modes(TrainOnly(), {"x": torch.randn(2, 6, 8)})


class ClampsData(Plain):
    """Gemma 3n's AltUp: weights clamped in place in training, through .data."""

    def forward(self, x):
        if self.training:
            self.up.weight.data.clamp_(-0.01, 0.01)
        return self.down(F.gelu(self.up(x)))


class ClampsNoGrad(Plain):
    """The same write spelled under no_grad on the parameter itself."""

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.up.weight.mul_(0.5)
        return self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("cls", [ClampsData, ClampsNoGrad])
def test_a_forward_writing_its_weights_is_stopped_before_the_write(cls):
    model = cls()
    weight = model.up.weight.detach().clone()
    assert not same_in_both_modes(model, {"x": torch.randn(2, 6, 8)})
    assert torch.equal(model.up.weight, weight)
