"""grow_heads on attentions whose operands have five axes, the heads not before the tokens (issue 39: timm
hiera_tiny_224 grow_heads was refused, "'getitem_8' carries heads or head size on an axis other than the attention's
heads", and nest_tiny with "projects q/k/v in one output of width 288, not 3 equal sections of 16 heads × 32": the
analysis took the axis before the tokens for the heads, which is Hiera's windows and NesT's image blocks). To
scaled_dot_product_attention and to q @ kᵀ every axis before the tokens is a batch axis; the heads are the axis the
projection's channels go to, and that is what the analysis reads now (analysis.head_projections.head_axes: tried in
order, the flow following the factors by the data refuses a wrong one). Spellings: NesT's reshape + permute of a fused
qkv with the output's heads innermost (permute(0, 2, 3, 4, 1)), Hiera's windows (B, -1, windows, 3, heads, d) with a
max-pooled query, unflatten, a chunk into q/k/v then views, separate projections with matmul + softmax and with einsum;
one head growing (Hiera's first stage: reshape(B, -1, C) with C read at run time puts it with its head size), and as
many heads as blocks (the sizes cannot tell them apart).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class BlockAttention(nn.Module):
    """Attention within blocks of tokens, x: (B, T blocks, N tokens, C)."""

    def __init__(self, dim: int, heads: int, spelling: str):
        super().__init__()
        self.h, self.spelling = heads, spelling
        if spelling in ("matmul", "einsum"):
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        else:
            self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, n, c = x.shape
        h, d = self.h, c // self.h
        if self.spelling == "nest":  # timm's NesT: (qkv, B, heads, T, N, d)
            q, k, v = self.qkv(x).reshape(b, t, n, 3, h, d).permute(3, 0, 4, 1, 2, 5).unbind(0)
        elif self.spelling == "unflatten":
            q, k, v = self.qkv(x).unflatten(-1, (3, h, d)).permute(3, 0, 4, 1, 2, 5)
        elif self.spelling == "chunk":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k, v = (y.view(b, t, n, h, d).permute(0, 3, 1, 2, 4) for y in (q, k, v))
        else:
            q, k, v = (p(x).reshape(b, t, n, h, d).transpose(2, 3).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.spelling == "matmul":
            y = torch.matmul(torch.matmul(q * d**-0.5, k.transpose(-2, -1)).softmax(-1), v)
        elif self.spelling == "einsum":
            a = torch.einsum("bhtnd,bhtmd->bhtnm", q, k) * d**-0.5
            y = torch.einsum("bhtnm,bhtmd->bhtnd", a.softmax(-1), v)
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        if self.spelling == "nest":  # (B, T, N, d, heads): each head's channels interleaved in the output
            y = y.permute(0, 2, 3, 4, 1).reshape(b, t, n, c)
        else:
            y = y.permute(0, 2, 3, 1, 4).reshape(b, t, n, c)
        return self.proj(y)


class WindowAttention(nn.Module):
    """Hiera's mask unit attention, x: (B, N, C), its tokens `windows` windows apart; the query max-pooled by 2."""

    def __init__(self, dim: int, heads: int, windows: int):
        super().__init__()
        self.h, self.w = heads, windows
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.h
        q, k, v = self.qkv(x).reshape(b, -1, self.w, 3, self.h, d).permute(3, 0, 4, 2, 1, 5).unbind(0)
        q = q.view(b, self.h, self.w, 2, -1, d).amax(dim=3)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 3).reshape(b, -1, c))


class Blocks(nn.Module):
    def __init__(self, spelling: str, heads: int, dim: int = 24):
        super().__init__()
        self.norm, self.attn, self.head = nn.LayerNorm(dim), BlockAttention(dim, heads, spelling), nn.Linear(dim, 5)

    def forward(self, x):
        return self.head(x + self.attn(self.norm(x))).mean((1, 2))


class Windows(nn.Module):
    def __init__(self, heads: int, dim: int = 16):
        super().__init__()
        self.norm, self.attn, self.head = nn.LayerNorm(dim), WindowAttention(dim, heads, 4), nn.Linear(dim, 5)

    def forward(self, x):
        b, n, c = x.shape
        skip = x.view(b, 2, n // 2, c).amax(1)  # the tokens pooled as the query is
        return self.head(skip + self.attn(self.norm(x))).mean(1)


@pytest.mark.parametrize("spelling", ["nest", "unflatten", "chunk", "matmul", "einsum"])
def test_heads_of_block_attention_grow_on_their_own_axis(spelling):
    torch.manual_seed(0)
    model = Blocks(spelling, heads=3).eval()
    r = grow_checked(model, "x:1x4x5x24", "grow_heads")  # 4 blocks of 5 tokens: 3 heads of 8
    assert r.targets["each"].endswith(": 3×8 → 5×8"), r.targets
    assert r.gm.attn.proj.in_features == 40
    x = torch.randn(2, 4, 5, 24)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_as_many_heads_as_blocks_are_told_apart_by_the_data():
    torch.manual_seed(0)
    model = Blocks("nest", heads=4).eval()
    r = grow_checked(model, "x:1x4x5x24", "grow_heads", heads=6)  # 4 blocks and 4 heads of 6
    assert r.targets["each"].endswith(": 4×6 → 6×6"), r.targets


@pytest.mark.parametrize("heads", [1, 2])
def test_window_attention_heads_grow_one_head_too(heads):
    torch.manual_seed(0)
    model = Windows(heads).eval()
    r = grow_checked(model, "x:1x16x16", "grow_heads", heads=heads + 1)  # 4 windows of 4 tokens
    d = 16 // heads
    assert r.targets["each"].endswith(f": {heads}×{d} → {heads + 1}×{d}"), r.targets
    assert r.gm.attn.qkv.out_features == 3 * (heads + 1) * d
    x = torch.randn(2, 16, 16)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_nest_spelling_under_torch_export():
    torch.manual_seed(0)
    model = Blocks("nest", heads=3).eval()
    r = grow_checked(model, "x:1x4x5x24", "grow_heads", capture="export")
    assert r.targets["each"].endswith(": 3×8 → 5×8"), r.targets
