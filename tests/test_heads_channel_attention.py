"""grow_heads on channel attention (issue 39's sweep: timm davit_tiny and edgenext_small were refused, "projects q/k/v
in one output of width 288, not 3 equal sections of 3 heads × 256" and "no Linear projecting their query"). In
channel attention (XCiT's cross-covariance attention, EdgeNeXt's, DaViT's channel blocks) each head's channels are
what it attends over and its scores are summed over the positions: the operands are (batch, heads, channels of the
head, positions), so the attention's "head size" is the token count, and a head's part of the projection has another
width. That is a legitimate layout: whole heads grow (new output rows per section of the projection, new zero input
columns of the output projection, a per-head temperature with them); the head's own width cannot. The query and key
may be normalised over the positions (F.normalize), which is exact as that axis does not grow.
Spellings: XCiT/EdgeNeXt (fused qkv, permute, F.normalize, a temperature per head, q @ kᵀ), DaViT (k scaled, kᵀ @ v,
the weights times qᵀ), separate projections with scaled_dot_product_attention (a head's width above and below the
token count).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import grow_checked
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

C, HEADS = 24, 3  # 3 heads of 8 channels, over 12 positions


class ChannelAttention(nn.Module):
    def __init__(self, spelling: str, width: int = C):
        super().__init__()
        self.spelling, self.width = spelling, width
        self.qkv = nn.Linear(C, 3 * C)
        self.q, self.k, self.v = (nn.Linear(C, width) for _ in range(3))
        self.proj = nn.Linear(width if spelling == "separate" else C, C)
        self.temperature = nn.Parameter(torch.rand(HEADS, 1, 1) + 0.5)

    def forward(self, x):
        b, n, c = x.shape
        if self.spelling == "xca":  # EdgeNeXt's and XCiT's
            q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, -1).permute(2, 0, 3, 4, 1).unbind(0)
            attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * self.temperature
            out = attn.softmax(dim=-1) @ v
            return self.proj(out.permute(0, 3, 1, 2).reshape(b, n, c))
        if self.spelling == "davit":  # DaViT's ChannelAttention: the groups read from a number, C from the input
            q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
            k = k * (c // HEADS) ** -0.5
            attn = (k.transpose(-1, -2) @ v).softmax(dim=-1)
            out = (attn @ q.transpose(-1, -2)).transpose(-1, -2)
            return self.proj(out.transpose(1, 2).reshape(b, n, c))
        q, k, v = (f(x).view(b, n, HEADS, -1).permute(0, 2, 3, 1) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # (b, heads, width / heads, n)
        return self.proj(out.permute(0, 3, 1, 2).reshape(b, n, -1))


@pytest.mark.parametrize(
    "spelling, width",
    [("xca", C), ("davit", C), ("separate", C), ("separate", 2 * C)],
    ids=["xca", "davit", "sep", "wide"],
)
def test_channel_attention_grows_whole_heads_exactly(spelling, width):
    torch.manual_seed(0)
    r = grow_checked(ChannelAttention(spelling, width), "x:2x12x24", "grow_heads", heads=5)
    per_head = width // HEADS
    assert r.targets["heads"].startswith("3 → 5")
    assert r.gm.proj.in_features == 5 * per_head
    assert torch.equal(r.gm.proj.weight[:, 3 * per_head :], torch.zeros(C, 2 * per_head))
    if spelling == "xca":
        assert r.gm.temperature.shape == (5, 1, 1)
    if spelling != "separate":
        assert r.gm.qkv.out_features == 3 * 5 * per_head
