"""grow_hidden through per-channel factors taken out of a larger parameter (issue 39: timm efficientvim_m1 grow_hidden
was refused, "the residual stream reaches 'mul_43' (mul), which produces stream values the analysis does not
understand"). EfficientViM keeps its four residual weights in one (4, C) parameter and reads them as
`sigmoid(alpha).view(4, -1, 1, 1)[i]`: each row, selected by an integer, is a factor of its own per channel. The
factor is found through what the graph computes on the parameter (an elementwise function, views that keep the
channel axis, an integer selection along another axis), the parameter grows along its channel axis, and every read of
it must scale the stream. Spellings: a view then an index (EfficientViM), unbind, a column selected with [:, i],
torch.select then reshape with the width written out, on a channels-first map and on a (B, T, C) token stream.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import NotApplicable
from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

C = 16


def factors(spelling: str, p: torch.Tensor) -> list[torch.Tensor]:
    """Two per-channel factors of shape (C, 1, 1) read out of the parameter `p`."""
    if spelling == "view index":  # EfficientViM: p (2, C)
        a = torch.sigmoid(p).view(2, -1, 1, 1)
        return [a[0], a[1]]
    if spelling == "unbind":  # p (2, C)
        a0, a1 = p.sigmoid().unbind(0)
        return [a0[:, None, None], a1[:, None, None]]
    if spelling == "column":  # p (C, 2)
        return [p[:, i].view(-1, 1, 1) for i in range(2)]
    if spelling == "select":  # p (2, C), the width written out
        return [torch.select(p, 0, i).reshape(C, 1, 1).exp() for i in range(2)]
    raise AssertionError(spelling)


class Map(nn.Module):
    """A channels-first stream: x + a0 · (dwconv(x) - x), then x + a1 · (ffn(x) - x); pooled, LayerNorm, head."""

    def __init__(self, spelling: str, off_stream: bool = False):
        super().__init__()
        self.spelling, self.off_stream = spelling, off_stream
        shape = (C, 2) if spelling == "column" else (2, C)
        self.alpha = nn.Parameter(torch.randn(shape) * 0.5)
        self.stem = nn.Conv2d(3, C, 2, 2)
        self.dw = nn.Conv2d(C, C, 3, padding=1, groups=C)
        self.ffn = nn.Sequential(nn.Conv2d(C, 2 * C, 1), nn.GELU(), nn.Conv2d(2 * C, C, 1))
        self.norm, self.head = nn.LayerNorm(C), nn.Linear(C, 5)

    def forward(self, x):
        a = factors(self.spelling, self.alpha)
        h = self.stem(x)
        h = h + a[0] * (self.dw(h) - h)
        h = h + a[1] * (self.ffn(h) - h)
        out = self.head(self.norm(h.mean((2, 3))))
        return out + a[1].sum() if self.off_stream else out


class Tokens(nn.Module):
    """A (B, T, C) pre-norm stream whose two residual branches are scaled by the rows of one parameter."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.alpha = nn.Parameter(torch.randn((C, 2) if spelling == "column" else (2, C)) * 0.5)
        self.embed, self.norms = nn.Linear(12, C), nn.ModuleList(nn.LayerNorm(C) for _ in range(3))
        self.mix, self.mlp = nn.Linear(C, C), nn.Sequential(nn.Linear(C, 32), nn.GELU(), nn.Linear(32, C))
        self.head = nn.Linear(C, 5)

    def forward(self, x):
        a = [f.view(1, 1, C) for f in factors(self.spelling, self.alpha)]
        h = self.embed(x)
        h = h + a[0] * self.mix(self.norms[0](h))
        h = h + a[1] * self.mlp(self.norms[1](h))
        return self.head(self.norms[2](h))


SPELLINGS = ["view index", "unbind", "column", "select"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_factor_rows_of_one_parameter_on_a_map(spelling):
    torch.manual_seed(0)
    model = Map(spelling).eval()
    r = grow_checked(model, "x:1x3x8x8", "grow_hidden")
    assert r.targets["hidden"].startswith(f"{C} → {2 * C}"), r.targets
    assert r.gm.alpha.shape == ((2 * C, 2) if spelling == "column" else (2, 2 * C))
    x = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_factor_rows_of_one_parameter_on_tokens(spelling):
    torch.manual_seed(0)
    model = Tokens(spelling).eval()
    r = grow_checked(model, "x:1x6x12", "grow_hidden")  # a factor under LayerNorms: replicated (×2)
    assert r.targets["hidden"].startswith(f"{C} → {2 * C}"), r.targets
    x = torch.randn(3, 6, 12)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_factor_row_also_read_off_the_stream_is_refused():
    gm = gg.trace(Map("view index", off_stream=True).eval(), input_shape=(1, 3, 8, 8))
    with pytest.raises(NotApplicable, match="per-channel factor of the stream also read off it"):
        gg.get_pass("grow_hidden")()(gm)
