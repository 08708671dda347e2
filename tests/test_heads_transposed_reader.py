"""grow_heads where a transposed convolution of one group reads the attention's output (issue 39: timm lowformer_b0
grow_heads was refused, "'stages_2_1_attn_main_1_upsampling' reads the output of attention ... before any output
projection, and is a transposed convolution (ConvTranspose2d, its weight's input channels first)"). LowFormer folds its
output projection into the upsampling of the attention's map: ConvTranspose2d(heads · d, C, …) is a learned linear map
of every input channel at each place, as a convolution is, so it is the output projection; its input channels are its
weight's first axis, where new heads get zero rows (analysis.head_layout.transposed_reader, rewrite.heads). Spellings:
LowFormer's (a pointwise conv projecting q/k/v per head, viewed (N, heads, 3·d, h·w); SDPA; the upsampling of stride 1,
and of stride 2 on a pooled map, cropped to the input), eager matmul + softmax, ConvTranspose1d over tokens. A grouped
transposed convolution reading the heads is still refused, saying so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

HEADS, D, C = 2, 4, 8


class LowAttention(nn.Module):
    def __init__(self, spelling: str, groups: int = 1):
        super().__init__()
        self.spelling = spelling
        conv, up = (nn.Conv1d, nn.ConvTranspose1d) if spelling == "1d" else (nn.Conv2d, nn.ConvTranspose2d)
        self.stride = 2 if spelling == "stride2" else 1
        self.pool = nn.AvgPool2d(2) if self.stride == 2 else nn.Identity()
        self.pwise = conv(C, 3 * HEADS * D, 1, bias=False)
        k = 2 * self.stride if self.stride > 1 else 3
        self.up = up(
            HEADS * D, C, k, stride=self.stride, padding=self.stride // 2 if self.stride > 1 else 1, groups=groups
        )

    def forward(self, x):
        y = self.pwise(self.pool(x))
        n = y.shape[0]
        qkv = y.reshape(n, HEADS, 3 * D, -1).permute(0, 1, 3, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        if self.spelling == "eager":
            o = torch.softmax(q @ k.transpose(-2, -1) * D**-0.5, dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        if self.spelling == "1d":
            return self.up(o.permute(0, 1, 3, 2).reshape(n, HEADS * D, y.shape[2]))[..., : x.shape[2]]
        o = o.permute(0, 1, 3, 2).reshape(n, HEADS * D, y.shape[2], y.shape[3])
        return self.up(o)[..., : x.shape[2], : x.shape[3]]  # cropped to the input, as LowFormer's


class Block(nn.Module):
    def __init__(self, spelling: str, groups: int = 1):
        super().__init__()
        self.attn, self.head = LowAttention(spelling, groups), nn.Linear(C, 5)

    def forward(self, x):
        y = x + self.attn(x)
        return self.head(y.flatten(2).mean(-1))


def _shape(spelling: str) -> str:
    return "x:2x8x12" if spelling == "1d" else "x:2x8x4x6"


@pytest.mark.parametrize("spelling", ["sdpa", "stride2", "eager", "1d"])
def test_a_transposed_convolution_reading_the_heads_grows_as_the_output_projection(spelling):
    torch.manual_seed(0)
    model = Block(spelling).eval()
    r = grow_checked(model, _shape(spelling), "grow_heads", heads=3)
    assert r.targets["each"].endswith(f": {HEADS}×{D} → 3×{D}"), r.targets
    up = r.gm.attn.up
    assert up.weight.shape[0] == up.in_channels == 3 * D and up.out_channels == C
    assert torch.equal(up.weight[HEADS * D :], torch.zeros_like(up.weight[HEADS * D :]))
    x = torch.randn(3, 8, 12) if spelling == "1d" else torch.randn(3, 8, 4, 6)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_grouped_transposed_convolution_is_still_refused():
    gm = gg.trace(Block("sdpa", groups=2), input_shape=(2, 8, 4, 6))
    with pytest.raises(gg.NotApplicable, match="transposed convolution"):
        gg.get_pass("grow_heads")(heads=3)(gm)
