"""grow_heads finds attention by what it computes (issue 39), in spellings Hugging Face's sweep showed it refusing.

Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite): the key is the per-head non-rotary part (from a
projection that holds each head's key and value in one block) next to a rotary part computed once for all heads from
another Linear and broadcast across them. Three spellings: an allocation filled by `copy_` into its slices with an
explicit expand (transformers today), `setitem` broadcasting the shared part (DeepSeek's original code), and `cat`
with an expand. Whole heads grow; a head's insides (its key/value block) cannot, and a part neither projected nor
the same for every head is refused, each saying why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hf_pass_matrix import _same_function
from torch import nn

import graphgrow as gg

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _rotate(x: torch.Tensor, t: int, freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) of x (…, t, r) at positions 0 … t-1."""
    angle = torch.arange(t, device=x.device, dtype=x.dtype)[:, None] * freq
    x1, x2 = x.chunk(2, -1)
    return x * torch.cat([angle.cos(), angle.cos()], -1) + torch.cat([-x2, x1], -1) * torch.cat(
        [angle.sin(), angle.sin()], -1
    )


class Latent(nn.Module):
    """Multi-head latent attention: 4 heads, each key 4 non-rotary + 4 rotary, value 8, a latent of 8."""

    def __init__(self, spelling: str, width: int = 16, heads: int = 4, nope: int = 4, rope: int = 4, value: int = 8):
        super().__init__()
        self.spelling, self.h, self.nope, self.rope, self.value, self.rank = spelling, heads, nope, rope, value, 8
        self.q = nn.Linear(width, heads * (nope + rope))
        self.kv_a = nn.Linear(width, self.rank + rope)
        self.norm = nn.LayerNorm(self.rank)
        self.kv_b = nn.Linear(self.rank, heads * (nope + value))
        self.o = nn.Linear(heads * value, width)
        self.register_buffer("freq", torch.rand(rope // 2))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_a(x).split([self.rank, self.rope], -1)
        k_pe = _rotate(k_pe.view(b, 1, t, self.rope), t, self.freq)  # one rotary key for every head
        query = torch.cat([q_nope, _rotate(q_pe, t, self.freq)], -1)
        kv = self.kv_b(self.norm(latent)).view(b, t, self.h, self.nope + self.value).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.value], -1)
        if self.spelling == "copy":  # transformers' DeepseekV2Attention.expand_kv
            key = kv.new_empty(b, self.h, t, self.nope + self.rope)
            key[..., : self.nope].copy_(k_nope)
            key[..., self.nope :].copy_(k_pe.expand(-1, self.h, -1, -1))
        elif self.spelling == "setitem":  # DeepSeek's own code: the assignment broadcasts the shared part
            key = k_pe.new_empty(b, self.h, t, self.nope + self.rope)
            key[:, :, :, : self.nope] = k_nope
            key[:, :, :, self.nope :] = k_pe
        else:
            key = torch.cat([k_nope, k_pe.expand(-1, self.h, -1, -1)], -1)
        out = F.scaled_dot_product_attention(query, key, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Unshared(Latent):
    """The key's second part is a table per head (not projected, not one for all heads): nothing for new heads."""

    def __init__(self):
        super().__init__("cat")
        self.table = nn.Parameter(torch.randn(1, 4, 1, 4))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        kv = self.kv_b(self.norm(self.kv_a(x)[..., : self.rank])).view(b, t, self.h, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.value], -1)
        key = torch.cat([k_nope, self.table.expand(b, -1, t, -1)], -1)
        out = F.scaled_dot_product_attention(q, key, v)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["copy", "setitem", "cat"])
def test_latent_attention_grows_whole_heads(spelling):
    torch.manual_seed(0)
    model = Latent(spelling)
    gm = gg.trace(model, input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.targets["heads"] == "4 → 6"
    g = result.gm
    assert (g.q.out_features, g.kv_b.out_features, g.o.in_features) == (48, 72, 48)
    assert g.kv_a.out_features == 12  # the shared rotary key and the latent do not grow
    for shape in ((3, 7, 16), (2, 4, 16)):  # other batch sizes and lengths than traced
        x = torch.randn(*shape)
        for train in (False, True):
            assert _same_function(gm, g, {"x": x}, train) <= 1e-6, (shape, train)


@pytest.mark.parametrize(
    "model,args,why",
    [
        (Latent("copy"), {"head_dim": 12}, r"projects k/v in one block per head \(4 heads × 12\).*whole heads"),
        (Unshared(), {"heads": 6}, r"not the same for every head"),
    ],
)
def test_latent_attention_refusals_say_why(model, args, why):
    gm = gg.trace(model, input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match=why):
        gg.get_pass("grow_heads")(**args)(gm)


class WrittenOutNorm(nn.Module):
    """Gemma-4's value norm without a scale, written out per head, in two spellings: x · rsqrt(mean(x²) + eps) and
    x / sqrt(mean(x²) + eps)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def norm(self, x):
        if self.spelling == "rsqrt":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x / x.square().mean(dim=-1, keepdim=True).add(1e-6).sqrt()

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (4, 4)).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, self.norm(k), self.norm(v))
        return self.o(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("spelling", ["rsqrt", "sqrt"])
def test_a_norm_written_out_per_head_lets_heads_grow(spelling):
    torch.manual_seed(0)
    gm = gg.trace(WrittenOutNorm(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)
    with pytest.raises(gg.NotApplicable, match=r"reduces over a growing axis \(head size 4\)"):
        gg.get_pass("grow_heads")(head_dim=6)(gm)


class OutputNorm(WrittenOutNorm):
    """Dory's L2 sub-norm written out over every head's output together before the output projection."""

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (4, 4)).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(self.norm(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)))


def test_a_norm_written_out_over_every_head_refuses_heads():
    gm = gg.trace(OutputNorm("rsqrt"), input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match=r"reduces over every head's output together .*cannot grow exactly"):
        gg.get_pass("grow_heads")(heads=6)(gm)


class SplitSections(nn.Module):
    """Grouped-query attention (4 query heads, 2 key/value heads of 4) from one projection cut by split(sizes), as a
    method on the projection or after an unsqueeze that leaves the sizes last (GPT-BigCode's spelling)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv, self.o = nn.Linear(16, 32), nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        if self.spelling == "split":
            q, k, v = torch.split(self.qkv(x), [16, 8, 8], -1)
        else:
            q, k, v = self.qkv(x).unsqueeze(1).split((16, 8, 8), dim=3)
        q, k, v = (a.reshape(b, t, -1, 4).transpose(1, 2) for a in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["split", "unsqueeze_split"])
def test_sections_cut_by_split_sizes_grow(spelling):
    torch.manual_seed(0)
    gm = gg.trace(SplitSections(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert result.targets["kv_heads"].startswith("2 → 3") and result.gm.qkv.out_features == 48
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class OutputGate(nn.Module):
    """An attention whose output is gated per head and coordinate before the output projection, by a Linear of the
    input (AFMoE's, Qwen3-Next's gated attention): out · sigmoid(g(x)), as a function or a method."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.g, self.o = (nn.Linear(16, 16) for _ in range(5))
        self.g1 = nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (4, 4)).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        if self.spelling.startswith(
            "per_head"
        ):  # one gate per head and token (Dots's, Laguna's): a Linear of width heads
            b, t, _ = x.shape
            act = F.softplus if self.spelling == "per_head_softplus" else torch.sigmoid
            gated = out.view(b, t, 4, 4) * act(self.g1(x)).unsqueeze(-1)
            return self.o(gated.view(b, t, -1))
        gate = torch.sigmoid(self.g(x)) if self.spelling == "function" else self.g(x).float().sigmoid()
        return self.o(out * gate)


@pytest.mark.parametrize("spelling", ["function", "method", "per_head", "per_head_softplus"])
def test_an_output_gate_grows_with_the_heads(spelling):
    torch.manual_seed(0)
    gm = gg.trace(OutputGate(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    per_head = spelling.startswith("per_head")
    gate = result.gm.g1 if per_head else result.gm.g
    assert gate.out_features == (6 if per_head else 24) and result.gm.o.in_features == 24
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class XLMAttention(nn.Module):
    """XLM/FlauBERT's eager attention: the scores masked in place by a mask expand_as'd from one head, softmax in
    float32 cast back with type_as(scores), and keys and values after an empty cache concatenated (torch.cat with a
    1-d empty tensor) — or the same with an out-of-place mask and .to(dtype)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.register_buffer("cache", torch.zeros(0))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, -1, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        k, v = torch.cat([self.cache, k], dim=-2), torch.cat([self.cache, v], dim=-2)
        scores = torch.matmul(q / 2.0, k.transpose(2, 3))
        mask = (x[..., 0] > 1.5).view(b, 1, 1, t).expand_as(scores)
        if self.spelling == "in_place":
            scores.masked_fill_(mask, torch.finfo(scores.dtype).min)
            weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        else:
            weights = F.softmax(scores.masked_fill(mask, -1e9).float(), dim=-1).to(scores.dtype)
        return self.o(torch.matmul(weights, v).transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["in_place", "out_of_place"])
def test_xlm_attention_grows(spelling):
    torch.manual_seed(0)
    gm = gg.trace(XLMAttention(spelling), input_shape=(1, 5, 16), capture="export")
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class SinkScaled(nn.Module):
    """A learnable sink per head applied after the attention as a scale computed from its own scores (Granite-SWA:
    sigmoid(logsumexp(scores) - sink)), or the same written as 1 / (1 + exp(sink - logsumexp(scores)))."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.sinks = nn.Parameter(torch.randn(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.5
        lse = torch.logsumexp(scores, dim=-1)
        if self.spelling == "sigmoid":
            scale = (lse - self.sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
        else:
            scale = 1 / (1 + torch.exp(self.sinks[None, :, None] - lse))
        out = torch.matmul(F.softmax(scores, dim=-1), v) * scale.unsqueeze(-1)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["sigmoid", "exp"])
def test_a_sink_per_head_grows_with_the_heads(spelling):
    torch.manual_seed(0)
    gm = gg.trace(SinkScaled(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert result.gm.sinks.shape == (6,) and torch.equal(result.gm.sinks[:4], gm.sinks)
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class BiasedGate(nn.Module):
    """Beam's gated attention output: a gate of the input shaped as the output (view_as, or a view with the head
    count written out) plus a bias per head, through a sigmoid; and a learnable scale per head on the output."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.g, self.o = (nn.Linear(16, 16) for _ in range(5))
        self.gate_bias, self.head_scale = nn.Parameter(torch.randn(4)), nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        if self.spelling == "view_as":
            gate = self.g(x).view_as(out) + self.gate_bias[None, None, :, None]
        else:
            gate = self.g(x).view(b, t, 4, 4) + self.gate_bias.view(1, 1, -1, 1)
        out = out * torch.sigmoid(gate) * self.head_scale.view(1, 1, -1, 1)
        return self.o(out.reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["view_as", "view"])
def test_per_head_parameters_grow_with_the_heads(spelling):
    torch.manual_seed(0)
    gm = gg.trace(BiasedGate(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    g = result.gm
    assert g.g.out_features == 24 and g.gate_bias.shape == (6,) and torch.equal(g.head_scale[4:], torch.ones(2))
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), g(x), atol=1e-6)


class ZeroedWeights(nn.Module):
    """CPM-Ant's eager attention: the weights zeroed where masked after the softmax (a method or torch.masked_fill)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        masked = (x[..., :1] > 1.5).view(b, 1, t, 1)
        w = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / 2.0, dim=-1)
        w = w.masked_fill(masked, 0.0) if self.spelling == "method" else torch.masked_fill(w, masked, 0.0)
        return self.o(torch.matmul(w, v).transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["method", "function"])
def test_weights_masked_after_the_softmax_grow(spelling):
    torch.manual_seed(0)
    gm = gg.trace(ZeroedWeights(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class HiddenAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.head = OutputGate("function"), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attn(x))


@pytest.mark.parametrize("leaf", ["attn", "attn.q"])
def test_an_attention_kept_whole_by_the_capture_is_named(leaf):
    gm = gg.trace(HiddenAttention(), input_shape=(1, 5, 16), leaves=[leaf])
    if leaf == "attn":  # the whole attention is a leaf: the refusal names it, not 'no attention'
        with pytest.raises(gg.NotApplicable, match=r"'attn' \(module attn\), which is a module kept whole"):
            gg.get_pass("grow_heads")(heads=6)(gm)
    else:  # a Linear kept as a leaf is what the analysis reads anyway
        assert gg.get_pass("grow_heads")(heads=6)(gm).preservation.eval.ok


class SinkColumn(nn.Module):
    """A learnable sink per head as an extra softmax column (GPT-OSS, Flint): the sinks concatenated after the keys'
    scores, the softmax (stabilised by its row maximum, or not), the sink column sliced off."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.sinks = nn.Parameter(torch.randn(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.5
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        logits = torch.cat([scores, sinks], dim=-1)
        if self.spelling == "stabilised":
            logits = logits - logits.max(dim=-1, keepdim=True).values
            weights = F.softmax(logits, dim=-1)[..., :-1]
        else:
            weights = F.softmax(logits, dim=-1)[:, :, :, :-1]
        return self.o(torch.matmul(weights, v).transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("spelling", ["stabilised", "plain"])
def test_a_sink_column_grows_with_the_heads(spelling):
    torch.manual_seed(0)
    gm = gg.trace(SinkColumn(spelling), input_shape=(1, 5, 16), capture="export")
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert result.gm.get_parameter("sinks").shape == (6,)
    x = torch.randn(3, 7, 16)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


def test_latent_attention_with_a_value_size_of_its_own_grows_heads():
    """Key head size (non-rotary + rotary) other than the value head size (Dots's 136 and 16): heads still grow."""
    torch.manual_seed(0)
    gm = gg.trace(Latent("copy", nope=6, rope=4, value=8), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")()(gm)  # the default: +50 % heads
    assert result.targets["heads"].startswith("4 → 6") and result.preservation.eval.ok and result.preservation.train.ok


class TokensCutAtRunTime(nn.Module):
    """LUKE's word/entity split: the attention's output cut along the tokens by a length read at run time
    (`out[:, :n]` with n from a size), then projected. The cut axis does not grow; the heads do."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, words):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)
        n = words.size(1)
        if self.spelling == "heads_first":  # cut before the heads are merged
            out = out[:, :, :n]
            return self.o(out.transpose(1, 2).reshape(b, n, -1))
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.o(out[:, :n])


@pytest.mark.parametrize("spelling", ["heads_first", "merged"])
def test_an_output_cut_along_the_tokens_at_run_time_grows_heads(spelling):
    torch.manual_seed(0)
    gm = gg.trace(TokensCutAtRunTime(spelling), input_shape={"x": (1, 5, 16), "words": (1, 3, 16)}, capture="fx")
    cuts = [i for n in gm.graph.nodes for a in n.args if isinstance(a, tuple) for i in a if isinstance(i, slice)]
    assert any(isinstance(i.stop, torch.fx.Node) for i in cuts)  # the bound is a node of the graph, not a number
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok
    assert result.gm.o.in_features == 24
