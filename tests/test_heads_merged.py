"""grow_heads on attention computed with the heads merged into the batch axis (issue 39's sweep found no attention in
DeBERTa-v2, GPT-NeoX-Japanese and BLOOM): q, k and v viewed as (batch · heads, tokens, d), the scores a bmm or
baddbmm of those, viewed as (batch, heads, q, k) for the mask and softmax and back for the product with the value.
The head count written in those views is rewritten, one read at run time follows by itself (or a constant times the
batch size: BLOOM's `view(batch * heads, q, -1)`); baddbmm's input is a bias: zeros of sizes read at run time need
nothing (their batch · heads a literal times the batch size, GPT-NeoX-Japanese's, is rewritten), a bias per head
computed in the forward and repeated over the batch (BLOOM's ALiBi) gives new heads copies of old heads' entries,
taken before the repeat (tests/test_heads_bias_copy.py). q/k/v sections cut by slices per head grow too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Merged(nn.Module):
    """4 heads of 4 on a width of 16."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling, self.h = spelling, 4
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.h, -1).permute(0, 2, 1, 3) for p in (self.q, self.k, self.v))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if self.spelling == "japanese":  # GPT-NeoX-Japanese's: zeros of batch · heads, the count a literal
            q, k, v = (a.reshape(b * self.h, t, -1) for a in (q, k, v))
            base = torch.zeros(b * self.h, t, t, dtype=q.dtype, device=q.device)
            scores = torch.baddbmm(base, q, k.transpose(1, 2), beta=1.0, alpha=0.5).view(b, self.h, t, t)
            weights = torch.softmax(scores.masked_fill(~causal, -1e9), dim=-1).view(b * self.h, t, t)
            out = torch.bmm(weights, v).view(b, self.h, t, -1)
        elif self.spelling == "bmm":  # DeBERTa-v2's: merged q/k/v, the key scaled, the scores viewed with the count
            q, k, v = (a.contiguous().view(-1, t, a.size(-1)) for a in (q, k, v))
            scores = torch.bmm(q, k.transpose(-1, -2) / 2.0).view(-1, self.h, t, t)
            weights = F.softmax(scores.masked_fill(~causal, -1e9), dim=-1)
            out = torch.bmm(weights.view(-1, t, t), v).view(-1, self.h, t, v.size(-1))
        else:  # GPT-NeoX-Japanese's and BLOOM's: baddbmm onto a zero or ALiBi input, sizes read at run time
            n, heads = q.size(0), q.size(1)
            qm, km = q.reshape(n * heads, t, -1), k.reshape(n * heads, t, -1)
            if self.spelling == "baddbmm":
                base = torch.zeros(n * heads, t, t, dtype=q.dtype, device=q.device)
            else:
                slopes = torch.arange(1, self.h + 1, dtype=x.dtype, device=x.device) * -0.1
                base = (slopes[:, None, None] * torch.arange(t, dtype=x.dtype, device=x.device)).repeat(n, 1, 1)
            scores = torch.baddbmm(base, qm, km.transpose(1, 2), beta=1.0, alpha=0.5).view(n, heads, t, -1)
            if self.spelling == "baddbmm":
                out = torch.softmax(scores + (~causal) * -1e9, dim=-1) @ v
            else:  # BLOOM's: the weights merged again with the batch, the count a constant times the batch size
                weights = torch.softmax(scores + (~causal) * -1e9, dim=-1)
                out = torch.bmm(weights.view(b * self.h, t, -1), v.reshape(b * self.h, t, -1)).view(b, self.h, t, -1)
        return self.o(out.permute(0, 2, 1, 3).reshape(b, t, 16))


@pytest.mark.parametrize("spelling", ["bmm", "baddbmm", "alibi", "japanese"])
def test_heads_merged_with_the_batch_grow(spelling):
    torch.manual_seed(0)
    gm = gg.trace(Merged(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.targets["heads"] == "4 → 6" and result.gm.o.in_features == 24
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-5)


class Interleaved(nn.Module):
    """One fused q/k/v projection viewed per head as (heads, 3 · head size) and cut by slices (GPT-NeoX-Japanese's
    `qkv[..., :d]`, `qkv[..., d:2 * d]`, `qkv[..., 2 * d:]`), not chunk or split: each slice is a whole section."""

    def __init__(self, merged: bool):
        super().__init__()
        self.merged = merged
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 4, 12).transpose(1, 2)
        q, k, v = qkv[..., :4], qkv[..., 4:8], qkv[..., 8:]
        if self.merged:
            w = torch.softmax(torch.bmm(q.reshape(b * 4, t, 4), k.reshape(b * 4, t, 4).transpose(1, 2)) * 0.5, -1)
            out = torch.bmm(w, v.reshape(b * 4, t, 4)).view(b, 4, t, 4)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, 16))


@pytest.mark.parametrize("merged", [False, True])
def test_sections_cut_by_slices_per_head_grow(merged):
    """Was refused: 'is the q of … but the analysis cannot tell which section of … it is'."""
    torch.manual_seed(0)
    gm = gg.trace(Interleaved(merged), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.gm.qkv.out_features == 72 and result.gm.o.in_features == 24
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-5)
