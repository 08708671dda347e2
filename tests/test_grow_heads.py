"""grow_heads: attention heads added and head sizes grown exactly (issue 23, item 2).

Heads added on GPT-2 (fused c_attn), LLaMA (RoPE, grouped-query and multi-query attention), BERT, a timm ViT (a
reshape that bakes the head count) and nn.TransformerEncoder (nn.MultiheadAttention as torch.export decomposes it);
the query/key head size grown where no rotary embedding forbids it (the 1/sqrt(d) scale explicit or SDPA's
default), the value/output head size grown under RoPE. Exact in eval and train mode at two batch sizes and two
sequence lengths, every grown parameter learning; refusals say why; a grown LLaMA on onnxruntime; the issue's
pipeline on an `hf:` LLaMA through the CLI.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import LLAMA, assert_onnx_agrees
from test_grow_hidden import _build
from test_hf_pass_matrix import _same_function
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec, spec_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# case → (architecture, pass arguments)
CASES = {
    "gpt2_heads": ("gpt2", {"heads": 3}),
    "gpt2_head_dim": ("gpt2", {"head_dim": 12}),  # fused q/k/v: the value size grows with it; explicit scale
    "llama_heads_gqa": ("llama", {"heads": 6}),  # 2 key/value heads → 3
    "llama_value_dim_rope": ("llama", {"value_dim": 6}),
    "bert_all": ("bert", {"by": 2, "head_dim": 10, "value_dim": 12}),
    "vit_heads_head_dim": ("timm_vit", {"heads": 3, "head_dim": 24}),  # SDPA's default scale
    "encoder_heads": ("pre_norm_encoder", {"heads": 4}),
    "post_norm_encoder_head_dim": ("post_norm_encoder", {"head_dim": 12}),
}
_TRACED: dict[str, tuple] = {}
_GROWN: dict[str, tuple] = {}


def traced(arch: str):
    if arch not in _TRACED:
        model, spec = _build(arch)
        _TRACED[arch] = (model, spec, gg.trace(model, input_shape=parse_spec(spec)))
    return _TRACED[arch]


def grown(case: str):
    if case not in _GROWN:
        arch, args = CASES[case]
        model, spec, gm = traced(arch)
        _GROWN[case] = (model, spec, gm, gg.get_pass("grow_heads")(**args)(gm))
    return _GROWN[case]


@pytest.mark.parametrize("case", list(CASES))
def test_exact_in_both_modes_and_learning(case):
    model, spec, gm, result = grown(case)
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    assert result.params_after > result.params_before
    lengths = (8, 5) if "1x8:" in spec else (None,)  # an image's token count is fixed
    for length in lengths:
        s = parse_spec(spec.replace("1x8:", f"1x{length}:") if length else spec)
        for batch in (2, 3):
            inputs = spec_inputs(model, s, seed=batch, batch=batch)
            for train in (False, True):
                assert _same_function(gm, result.gm, inputs, train) <= 1e-6, (case, length, batch, train)


def test_grouped_query_heads_keep_their_ratio():
    _, _, _, result = grown("llama_heads_gqa")
    attn = result.gm.get_submodule("model.layers.0.self_attn")
    assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features) == (24, 12, 12)
    assert attn.o_proj.in_features == 24 and result.targets["kv_heads"].startswith("2 → 3")
    assert not attn.o_proj.weight[:, 16:].any() and attn.o_proj.weight[:, :16].abs().min() > 0  # zero last factor
    assert attn.q_proj.weight[16:].abs().min() > 0 and attn.k_proj.weight[8:].abs().min() > 0  # random: symmetry broken
    expands = [
        n.args[1]
        for n in result.gm.graph.nodes
        if n.op == "call_method" and n.target == "expand" and isinstance(n.args[1], list) and len(n.args[1]) == 5
    ]
    assert expands and all(e[1:3] == [3, 2] for e in expands)  # repeat_kv: 3 key/value heads × 2


def test_head_size_keeps_every_logit():
    """New query rows zero, new key rows random; the scale moves to 1/sqrt(d') and old query rows compensate."""
    _, _, gm, result = grown("bert_all")
    old = gm.get_submodule("bert.encoder.layer.0.attention.self")
    new = result.gm.get_submodule("bert.encoder.layer.0.attention.self")
    assert (new.query.out_features, new.key.out_features, new.value.out_features) == (40, 40, 48)
    wq = new.query.weight.view(4, 10, 16)
    assert torch.allclose(wq[:2, :8], old.query.weight.view(2, 8, 16) * math.sqrt(10 / 8))
    assert not wq[:2, 8:].any() and wq[2:].abs().min() > 0  # old heads' new dims zero; new heads random
    assert new.key.weight.view(4, 10, 16)[:2, 8:].abs().min() > 0
    [sdpa] = [n for n in result.gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert sdpa.kwargs["scale"] == pytest.approx(10**-0.5)
    dense = result.gm.get_submodule("bert.encoder.layer.0.attention.output.dense")
    assert dense.in_features == 48 and not dense.weight.view(16, 4, 12)[:, :, 8:].any()


def test_fused_projections_grow_per_section():
    _, _, _, result = grown("gpt2_head_dim")
    c_attn = result.gm.get_submodule("transformer.h.0.attn.c_attn")
    assert c_attn.out_features == 3 * 2 * 12 and "value head size grew" in result.notes[0]
    [split] = [n for n in result.gm.graph.nodes if getattr(n.target, "__name__", "") == "split"]
    assert split.args[1] == 24
    _, _, _, vit = grown("vit_heads_head_dim")
    reshapes = [n.args[1:] for n in vit.gm.graph.nodes if n.op == "call_method" and n.target == "reshape"]
    assert (3, 3, 24) in [r[2:] for r in reshapes] and vit.gm.get_submodule("blocks.0.attn.proj").in_features == 72
    assert "default 1/sqrt(24)" in vit.targets["scale"]


def test_multi_query_attention_grows_its_key_value_head():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=16,
        use_cache=False,
    )
    gm = gg.trace(tf.LlamaForCausalLM(cfg), input_shape=parse_spec("input_ids:1x8:int64"))
    result = gg.get_pass("grow_heads")(heads=8)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok
    assert result.gm.get_submodule("model.layers.0.self_attn.k_proj").out_features == 8  # 1 → 2 key/value heads
    with pytest.raises(gg.NotApplicable, match=r"4 query heads share 1 key/value head \(4 each\).*heads=8, 12"):
        gg.get_pass("grow_heads")(heads=6)(gm)


def test_one_attention_at_a_time():
    _, _, gm = traced("pre_norm_encoder")
    p = gg.get_pass("grow_heads")
    listed = p().candidates(gm)
    assert [c.args.get("at") for c in listed] == [None, "encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert listed[0].default and listed[0].params == 2 * listed[1].params == 2 * (24 * 17 + 8 * 16)  # rows + columns
    result = p(heads=4, at="encoder.layers.1.self_attn")(gm)  # the two layers share a mul(batch, heads) node
    assert result.preservation.eval.ok and result.preservation.train.ok
    sizes = {path: t.shape for path, t in result.gm.named_parameters() if "in_proj_weight" in path}
    assert sizes == {
        "encoder.layers.0.self_attn.in_proj_weight": (48, 16),
        "encoder.layers.1.self_attn.in_proj_weight": (96, 16),
    }


class SdpaGQA(nn.Module):
    """Grouped-query attention left to scaled_dot_product_attention(enable_gqa=True): no repeat in the graph."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 8)

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (-1, 4)).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).flatten(2))


@pytest.mark.parametrize("args,sizes", [({"heads": 6}, (24, 12, 12)), ({"head_dim": 6}, (24, 12, 12))])
def test_sdpa_grouped_query_attention(args, sizes):
    torch.manual_seed(0)
    gm = gg.trace(SdpaGQA(), input_shape=(1, 5, 8))
    result = gg.get_pass("grow_heads")(**args)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert tuple(result.gm.get_submodule(p).out_features for p in "qkv") == sizes
    x = torch.randn(3, 7, 8)  # another batch size and sequence length
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class SingleHead(nn.Module):
    """One head (graphgrow's own deepen block picks one on a narrow stream): the merge back to (N, T, C) spelled as
    people spell it. A head axis of size 1 must stay with the features, not slide onto the tokens."""

    def __init__(self, merge: str):
        super().__init__()
        self.merge = merge
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        q, k, v = (p(x).unflatten(-1, (1, -1)).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        if self.merge == "flatten":
            a = a.flatten(2)
        elif self.merge == "flatten_negative":
            a = a.flatten(-2, -1)
        elif self.merge == "torch_flatten":
            a = torch.flatten(a, start_dim=2)
        else:
            a = a.reshape(x.size(0), x.size(1), -1)
        return self.o(a)


@pytest.mark.parametrize("merge", ["flatten", "flatten_negative", "torch_flatten", "reshape"])
@pytest.mark.parametrize("args,width", [({"heads": 2}, 16), ({"value_dim": 12}, 12)])
def test_a_single_head_grows(merge, args, width):
    torch.manual_seed(0)
    gm = gg.trace(SingleHead(merge), input_shape=(1, 5, 8))
    result = gg.get_pass("grow_heads")(**args)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert result.gm.get_submodule("v").out_features == width and result.gm.get_submodule("o").in_features == width
    x = torch.randn(3, 7, 8)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class ComputedSizes(nn.Module):
    """timm's Attention as CaiT and DaViT write it: head size C // heads and the merge back to C, both computed from
    the input's shape at run time (no constant to edit)."""

    def __init__(self, dim: int = 24, heads: int = 3):
        super().__init__()
        self.num_heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("args,width", [({"heads": 4}, 32), ({"head_dim": 12}, 36)])
def test_sizes_computed_from_the_input_become_inferred(args, width):
    torch.manual_seed(0)
    gm = gg.trace(ComputedSizes(), input_shape=(1, 5, 24))
    result = gg.get_pass("grow_heads")(**args)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert result.gm.get_submodule("proj").in_features == width
    x = torch.randn(3, 7, 24)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class QKNorm(nn.Module):
    """A LayerNorm over each head's query and key (as in ViT-22B, Qwen3), and a bias per head on the logits computed
    in the forward (ALiBi-like slopes: no parameter holds it, so new heads read copies of old heads' entries:
    tests/test_heads_bias_copy.py; a bias read from a parameter grows: tests/test_heads_tables.py)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        q, k, v = (self.norm(t(x).unflatten(-1, (2, 4)).transpose(1, 2)) for t in (self.q, self.k, self.v))
        bias = torch.arange(1, 3, dtype=x.dtype, device=x.device).view(2, 1, 1) * 0.5
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).flatten(2))


def test_heads_grow_under_a_query_key_norm_and_a_bias_per_head_computed_in_the_forward():
    torch.manual_seed(0)
    gm = gg.trace(QKNorm(), input_shape=(1, 5, 8))
    result = gg.get_pass("grow_heads")(heads=4)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    x = torch.randn(3, 7, 8)
    assert result.gm.o.in_features == 16 and torch.allclose(gm(x), result.gm(x), atol=1e-6)


@pytest.mark.parametrize(
    "model,args,why",
    [
        (Opaque(), {}, r"'attn' \(module attn\), which is an nn.MultiheadAttention kept whole"),
        (QKNorm(), {"head_dim": 8}, "normalises over a growing axis"),
    ],
)
def test_refusals_say_why(model, args, why):
    gm = gg.trace(model, input_shape=(1, 5, 8), leaves=["attn"] if isinstance(model, Opaque) else ())
    with pytest.raises(gg.NotApplicable, match=why):
        gg.get_pass("grow_heads")(**args)(gm)


@pytest.mark.parametrize(
    "args,why",
    [
        ({"head_dim": 8}, r"rotary position embedding\): its frequencies depend on the head size.*value_dim="),
        (
            {"heads": 5},
            r"4 query heads share 2 key/value heads \(2 each\); 5 query heads cannot keep that ratio.*heads=6, 8",
        ),
        ({"heads": 2}, "would remove heads"),
    ],
)
def test_llama_refusals(args, why):
    _, _, gm = traced("llama")
    with pytest.raises(gg.NotApplicable, match=why):
        gg.get_pass("grow_heads")(**args)(gm)


def test_fused_value_size_alone_is_refused():
    _, _, gm = traced("gpt2")
    with pytest.raises(gg.NotApplicable, match=r"one fused projection in equal sections.*head_dim=12"):
        gg.get_pass("grow_heads")(value_dim=12)(gm)


def test_grown_model_on_onnxruntime(tmp_path):
    _, spec, _, result = grown("llama_heads_gqa")
    assert_onnx_agrees(result.gm, spec, tmp_path / "llama_heads.onnx")


@pytest.mark.slow  # three passes and an export through the CLI: make test runs it, not the edit loop
def test_cli_grows_llama_hidden_heads_and_depth(runner, tmp_path):
    """The issue's pipeline: hidden 64 → 96, heads 4 → 6 (key/value heads 2 → 3), layers 2 → 3, then onnxruntime."""
    from graphgrow.cli import main

    pytest.importorskip("transformers")
    res = runner.invoke(
        main,
        [
            "mutate",
            LLAMA,
            "--pass",
            "grow_hidden(to=96),grow_heads(heads=6),deepen(block=transformer)",
            "-o",
            str(tmp_path / "grown.pt"),
            "--check",
            "--json",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output[-2000:]
    report = json.loads(res.output)
    hidden, heads, deepen = report["passes"]
    assert hidden["targets"]["hidden"] == "64 → 96 (given)" and heads["targets"]["heads"] == "4 → 6"
    assert heads["targets"]["kv_heads"].startswith("2 → 3") and "6 heads" in deepen["targets"]["block"]
    assert report["preservation"]["eval_ok"] and report["preservation"]["train_ok"]
    grown_model = gg.load_model(tmp_path / "grown.pt").module
    attn = grown_model.get_submodule("model.layers.1.self_attn")
    assert (attn.q_proj.in_features, attn.q_proj.out_features, attn.k_proj.out_features) == (
        96,
        96,
        48,
    )  # 6 × 16, 3 × 16
    assert attn.o_proj.in_features == 96 and grown_model.model.embed_tokens.weight.shape == (64, 96)


class BeitAttention(nn.Module):
    """timm's BEiT attention (fused path, qkv_bias=True): the projection is `F.linear(x, weight=…, bias=…)`, its
    weight and bias given by name, the bias concatenated from the query's and value's parameters and a zero key
    buffer. `own_bias`: one bias parameter instead, still passed by name, and the heads merged with -1 (BEiT's
    reshape(B, N, C) keeps the old width, which grow_heads refuses on its own)."""

    def __init__(self, own_bias: bool, dim: int = 8, num_heads: int = 2):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        if own_bias:
            self.qkv_bias = nn.Parameter(torch.randn(dim * 3) * 0.1)
        else:
            self.q_bias = nn.Parameter(torch.randn(dim) * 0.1)
            self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
            self.v_bias = nn.Parameter(torch.randn(dim) * 0.1)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        own = getattr(self, "qkv_bias", None)
        qkv_bias = own if own is not None else torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, -1 if own is not None else C)
        return self.proj(x)


def test_projection_with_weight_and_bias_by_name_grows():
    """F.linear(x, weight=…, bias=…) was an IndexError (exit 3): the analysis read them by position only."""
    torch.manual_seed(0)
    gm = gg.trace(BeitAttention(own_bias=True), input_shape=(1, 5, 8))
    result = gg.get_pass("grow_heads")(heads=3)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert result.gm.get_parameter("qkv_bias").shape == (36,) and result.gm.get_submodule("proj").in_features == 12
    x = torch.randn(3, 7, 8)
    assert torch.allclose(gm(x), result.gm(x), atol=1e-6)


def test_projection_with_a_bias_made_of_section_parameters_grows():
    """timm's BEiT (beitv2_base_patch16_224): the bias is torch.cat of q/k/v pieces (k a zero buffer); was refused
    ('takes its bias from a computed tensor'), each piece now grows per head (tests/test_heads_bias_pieces.py)."""
    torch.manual_seed(0)
    gm = gg.trace(BeitAttention(own_bias=False), input_shape=(1, 5, 8))
    result = gg.get_pass("grow_heads")(heads=3)(gm)
    assert result.preservation.eval.ok and result.preservation.train.ok and not result.preservation.dead
    assert result.gm.get_parameter("q_bias").shape == (12,) and result.gm.get_buffer("k_bias").shape == (12,)


def test_timm_beit_grows_its_heads_and_its_width():
    """Issue 39: beitv2_base_patch16_224 stopped both passes with an IndexError (exit 3) in the attention analysis;
    grow_heads then refused its qkv bias made of q/k/v parameters (grown per head now) and its reshape(B, N, 3,
    self.num_heads, -1), the head count a traced module attribute (now inferred, the head size written out), then its
    relative-position bias per head, gathered from its table by a tensor index: new heads read a copy of old heads'
    bias now (tests/test_heads_bias_copy.py)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("beitv2_base_patch16_224", depth=1, embed_dim=32, num_heads=2, img_size=32, patch_size=16)
    gm = gg.trace(model.eval(), input_shape=(1, 3, 32, 32))
    r = gg.get_pass("grow_heads")()(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and not r.preservation.dead
    assert r.targets["heads"].startswith("2 → 3")
    r = gg.get_pass("grow_width")()(gm)  # the attention analysis no longer stops it; the MLP grows
    assert r.preservation.eval.ok and r.preservation.train.ok and not r.preservation.dead
