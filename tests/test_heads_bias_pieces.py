"""grow_heads where a fused q/k/v projection's bias is concatenated from one parameter per section (issue 39's sweep
refused timm's BEiT and EVA: "'linear' takes its bias from a computed tensor ('cat_1')"): `F.linear(x, weight, bias=
cat((q_bias, k_bias, v_bias)))` with k_bias a zero buffer, or `zeros_like(v_bias)` in its place. Each piece grows as a
parameter with an entry per head (new heads' entries 0, the zeros' size following); a head size growth is refused.
Spellings: keyword or positional F.linear, a buffer or zeros_like for the key's bias, SDPA or eager attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class BiasPieces(nn.Module):
    """timm's BEiT attention: 4 heads of 4 on a width of 16."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv = nn.Linear(16, 48, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
        self.register_buffer("k_bias", torch.zeros(16), persistent=False)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        b, n, c = x.shape
        if self.spelling == "zeros_like":  # older timm: the key's bias made in the forward
            bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias))
            qkv = F.linear(x, self.qkv.weight, bias)
        else:
            qkv = F.linear(x, weight=self.qkv.weight, bias=torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        q, k, v = qkv.reshape(b, n, 3, 4, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if self.spelling == "eager":
            out = (q * 0.5 @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("spelling", ["keyword", "zeros_like", "eager"])
def test_a_bias_concatenated_from_section_parameters_grows_with_the_heads(spelling):
    torch.manual_seed(0)
    model = BiasPieces(spelling)
    gm = gg.trace(model, input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-5)
    g = result.gm
    assert g.qkv.weight.shape == (72, 16) and g.q_bias.shape == g.v_bias.shape == (24,)
    assert torch.equal(g.q_bias[:16], model.q_bias) and not g.q_bias[16:].any() and not g.v_bias[16:].any()


def test_a_head_size_does_not_grow_with_a_bias_made_of_section_parameters():
    gm = gg.trace(BiasPieces("keyword"), input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match="concatenation of 3 parameters .* the head size grows"):
        gg.get_pass("grow_heads")(head_dim=8)(gm)
