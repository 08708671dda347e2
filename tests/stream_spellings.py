"""Tiny residual streams written the ways published models write them (tests/test_grow_hidden.py): each has one thing
on its stream that grow_hidden must understand by what it computes — an add or a product done in place, a tensor read
for its dtype or shape only, a per-channel scale or a depthwise convolution, a LayerNorm written out by hand. Width 8,
vocabulary 20, one block: cheap to capture and verify."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D = 8
SPEC = "ids:1x5:int64"


class Block(nn.Module):
    """Embedding → x + fc(norm(x)) → head(norm(x)), with `mix(x, branch)` deciding how the branch joins the stream."""

    def __init__(self, norm: nn.Module | None = None, norm2: nn.Module | None = None):
        super().__init__()
        self.embed, self.fc, self.head = nn.Embedding(20, D), nn.Linear(D, D), nn.Linear(D, 3)
        self.norm = norm if norm is not None else nn.LayerNorm(D)
        self.norm2 = norm2 if norm2 is not None else nn.LayerNorm(D)

    def branch(self, x):
        return self.fc(self.norm(x))

    def mix(self, x, b):
        return x + b

    def forward(self, ids):
        x = self.embed(ids)
        x = self.mix(x, self.branch(x))
        return self.head(self.norm2(x))


class InPlaceAdd(Block):
    """Falcon's `mlp_output += attention_output`, GPT-OSS's expert sum: the residual add done in place."""

    def mix(self, x, b):
        b.add_(x)
        return b


class InPlaceIadd(Block):
    def mix(self, x, b):
        b += x
        return b


class InPlaceMask(Block):
    """Flaubert's `tensor *= mask.unsqueeze(-1)`: every coordinate of a token scaled by its mask, in place."""

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.branch(x)
        x.mul_((ids > 2).unsqueeze(-1).to(x.dtype))  # padding tokens zeroed
        return self.head(self.norm2(x))


class TypeAsReader(Block):
    """GraniteMoE's router weights `.type_as(hidden)`, Funnel's `x.new_ones(n, n)`, GIT's `zeros_like(x)[..., 0]`
    as token types, DOTS' `x.detach()`: reads of the stream for its dtype, shape, or values without a gradient."""

    def __init__(self):
        super().__init__()
        self.types = nn.Embedding(2, D)

    def mix(self, x, b):
        half = torch.full((1,), 0.5).type_as(b)
        ones = b.new_ones(2, 2)
        kinds = torch.zeros_like(x, dtype=torch.int64)[..., 0] * ones.long()[0, 0]  # (batch, tokens) of 0
        return x + b * half + self.types(kinds) + x.detach() * 0.1


class LayerScale(Block):
    """ConvNeXt's / CaiT's layer scale γ ⊙ branch, DOGE's residual weight γ ⊙ x: a factor per hidden coordinate."""

    def __init__(self):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)
        self.keep = nn.Parameter(torch.rand(D) + 0.5)

    def mix(self, x, b):
        return x * self.keep[None, None, :] + self.gamma * b


class Depthwise(Block):
    """ConvBERT's / ConvNeXt's depthwise convolution of the stream (channels first), then a pointwise one."""

    def __init__(self):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.dw = nn.Conv1d(D, D, 3, padding=1, groups=D)
        self.pw = nn.Conv1d(D, D, 1)

    def mix(self, x, b):
        return x + b + self.pw(self.dw(x.transpose(1, 2))).transpose(1, 2)


class HandLayerNorm(nn.Module):
    """A LayerNorm written out: DeBERTa's (divide by sqrt, with a bias) or Cohere's (rsqrt, no bias)."""

    def __init__(self, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)
        self.bias = nn.Parameter(torch.randn(D) * 0.1) if bias else None
        self.variance_epsilon = 1e-6

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        if self.bias is None:
            return self.weight * ((x - mean) * torch.rsqrt(var + self.variance_epsilon))
        return self.weight * ((x - mean) / torch.sqrt(var + self.variance_epsilon)) + self.bias


class HandNorms(Block):
    def __init__(self, bias: bool):
        super().__init__(HandLayerNorm(bias), HandLayerNorm(bias))


class ExpandedPositions(Block):
    """Flaubert's `position_embeddings(positions).expand_as(tensor)`: a table's values in the stream's shape."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(16, D)

    def mix(self, x, b):
        p = self.pos(torch.arange(x.shape[1], device=x.device))[None]
        return x + p.expand_as(x) + b


class WrittenActivation(Block):
    """ALBERT's / FNet's MLM transform: Linear → GELU written out op by op (gelu_new with tanh, or x·σ(1.702x)) →
    LayerNorm; and Funnel's pooling of the tokens, avg_pool2d of (B, 1, T, D) by (2, 1), and its zero padding."""

    def __init__(self, quick: bool):
        super().__init__()
        self.dense, self.norm3, self.quick = nn.Linear(D, D), nn.LayerNorm(D), quick

    def act(self, h):
        if self.quick:
            return h * torch.sigmoid(1.702 * h)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.branch(x)
        x = F.avg_pool2d(x[:, None], (2, 1), stride=(2, 1), ceil_mode=True)[:, 0]
        x = F.pad(x, (0, 0, 0, 2))  # two zero tokens appended
        return self.head(self.norm3(self.act(self.dense(self.norm2(x)))))


class SubNorm(Block):
    """BitNet's attention sub-norm: an RMSNorm over heads × head size, which equals the hidden size, before the
    output projection. Not on the stream: its tensors come from a softmax over head features, not understood there."""

    def __init__(self):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.q, self.sub, self.o = nn.Linear(D, D), nn.RMSNorm(D), nn.Linear(D, D)

    def branch(self, x):
        h = self.q(self.norm(x)).view(*x.shape[:2], 2, D // 2).transpose(1, 2)
        h = torch.softmax(h, -1).transpose(1, 2).reshape(*x.shape[:2], -1)
        return self.o(self.sub(h))


class LayerDropPath(nn.Module):
    """CvT's / BEiT's drop-path under their own class names: identity in eval, a per-sample 0 or 1/keep in train."""

    def __init__(self, p: float = 0.3):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training:
            return x
        keep = torch.rand(x.shape[0], *([1] * (x.dim() - 1)), device=x.device) >= self.p
        return x / (1 - self.p) * keep.to(x.dtype)


class SwitchedDropPath(Block):
    """BEiT's drop-path as torch.export captures it (a mode switch: identity in eval, a per-sample draw in train),
    FocalNet's `1.0 * x` (the number on the left)."""

    def __init__(self):
        super().__init__()
        self.drop = LayerDropPath()

    def mix(self, x, b):
        return x + self.drop(1.0 * b)


class ClassAndMeanHead(Block):
    """DINOv2's classifier: the class token beside the mean of the patch tokens, concatenated along the hidden axis,
    read by one Linear (2·d inputs)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2 * D, 3)

    def forward(self, ids):
        x = self.embed(ids)
        h = self.norm2(x + self.branch(x))
        return self.head(torch.cat([h[:, 0], h[:, 1:].mean(dim=1)], dim=-1))


class Extras(nn.Module):
    """A layer's other outputs (attention weights …), kept as one opaque call (a leaf)."""

    def forward(self, ids):
        return ids, ids * 2


class ClassTokenSplit(Block):
    """CvT: the class token split from the patch tokens (torch.split along the tokens), normalised alone; a layer's
    `(hidden,) + outputs[1:]`; a drop-path module; a depthwise conv + BatchNorm projection (channels first)."""

    def __init__(self):
        super().__init__(nn.LayerNorm(D), nn.LayerNorm(D))
        self.drop, self.extras = LayerDropPath(), Extras()
        self.dw, self.bn = nn.Conv1d(D, D, 3, padding=1, groups=D), nn.BatchNorm1d(D)

    def forward(self, ids):
        x = self.embed(ids)
        b = self.fc(self.bn(self.dw(self.norm(x).transpose(1, 2))).transpose(1, 2))
        out = (x + self.drop(b),) + self.extras(ids)[1:]
        cls, patches = torch.split(out[0], [1, x.shape[1] - 1], dim=1)
        return self.head(self.norm2(cls)) + self.head(self.norm2(patches)).mean(1, keepdim=True) + out[1][0, 0]


class ExpertCopies(Block):
    """Llama 4's mixture of experts: the normed tokens repeated once per expert (`x.repeat(E, 1)`, or `torch.tile`),
    each copy scaled by its router score, one Linear over all copies, summed over the experts."""

    def __init__(self, tile: bool):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.router, self.tile = nn.Linear(D, 2, bias=False), tile

    def branch(self, x):
        flat = self.norm(x).reshape(-1, D)
        copies = torch.tile(flat, (2, 1)) if self.tile else flat.repeat(2, 1)
        scores = torch.sigmoid(self.router(flat)).t().reshape(-1, 1)
        return self.fc(copies * scores).reshape(2, -1, D).sum(0).reshape(x.shape)


class ShortConv(Block):
    """Inkling's causal short convolution of the stream: F.conv1d on its own weight viewed through unit dims
    (`w.squeeze(1).unsqueeze(1)`), groups = the width, cut back to the tokens; or with a bias, groups by name."""

    def __init__(self, viewed: bool):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.weight = nn.Parameter(torch.randn(D, 1, 3) * 0.3)
        self.bias = None if viewed else nn.Parameter(torch.randn(D) * 0.1)
        self.viewed = viewed

    def mix(self, x, b):
        h = (x + b).transpose(1, 2)
        if self.viewed:
            c = F.conv1d(h, self.weight.squeeze(1).unsqueeze(1), None, [1], [2], [1], D)
        else:
            c = F.conv1d(h, self.weight, self.bias, padding=2, groups=D)
        return x + b + c[..., : x.shape[1]].transpose(1, 2)


class GatedNorm(Block):
    """AXK2's gated norm: the norm's output times σ of a bottleneck MLP of it, σ(fc2(silu(fc1(norm(x))))), a gate
    per hidden coordinate; a bilinear gate h · F.linear(h, W) on a parameter; a GLU gate through an nn.Sigmoid."""

    def __init__(self, kind: str):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.fc1, self.fc2, self.kind = nn.Linear(D, 3), nn.Linear(3, D), kind
        self.w, self.act = nn.Parameter(torch.randn(D, D) * 0.3), nn.Sigmoid()

    def branch(self, x):
        h = self.norm(x)
        if self.kind == "bottleneck":
            g = torch.sigmoid(self.fc2(F.silu(self.fc1(h))))
        else:
            g = F.linear(h, self.w) if self.kind == "bilinear" else self.act(F.linear(h, self.w))
        return self.fc(h * g)


class TokenMaxAndPool(Block):
    """Hiera: the tokens' maximum over query-stride groups, y.view(B, 2, -1, d).max(dim=1).values (or [0], amax), and
    its pooler, an average over the tokens channels first (AdaptiveAvgPool1d(1) of (N, d, T), or the function)."""

    def __init__(self, kind: str):
        super().__init__()
        self.pool, self.kind = nn.AdaptiveAvgPool1d(1), kind

    def forward(self, ids):
        x = self.embed(ids)
        y = self.fc(x[:, :4]).view(x.shape[0], 2, -1, D)
        tops = {"values": lambda t: t.max(dim=1).values, "[0]": lambda t: torch.max(t, 1)[0]}
        tops["amax"] = lambda t: t.amax(1)
        top = tops[self.kind](y)
        h = self.norm2(x[:, :2] + top).transpose(1, 2)
        return self.head((self.pool(h) if self.kind == "values" else F.adaptive_avg_pool1d(h, 1)).flatten(1))


class HyperConnections(Block):
    """DeepSeek-V4's / HY-V4's hyper-connections: 2 copies of the stream, (B, T, 2, d), mixed by coefficients from all
    copies flattened, F.linear(flat · rsqrt(mean(flat²) + eps), W) (or F.linear(flat, W) · rsqrt(…)); the layer reads
    the copies' weighted sum, its output is spread back onto them, and the copies are mixed by H @ x."""

    def __init__(self, after: bool):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.fn = nn.ParameterList([nn.Parameter(torch.randn(6, 2 * D) * 0.3) for _ in range(2)])
        self.after = after

    def coefficients(self, x, i):
        flat = x.flatten(2)
        r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
        return F.linear(flat, self.fn[i]) * r if self.after else F.linear(flat * r, self.fn[i])

    def forward(self, ids):
        x = self.embed(ids).unsqueeze(2).expand(-1, -1, 2, -1)
        c = self.coefficients(x, 0)
        pre, mix = torch.sigmoid(c[..., :2]).unsqueeze(-1), torch.softmax(c[..., 2:].unflatten(-1, (2, 2)), -1)
        x = self.branch((pre * x).sum(2)).unsqueeze(2) * pre + mix @ x
        return self.head(self.norm2((torch.sigmoid(self.coefficients(x, 1)[..., :2]).unsqueeze(-1) * x).sum(2)))


class WrittenRMSNorm(nn.Module):
    """HRM's RMSNorm without a weight, written out: x · rsqrt(mean(x²) + eps) in float32, cast back (x², x·x)."""

    def __init__(self, square: str):
        super().__init__()
        self.square = square

    def forward(self, x):
        h = x.float()
        ms = h.pow(2).mean(-1, keepdim=True) if self.square == "pow" else (h * h).mean(-1, keepdim=True)
        return (h * torch.rsqrt(ms + 1e-6)).type_as(x)


class WrittenNorms(Block):
    def __init__(self, square: str):
        super().__init__(WrittenRMSNorm(square), WrittenRMSNorm(square))


class SphereNorm(nn.Module):
    """Dory's L2 norm: onto the unit sphere, x · rsqrt(Σx² + eps) in float32, cast back (x.pow(2) or x · x)."""

    def __init__(self, square: str = "pow"):
        super().__init__()
        self.square = square

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt((h.pow(2) if self.square == "pow" else h * h).sum(-1, keepdim=True) + 1e-6)).type_as(x)


class Spherical(Block):
    """Dory's (nGPT's) stream: every hidden state on the unit sphere, moved towards the normalised branch output at a
    learned rate per coordinate, |λ · s|; the layer runs twice in a loop, so λ is read twice."""

    def __init__(self, square: str):
        super().__init__(SphereNorm(square), SphereNorm(square))
        self.lam = nn.Parameter(torch.full((D,), 0.05) + 0.01 * torch.rand(D))

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        for _ in range(2):
            h = self.norm(h + (self.lam * 4.0).abs() * (self.norm(self.fc(h)) - h))
        return self.head(self.norm2(h))


class DepthAttention(Block):
    """Inkling's depth attention: a sublayer reads a softmax mix of the earlier states (the embedding, each block's
    output) stacked along a sources axis, normalised without a weight and scored by a learned query, q @ statesᵀ; the
    history starts as x.new_zeros(B, T, 0, d) and the mix comes out as unbind(-2)[0]."""

    def __init__(self):
        super().__init__(nn.RMSNorm(D), nn.RMSNorm(D))
        self.query = nn.Parameter(torch.randn(D) * 0.3)

    def read(self, states):
        h = states.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = self.query.reshape(-1, D).expand(states.shape[0], states.shape[1], -1, -1)
        return (torch.softmax(q @ normed.transpose(2, 3) * 0.5, -1) @ normed).unbind(-2)[0]

    def forward(self, ids):
        x = self.embed(ids)
        history = torch.cat([x.new_zeros(x.shape[0], x.shape[1], 0, D), x.unsqueeze(-2)], -2)
        history = torch.cat([history, self.branch(self.read(history)).unsqueeze(-2)], -2)
        return self.head(self.norm2(self.read(history)))


def spellings() -> dict[str, tuple[type, tuple]]:
    """name → (module class, its arguments); names ending in '(fx)' are captured with torch.fx (`extras` kept as a
    leaf), the others with torch.export (as Hugging Face models are)."""
    return {
        "add_": (InPlaceAdd, ()),
        "+=": (InPlaceIadd, ()),
        "mul_ by a token mask": (InPlaceMask, ()),
        "type_as/new_ones/zeros_like/detach": (TypeAsReader, ()),
        "layer scale": (LayerScale, ()),
        "depthwise conv": (Depthwise, ()),
        "hand LayerNorm, divide": (HandNorms, (True,)),
        "hand LayerNorm, rsqrt, no bias": (HandNorms, (False,)),
        "expand_as": (ExpandedPositions, ()),
        "gelu_new written out, token pooling": (WrittenActivation, (False,)),
        "quick gelu written out, token pooling": (WrittenActivation, (True,)),
        "a norm of the hidden width inside a block": (SubNorm, ()),
        "class token split, tuple, drop-path, BatchNorm (fx)": (ClassTokenSplit, ()),
        "drop-path as a mode switch, 1.0 * x": (SwitchedDropPath, ()),
        "class token and patch mean concatenated": (ClassAndMeanHead, ()),
        "tokens repeated per expert (repeat)": (ExpertCopies, (False,)),
        "tokens repeated per expert (tile)": (ExpertCopies, (True,)),
        "F.conv1d depthwise on a viewed weight": (ShortConv, (True,)),
        "F.conv1d depthwise with a bias, groups by name (fx)": (ShortConv, (False,)),
        "a gate from a bottleneck MLP on the norm's output": (GatedNorm, ("bottleneck",)),
        "a bilinear gate F.linear(h, W) on the norm's output": (GatedNorm, ("bilinear",)),
        "a gate through an nn.Sigmoid module (fx)": (GatedNorm, ("module",)),
        "max over token groups (.values), AdaptiveAvgPool1d over the tokens": (TokenMaxAndPool, ("values",)),
        "max over token groups ([0]), adaptive_avg_pool1d (fx)": (TokenMaxAndPool, ("[0]",)),
        "amax over token groups, adaptive_avg_pool1d": (TokenMaxAndPool, ("amax",)),
        "hyper-connections, the mean square before the Linear": (HyperConnections, (False,)),
        "hyper-connections, the mean square after the Linear (fx)": (HyperConnections, (True,)),
        "an RMSNorm without a weight written out, pow": (WrittenNorms, ("pow",)),
        "an RMSNorm without a weight written out, x·x (fx)": (WrittenNorms, ("mul",)),
        "L2 norms and a learned rate per coordinate, looped": (Spherical, ("pow",)),
        "L2 norms (x·x) and a learned rate per coordinate, looped (fx)": (Spherical, ("mul",)),
        "depth attention over earlier states": (DepthAttention, ()),
        "depth attention over earlier states (fx)": (DepthAttention, ()),
    }


__all__ = ["D", "SPEC", "F", "spellings"]
