"""grow_heads on multi-query attention whose key and value are one head by construction (issue 39's sweep refused
GPT-BigCode): the key has a size-1 heads axis that broadcasts over the query heads (a fused projection of the query
and one key and value head, unsqueezed and split; separate key and value projections of one head; eager or SDPA; or
repeated once per query head by a constant, as transformers' repeat_kv does), so no key/value head can be added, and
the query heads grow alone, any count, all sharing it. Where the key/value heads are a real axis, heads still grow
with the grouped-query ratio kept (tests/test_grow_heads.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class OneKV(nn.Module):
    """4 query heads of 4 and one key/value head of 4."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        if spelling in ("fused", "repeat_kv"):
            self.c_attn = nn.Linear(16, 16 + 2 * 4)
        else:
            self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.o = nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        if self.spelling in ("fused", "repeat_kv"):  # GPT-BigCode's multi_query c_attn
            q, k, v = self.c_attn(x).unsqueeze(1).split((16, 4, 4), dim=3)
            q = q.view(b, t, -1, 4).transpose(1, 2)
        else:
            q = self.q(x).view(b, t, -1, 4).transpose(1, 2)
            k, v = self.k(x).unsqueeze(1), self.v(x)[:, None]
        if self.spelling == "repeat_kv":  # transformers' sdpa path: the one head repeated per query head
            k, v = (t[:, :, None].expand(b, 1, 4, t_, 4).reshape(b, 4, t_, 4) for t, t_ in ((k, t), (v, t)))
        if self.spelling == "eager":
            out = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["fused", "separate", "eager", "repeat_kv"])
@pytest.mark.parametrize("heads", [6, None])
def test_query_heads_grow_alone_around_one_key_value_head(spelling, heads):
    torch.manual_seed(0)
    gm = gg.trace(OneKV(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=heads)(gm)  # None: the default, +50 %
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.targets["heads"].startswith("4 → 6") and result.targets["kv_heads"].startswith("1 (kept)")
    g = result.gm
    assert g.o.in_features == 24
    fused = spelling in ("fused", "repeat_kv")
    assert (g.c_attn.out_features if fused else (g.q.out_features, g.k.out_features)) in (32, (24, 4))
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), g(x), atol=1e-6)
