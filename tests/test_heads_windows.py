"""grow_heads on window attention whose head count is read from a module attribute (issue 39: timm
swin_s3_tiny_224 grow_heads made a model that could not run, "node 'matmul_3' fails on inputs of shapes
[(45, 3, 49, 49), (27, 5, 49, 32)]"). A shifted window's scores are viewed as (batch, windows, heads, q, k) to add
the window mask and back to (batch · windows, heads, q, k): `attn.view(-1, nw, self.num_heads, N, N)`. A model whose
forward branches on `training` (a drop-path) is traced with its number attributes read at run time, so the head count
in those views was a read of `num_heads`, not a literal: the analysis took it for a size that follows the grown heads
by itself, left it at the old count, and the views regrouped the grown heads into the batch. The count read from an
attribute is now rewritten to the grown one. Spellings: timm's (view, `@`, a relative-position table per head), reshape
with torch.matmul and the batch of windows read at run time, an einsum of the scores with the views of the mask; stages
of 2 and 3 heads; fx (the attribute read at run time) and torch.export (literals).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["timm", "reshape", "einsum"]
WIN = 4  # 4 × 4 windows on an 8 × 8 map: 4 windows, 16 tokens each


def _mask() -> torch.Tensor:
    """Swin's shifted-window mask on an 8 × 8 map: (windows, N, N), 0 within a region, -100 across."""
    img = torch.zeros(8, 8)
    for i, hs in enumerate((slice(0, 4), slice(4, 6), slice(6, 8))):
        for j, ws in enumerate((slice(0, 4), slice(4, 6), slice(6, 8))):
            img[hs, ws] = 3 * i + j
    win = img.view(2, WIN, 2, WIN).permute(0, 2, 1, 3).reshape(4, WIN * WIN)
    return (win[:, None, :] - win[:, :, None]).ne(0).float() * -100.0


class WindowAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, spelling: str):
        super().__init__()
        self.num_heads, self.spelling = num_heads, spelling
        self.scale = (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.randn(WIN * WIN, WIN * WIN, num_heads) * 0.1)  # a bias per head

    def forward(self, x, mask):
        b_, n, c = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        nw = mask.shape[0]
        if self.spelling == "timm":
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = attn + self.table.permute(2, 0, 1).unsqueeze(0)
            attn = attn.view(-1, nw, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n)
        elif self.spelling == "reshape":
            attn = torch.matmul(q, k.transpose(-1, -2)) * self.scale + self.table.permute(2, 0, 1)[None]
            attn = attn.reshape(b_ // nw, nw, self.num_heads, n, n) + mask[None, :, None]
            attn = attn.reshape(b_, self.num_heads, n, n)
        else:
            attn = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale + self.table.permute(2, 0, 1)
            attn = (attn.view(-1, nw, self.num_heads, n, n) + mask.view(1, nw, 1, n, n)).view(-1, self.num_heads, n, n)
        x = torch.softmax(attn, dim=-1) @ v
        return self.proj(x.transpose(1, 2).reshape(b_, n, -1))


class DropPath(nn.Module):
    """timm's drop-path: a branch on `training` (so the trace reads number attributes at run time)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Block(nn.Module):
    """A shifted-window block on a (B, 8, 8, C) map."""

    def __init__(self, dim: int, heads: int, spelling: str):
        super().__init__()
        self.norm, self.attn, self.drop = nn.LayerNorm(dim), WindowAttention(dim, heads, spelling), DropPath(0.1)
        self.register_buffer("mask", _mask())

    def forward(self, x):
        b, h, w, c = x.shape
        y = torch.roll(self.norm(x), shifts=(-2, -2), dims=(1, 2))
        y = y.view(b, h // WIN, WIN, w // WIN, WIN, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, WIN * WIN, c)
        y = self.attn(y, self.mask)
        y = y.view(b, h // WIN, w // WIN, WIN, WIN, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return x + self.drop(torch.roll(y, shifts=(2, 2), dims=(1, 2)))


class Stages(nn.Module):
    """Two stages of shifted-window blocks, 2 heads of 8, then 3 heads of 8, joined by a Linear."""

    def __init__(self, spelling: str):
        super().__init__()
        self.a, self.join, self.b = Block(16, 2, spelling), nn.Linear(16, 24), Block(24, 3, spelling)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.b(self.join(self.a(x))).mean((1, 2)))


@pytest.mark.parametrize(
    ("spelling", "capture"), [(s, "fx") for s in SPELLINGS] + [("timm", "export")]
)  # (torch.export: a minute and a half a capture on a loaded machine)
def test_window_attentions_of_two_stages_grow_exactly(spelling, capture):
    torch.manual_seed(0)
    model = Stages(spelling).eval()
    r = grow_checked(model, "x:1x8x8x16", "grow_heads", capture=capture)
    assert r.targets["each"] == "a.attn: 2×8 → 3×8; b.attn: 3×8 → 5×8", r.targets
    g = r.gm
    assert (g.a.attn.proj.in_features, g.b.attn.proj.in_features) == (24, 40)
    assert (g.a.attn.table.shape[-1], g.b.attn.table.shape[-1]) == (3, 5)
    x = torch.randn(3, 8, 8, 16)  # batch 3: 12 windows, viewed as (3, 4, heads, …) around the mask
    torch.testing.assert_close(g(x), model(x), atol=1e-5, rtol=1e-5)
