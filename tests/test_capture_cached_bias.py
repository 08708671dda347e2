"""A block that caches a computed tensor in eval mode is traced through, not kept whole (issue 39: timm levit_128
grow_heads was refused, "'stages.0.blocks.0.attn' is a module kept whole by the capture (Attention, a leaf holding
Linear layers)": LeViT's attention computes its bias per head as `attention_biases[:, idxs]` in train mode and keeps
it in `self.attention_bias_cache[str(device)]` in eval mode). Two things made the paths differ: the first trace
filled the cache with its proxies, so the next one (the other path) read them back as work done; and the eval path's
`str(x.device)` is a metadata query nothing in the graph reads. The dicts, lists and sets a model's modules hold
are now as they were before each trace (and the model keeps no proxy), and a metadata query nothing reads is no work
of a path. The bias table then grows with the heads (tests/test_heads_rel_table.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.graph.graph_meta import trace_report
from tests.conftest import grow_checked

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.fast]  # conftest.py

T, H = 5, 4


class CachedBias(nn.Module):
    """Attention of 4 heads with a bias per head gathered from a heads × distances table, cached in eval mode."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.biases = nn.Parameter(torch.randn(H, 2 * T - 1))
        pos = torch.arange(T)
        self.register_buffer("idxs", pos[:, None] - pos[None, :] + T - 1, persistent=False)
        self.cache: dict | list = [] if spelling == "list" else {}

    def bias(self, device: torch.device) -> torch.Tensor:
        if self.spelling == "levit":  # LeViT's: keyed by the device
            if torch.jit.is_tracing() or self.training:
                return self.biases[:, self.idxs]
            key = str(device)
            if key not in self.cache:
                self.cache[key] = self.biases[:, self.idxs]
            return self.cache[key]
        if self.training:
            return self.biases[:, self.idxs]
        if self.spelling == "list":
            if not self.cache:
                self.cache.append(self.biases[:, self.idxs])
            return self.cache[0]
        return self.cache.setdefault("bias", self.biases[:, self.idxs])  # type: ignore[union-attr]

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) * 0.5 + self.bias(x.device)
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, 16))


class Net(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.blocks = nn.Sequential(CachedBias(spelling), CachedBias(spelling))

    def forward(self, x):
        return self.blocks(x)


SPELLINGS = ["levit", "dict", "list"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_block_caching_its_bias_is_traced_through_and_keeps_no_proxy(spelling):
    model = Net(spelling).eval()
    gm = gg.trace(model, input_shape=(1, T, 16))
    assert not trace_report(gm).get("auto_leaves")
    assert {str(n.target) for n in gm.graph.nodes if n.op == "call_module"} >= {"blocks.0.q", "blocks.1.o"}
    cached = [v for m in model.blocks for v in (m.cache.values() if isinstance(m.cache, dict) else m.cache)]
    assert all(isinstance(v, torch.Tensor) for v in cached)  # what the model's own runs cached, no proxy of a trace


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_its_heads_grow_with_their_bias_table(spelling):
    torch.manual_seed(0)
    model = Net(spelling)
    r = grow_checked(model, f"x:1x{T}x16", "grow_heads", heads=6)
    table = r.gm.get_parameter("blocks.0.biases")
    assert table.shape == (6, 2 * T - 1) and not table[H:].any()
    x = torch.randn(3, T, 16)
    assert torch.allclose(model.eval()(x), r.gm.eval()(x), atol=1e-5)


def test_a_cache_warmed_before_the_trace_stays_the_models():
    model = Net("levit").eval()
    x = torch.randn(2, T, 16)
    model(x)  # the cache now holds the real bias under "cpu"
    gm = gg.trace(model, input_shape=(1, T, 16))
    assert not trace_report(gm).get("auto_leaves")
    assert all(list(m.cache) == ["cpu"] and isinstance(m.cache["cpu"], torch.Tensor) for m in model.blocks)
