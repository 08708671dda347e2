"""add_branch's default conv is one whose input is not zero everywhere (issue 39: timm CSATv2's default was a conv
reading a map that is zero at init, and verification refused: 'the tensor entering merge is zero on every check
input'). A branch beside such a conv reads zeros, so neither its gate nor its layers get a gradient; the default
passes over it to a conv that is fed, and the grown model verifies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import grow_checked
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class LateZeroFed(nn.Module):
    """stem conv → conv a (fed) → conv z, the last conv, reading `zero(h)` (zeros at init whatever h is), added
    back: the last main-path conv, the default's first choice, is fed only zeros."""

    def __init__(self, zero: str):
        super().__init__()
        self.zero = zero
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.ln = nn.LayerNorm(1)  # a norm over one value: its output is its β, 0 at init
        self.z = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def zeros(self, h):
        if self.zero == "nn.LayerNorm(1) over a channel mean":
            m = self.ln(h.mean(1, keepdim=True).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            return m.expand(-1, h.shape[1], -1, -1)
        if self.zero == "F.relu of a negative map":
            return F.relu(-(h * h) - 1.0)
        return h * torch.zeros_like(h[:, :1])  # masked out everywhere

    def forward(self, x):
        h = torch.relu(self.a(torch.relu(self.stem(x))))
        h = h + self.z(self.zeros(h))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("zero", ["nn.LayerNorm(1) over a channel mean", "F.relu of a negative map", "a mask of zeros"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_default_conv_is_not_fed_only_zeros(zero, capture):
    torch.manual_seed(0)
    r = grow_checked(LateZeroFed(zero), "x:2x3x8x8", "add_branch", capture)
    assert "input is zero" in str(r.targets), r.targets  # said, and the fed conv a chosen
    assert r.targets["span"].endswith("a [2, 8, 8, 8]") or "→ a " in str(r.targets["span"]), r.targets


def test_a_conv_fed_zeros_named_by_the_user_is_still_refused():
    """Only the default moves: a place the user names is used, and verification says why it cannot learn."""
    gm = gg.trace(LateZeroFed("F.relu of a negative map"), input_shape=parse_spec("x:2x3x8x8"), capture="fx")
    with pytest.raises(gg.NotApplicable, match="zero on every check input"):
        gg.get_pass("add_branch")(at="z")(gm)
