"""Attention over more than four dims exports (graphgrow/io/onnx_attention.py; issue 39: timm hiera_tiny_224 was
broken on four passes, "torch.onnx.export failed: only 4D query, key, and value are supported"): the leading dims are
flattened into one for the call and restored after it, and onnxruntime agrees with PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import open_session
from graphgrow.verify.equivalence import check_equivalence

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class UnitAttention(nn.Module):
    """Tokens (B, 16, 8) in 2 mask units × 2 heads of size 4 (`how`: Hiera's fused qkv unbound from a 6-D permute;
    separate projections viewed to 5-D; with a scale and a causal mask)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv, self.q, self.k, self.v = nn.Linear(8, 24), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        if self.how == "fused qkv, unbind":
            qkv = self.qkv(x).reshape(b, -1, 2, 3, 2, 4).permute(3, 0, 4, 2, 1, 5)  # 3, B, heads, units, T, D
            q, k, v = qkv.unbind(0)
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            q, k, v = (f(x).view(b, 2, t // 2, 2, 4).transpose(2, 3) for f in (self.q, self.k, self.v))
            if self.how == "separate projections":
                out = F.scaled_dot_product_attention(q, k, v)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        return self.proj(out.transpose(1, 3).reshape(b, t, 8))


@pytest.mark.parametrize("how", ["fused qkv, unbind", "separate projections", "a scale and a causal mask"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_five_dimensional_attention_exports_and_agrees(how, capture):
    torch.manual_seed(0)
    gm = gg.trace(UnitAttention(how), input_shape=(1, 16, 8), capture=capture)
    proto = export_onnx(gm, (1, 16, 8))
    report = check_equivalence(gm, open_session(proto.SerializeToString(), "cpu"), (1, 16, 8))
    assert report.passed, report
