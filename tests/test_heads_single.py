"""grow_heads on an attention of one head (issue 39: timm sam2_hiera_tiny grow_heads changed the model's output,
relative error 0.0957). SAM2's first attention reshapes its fused projection to (B, N, 3, num_heads, -1) with
num_heads = 1: the head's factor of size 1 fits the sections' axis of 3 as well as the heads' axis of 1 after it, and
the analysis put it with the sections; unbinding that axis then dropped it, so the query's heads axis held no head,
the new head became a fourth section in the reshape's 3 (rewritten to 6) and the growth was wrong. A size-1 factor now
goes to the axis written 1 (or -1) after a full one, and an unbind that would drop a growing factor is refused.
Spellings: SAM2's reshape + unbind(2), timm ViT's reshape + permute + unbind(0) (torch.export writes unbind(x)
without its dim: that failed with an IndexError), separate projections viewed with a constant token count, an eager
attention (matmul, softmax); beside SAM2's pooled-query attention (left as it is); fx and torch.export captures.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import NotApplicable

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPELLINGS = ["sam2", "vit", "separate", "eager"]


class OneHead(nn.Module):
    """A (B, 4, 4, 16) map attended as 16 tokens by one head of 16."""

    def __init__(self, spelling: str, heads: int = 1):
        super().__init__()
        self.spelling, self.heads = spelling, heads
        self.qkv, self.q, self.k, self.v = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        b, h, w, _ = x.shape
        if self.spelling == "separate":  # the token count written as a number
            q, k, v = (f(x).view(b, 16, self.heads, 16 // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        elif self.spelling == "vit":  # timm's Attention
            qkv = self.qkv(x).reshape(b, h * w, 3, self.heads, 16 // self.heads).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
        else:  # SAM2's MultiScaleAttention
            q, k, v = torch.unbind(self.qkv(x).reshape(b, h * w, 3, self.heads, -1), 2)
            if self.spelling == "pooled query":  # its q_pool at a stage change: the query's map halved
                q = F.max_pool2d(q.reshape(b, h, w, -1).permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)
                h, w = q.shape[1:3]
                q = q.reshape(b, h * w, self.heads, -1)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.spelling == "eager":
            out = (q * 0.25 @ k.transpose(-2, -1)).softmax(-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, h, w, -1))


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_one_head_grows_to_two_exactly(spelling, capture):
    torch.manual_seed(0)
    model = OneHead(spelling).eval()
    gm = gg.trace(model, input_shape=(1, 4, 4, 16), capture=capture)
    result = gg.get_pass("grow_heads")()(gm)  # the default: +50 %, 1 → 2
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.targets["heads"].startswith("1 → 2"), result.targets
    g = result.gm
    assert g.proj.in_features == 32 and (g.q.out_features if spelling == "separate" else g.qkv.out_features) in (
        32,
        96,
    )
    x = torch.randn(3, 4, 4, 16)
    torch.testing.assert_close(g(x), model(x), atol=1e-5, rtol=1e-5)


class Stages(nn.Module):
    """SAM2's first two stages in small: a one-head attention, then a two-head one whose query is pooled."""

    def __init__(self):
        super().__init__()
        self.a, self.b = OneHead("sam2"), OneHead("pooled query", heads=2)

    def forward(self, x):
        return self.b(x + self.a(x))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_beside_a_pooled_query_the_single_head_grows(capture):
    """The attention whose query is pooled between its projection and the attention has no Linear the analysis
    follows to its query: it is left as it is (as in SAM2's run); the one-head attention grows 1 → 2."""
    torch.manual_seed(0)
    model = Stages().eval()
    result = gg.get_pass("grow_heads")()(gg.trace(model, input_shape=(1, 4, 4, 16), capture=capture))
    assert result.targets["each"] == "a: 1×16 → 2×16", result.targets
    assert (result.gm.a.proj.in_features, result.gm.b.proj.in_features) == (32, 16)
    x = torch.randn(2, 4, 4, 16)
    torch.testing.assert_close(result.gm(x), model(x), atol=1e-5, rtol=1e-5)


class UnboundHead(nn.Module):
    """One head whose heads axis is made by unsqueeze after the sections are unbound: the head's factor sits beside
    the head size (or beside the unbound sections), so a second head has no place (refused, not grown wrongly)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, t, c = x.shape  # the head's width read from the input (traced: a size read at run time, no number)
        q, k, v = (a.unsqueeze(1) for a in self.qkv(x).view(b, t, 3, c).unbind(2))
        return self.proj(F.scaled_dot_product_attention(q, k, v).squeeze(1))


def test_a_head_unbound_with_the_sections_is_refused():
    gm = gg.trace(UnboundHead().eval(), input_shape=(1, 5, 16))
    with pytest.raises(NotApplicable, match="carries heads or head size on an axis other than"):
        gg.get_pass("grow_heads")()(gm)
