"""grow_hidden through maps along another axis than the hidden one (issue 39: timm gmixer_12_224 grow_hidden was
refused, "the residual stream reaches 'blocks_11_mlp_tokens_fc2' ..., which produces stream values the analysis does
not understand"; coat_tiny, "the residual stream reaches 'stack' (stack), which reads it in a way the analysis does
not understand"). MLP-Mixer's token MLP transposes the normed stream to (B, C, T) and applies Linear layers over the
tokens, with a gated unit x1 · act(x2) between them: each hidden coordinate is mapped alike, so the weights do not
grow; with a bias the map is affine (W·0 + b is no zero), so new coordinates must be the mean or copies, and the
product of two stream tensors keeps zeros or copies only. CoaT stacks the class tokens of its three scales (B, 3, C)
and mixes them with a Conv1d of kernel 1 whose positions are the hidden coordinates. Spellings: nn.Linear and
F.linear over the tokens, the gate's halves by chunk, split and slicing, without a bias; torch.stack at dim 1 and
-2, torch.concat of unsqueezed tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import grow_checked

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

C, T, H = 16, 6, 8


class Mixer(nn.Module):
    """(B, T, C) tokens: x + token_mlp(norm(x)ᵀ)ᵀ, then x + mlp(norm(x)); the mean token, LayerNorm, head."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling, bias = spelling, spelling != "no bias"
        self.embed, self.norms = nn.Linear(12, C), nn.ModuleList(nn.LayerNorm(C) for _ in range(3))
        self.fc1, self.fc2 = nn.Linear(T, 2 * H, bias=bias), nn.Linear(H, T, bias=bias)
        self.mlp, self.head = nn.Sequential(nn.Linear(C, 32), nn.GELU(), nn.Linear(32, C)), nn.Linear(C, 5)

    def tokens(self, y):  # y (B, C, T)
        if self.spelling == "functional":
            x1, x2 = F.linear(y, self.fc1.weight, self.fc1.bias).split(H, dim=-1)
            return F.linear(x1 * F.silu(x2), self.fc2.weight, self.fc2.bias)
        z = self.fc1(y)
        x1, x2 = z.chunk(2, dim=-1) if self.spelling == "module" else (z[..., :H], z[..., H:])
        return self.fc2(x1 * F.gelu(x2))

    def forward(self, x):
        h = self.embed(x)
        h = h + self.tokens(self.norms[0](h).transpose(1, 2)).transpose(1, 2)
        h = h + self.mlp(self.norms[1](h))
        return self.head(self.norms[2](h).mean(1))


@pytest.mark.parametrize("spelling", ["module", "functional", "no bias"])
def test_a_token_mlp_on_the_stream(spelling):
    torch.manual_seed(0)
    model = Mixer(spelling).eval()
    r = grow_checked(model, f"x:1x{T}x12", "grow_hidden")
    # the norm's output (zero) reaches the stream's sum (a LayerNorm's input: the mean) through maps alike for every
    # coordinate, with no writer between: replicated, biased or not
    assert r.targets["hidden"].startswith(f"{C} → {2 * C}"), r.targets
    assert r.gm.fc1.weight.shape == (2 * H, T)  # the token MLP does not grow
    x = torch.randn(3, T, 12)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)


class Scales(nn.Module):
    """Three token streams of other lengths, each normed; their class tokens stacked (B, 3, C), mixed by a Conv1d of
    kernel 1 over the stack, then the head."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.embed = nn.Linear(12, C)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C)) for _ in "abc")
        self.norms = nn.ModuleList(nn.LayerNorm(C) for _ in "abc")
        self.aggregate, self.head = nn.Conv1d(3, 1, 1), nn.Linear(C, 5)

    def forward(self, x):
        h, tokens = self.embed(x), []
        for i, (block, norm) in enumerate(zip(self.blocks, self.norms, strict=True)):
            h = h[:, : T - i] + block(h[:, : T - i])
            tokens.append(norm(h)[:, 0])
        if self.spelling == "stack":
            y = torch.stack(tokens, dim=1)
        elif self.spelling == "stack -2":
            y = torch.stack(tokens, -2)
        else:
            y = torch.concat([t.unsqueeze(1) for t in tokens], dim=1)
        return self.head(self.aggregate(y).squeeze(1))


@pytest.mark.parametrize("spelling", ["stack", "stack -2", "concat"])
def test_class_tokens_stacked_and_mixed_by_a_kernel_one_conv(spelling):
    torch.manual_seed(0)
    model = Scales(spelling).eval()
    r = grow_checked(model, f"x:1x{T}x12", "grow_hidden")
    assert r.targets["hidden"].startswith(f"{C} → {2 * C}"), r.targets  # the conv's bias: replicated
    assert r.gm.aggregate.weight.shape == (1, 3, 1) and r.gm.head.in_features == 2 * C
    x = torch.randn(3, T, 12)
    torch.testing.assert_close(r.gm(x), model(x), atol=1e-5, rtol=1e-5)
