"""grow_heads where a per-head bias of the scores is computed by a small MLP from the relative positions (issue 39: timm
swinv2_tiny_window8_256 and swinv2_cr_tiny_224 grow_heads were refused, "'unsqueeze' is a mask or bias per head
(1, 3, 64, 64) (ALiBi, relative positions): new heads have none"). Swin V2's continuous position bias is
`cpb_mlp(relative_coords_table)`, a Linear with one output per head at its end, computed from buffers alone, then
looked up per query and key: the last Linear's rows grow with the heads (analysis.head_params._learned_table), new rows
zero. With it: cosine attention (F.normalize of q and k) times a logit scale per head, (H, 1, 1) or (H,) reshaped,
and a q/k/v bias concatenated from q_bias, a zero k_bias buffer and v_bias into F.linear(x, qkv.weight, bias).
Spellings: timm's Swin V2 (Sequential MLP, table[index.view(-1)].view(N, N, -1).permute, 16·sigmoid), Swin V2-CR's
(Mlp with a dropout between its Linears and one after, transpose(1, 0).reshape(heads, N, N)), functional (F.linear on
parameters, index_select, the bias as SDPA's attn_mask). A bias MLP that reads the tokens is not a table: refused as
before. fx only: torch.export writes F.normalize as a norm divided through expand_as, which the flow does not follow.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

WIN = 4
N = WIN * WIN


def _coords() -> tuple[torch.Tensor, torch.Tensor]:
    """((2W-1)², 2) relative coordinates, log-spaced as Swin V2's, and the (N, N) index of each pair's row."""
    r = torch.arange(-(WIN - 1), WIN).float()
    table = torch.stack(torch.meshgrid(r, r, indexing="ij"), -1).reshape(-1, 2) / (WIN - 1) * 8
    table = torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)
    pos = torch.stack(torch.meshgrid(torch.arange(WIN), torch.arange(WIN), indexing="ij")).flatten(1)
    rel = (pos[:, :, None] - pos[:, None, :]).permute(1, 2, 0) + (WIN - 1)
    return table, rel[..., 0] * (2 * WIN - 1) + rel[..., 1]


class CosineAttention(nn.Module):
    def __init__(self, dim: int, heads: int, spelling: str):
        super().__init__()
        self.h, self.spelling = heads, spelling
        table, index = _coords()
        self.register_buffer("coords", table)
        self.register_buffer("index", index)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=spelling == "cr"), nn.Linear(dim, dim)
        if spelling == "timm":
            self.q_bias, self.v_bias = nn.Parameter(torch.randn(dim) * 0.1), nn.Parameter(torch.randn(dim) * 0.1)
            self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
            self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(heads, 1, 1) + 1))
            self.cpb_mlp = nn.Sequential(nn.Linear(2, 32), nn.ReLU(inplace=True), nn.Linear(32, heads, bias=False))
        elif spelling == "cr":
            self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(heads) + 1))
            self.fc1, self.drop, self.fc2 = nn.Linear(2, 32), nn.Dropout(0.125), nn.Linear(32, heads)
            self.drop2 = nn.Dropout(0.0)  # timm's Mlp: a dropout after its last Linear too
        else:
            self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(heads, 1, 1) + 1))
            self.w1, self.b1 = nn.Parameter(torch.randn(32, 2) * 0.5), nn.Parameter(torch.zeros(32))
            self.w2 = nn.Parameter(torch.randn(heads, 32) * 0.2)

    def forward(self, x):
        b, n, c = x.shape
        if self.spelling == "timm":
            bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            qkv = F.linear(x, weight=self.qkv.weight, bias=bias).reshape(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        else:
            qkv = self.qkv(x).view(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.spelling == "functional":
            table = F.linear(F.relu(F.linear(self.coords, self.w1, self.b1)), self.w2)  # (pairs, heads)
            bias = table.index_select(0, self.index.flatten()).view(n, n, self.h).permute(2, 0, 1)[None]
            scale = torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
            y = F.scaled_dot_product_attention(
                F.normalize(q, dim=-1) * scale, F.normalize(k, dim=-1), v, bias, scale=1.0
            )
            return self.proj(y.transpose(1, 2).reshape(b, n, c))
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        if self.spelling == "timm":
            attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
            table = self.cpb_mlp(self.coords).view(-1, self.h)
            bias = table[self.index.view(-1)].view(N, N, -1).permute(2, 0, 1).contiguous()
            attn = attn + (16 * torch.sigmoid(bias)).unsqueeze(0)
        else:
            attn = attn * torch.clamp(self.logit_scale.reshape(1, self.h, 1, 1), max=math.log(100.0)).exp()
            table = self.drop2(self.fc2(self.drop(F.relu(self.fc1(self.coords)))))  # ((2W-1)², heads)
            bias = table.transpose(1, 0)[:, self.index.view(-1)].reshape(self.h, N, N)
            attn = attn + bias.unsqueeze(0)
        y = attn.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


class Model(nn.Module):
    def __init__(self, spelling: str, heads: int = 2, dim: int = 16):
        super().__init__()
        self.attn, self.norm, self.head = CosineAttention(dim, heads, spelling), nn.LayerNorm(dim), nn.Linear(dim, 5)

    def forward(self, x):
        return self.head(x + self.norm(self.attn(x))).mean(1)


@pytest.mark.parametrize("spelling", ["timm", "cr", "functional"])
def test_position_bias_mlp_grows_a_row_per_new_head(spelling):
    torch.manual_seed(0)
    model = Model(spelling).eval()
    r = grow_checked(model, f"x:2x{N}x16", "grow_heads", heads=3)
    assert r.targets["each"].endswith(": 2×8 → 3×8"), r.targets
    g = r.gm.attn
    last = {"timm": lambda: getattr(g.cpb_mlp, "2").weight, "cr": lambda: g.fc2.weight, "functional": lambda: g.w2}[
        spelling
    ]()
    assert last.shape[0] == 3 and torch.equal(last[2], torch.zeros_like(last[2]))
    assert g.logit_scale.shape[0] == 3
    x = torch.randn(3, N, 16)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


class TokenBias(CosineAttention):
    """A bias per head computed by a Linear from the tokens themselves: not a table of parameters."""

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.fc2(F.relu(self.fc1(x[..., :2]))).transpose(1, 2)[..., None]  # (B, heads, N, 1)
        y = (q @ k.transpose(-2, -1) * (c // self.h) ** -0.5 + bias).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


def test_a_bias_computed_from_the_tokens_is_refused():
    import graphgrow as gg
    from graphgrow.core.errors import NotApplicable
    from graphgrow.graph.inputs import parse_spec

    model = nn.Sequential(TokenBias(16, 2, "cr")).eval()
    with pytest.raises(NotApplicable, match="bias per head"):
        gg.get_pass("grow_heads")(heads=3)(gg.trace(model, input_shape=parse_spec(f"input:2x{N}x16")))
