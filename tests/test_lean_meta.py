"""graph/lean_meta.py: torch.export's node metadata without memory-format queries, and no fake-tensor dispatch
cache, for the capture and the ONNX export (sweep speed: on a chunked linear attention with symbolic sizes they were
13 % and 45 % of a trace). The graph, the captured model and the exported ONNX model stay the same; only
`tensor_meta.memory_format` is None."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo import config as dynamo_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import proxy_tensor

from graphgrow.capture.export_capture import export_capture
from graphgrow.graph.inputs import plain_spec
from graphgrow.graph.lean_meta import lean_tensor_meta
from graphgrow.io import export as gx


class Chunked(nn.Module):
    """A sequence padded to a multiple of a chunk and cut into chunks (sizes hold Mod(s, 4) when s is symbolic)."""

    def __init__(self, spell: str) -> None:
        super().__init__()
        self.proj, self.spell = nn.Linear(8, 8), spell

    def forward(self, x):
        b, s, d = x.shape
        pad = (4 - s % 4) % 4
        y = F.pad(self.proj(x), (0, 0, 0, pad))
        chunks = y.view(b, -1, 4, d) if self.spell == "view" else torch.reshape(y, (b, (s + pad) // 4, 4, d))
        return chunks.cumsum(2).flatten(1, 2)[:, :s] + x


class Substitution(nn.Module):
    """A chunked sequence's unit lower-triangular system solved by forward substitution, row by row in place (the
    torch fallback of a gated delta rule): every step slices other rows of a tensor with symbolic leading sizes."""

    def __init__(self, spell: str) -> None:
        super().__init__()
        self.proj, self.spell = nn.Linear(8, 8), spell

    def forward(self, x):
        b, s, d = x.shape
        pad = (4 - s % 4) % 4
        y = F.pad(self.proj(x), (0, 0, 0, pad)).reshape(b, -1, 4, d)
        a = -(y @ y.transpose(-1, -2)).tril(-1)
        for i in range(1, 4):
            row, sub = a[..., i, :i].clone(), a[..., :i, :i].clone()
            if self.spell == "setitem":
                a[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
            else:
                new = row + torch.einsum("...j,...jk->...k", row, sub)
                a.narrow(-2, i, 1).narrow(-1, 0, i).copy_(new[..., None, :])
        return (a @ y).flatten(1, 2)[:, :s] + x


def _export(model, x):
    dims = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
    return torch.export.export(model, (x,), dynamic_shapes=dims, strict=False)


def _formats(graph) -> set:
    return {n.meta["tensor_meta"].memory_format for n in graph.nodes if n.meta.get("tensor_meta") is not None}


@pytest.mark.parametrize("spell", ["view", "reshape"])
def test_the_same_graph_without_memory_format_queries(spell):
    model, x = Chunked(spell).eval(), torch.randn(2, 6, 8)
    plain = _export(model, x)
    with lean_tensor_meta():
        lean = _export(model, x)
    assert str(lean.graph) == str(plain.graph)
    assert str(lean.range_constraints) == str(plain.range_constraints)
    assert torch.equal(lean.module()(x), plain.module()(x))
    assert torch.contiguous_format in _formats(plain.graph)  # torch asks, and the answer was recorded
    assert _formats(lean.graph) == {None}  # not asked


def _cache_records() -> int:
    return FakeTensorMode.cache_hits + FakeTensorMode.cache_misses + sum(FakeTensorMode.cache_bypasses.values())


@pytest.mark.parametrize("spell", ["setitem", "copy_"])
def test_a_forward_substitution_is_traced_without_fake_cache_entries(spell):
    model, x = Substitution(spell).eval(), torch.randn(2, 6, 8)
    before = _cache_records()
    plain = _export(model, x)
    assert _cache_records() > before  # torch caches by default: each dispatch is looked up or recorded
    before = _cache_records()
    with lean_tensor_meta():
        lean = _export(model, x)
    assert _cache_records() == before  # no entry made, none looked up
    assert str(lean.graph) == str(plain.graph)
    assert str(lean.range_constraints) == str(plain.range_constraints)
    y = torch.randn(3, 9, 8)
    assert torch.equal(lean.module()(y), plain.module()(y))
    assert torch.allclose(lean.module()(y), model(y), atol=1e-5)


def test_the_tracer_is_restored_after_an_error_and_nesting_is_harmless():
    before, cached = proxy_tensor._extract_tensor_metadata, dynamo_config.fake_tensor_cache_enabled
    with contextlib.suppress(RuntimeError), lean_tensor_meta():
        with lean_tensor_meta():
            assert proxy_tensor._extract_tensor_metadata is not before
            assert dynamo_config.fake_tensor_cache_enabled is False
        assert dynamo_config.fake_tensor_cache_enabled is False
        raise RuntimeError("stop")
    assert proxy_tensor._extract_tensor_metadata is before
    assert dynamo_config.fake_tensor_cache_enabled is cached


def test_capture_records_no_memory_format():
    model = Chunked("view").eval()
    gm, _ = export_capture(model, {"x": torch.randn(2, 6, 8)})
    assert _formats(gm.graph) == {None}
    y = torch.randn(3, 5, 8)
    assert torch.allclose(gm(x=y), model(y))


def test_the_onnx_export_is_the_same(monkeypatch):
    model = Chunked("reshape").eval()
    gm, _ = export_capture(model, {"x": torch.randn(2, 6, 8)})
    spec = plain_spec((2, 6, 8), name="x")
    lean = gx.export_onnx(gm, spec)
    monkeypatch.setattr(gx, "lean_tensor_meta", contextlib.nullcontext)
    plain = gx.export_onnx(gm, spec)
    assert lean.graph.SerializeToString() == plain.graph.SerializeToString()
