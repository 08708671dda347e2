"""A matrix product's output and a concatenation carry their channels where their operands say: `probs @ v` has v's
channels (the head size) last, whatever its shape, and `cat([heads, more_heads], dim=2)` of (B, T, H, d) tensors
keeps their channel axis. ConvBERT concatenates its attention heads with its convolution heads along the heads dim;
the (B, T, 2H, d) result matched no input's shape, so its channel axis was guessed from the layout (dim 1 of a
4-d tensor, as for an image): the tokens. An attention whose head size equals the number of tokens made the product
look like its probabilities (T × T) the same way. Everything after was then read with its channels on the token
axis, the block's MLP too, whose Linears looked like token mixers (issue 39: hf convbert grow_width was refused,
'every channel group of this model is frozen': at the sweep's 16 tokens and head size 16 no MLP group was found)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.analysis.axes import node_axis
from graphgrow.analysis.coupling import analyze

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("one_thread")]  # conftest.py

T, D, HEADS = 8, 16, 2  # head size D // HEADS == T: probabilities and values have one shape


class Block(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.conv_heads, self.proj = nn.Linear(D, D), nn.Linear(2 * D, D)
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc1, self.fc2, self.head, self.spelling = (
            nn.Linear(D, 4 * D),
            nn.Linear(4 * D, D),
            nn.Linear(D, 3),
            spelling,
        )

    def attend(self, q, k, v):
        b, h, t, d = q.shape
        if self.spelling == "@":
            return F.softmax(q @ k.transpose(-2, -1) / d**0.5, dim=-1) @ v
        if self.spelling == "torch.matmul":
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)) * d**-0.5, -1), v)
        q, k, v = (x.reshape(b * h, t, d) for x in (q, k, v))  # "bmm"
        return torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v).view(b, h, t, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, D // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        heads = self.attend(q, k, v).permute(0, 2, 1, 3)  # (B, T, H, d)
        more = self.conv_heads(x).reshape(b, t, HEADS, D // HEADS)  # ConvBERT's conv heads
        x = self.norm1(self.proj(torch.cat([heads, more], dim=2).reshape(b, t, 2 * D)) + x)  # BERT's post-norm
        return self.head(self.norm2(self.fc2(F.gelu(self.fc1(x))) + x))


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("spelling", ["@", "torch.matmul", "bmm"])
def test_the_mlp_after_an_attention_with_head_size_equal_to_tokens_grows(spelling, capture):
    torch.manual_seed(0)
    gm = gg.trace(Block(spelling), input_shape=(2, T, D), capture=capture)
    c = analyze(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    fc1 = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc1")
    assert node_axis(nodes[fc1]) == 2  # its features, not the tokens
    assert not c.why_frozen(c.group_of[fc1]), c.why_frozen(c.group_of[fc1])
    r = gg.get_pass("grow_width")(target="fc1")(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    assert r.gm.get_submodule("fc1").out_features == r.gm.get_submodule("fc2").in_features > 4 * D
