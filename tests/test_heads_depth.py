"""grow_heads beside attentions whose query no Linear projects (issue 39's sweep refused Inkling 2: "'expand_25' is
the query of 'matmul_18' and comes from no Linear"): depth attention, a learned query (a parameter, expanded over the
tokens) attending over the stacked states of earlier layers, has no heads to add. It is left as it is and the
model's other attentions grow; a model with only such attentions is refused with that reason. Spellings: the query
expanded and read by SDPA, or by an eager matmul + softmax; the states stacked or concatenated.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class DepthMix(nn.Module):
    """One self-attention of 4 heads of 4 (unless `heads` is False), then a depth attention over [x, attn(x)]."""

    def __init__(self, spelling: str, heads: bool = True):
        super().__init__()
        self.spelling, self.heads = spelling, heads
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.query = nn.Parameter(torch.randn(16))

    def forward(self, x):
        b, t, _ = x.shape
        y = x
        if self.heads:
            q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
            y = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 16))
        if self.spelling == "sdpa":  # Inkling 2's: (batch, tokens, sources, hidden), the query expanded over them
            states = torch.stack([x, y], dim=-2)
            query = self.query.view(-1, 16).expand(b, t, -1, -1)
            mixed = F.scaled_dot_product_attention(query, states, states)[..., 0, :]
        else:
            states = torch.cat([x[:, :, None], y[:, :, None]], dim=2)
            query = self.query.view(1, 1, 1, 16).expand(b, t, 1, 16)
            weights = torch.softmax(torch.matmul(query, states.transpose(-1, -2)) * 0.25, dim=-1)
            mixed = torch.matmul(weights, states).squeeze(2)
        return mixed


@pytest.mark.parametrize("spelling", ["sdpa", "eager"])
def test_a_depth_attention_is_left_as_it_is_and_the_heads_grow(spelling):
    torch.manual_seed(0)
    gm = gg.trace(DepthMix(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.targets["attentions"].startswith("1 ") and result.gm.o.in_features == 24
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-5)


@pytest.mark.parametrize("spelling", ["sdpa", "eager"])
def test_a_model_with_only_depth_attention_is_refused_with_the_reason(spelling):
    gm = gg.trace(DepthMix(spelling, heads=False), input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match="no Linear projecting their query .*no heads to add"):
        gg.get_pass("grow_heads")(heads=6)(gm)
