"""grow_hidden through a product x @ M that maps each hidden coordinate's row alike (issue 39: timm efficientvim_m1
grow_hidden was refused, "the residual stream reaches 'matmul_11' (matmul), which produces stream values the analysis
does not understand"). EfficientViM's state-space mixer holds the stream as (B, C, L), C the hidden axis, and
computes h = x @ (a·b)ᵀ (B, C, S) and y = h' @ c (B, C, L), where a, b and c are computed from the stream by 1×1
convs: each hidden coordinate's row is multiplied by the same matrix, which carries no hidden size, so new
coordinates keep their fill (linear and alike for every channel) and the convs reading the stream get new columns.
Spellings: the @ operator, torch.matmul, torch.bmm; the product on the tokens' side (an (L, S) matrix) and on the
state side. A product whose other side carries the hidden size (x @ xᵀ, a Gram matrix of the channels) is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import NotApplicable
from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

C, S = 16, 4


def product(spelling: str, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    if spelling == "operator":
        return x @ m
    if spelling == "matmul":
        return torch.matmul(x, m)
    return torch.bmm(x, m)


class Mixer(nn.Module):
    """(B, C, L) tokens: x + out(x @ softmax(b)ᵀ) @ c, b and c (B, S, L) from 1×1 convs of x; mean, LayerNorm, head."""

    def __init__(self, spelling: str, gram: bool = False):
        super().__init__()
        self.spelling, self.gram = spelling, gram
        self.stem = nn.Conv1d(3, C, 1)
        self.bc = nn.Conv1d(C, 2 * S, 1)
        self.out = nn.Conv1d(C, C, 1)
        self.norm, self.head = nn.LayerNorm(C), nn.Linear(C, 5)

    def forward(self, x):
        h = self.stem(x)
        b, c = self.bc(h).split(S, dim=1)
        if self.gram:  # the channels' Gram matrix (C × C): every entry depends on the width
            m = product(self.spelling, h, h.transpose(1, 2)) / h.shape[-1]
            h = h + product(self.spelling, m, h)
        else:
            state = product(self.spelling, h, b.softmax(-1).transpose(1, 2))  # (B, C, S)
            h = h + product(self.spelling, self.out(state), c)  # (B, C, L)
        return self.head(self.norm(h.mean(-1)))


SPELLINGS = ["operator", "matmul", "bmm"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rows_mapped_alike_by_a_product(spelling):
    torch.manual_seed(0)
    model = Mixer(spelling).eval()
    r = grow_checked(model, "x:1x3x10", "grow_hidden")
    assert r.targets["hidden"].startswith(f"{C} → {C + C // 2}"), r.targets
    assert r.gm.bc.in_channels == r.gm.out.out_channels == C + C // 2
    x = torch.randn(3, 3, 10)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_product_with_the_stream_on_both_sides_is_refused():
    gm = gg.trace(Mixer("operator", gram=True).eval(), input_shape=(1, 3, 10))
    with pytest.raises(NotApplicable, match="residual stream reaches"):
        gg.get_pass("grow_hidden")()(gm)
