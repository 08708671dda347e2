"""grow_width's default layer is one whose input is not zero everywhere (issue 39: timm CSATv2's default was the MLP
after a LayerNorm over one channel, whose output is its β, 0 at init, and verification refused: 'the tensor entering
… is zero on every check input'). New units of a layer fed only zeros get no gradient; the default passes over it to
the next layer, which verifies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import grow_checked
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class ZeroFed(nn.Module):
    """A map (N, 3, 4, 4) → a 1-channel conv → its positions as tokens of one feature through a 1 → 4 → 1 MLP after
    `zero(t)` (zeros at init, whatever t is), added back (CSATv2's spatial attention) → flattened → Linear(16, 16) →
    ReLU → 8 × (Linear(16, 16) → ReLU) → Linear(16, 3) (deep enough that growing `a` is within the default's
    parameter budget)."""

    def __init__(self, zero: str):
        super().__init__()
        self.zero = zero
        self.stem, self.norm = nn.Conv2d(3, 1, 1), nn.LayerNorm(1)
        self.fc1, self.fc2 = nn.Linear(1, 4), nn.Linear(4, 1)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 3)
        self.body = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(16, 16), nn.ReLU())])

    def zeros(self, t):
        if self.zero == "nn.LayerNorm(1)":
            return self.norm(t)
        if self.zero == "F.layer_norm over one channel":
            return F.layer_norm(t, (1,))
        return torch.relu(-(t * t) - 1.0)  # a dead ReLU

    def forward(self, x):
        s = self.stem(x)
        t = s.flatten(2).transpose(1, 2)
        t = self.fc2(F.gelu(self.fc1(self.zeros(t))))
        s = s + t.transpose(1, 2).reshape(s.shape)
        return self.b(self.body(F.relu(self.a(s.flatten(1)))))


@pytest.mark.parametrize("zero", ["nn.LayerNorm(1)", "F.layer_norm over one channel", "a dead ReLU"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_default_layer_is_not_fed_only_zeros(zero, capture):
    torch.manual_seed(0)
    r = grow_checked(ZeroFed(zero), "x:2x3x4x4", "grow_width", capture)
    assert r.gm.get_submodule("fc1").out_features == 4 and r.gm.get_submodule("a").out_features > 16
    assert "only zeros as input" in str(r.targets)


def test_a_layer_fed_zeros_named_by_the_user_is_still_refused():
    """Only the default moves: a target the user names is grown there, and verification says why it cannot learn."""
    gm = gg.trace(ZeroFed("nn.LayerNorm(1)"), input_shape=parse_spec("x:2x3x4x4"), capture="fx")
    with pytest.raises(gg.NotApplicable, match="zero on every check input"):
        gg.get_pass("grow_width")(target="fc1")(gm)
