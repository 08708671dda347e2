"""grow_heads with a relative-position bias gathered from a learned table by a tensor of positions (issue 39: timm
beitv2 and gcvit were refused, "'unsqueeze' is a mask or bias per head (1, 12, 197, 197) (ALiBi, relative
positions): new heads have none"; since 42cf17a new heads read a copy of old heads' bias, which they share with
them). The table is found by following the bias back from the scores through the ops that gather it
(`table[index]`, `table[:, index]`, `index_select`, `gather`) and gets entries of its own for the new heads: zero,
so a new head starts with no position bias (the function is exact whatever they are: new heads' outputs enter the
output projection through zero columns) and learns one. A gather's index, which has a row per head, gives new heads
a copy of an old head's row (the same positions, read from their own entries).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import grow_checked

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.fast]  # conftest.py

T, H, L = 5, 4, 9  # tokens, heads, relative distances (2T - 1)


class RelTable(nn.Module):
    """One attention, 4 heads of 4 on a width of 16, with a bias per head gathered from a table of relative
    distances × heads (or heads × distances) by a buffer of the distance between every two tokens."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        heads_first = spelling in ("heads_first", "gather")
        self.table = nn.Parameter(torch.randn((H, L) if heads_first else (L, H)))
        pos = torch.arange(T)
        self.register_buffer("index", pos[:, None] - pos[None, :] + T - 1, persistent=False)  # (T, T)
        self.bias_shape = (T, T, H)

    def bias(self) -> torch.Tensor:
        s = self.spelling
        if s == "beit":  # timm BEiT's: rows by the flat index, viewed back, heads first
            b = self.table[self.index.view(-1)].view(T, T, -1).permute(2, 0, 1).contiguous()
        elif s == "gcvit":  # timm's RelPosBias: viewed by a shape attribute that names the heads
            b = self.table[self.index.view(-1)].view(self.bias_shape).permute(2, 0, 1)
        elif s == "index_select":
            b = torch.index_select(self.table, 0, self.index.flatten()).reshape(T, T, H).permute(2, 0, 1)
        elif s == "heads_first":  # a table of heads × distances, indexed along its second axis
            b = self.table[:, self.index]
        else:  # gather along the distances with the index expanded over the heads
            b = self.table.gather(1, self.index.reshape(1, -1).expand(H, -1)).view(H, T, T)
        return b.unsqueeze(0)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.spelling in ("gcvit", "index_select"):  # added to the scores eagerly
            attn = (q * 0.5) @ k.transpose(-2, -1)
            attn = attn + self.bias()
            out = attn.softmax(dim=-1) @ v
        else:  # scaled_dot_product_attention's additive mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias())
        return x + self.o(out.transpose(1, 2).reshape(b, t, 16))


SPELLINGS = ["beit", "gcvit", "index_select", "heads_first", "gather"]


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_gathered_position_table_grows_entries_for_new_heads(spelling, capture):
    torch.manual_seed(0)
    model = RelTable(spelling)
    old = model.table.detach().clone()
    r = grow_checked(model, f"x:1x{T}x16", "grow_heads", capture=capture, heads=6)
    table = r.gm.get_parameter("table")
    heads_axis = 0 if spelling in ("heads_first", "gather") else 1
    assert table.shape[heads_axis] == 6 and table.shape[1 - heads_axis] == L
    kept = table.narrow(heads_axis, 0, H)
    assert torch.equal(kept, old) and not table.narrow(heads_axis, H, 2).any()  # new heads: no bias at first
    x = torch.randn(3, T, 16)
    assert torch.allclose(model.eval()(x), r.gm.eval()(x), atol=1e-5)


def test_new_heads_learn_their_own_position_bias():
    """The new entries get a gradient of their own (a copy of an old head's bias would tie them to it)."""
    torch.manual_seed(0)
    r = grow_checked(RelTable("beit"), f"x:1x{T}x16", "grow_heads", heads=6)
    gm = r.gm.train()
    with torch.no_grad():  # one step of the new heads' output columns: their attention now reaches the output
        gm.o.weight[:, 16:].normal_()
    gm(torch.randn(2, T, 16)).square().sum().backward()
    assert gm.get_parameter("table").grad[:, H:].abs().sum() > 0
