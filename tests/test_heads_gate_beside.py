"""grow_heads where one projection makes the query and, per head beside it, an output gate (issue 39's sweep refused
Qwen3.5-MoE's and AXK2's q_proj: "has 128 outputs, not heads 4 × head size 16"): the projection's output is viewed
as (…, heads, query size + gate size), cut on that last axis into the query and the gate, and the gate, flattened,
multiplies the attention's output before the output projection. Each head's rows are one block: whole heads grow
(new heads' query and gate rows random, the output projection's new columns zero); a head size cannot, since the
block's parts are cut apart after the projection. Spellings: nn.Linear + view + chunk + SDPA (Qwen3-Next's),
F.linear + reshape + split((d, 1)) + eager matmul/softmax (a scalar gate per head), unflatten + slices + einsum
(the gate multiplying each head's output before the heads are flattened), each with and without grouped-query
attention; and one traced by torch.export.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class GateBeside(nn.Module):
    """4 query heads of 4 (2 key/value heads when `gqa`) on a width of 16; q_proj makes query and gate per head."""

    def __init__(self, spelling: str, gqa: bool = False, gate: int = 4):
        super().__init__()
        self.spelling, self.kv, self.g = spelling, 2 if gqa else 4, gate
        self.q_proj = nn.Linear(16, 4 * (4 + gate))
        self.k, self.v = nn.Linear(16, self.kv * 4), nn.Linear(16, self.kv * 4)
        self.o = nn.Linear(16, 16)
        if spelling == "functional":  # the query's weight held as parameters and applied with F.linear
            self.wq = nn.Parameter(self.q_proj.weight.detach().clone())
            self.bq = nn.Parameter(self.q_proj.bias.detach().clone())
            del self.q_proj

    def forward(self, x):
        b, t, _ = x.shape
        if self.spelling == "chunk":  # Qwen3-Next's: view per head, chunk in two
            q, gate = torch.chunk(self.q_proj(x).view(b, t, -1, 8), 2, dim=-1)
            gate = gate.reshape(b, t, -1)
        elif self.spelling == "functional":  # AXK2's reshape and split, a scalar gate per head (Dots')
            q, gate = F.linear(x, self.wq, self.bq).reshape(b, t, -1, 4 + self.g).split([4, self.g], dim=-1)
        else:  # unflatten and slices
            both = self.q_proj(x).unflatten(-1, (4, 8))
            q, gate = both[..., :4], both[..., 4:]
        q = q.transpose(1, 2)
        k, v = (p(x).view(b, t, self.kv, 4).transpose(1, 2) for p in (self.k, self.v))
        if self.kv != 4:  # transformers' repeat_kv
            k, v = (a[:, :, None].expand(b, self.kv, 4 // self.kv, t, 4).reshape(b, 4, t, 4) for a in (k, v))
        if self.spelling == "chunk":
            out = F.scaled_dot_product_attention(q, k, v)
        elif self.spelling == "functional":
            out = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v
        else:
            out = torch.einsum("bhqk,bhkd->bhqd", torch.einsum("bhqd,bhkd->bhqk", q, k).mul(0.5).softmax(-1), v)
        if self.spelling == "chunk":
            return self.o(out.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate))
        return self.o((out.transpose(1, 2) * torch.sigmoid(gate)).flatten(2))


def _grown(gm, heads):
    result = gg.get_pass("grow_heads")(heads=heads)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-5)
    return result


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("spelling", ["chunk", "functional", "slices"])
def test_a_gate_beside_the_query_grows_with_its_heads(spelling, gqa):
    torch.manual_seed(0)
    gm = gg.trace(GateBeside(spelling, gqa, gate=4 if spelling != "functional" else 1), input_shape=(1, 5, 16))
    new = 6 if not gqa else 8  # grouped-query: 2 key/value heads of 2 query heads each grow to 4
    result = _grown(gm, new)
    assert result.targets["heads"] == f"4 → {new}" and result.gm.o.in_features == new * 4
    rows = dict(result.gm.named_parameters())["wq" if spelling == "functional" else "q_proj.weight"].shape[0]
    assert rows == new * (4 + (1 if spelling == "functional" else 4))


def test_a_gate_beside_the_query_grows_under_torch_export():
    torch.manual_seed(0)
    gm = gg.trace(GateBeside("chunk", gqa=True), input_shape=(1, 5, 16), capture="export")
    _grown(gm, 8)


def test_a_head_size_does_not_grow_where_the_gate_sits_beside_the_query():
    gm = gg.trace(GateBeside("chunk"), input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match=r"only whole heads can grow"):
        gg.get_pass("grow_heads")(head_dim=8)(gm)
