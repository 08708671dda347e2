"""grow_heads grows parameters that hold an entry per head (issue 39's sweep refused DeBERTa and CPM-Ant for them): a
bias of the query and value per head × head size (DeBERTa's q_bias / v_bias, viewed per head in two spellings), a
scale of the query per head and coordinate computed from a parameter (Dory's sqk · c, squared), and a
relative-position bias table with one column per head, looked up by position buckets and added to the scores
(CPM-Ant's F.embedding, T5's nn.Embedding; eagerly, added in place as MPNet's `scores.add_(bias)` or `+=`, or as
scaled_dot_product_attention's mask; one table read by every layer, grown once). New heads get zero entries; a
table shared with an attention that does not grow is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class BiasPerHead(nn.Module):
    """q and v projected without bias, then a learnable bias of heads × head size added per head."""

    def __init__(self, spelling: str, heads: int = 4):
        super().__init__()
        self.spelling, self.h = spelling, heads
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16, bias=False) for _ in range(4))
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))

    def per_head(self, x: torch.Tensor) -> torch.Tensor:  # DeBERTa's transpose_for_scores
        return x.view(x.size()[:-1] + (self.h, -1)).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = (self.per_head(p(x)) for p in (self.q, self.k, self.v))
        if self.spelling == "deberta":
            q = q + self.per_head(self.q_bias[None, None, :])
            v = v + self.per_head(self.v_bias[None, None, :])
        elif self.spelling == "view":
            q = q + self.q_bias.view(1, self.h, 1, -1)
            v = v + self.v_bias.view(self.h, 1, -1)
        else:  # a scale per head and coordinate, a function of the parameter (Dory's sqk · c, squared)
            q = q * (self.q_bias * 2.0).view(-1, 1, 4).square()
            v = v + self.v_bias.view(self.h, 1, -1)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).flatten(2))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, bias, spelling: str):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        if spelling in ("function", "module"):  # CPM-Ant's: scores + position bias, softmax, weights @ value
            out = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + bias, -1) @ v
        elif spelling in ("add_", "export"):  # MPNet's: the bias added in place
            scores = torch.matmul(q, k.transpose(-1, -2)) / 2.0
            scores.add_(bias)
            out = torch.softmax(scores, -1) @ v
        elif spelling == "iadd":  # scaled and biased in place
            scores = q @ k.transpose(-1, -2)
            scores *= 0.5
            scores += bias
            out = torch.softmax(scores, -1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.o(out.transpose(1, 2).reshape(b, t, 16))


class RelativeBias(nn.Module):
    """Two layers reading one table of relative-position buckets × heads, looked up once for the model."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        if spelling in ("module", "add_"):
            self.table = nn.Embedding(9, 4)
        else:
            self.bias_table = nn.Parameter(torch.randn(9, 4))

    def forward(self, x):
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        buckets = (pos[None, :] - pos[:, None]).clamp(-4, 4) + 4
        rows = self.table(buckets) if hasattr(self, "table") else F.embedding(buckets, self.bias_table)
        bias = rows.permute(2, 0, 1).unsqueeze(0)  # (1, heads, t, t)
        for layer in self.layers:
            x = layer(x, bias, self.spelling)
        return x


def _grows(model: nn.Module, capture: str = "auto") -> gg.PassResult:
    torch.manual_seed(0)
    gm = gg.trace(model, input_shape=(1, 5, 16), capture=capture)
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-5)
    return result


@pytest.mark.parametrize("spelling", ["deberta", "view", "scale"])
def test_a_bias_per_head_and_head_size_grows_with_the_heads(spelling):
    g = _grows(BiasPerHead(spelling)).gm
    assert g.q_bias.shape == g.v_bias.shape == (24,)
    fill = 1.0 if spelling == "scale" else 0.0  # the new heads' entries, after the old ones: 1 in a factor, 0 in a term
    assert torch.equal(g.q_bias[16:], torch.full((8,), fill)) and torch.equal(g.v_bias[16:], torch.zeros(8))


@pytest.mark.parametrize("spelling", ["function", "module", "sdpa", "add_", "iadd", "export"])
def test_a_position_bias_table_per_head_grows_once_for_every_layer(spelling):
    model = RelativeBias(spelling)
    g = _grows(model, "export" if spelling == "export" else "auto").gm
    table = g.table.weight if hasattr(model, "table") else g.bias_table
    old = model.table.weight if hasattr(model, "table") else model.bias_table
    assert table.shape == (9, 6) and torch.equal(table[:, :4], old) and not table[:, 4:].any()


def test_a_table_shared_with_an_attention_that_does_not_grow_is_refused():
    gm = gg.trace(RelativeBias("function"), input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match="bias_table' holds an entry per head .* for .* too"):
        gg.get_pass("grow_heads")(heads=6, at="layers.0")(gm)


def test_a_bias_per_head_refuses_a_head_size_growth():
    gm = gg.trace(BiasPerHead("view"), input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match=r"old size on a growing axis \(head size 4\)"):
        gg.get_pass("grow_heads")(head_dim=6)(gm)
