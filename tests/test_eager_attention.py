"""grow_heads on attention written eagerly (issue 39): softmax(q @ kᵀ · scale + mask) @ v, found by what it computes
(analysis.eager_attention), grows as scaled_dot_product_attention does.

A plain module in two spellings (torch.matmul with a transpose and a division by sqrt(d); einsum with a multiplication
by 1/sqrt(d)), each with a causal mask, soft-capping and dropout on the weights: heads, head size (the scale constant
moved to the new size) and value size grown, exact in eval and train mode at other batch sizes and lengths, saved and
reloaded, on onnxruntime. Hugging Face LLaMA, GPT-2 and Gemma2 (soft-capping) with attn_implementation="eager". What
is refused says why.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_onnx_agrees
from test_hf_pass_matrix import _same_function
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec, spec_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Eager(nn.Module):
    """Causal self-attention, 4 heads of 4, written without scaled_dot_product_attention."""

    def __init__(self, spelling: str, heads: int = 4, width: int = 16, per_head_bias: bool = False):
        super().__init__()
        self.spelling, self.h = spelling, heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.drop = nn.Dropout(0.1)
        self.per_head_bias = per_head_bias  # ALiBi-like slopes computed in the forward: new heads read copies

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (self.h, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        d, t = q.size(-1), x.size(1)
        if self.spelling == "matmul":
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
        else:
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * d**-0.5
        scores = torch.tanh(scores / 5.0) * 5.0  # soft-capping
        if self.per_head_bias:
            scores = scores + torch.arange(1, self.h + 1, dtype=x.dtype, device=x.device).view(self.h, 1, 1) * -0.1
        i = torch.arange(t, device=x.device)  # (not .triu(1): not on the saved graph's closed op list yet)
        causal = i[None, :] > i[:, None]
        weights = self.drop(F.softmax(scores.masked_fill(causal, float("-inf")), dim=-1))
        out = weights @ v if self.spelling == "matmul" else torch.einsum("bhqk,bhkd->bhqd", weights, v)
        return self.o(out.transpose(1, 2).flatten(2))


class FusedDivided(nn.Module):
    """One fused q/k/v projection, scores divided by sqrt(d) as a literal (2.0 for d = 4)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v
        return self.proj(a.transpose(1, 2).flatten(2))


class WeightsReturned(Eager):
    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (self.h, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        w = (q @ k.transpose(-2, -1)).softmax(-1)
        return self.o((w @ v).transpose(1, 2).flatten(2)), w


class SoftmaxClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(x).softmax(-1)


def _checked(result, gm, batch_shapes=((3, 7, 16), (2, 4, 16))):
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.params_after > result.params_before
    for shape in batch_shapes:  # other batch sizes and sequence lengths than traced
        x = torch.randn(*shape)
        for train in (False, True):
            assert _same_function(gm, result.gm, {"x": x}, train) <= 1e-6, (shape, train)


@pytest.mark.parametrize("spelling", ["matmul", "einsum"])
@pytest.mark.parametrize(
    "args,widths,scale",
    [
        ({"heads": 6}, (24, 24), "unchanged"),
        ({"head_dim": 6}, (24, 24), "1/sqrt(4) → 1/sqrt(6); old query rows × sqrt(6/4)"),
        ({"value_dim": 6}, (16, 24), "unchanged"),
    ],
)
def test_plain_eager_attention_grows_exactly(spelling, args, widths, scale):
    torch.manual_seed(0)
    gm = gg.trace(Eager(spelling), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(**args)(gm)
    assert (result.gm.q.out_features, result.gm.v.out_features) == widths and result.gm.o.in_features == widths[1]
    assert result.targets["scale"] == scale
    _checked(result, gm)


@pytest.mark.parametrize("spelling", ["matmul", "einsum"])
def test_plain_eager_attention_saves_reloads_and_runs_on_onnxruntime(spelling, tmp_path):
    torch.manual_seed(0)
    gm = gg.trace(Eager(spelling), input_shape=(1, 5, 16))
    grown = gg.get_pass("grow_heads")(heads=6)(gm).gm
    gg.save_model(grown, tmp_path / "m.pt")
    loaded = gg.load_model(tmp_path / "m.pt").module
    x = torch.randn(2, 6, 16)
    assert torch.equal(loaded.eval()(x), grown.eval()(x))
    assert_onnx_agrees(grown, "x:1x5x16", tmp_path / "m.onnx")


def test_fused_projection_with_a_literal_divisor_grows_its_head_size():
    torch.manual_seed(0)
    gm = gg.trace(FusedDivided(), input_shape=(1, 5, 8))
    result = gg.get_pass("grow_heads")(head_dim=6)(gm)
    assert result.targets["scale"].startswith("1/sqrt(4) → 1/sqrt(6)") and result.gm.qkv.out_features == 36
    _checked(result, gm, ((3, 7, 8),))


@pytest.mark.parametrize("spelling", ["matmul", "einsum"])
def test_a_bias_per_head_computed_in_the_forward_gives_new_heads_copies(spelling):
    """ALiBi-like slopes computed in the forward (was refused: 'a mask or bias per head (4, 1, 1) … new heads have
    none'): new heads read a copy of old heads' slopes (tests/test_heads_bias_copy.py)."""
    torch.manual_seed(0)
    gm = gg.trace(Eager(spelling, per_head_bias=True), input_shape=(1, 5, 16))
    result = gg.get_pass("grow_heads")(heads=6)(gm)
    assert result.gm.o.in_features == 24
    _checked(result, gm)


@pytest.mark.parametrize(
    "model,args,why",
    [
        (WeightsReturned("matmul"), {}, r"holds the attention weights of 'matmul_1' and is also read by 'output'"),
        (SoftmaxClassifier(), {}, "no scaled_dot_product_attention and no softmax between two matrix products"),
    ],
)
def test_refusals_say_why(model, args, why):
    gm = gg.trace(model, input_shape=(1, 5, 16))
    with pytest.raises(gg.NotApplicable, match=why):
        gg.get_pass("grow_heads")(**args)(gm)


def _hf(arch: str):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=50, max_position_embeddings=16, use_cache=False, attn_implementation="eager")
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0, **common)
        return tf.GPT2LMHeadModel(cfg)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, **common)
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small))
    cfg = tf.Gemma2Config(num_key_value_heads=2, head_dim=4, sliding_window=8, **small)
    assert cfg.attn_logit_softcapping  # Gemma2 caps its attention scores: tanh(x / cap) · cap
    return tf.Gemma2ForCausalLM(cfg)


@pytest.mark.slow  # three Hugging Face captures (~12 s): make test runs them, not the edit loop
@pytest.mark.parametrize(
    "arch,args,heads",
    [
        ("llama", {"heads": 6}, "4 → 6"),  # grouped-query: 2 key/value heads → 3
        ("gpt2", {"head_dim": 12}, "2 (kept)"),  # fused c_attn; the scale constant moves to 1/sqrt(12)
        ("gemma2", {"heads": 6}, "4 → 6"),  # soft-capped scores, a scale of its own (query_pre_attn_scalar)
    ],
)
def test_hugging_face_eager_attention_grows_exactly(arch, args, heads):
    model = _hf(arch)
    assert model.config._attn_implementation == "eager"
    spec = "input_ids:1x8:int64"
    gm = gg.trace(model, input_shape=parse_spec(spec))
    assert not any(getattr(n.target, "__name__", "") == "scaled_dot_product_attention" for n in gm.graph.nodes)
    result = gg.get_pass("grow_heads")(**args)(gm)
    assert result.targets["heads"] == heads
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    for length, batch in ((8, 2), (5, 3)):
        inputs = spec_inputs(model, parse_spec(spec.replace("1x8:", f"1x{length}:")), seed=batch, batch=batch)
        for train in (False, True):
            assert _same_function(gm, result.gm, inputs, train) <= 1e-6, (arch, length, batch, train)
    if arch == "gpt2":
        assert result.targets["scale"] == "1/sqrt(8) → 1/sqrt(12); old query rows × sqrt(12/8)"


# --- Gemma's RMSNorm, x · (1 + weight) (issue 39): captured as an nn.RMSNorm, so grow_hidden follows the stream ------


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm arithmetic under another name: the weight stores the scale's offset from 1."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class OffsetNormStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.final = nn.Embedding(50, 16), OffsetRMSNorm(16), OffsetRMSNorm(16)
        self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 50)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.head(self.final(h))


def test_an_rms_norm_scaling_by_one_plus_its_weight_grows_with_the_stream():
    from graphgrow.jobs.native import _class_layout

    torch.manual_seed(0)
    model = OffsetNormStack()
    gm = gg.trace(model, "input_ids:1x6:int64")
    assert isinstance(gm.norm, nn.RMSNorm) and torch.equal(gm.norm.weight, 1 + model.norm.weight.detach())
    assert gm.meta["graphgrow"]["trace"]["standins"] == {"norm": "RMSNorm", "final": "RMSNorm"}
    result = gg.get_pass("grow_hidden")(to=24)(gm)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and not checked.dead and result.gm.norm.normalized_shape == (24,)
    # back in the class's own layout (as_native): the offset w = weight - 1 (the grown weight is rescaled: the RMS
    # runs over more coordinates)
    assert torch.allclose(_class_layout(gm, model)["norm.weight"], model.norm.weight.detach())
    assert torch.equal(_class_layout(result.gm, model)["final.weight"], result.gm.final.weight.detach() - 1)
