"""Issue 39: shapes the registry sweep found, grown by what they compute (never by a model's name).

- An embedding written as a call on a weight tensor and scaled to the stream (`F.embedding(ids, head.weight) *
  embed_scale`: Gemma's and Blenderbot's scaled embeddings, tied to the LM head) is a writer of the residual stream:
  grow_hidden grows it, tie kept, exact in eval and train mode.
- A per-token scale on the stream (x · w, w of size 1 along the hidden axis: a gate or a router's weight on an
  expert's output) scales every hidden coordinate alike: grow_hidden follows it.
- A replicated stream (post-norm BERT; BLOOM's norm right after its embedding) whose LM head is tied to the token
  embedding: the head takes the embedding's copied columns and the norm it alone reads takes the shares (γ, β / k).
- Attention and MLP in parallel on one residual (GPT-J, GPT-NeoX): grow_hidden grows it; grow_heads follows rotary
  embeddings written rotate-every-two (torch.stack([-x2, x1], -1).flatten(-2): GPT-J, Cohere).
- A fused q/k/v projection of unequal sections (Phi-3's qkv_proj with grouped-query attention) cut by slices of its
  last axis: each section grows as its own projection would, the slices follow.
- A fused q/k/v projection of equal sections interleaved per head (GPT-NeoX: heads × (q, k, v) × head size).
- x + 0 on the stream (CTRL's absent token-type embedding) is an identity.
- Layers shared by several attentions (ALBERT calls one layer at every depth) are grown once by grow_heads.
- Query/key norms over the head size (Qwen3's q_norm, k_norm): heads grow by whole heads; a new head size is refused
  naming the norm.
Plain modules run in milliseconds; the Hugging Face cases use tiny configs (hidden 32, one layer, vocabulary 100) and
are marked slow (a torch.export capture each).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hf_pass_matrix import _same_function
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import TensorSpec, parse_spec, spec_inputs


class ScaledTiedLM(nn.Module):
    """A pre-norm block whose token embedding reads the LM head's weight through F.embedding and is scaled by a
    one-element buffer (sqrt(d)), as Gemma's embedding is."""

    def __init__(self, vocab: int = 20, d: int = 16):
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("embed_scale", torch.tensor(d**0.5))
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, ids):
        x = F.embedding(ids, self.head.weight) * self.embed_scale
        x = x + self.down(F.gelu(self.up(self.norm1(x))))
        return self.head(self.norm2(x))


def test_an_embedding_call_on_a_tied_weight_scaled_by_a_buffer_is_a_stream_writer():
    torch.manual_seed(0)
    model = ScaledTiedLM()
    gm = gg.trace(model, input_shape=(TensorSpec("ids", (2, 5), "int64", high=20),))
    result = gg.get_pass("grow_hidden")(to=24)(gm)
    assert result.targets["hidden"].startswith("16 → 24")
    assert "'embedding': 1" in result.targets["stream"]
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok
    grown = dict(result.gm.named_parameters())
    assert grown["head.weight"].shape == (20, 24)  # one tensor: the embedding's columns and the head's inputs
    ids = torch.randint(0, 20, (3, 7))
    assert torch.allclose(result.gm(ids), model(ids), atol=1e-5)


class TokenGatedBlock(nn.Module):
    """A pre-norm block whose MLP output is scaled per token by a gate read from the stream (sigmoid(Linear(d, 1)):
    Qwen2-MoE's shared-expert gate; a router's weight on an expert's output has the same form)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.gate, self.up, self.down = nn.Linear(d, 1), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.inp, self.head = nn.Linear(8, d), nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        h = self.norm1(x)
        x = x + torch.sigmoid(self.gate(h)) * self.down(F.gelu(self.up(h)))
        return self.head(self.norm2(x))


def test_a_per_token_scale_on_the_stream_keeps_every_coordinate_alike():
    torch.manual_seed(0)
    model = TokenGatedBlock()
    gm = gg.trace(model, input_shape=(2, 5, 8))
    result = gg.get_pass("grow_hidden")(to=24)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok
    assert dict(result.gm.named_parameters())["gate.weight"].shape == (1, 24)  # the gate reads the stream too
    x = torch.randn(3, 7, 8)
    assert torch.allclose(result.gm(x), model(x), atol=1e-5)


class ParallelBlock(nn.Module):
    """Attention and MLP in parallel on one residual, read through one norm (GPT-J, GPT-NeoX's parallel residual)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp, self.norm, self.final = nn.Linear(8, d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)  # the attention branch's projections, as the stream sees them
        self.up, self.down, self.head = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        h = self.norm(x)
        x = x + self.mix(h) + self.down(F.gelu(self.up(h)))
        return self.head(self.final(x))


def test_a_parallel_residual_grows_its_hidden_size():
    torch.manual_seed(0)
    model = ParallelBlock()
    gm = gg.trace(model, input_shape=(2, 5, 8))
    result = gg.get_pass("grow_hidden")(to=24)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok
    x = torch.randn(3, 7, 8)
    assert torch.allclose(result.gm(x), model(x), atol=1e-5)


def test_adding_zero_to_the_stream_is_an_identity():
    """CTRL adds a token-type embedding of 0 when no types are given: x + 0 keeps every coordinate's fill (any other
    number is refused)."""

    class ZeroAdd(TokenGatedBlock):
        def __init__(self, c: float):
            super().__init__()
            self.c = c

        def forward(self, x):
            return super().forward(x) if self.c is None else self.head(self.norm2(self.inp(x) + self.c))

    torch.manual_seed(0)
    gm = gg.trace(ZeroAdd(0), input_shape=(2, 5, 8))
    result = gg.get_pass("grow_hidden")(to=24)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok
    with pytest.raises(gg.NotApplicable, match="adds a constant to the stream"):
        gg.get_pass("grow_hidden")(to=24)(gg.trace(ZeroAdd(0.5), input_shape=(2, 5, 8)))


class SubNormAttention(nn.Module):
    """An attention whose output, all heads together, is normalised before the output projection (BitNet's
    attn_sub_norm)."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads, self.q, self.k, self.v, self.o = (
            heads,
            nn.Linear(d, d),
            nn.Linear(d, d),
            nn.Linear(d, d),
            nn.Linear(d, d),
        )
        self.sub_norm = nn.RMSNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        return self.o(self.sub_norm(y))


def test_a_norm_over_every_heads_output_is_refused_as_such():
    gm = gg.trace(SubNormAttention(), input_shape=(2, 5, 16))
    for args in ({"heads": 6}, {"value_dim": 6}):
        with pytest.raises(gg.NotApplicable, match=r"sub_norm.*normalises over every head's output together"):
            gg.get_pass("grow_heads")(**args)(gm)


def _hf(arch: str):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=100, max_position_embeddings=32, use_cache=False, attn_implementation="eager")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, **common)
    if arch == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=8, **small))
    if arch == "albert":  # one layer's modules called at every depth: shared by both attentions
        return tf.AlbertForMaskedLM(
            tf.AlbertConfig(**{k: v for k, v in small.items() if k != "max_position_embeddings"}, embedding_size=32)
        )
    if arch == "qwen3":  # RMSNorms over each query and key head (q_norm, k_norm)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=8, **small))
    if arch == "bert":  # post-norm, its MLM decoder tied to the word embedding
        return tf.BertForMaskedLM(tf.BertConfig(**{k: v for k, v in small.items() if k != "use_cache"}))
    if arch == "bloom":  # a LayerNorm right after the tied embedding: replicated as a post-norm stream is
        return tf.BloomForCausalLM(tf.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=100, use_cache=False))
    if arch == "gptj":  # attention and MLP in parallel on one residual; rotary on part of each head, every two
        return tf.GPTJForCausalLM(
            tf.GPTJConfig(n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=32, vocab_size=100, use_cache=False)
        )
    if arch == "phi3":  # one qkv_proj of unequal sections (q of 4 heads, k and v of 2), cut by slices
        return tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=2, pad_token_id=0, **small))
    if arch == "gpt_neox":  # query_key_value interleaved per head: viewed as heads × 3·head size, then split
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(use_parallel_residual=True, **small))
    raise AssertionError(arch)


@pytest.mark.slow  # a Hugging Face capture (~8 s)
@pytest.mark.parametrize(
    "arch, pass_name, args, key, value",
    [
        ("gemma2", "grow_hidden", {}, "hidden", "32 → 48"),
        ("albert", "grow_heads", {"head_dim": 12}, "head_dim", "8 → 12"),  # the shared layers grown once
        ("qwen3", "grow_heads", {}, "heads", "4 → 6"),  # whole heads: the q/k norms keep their size
        ("bert", "grow_hidden", {}, "hidden", "32 → 64"),  # replicated; the tied decoder's shares on its LayerNorm
        ("bloom", "grow_hidden", {}, "hidden", "32 → 64"),
        ("gptj", "grow_heads", {}, "heads", "4 → 6"),
        ("gpt_neox", "grow_heads", {}, "heads", "4 → 6"),
        (
            "phi3",
            "grow_heads",
            {"heads": 8, "value_dim": 12},
            "heads",
            "4 → 8",
        ),  # each section grown as its own  # RoPE as stack([-x2, x1], -1).flatten(-2) followed
    ],
)
def test_hugging_face_shapes_grow_exactly(arch, pass_name, args, key, value):
    model = _hf(arch)
    spec = "input_ids:1x8:int64"
    gm = gg.trace(model, input_shape=parse_spec(spec))
    result = gg.get_pass(pass_name)(**args)(gm)
    assert result.targets[key].startswith(value), result.targets
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    inputs = spec_inputs(model, parse_spec(spec.replace("1x8:", "1x6:")), seed=2, batch=2)
    for train in (False, True):
        assert _same_function(gm, result.gm, inputs, train) <= 1e-5, (arch, train)
    if arch == "gpt_neox":  # partial rotary: a new head size is refused at the rotary slice, not the fused layout
        with pytest.raises(gg.NotApplicable, match=r"indexes a growing axis \(head size"):
            gg.get_pass("grow_heads")(head_dim=12)(gm)
    if arch == "qwen3":  # a query/key norm over the head size forbids a new head size, and says so
        with pytest.raises(gg.NotApplicable, match=r"q_norm.*normalises over a growing axis.*grow heads instead"):
            gg.get_pass("grow_heads")(head_dim=12)(gm)
