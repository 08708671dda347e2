"""grow_hidden: a transformer's hidden (residual-stream) size grown exactly (issue 23, item 1).

Pre-norm streams by increments that are no integer factor (GPT-2 with tied embeddings, LLaMA with RMSNorm, RoPE,
grouped-query attention and SwiGLU, a timm ViT with its class token and position embedding, nn.TransformerEncoder
with norm_first=True whose head reads the raw stream); post-norm streams (BERT, norm_first=False) by an integer
factor, other sizes refused with the reason. Exact in eval and train mode at two batch sizes and two sequence
lengths, every grown parameter learning; the grown GPT-2 on onnxruntime; the CLI on an `hf:` LLaMA, 64 → 96.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import LLAMA, assert_onnx_agrees
from test_hf_pass_matrix import _same_function, build
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec, spec_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# architecture → (pass arguments, the hidden size before → after)
ARCHS = {
    "gpt2": ({"to": 21}, 16, 21),
    "llama": ({"by": 8}, 16, 24),
    "bert": ({}, 16, 32),
    "post_norm_encoder": ({"to": 48}, 16, 48),
    "pre_norm_encoder": ({"by": 3}, 16, 19),
    "timm_vit": ({"to": 45}, 32, 45),
}
_GROWN: dict[str, tuple] = {}


class Encoder(nn.Module):
    """Embedding → nn.TransformerEncoder (batch_first, pre- or post-norm, no final norm) → a per-token Linear."""

    def __init__(self, norm_first: bool, vocab: int = 50, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d, 2, dim_feedforward=32, dropout=0.1, batch_first=True, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 5)

    def forward(self, input_ids):
        return self.head(self.encoder(self.embed(input_ids)))


def _build(arch: str) -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    if arch.endswith("_norm_encoder"):
        return Encoder(norm_first=arch.startswith("pre")), "input_ids:1x8:int64"
    if arch != "timm_vit":
        return build(arch)
    timm = pytest.importorskip("timm")
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=32,
        num_heads=2,
        num_classes=3,
    )
    return model, "x:1x3x32x32"


def traced(arch: str):
    model, spec = _build(arch)
    return model, spec, gg.trace(model, input_shape=parse_spec(spec))


def grown(arch: str):
    """(model, spec, traced graph, PassResult of grow_hidden), once per architecture."""
    if arch not in _GROWN:
        model, spec, gm = traced(arch)
        _GROWN[arch] = (model, spec, gm, gg.get_pass("grow_hidden")(**ARCHS[arch][0])(gm))
    return _GROWN[arch]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_exact_in_both_modes_and_learning(arch):
    model, spec, gm, result = grown(arch)
    _, old, new = ARCHS[arch]
    assert result.targets["hidden"].startswith(f"{old} → {new}")
    checked = result.preservation
    assert checked.eval.ok and checked.train.ok and checked.trainable and not checked.dead
    lengths = (8, 5) if "1x8:" in spec else (None,)  # an image's token count is fixed
    for length in lengths:
        s = parse_spec(spec.replace("1x8:", f"1x{length}:") if length else spec)
        for batch in (2, 3):
            inputs = spec_inputs(model, s, seed=batch, batch=batch)
            for train in (False, True):
                assert _same_function(gm, result.gm, inputs, train) <= 1e-6, (arch, length, batch, train)


def test_heads_stay_and_the_stream_grows_everywhere():
    _, _, _, result = grown("llama")
    layer = result.gm.get_submodule("model.layers.0")
    attn, mlp = layer.self_attn, layer.mlp
    assert (attn.q_proj.in_features, attn.q_proj.out_features) == (24, 16)  # 4 heads × head_dim 4, as before
    assert (attn.k_proj.in_features, attn.k_proj.out_features) == (24, 8)  # 2 key/value heads (GQA), as before
    assert (attn.o_proj.in_features, attn.o_proj.out_features) == (16, 24)
    assert mlp.gate_proj.in_features == mlp.up_proj.in_features == 24 and mlp.down_proj.out_features == 24
    assert result.gm.model.embed_tokens.weight.shape == (50, 24) and result.gm.lm_head.in_features == 24
    norm = result.gm.model.norm
    assert isinstance(norm, nn.RMSNorm) and norm.normalized_shape == (24,) and norm.eps == pytest.approx(1e-6 * 16 / 24)
    assert not result.gm.model.embed_tokens.weight[:, 16:].any()  # an RMSNorm stream: new coordinates start at zero
    assert "zero" in result.targets["rule"] and "mean" not in result.targets["rule"]


def test_tied_embeddings_grow_once():
    _, _, _, result = grown("gpt2")
    gm = result.gm
    assert gm.lm_head.weight is gm.transformer.wte.weight and gm.lm_head.weight.shape == (50, 21)
    wte = gm.transformer.wte.weight
    assert torch.allclose(wte[:, 16:], wte[:, :16].mean(1, keepdim=True).expand(-1, 5))  # a LayerNorm stream: the mean
    ln = gm.transformer.ln_f
    assert ln.normalized_shape == (21,) and ln.eps == pytest.approx(1e-5 * 16 / 21) and not ln.bias[16:].any()


class TiedHeadBehindABiaslessNorm(nn.Module):
    """A post-norm stream whose tied LM head reads a final LayerNorm without a bias (ESMC's): the norm's γ takes the
    head's shares, and there is no β to divide."""

    def __init__(self):
        super().__init__()
        self.embed, self.fc, self.norm = nn.Embedding(50, 16), nn.Linear(16, 16), nn.LayerNorm(16)
        self.final, self.head = nn.LayerNorm(16, bias=False), nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        x = self.norm(x + self.fc(x))
        return self.head(self.final(x))


def test_a_tied_head_behind_a_norm_without_bias_grows():
    torch.manual_seed(0)
    gm = gg.trace(TiedHeadBehindABiaslessNorm(), input_shape=parse_spec("ids:1x4:int64"))
    result = gg.get_pass("grow_hidden")(to=32)(gm)  # verified exact in eval and train mode by the pass
    assert "replicated 2×" in result.targets["rule"]
    assert result.gm.final.weight.shape == (32,) and result.gm.final.bias is None
    assert result.gm.head.weight is result.gm.embed.weight


class UnusedBranchAfterTheOutput(nn.Module):
    """A branch computed after the output and never read (kept in a graph for its random draws, as CANINE's unused
    final encoder is): its norm comes last in the graph, but the stream is the one the output depends on."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Embedding(50, 16), nn.LayerNorm(16)
        self.final, self.head = nn.LayerNorm(16), nn.Linear(16, 3)
        self.unused_embed, self.unused_fc, self.unused_norm = nn.Embedding(50, 16), nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, ids):
        x = self.embed(ids)
        x = torch.sigmoid(x) + F.gelu(self.norm(x))
        out = self.head(self.final(x))
        y = self.unused_embed(ids)
        self.unused_norm(y + self.unused_fc(y))
        return out


def test_the_stream_is_the_one_the_outputs_depend_on():
    gm = gg.trace(UnusedBranchAfterTheOutput(), input_shape=parse_spec("ids:1x4:int64"), capture="fx")
    assert [n.name for n in gm.graph.nodes if n.op == "call_module"][-1] == "unused_norm"
    with pytest.raises(gg.NotApplicable, match=r"reaches 'sigmoid' \(sigmoid\)"):  # the live stream's reason
        gg.get_pass("grow_hidden")(to=32)(gm)


def test_vit_class_token_and_position_embedding_grow():
    _, _, _, result = grown("timm_vit")
    gm = result.gm
    assert gm.cls_token.shape == (1, 1, 45) and gm.pos_embed.shape == (1, 17, 45)
    assert gm.patch_embed.proj.out_channels == 45 and gm.head.in_features == 45
    assert torch.allclose(gm.pos_embed[..., 32:], gm.pos_embed[..., :32].mean(-1, keepdim=True).expand(1, 17, 13))


def test_post_norm_replicates_and_refuses_other_sizes():
    _, _, gm, result = grown("bert")
    assert "replicated 2×" in result.targets["rule"] and "post-norm" in result.targets["rule"]
    with pytest.raises(gg.NotApplicable, match=r"cannot grow the hidden size 16 → 24 exactly: .*post-norm.*to=32, 48"):
        gg.get_pass("grow_hidden")(to=24)(gm)
    with pytest.raises(gg.NotApplicable, match="does not grow it"):
        gg.get_pass("grow_hidden")(to=16)(gm)


class NoNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class NormOut(nn.Module):
    """Returns the normalised stream itself (a bare backbone's last_hidden_state)."""

    def __init__(self):
        super().__init__()
        self.embed, self.fc, self.norm = nn.Embedding(20, 8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, ids):
        x = self.embed(ids)
        return self.norm(x + self.fc(self.norm(x)))


class Gated(nn.Module):
    """An activation applied to the stream itself (`act`): a sigmoid (σ(0) ≠ 0) keeps neither a zero nor a mean
    fill; tanh and GELU (f(0) = 0) keep zeros, which the LayerNorm's input cannot have: copies only (×2)."""

    def __init__(self, act=torch.sigmoid):
        super().__init__()
        self.act = act
        self.embed, self.norm, self.head = nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, ids):
        x = self.embed(ids)
        x = self.act(x) + F.gelu(self.norm(x))
        return self.head(self.norm(x))


class RepeatsHidden(nn.Module):
    """x.repeat(1, 1, 2): the hidden coordinates copied side by side (not the tokens), read by 2·d input columns."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)).repeat(1, 1, 2))


class SphereAfterPostNorm(nn.Module):
    """A post-norm stream (only replication is exact there) projected onto the unit sphere before its head (Dory's L2
    norm): replication changes the sum of squares, so no growth is exact."""

    def __init__(self):
        super().__init__()
        from stream_spellings import SphereNorm

        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 3)
        self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.ln, self.ln2, self.sphere = nn.LayerNorm(8), nn.LayerNorm(8), SphereNorm()

    def forward(self, ids):
        x = self.ln(self.embed(ids))
        x = self.ln2(x + self.fc2(self.ln(x + self.fc(x))))
        return self.head(self.sphere(x))


@pytest.mark.parametrize(
    "model,spec,why",
    [
        (NoNorm(), (2, 8), "no LayerNorm or RMSNorm over a last dimension"),
        (SphereAfterPostNorm(), "ids:1x4:int64", r"divides by the norm of the whole vector.*a post-norm stream"),
        (RepeatsHidden(), "ids:1x4:int64", r"'repeat' \(repeat[.\w]*\), which mixes the hidden axis"),
        (NormOut(), "ids:1x4:int64", r"'norm_1' \(module norm\), which is a model output"),
        (Gated(), "ids:1x4:int64", r"reaches '\w+' \(sigmoid\), which .* the analysis does not understand"),
    ],
)
def test_refusals_say_why(model, spec, why):
    gm = gg.trace(model, input_shape=parse_spec(spec) if isinstance(spec, str) else spec)
    with pytest.raises(gg.NotApplicable, match=why):
        gg.get_pass("grow_hidden")()(gm)


def test_activations_with_f0_zero_on_the_stream_grow_by_copies():
    """tanh and GELU on the stream (one norm module called twice): new coordinates must be zero for them and the mean
    for the LayerNorm's input, so the default is ×2 by replication, exact; +50 % is refused with both reasons."""
    gm = gg.trace(Gated(torch.tanh), input_shape=parse_spec("ids:1x4:int64"))
    r = gg.get_pass("grow_hidden")()(gm)
    assert r.targets["hidden"].startswith("8 → 16") and "replicated 2×" in r.targets["rule"]
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    assert r.gm.get_submodule("norm").normalized_shape == (16,)  # the shared norm grown once
    with pytest.raises(gg.NotApplicable, match=r"8 → 12 exactly: .*elementwise activation"):
        gg.get_pass("grow_hidden")(to=12)(gm)


def test_grown_model_on_onnxruntime(tmp_path):
    _, spec, _, result = grown("gpt2")
    assert_onnx_agrees(result.gm, spec, tmp_path / "gpt2_wider.onnx")


def test_cli_grows_llama_hidden_64_to_96(runner, tmp_path):
    from graphgrow.cli import main

    pytest.importorskip("transformers")
    res = runner.invoke(
        main,
        ["mutate", LLAMA, "--pass", "grow_hidden(to=96)", "-o", str(tmp_path / "wide.pt"), "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output[-2000:]
    report = json.loads(res.output)
    [grow] = report["passes"]
    assert grow["targets"]["hidden"] == "64 → 96 (given)"
    assert report["preservation"]["eval_ok"] and report["preservation"]["train_ok"]
    wide = gg.load_model(tmp_path / "wide.pt").module
    assert (
        wide.model.embed_tokens.weight.shape == (64, 96)
        and wide.get_submodule("model.layers.1.self_attn.q_proj").out_features == 64
    )


class NamedLinear(nn.Module):
    """Layers on the stream called as F.linear(x, weight=…, bias=…), their parameters given by name (timm's BEiT
    calls its qkv projection so)."""

    def __init__(self):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 3)
        self.w_in, self.b_in = nn.Parameter(torch.randn(16, 8) * 0.3), nn.Parameter(torch.randn(16) * 0.1)
        self.w_out, self.b_out = nn.Parameter(torch.randn(8, 16) * 0.3), nn.Parameter(torch.randn(8) * 0.1)
        self.w_stem, self.b_stem = nn.Parameter(torch.randn(8, 5) * 0.3), nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x):
        x = F.linear(x, weight=self.w_stem, bias=self.b_stem)  # writes the stream
        h = F.gelu(F.linear(self.norm(x), weight=self.w_in, bias=self.b_in))
        x = x + F.linear(h, weight=self.w_out, bias=self.b_out)
        return self.head(self.norm(x))


def test_functional_linear_with_parameters_by_name_grows():
    """Its reader was an IndexError (the weight read by position), its writer's parameters left out of the growth."""
    gm = gg.trace(NamedLinear(), input_shape=(1, 4, 5))
    assert all(n.kwargs for n in gm.graph.nodes if n.target is F.linear)  # traced as written: by name
    r = gg.get_pass("grow_hidden")(to=12)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    assert r.gm.get_parameter("w_in").shape == (16, 12) and r.gm.get_parameter("w_out").shape == (12, 16)
    assert r.gm.get_parameter("b_out").shape == (12,) and r.gm.get_parameter("w_stem").shape == (12, 5)


@pytest.mark.parametrize("kind", ["gathered_bmm", "transposed_matmul", "dense_einsum", "module_list"])
def test_mixture_of_experts_grows_every_expert_and_the_router(kind):
    """Experts stacked in one parameter ([E, out, in] gathered by the routed indices and multiplied with bmm, [E, in,
    out] with index_select and `@`, every expert on every token with an einsum) or a ModuleList: the stream reaches
    each expert's input columns and output rows and the router's columns; the routing does not move."""
    from moe_models import SPEC, H, MoEBlock

    gm = gg.trace(MoEBlock(kind), input_shape=parse_spec(SPEC))
    r = gg.get_pass("grow_hidden")(by=5)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok
    assert r.gm.get_parameter("moe.router.gate.weight").shape == (4, H + 5)
    grown = {n: tuple(p.shape) for n, p in r.gm.named_parameters() if n.startswith("moe.") and "router" not in n}
    old = {n: tuple(p.shape) for n, p in gm.named_parameters() if n in grown}
    changed = {n for n in grown if grown[n] != old[n]}
    assert changed and all(sum(a != b for a, b in zip(grown[n], old[n])) == 1 and H + 5 in grown[n] for n in changed), (
        grown,
        old,
    )


class ScaledPositionTable(nn.Module):
    """CTRL's embedding: the token embedding scaled in place (`x *= sqrt(d)`) plus a position table (a buffer)
    gathered by the positions, then a pre-norm block."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.fc, self.head = (
            nn.Embedding(20, 8),
            nn.LayerNorm(8),
            nn.Linear(8, 8),
            nn.Linear(8, 3),
        )
        self.register_buffer("table", torch.randn(16, 8))

    def forward(self, ids):
        x = self.embed(ids)
        x *= 8**0.5
        x = x + self.table[torch.arange(ids.shape[1])]
        x = x + self.fc(self.norm(x))
        return self.head(self.norm(x))


def test_in_place_scale_and_a_gathered_position_table_grow():
    gm = gg.trace(ScaledPositionTable(), input_shape=parse_spec("ids:1x5:int64"))
    r = gg.get_pass("grow_hidden")(to=12)(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok
    assert tuple(r.gm.get_buffer("table").shape) == (16, 12)


@pytest.mark.parametrize("name", list(__import__("stream_spellings").spellings()))
def test_stream_ops_understood_by_what_they_compute(name):
    """In-place adds and products, dtype/shape-only readers, per-channel factors, depthwise convolutions, LayerNorms
    written by hand, expand_as (tests/stream_spellings.py), each as published models write it: captured as the
    Hugging Face models are (torch.export), grown 8 → 12 (or ×2 where a per-channel op meets a LayerNorm's input)
    and verified exactly in both modes, every new parameter learning. Each was refused before."""
    from stream_spellings import SPEC, spellings

    cls, args = spellings()[name]
    torch.manual_seed(0)
    model = cls(*args)
    leaves = ["extras"] if hasattr(model, "extras") else []
    fx = {"capture": "fx", "leaves": leaves} if name.endswith("(fx)") else {"capture": "export"}
    gm = gg.trace(model, input_shape=parse_spec(SPEC), **fx)
    r = gg.get_pass("grow_hidden")()(gm)
    assert r.preservation.eval.ok and r.preservation.train.ok and r.preservation.trainable_ok, r.preservation
    new = int(r.targets["hidden"].split("→ ")[1].split()[0])
    assert r.gm.get_submodule("head").in_features in (new, 2 * new)  # 2 stream tensors side by side: DINOv2's head


def test_a_norm_without_a_weight_grows_only_by_replication():
    """No γ absorbs the factor sqrt(d/d') a weightless norm's old outputs would change by: any size but a multiple is
    refused with that reason (the default, ×2, verifies: test_stream_ops_understood_by_what_they_compute)."""
    from stream_spellings import SPEC, WrittenNorms

    gm = gg.trace(WrittenNorms("pow"), input_shape=parse_spec(SPEC), capture="export")
    with pytest.raises(gg.NotApplicable, match=r"'\w+' is a norm without a weight.*to=16, 24"):
        gg.get_pass("grow_hidden")(to=12)(gm)


@pytest.mark.parametrize("weighted", [True, False])
def test_a_written_rms_norm_is_one_without_a_weight_only_when_nothing_scales_it(weighted):
    """x · rsqrt(mean(x²) + eps) is a norm without a weight (HRM's) unless a parameter multiplies it next (LLaMA's
    RMSNorm written out in a streamed window: reading it as weightless made deepen(block=copy) see per-channel writers
    in every layer and refuse, docs/streaming.md)."""
    from graphgrow.analysis.stream_norms import norm_of

    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

        def forward(self, x):
            h = x.float()
            y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
            return self.weight * y if weighted else y

    gm = torch.fx.symbolic_trace(Written())
    found = [n.name for n in gm.graph.nodes if norm_of(gm, n) is not None]
    assert found == ([] if weighted else ["mul"])
