"""Attention over more than four dims exports (graphgrow/io/onnx_attention.py; issue 39: timm hiera_tiny_224 was
broken on four passes, "torch.onnx.export failed: only 4D query, key, and value are supported"): the dims before the
last three are flattened into one for the call and restored after it, read from the query inside the traced call, so
dynamic dims stay dynamic; onnxruntime agrees with PyTorch. An export with no attention over more than 4 dims is the
same as without the rewrite (47afbe4's rewrite fixed named inputs' sequence length: reverted in e5dceba)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec
from graphgrow.graph.shapes import annotate
from graphgrow.io import export as export_module
from graphgrow.io.export import export_onnx
from graphgrow.io.onnx_attention import any_rank_attention, four_d_attention
from graphgrow.io.runtime import open_session
from graphgrow.verify.equivalence import check_equivalence

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

HOWS = ["fused qkv, unbind", "separate projections", "a scale and a causal mask", "a 5-D mask, keywords"]


class UnitAttention(nn.Module):
    """Tokens (B, 16, 8) in 2 mask units × 2 heads of size 4 (`how`: Hiera's fused qkv reshaped to 6-D, permuted
    and unbound; separate projections viewed to 5-D; with a scale and a causal mask; a 5-D float mask, every
    argument by keyword)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv, self.q, self.k, self.v = nn.Linear(8, 24), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.randn(2, 1, 8, 8))  # per head × (L, S): broadcast over batch and units
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        if self.how == "fused qkv, unbind":
            qkv = self.qkv(x).reshape(b, -1, 2, 3, 2, 4).permute(3, 0, 4, 2, 1, 5)  # 3, B, heads, units, T, D
            q, k, v = qkv.unbind(0)
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            q, k, v = (f(x).view(b, 2, -1, 2, 4).transpose(2, 3) for f in (self.q, self.k, self.v))
            if self.how == "separate projections":
                out = F.scaled_dot_product_attention(q, k, v)
            elif self.how == "a scale and a causal mask":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
            else:
                out = F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=self.bias[None], scale=0.5)
        return self.proj(out.transpose(1, 3).reshape(b, t, 8))


class HeadAttention(nn.Module):
    """Ordinary 4-D attention (B, heads, T, D)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 8))


class TokenUnits(nn.Module):
    """Token ids → 5-D attention over 2 units of a sequence whose length the export keeps dynamic."""

    def __init__(self, how: str):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.attn = UnitAttention(how)

    def forward(self, input_ids):
        return self.attn(self.embed(input_ids))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_five_dimensional_attention_exports_and_agrees(how, capture):
    torch.manual_seed(0)
    gm = gg.trace(UnitAttention(how).eval(), input_shape=(1, 16, 8), capture=capture)
    proto = export_onnx(gm, (1, 16, 8))
    report = check_equivalence(gm, open_session(proto.SerializeToString(), "cpu"), (1, 16, 8))
    assert report.passed, report


def test_without_the_rewrite_the_exporter_refuses(monkeypatch):
    """The class of failure the rewrite addresses (the test above fails without it)."""
    monkeypatch.setattr(export_module, "four_d_attention", lambda gm: gm)
    gm = gg.trace(UnitAttention("separate projections").eval(), input_shape=(1, 16, 8))
    with pytest.raises(gg.ExportError, match="only 4D query, key, and value"):
        export_onnx(gm, (1, 16, 8))


@pytest.mark.parametrize("how", HOWS[:3])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_named_inputs_keep_a_dynamic_sequence_length(how, capture):
    """Token ids at length 16 exported with a dynamic batch and sequence length: the leading sizes come from the
    query inside the traced call (symbolic), not from the capture's example; checked at a second length."""
    spec = parse_spec("input_ids:1x16:int64")
    gm = gg.trace(TokenUnits(how).eval(), input_shape=spec, capture=capture)
    proto = export_onnx(gm, spec)
    dims = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence"]
    report = check_equivalence(gm, open_session(proto.SerializeToString(), "cpu"), spec)
    assert report.passed and any("sequence 8" in o.case for o in report.outputs), report


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_four_dimensional_attention_exports_as_before(capture, monkeypatch):
    """With metadata saying 4 dims the graph is not touched; without metadata (the call becomes any_rank_attention)
    the exported ONNX graph is the same, node for node, as the export without the rewrite."""
    gm = gg.trace(HeadAttention().eval(), input_shape=(1, 16, 8), capture=capture)
    for n in gm.graph.nodes:
        n.meta.pop("gg_shape", None)
        n.meta.pop("val", None)
        n.meta.pop("tensor_meta", None)
    assert any(n.target is any_rank_attention for n in four_d_attention(gm).graph.nodes)

    def nodes(proto):
        return [(n.op_type, list(n.input), list(n.output), list(n.attribute)) for n in proto.graph.node]

    spec = parse_spec("x:float32[1,seq=16,8]")
    with_rewrite = export_onnx(gm, spec)
    monkeypatch.setattr(export_module, "four_d_attention", lambda gm: gm)
    without = export_onnx(gm, spec)
    assert nodes(with_rewrite) == nodes(without) and with_rewrite.graph.input == without.graph.input
    assert [d.dim_param for d in with_rewrite.graph.input[0].type.tensor_type.shape.dim][:2] == ["batch", "seq"]
    annotated = gg.trace(HeadAttention().eval(), input_shape=(1, 16, 8), capture=capture)
    annotate(annotated, (1, 16, 8))  # gg_shape on every node (fx captures have no other metadata)
    assert four_d_attention(annotated) is annotated


def test_any_rank_attention_is_the_attention_at_every_rank():
    """Eagerly: 3-, 4-, 5- and 6-D inputs, key/value broadcast over a leading dim, a 6-D boolean mask, GQA heads."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 2, 5, 4), torch.randn(3, 1, 2, 2, 6, 4), torch.randn(3, 1, 2, 2, 6, 3)
    mask = torch.rand(1, 2, 1, 1, 5, 6) > 0.3
    for args, kwargs in (
        ((q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]), {}),
        ((q[0, 0], k[0, 0], v[0, 0]), {"is_causal": True}),
        ((q[0], k[0], v[0], mask[0]), {}),
        ((q, k, v), {"attn_mask": mask, "scale": 0.7}),
        ((q[:, :, :, :2], k[:, :, :, :1], v[:, :, :, :1]), {"enable_gqa": True}),
    ):
        torch.testing.assert_close(any_rank_attention(*args, **kwargs), F.scaled_dot_product_attention(*args, **kwargs))
