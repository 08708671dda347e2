"""grow_heads with a mask or bias per head that no single parameter holds (issue 39's sweep refused BLOOM, MPT, mT5
and LayoutLMv3: "a mask or bias per head … new heads have none"). New heads' outputs enter the output projection
through zero columns, so any bias keeps the function exact: where the per-head tensor comes from one parameter or
buffer whose axis holds the heads (T5's nn.Embedding of buckets × heads, also through a mask combined with it by
`where` or `+`; a bias buffer sliced to the sequence length), it grows (new heads' entries 0, their own); otherwise
(ALiBi's slopes computed in the forward or held in a buffer, a bias summed from two tables) new heads read a copy of
an old head's entries, taken where the heads first sit on one axis (before a repeat over the batch or a slice). A
bias computed from another attention's scores (RealFormer's, which grow themselves) is still refused. New heads
learn: their output columns get a gradient at once, their q/k/v rows after one step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.fast]  # conftest.py


class Alibi(nn.Module):
    """One attention, 4 heads of 4 on a width of 16, with ALiBi-like slopes × relative positions per head."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling, self.h = spelling, 4
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, 5, dtype=torch.float32), persistent=False)
        if spelling == "sliced":  # MPT's: built once for the longest sequence, sliced to the length at run time
            pos = torch.arange(-31, 1, dtype=torch.float32).view(1, 1, 1, 32)
            self.register_buffer("table", pos * self.slopes.view(1, 4, 1, 1), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        pos = torch.arange(t, dtype=x.dtype, device=x.device)
        if self.spelling == "computed":  # BLOOM's slopes, computed in the forward from the head count
            slopes = torch.pow(torch.tensor(0.5, device=x.device), torch.arange(1, self.h + 1, device=x.device))
            bias = slopes[:, None, None] * (pos[None, :] - pos[:, None])
            out = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + bias, dim=-1) @ v
        elif self.spelling == "buffer":  # the slopes a buffer, the bias scaled_dot_product_attention's mask
            bias = self.slopes.view(-1, 1, 1) * (pos[None, :] - pos[:, None]).abs().neg()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        else:
            bias = self.table.squeeze(0)[:, :, -t:]  # (heads, 1, t)
            out = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / 2.0 + bias, dim=-1) @ v
        return x + self.o(out.transpose(1, 2).reshape(b, t, 16))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, bias, eager: bool):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        if eager:
            out = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + bias, dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.o(out.transpose(1, 2).reshape(b, t, 16))


class Relative(nn.Module):
    """Two layers reading one relative-position bias per head (buckets × heads), combined with a causal mask."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.table = nn.Embedding(9, 4)  # T5's
        if spelling == "summed":  # LayoutLMv3's: a 1-D and a 2-D table, each gathered by its own buckets, summed
            self.other = nn.Parameter(torch.randn(4, 9))

    def forward(self, x):
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        rel = pos[None, :] - pos[:, None]
        bias = self.table(rel.clamp(-4, 4) + 4).permute(2, 0, 1).unsqueeze(0)  # (1, heads, t, t)
        causal = (rel <= 0)[None, None]
        if self.spelling == "where":  # T5's: where(mask, bias, min), scaled_dot_product_attention's mask
            bias = torch.where(causal, bias, torch.finfo(x.dtype).min)
        elif self.spelling == "add":  # an additive mask broadcast over the heads
            bias = bias + (~causal).to(x.dtype) * -1e9
        else:
            bias = bias + self.other[:, (rel.abs().clamp(max=4) * 2)].unsqueeze(0)
        for layer in self.layers:
            x = layer(x, bias, self.spelling != "where")
        return x


class Residual(nn.Module):
    """RealFormer's: the second attention adds the first one's scores to its own (they grow with the first one)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Layer(), Layer()

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.a.q, self.a.k, self.a.v))
        first = q @ k.transpose(-1, -2) / 2.0
        x = x + self.a.o((torch.softmax(first, -1) @ v).transpose(1, 2).reshape(b, t, 16))
        return self.b(x, first.detach(), True)


def _grows(model: nn.Module) -> gg.PassResult:
    torch.manual_seed(0)
    gm = gg.trace(model, input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-5)
    _learns(result.gm, x)
    return result


def _learns(g: nn.Module, x: torch.Tensor) -> None:
    """New heads' output columns get a gradient at once; after one step on them, their q/k/v rows do too."""
    outs = [m for n, m in g.named_modules() if n.endswith("o")]
    grads = torch.autograd.grad(g(x).square().sum(), [m.weight for m in outs])
    assert all(gr[:, 16:].abs().sum() > 0 for gr in grads)
    with torch.no_grad():
        for m, gr in zip(outs, grads):
            m.weight -= 0.1 * gr
    rows = [getattr(m, p).weight for m in g.modules() if isinstance(getattr(m, "q", None), nn.Linear) for p in "qkv"]
    grads = torch.autograd.grad(g(x).square().sum(), rows)
    assert rows and all(gr[16:].abs().sum() > 0 for gr in grads)


@pytest.mark.parametrize("spelling", ["computed", "buffer", "sliced"])
def test_alibi_slopes_per_head_give_new_heads_copies(spelling):
    g = _grows(Alibi(spelling)).gm
    assert g.o.in_features == 24
    if spelling == "sliced":  # the bias itself a buffer with a heads axis: it grows, new heads' entries 0
        assert g.table.shape == (1, 6, 1, 32) and not g.table[:, 4:].any()
    else:  # the slopes are read, not grown: the copy is taken from what they compute
        assert all(6 not in b.shape for b in g.buffers()) and any(n.target is torch.cat for n in g.graph.nodes)


@pytest.mark.parametrize("spelling", ["where", "add"])
def test_a_bias_table_combined_with_a_mask_grows_its_table(spelling):
    model = Relative(spelling)
    g = _grows(model).gm
    assert g.table.weight.shape == (9, 6) and torch.equal(g.table.weight[:, :4], model.table.weight)
    assert not g.table.weight[:, 4:].any()  # new heads' own entries, zero


def test_a_bias_summed_from_two_tables_gives_new_heads_copies():
    model = Relative("summed")
    g = _grows(model).gm
    assert g.table.weight.shape == (9, 4) and g.other.shape == (4, 9)  # the sum is copied, the tables kept
    assert g.get_submodule("layers.0.o").in_features == g.get_submodule("layers.1.o").in_features == 24


def test_a_bias_from_another_attentions_scores_is_refused():
    gm = gg.trace(Residual(), input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match=r"mask or bias per head|also read by"):
        gg.get_pass("grow_heads")(heads=6)(gm)
