"""upcycle: a dense transformer's MLPs become mixtures of experts whose experts start as copies, exactly (issue 44).

The full check on a plain nn.Module transformer written here (fast) and on LLaMA and GPT-2 built from tiny Hugging
Face configs (slow: ONNX export): the pass's own verification (eval and train mode, every new parameter learning),
the same function again on other inputs, the file saved and read back, and the export on onnxruntime. Also: how the
experts diverge (the router's gradient is zero at insertion, the experts' is not and differs per expert), `at=`,
refusals with their reasons, and bad arguments refused when the spec is parsed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_onnx_agrees, small_cnn
from test_hf_pass_matrix import _same_function, build
from torch import nn

import graphgrow as gg
from graphgrow.core.state import dropout_off
from graphgrow.graph.inputs import parse_spec, spec_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPEC = "input_ids:1x8:int64"


class Block(nn.Module):
    """A pre-norm block: causal self-attention written with F.scaled_dot_product_attention, a GELU MLP with dropout."""

    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


_TRACED: dict[str, tuple[nn.Module, torch.fx.GraphModule]] = {}


def traced(arch: str):
    """(model, graph), traced once per architecture."""
    if arch not in _TRACED:
        if arch == "plain":
            torch.manual_seed(0)
            model = TinyLM()
        elif arch in ("llama", "mistral"):  # 2 layers: as_native's Mixtral has a mixture in each
            model = _moe_family(arch)
        else:
            model, spec = build(arch)
            assert spec == SPEC
        _TRACED[arch] = (model, gg.trace(model, input_shape=parse_spec(SPEC)))
    return _TRACED[arch]


def full_check(arch: str, tmp_path, onnx: bool) -> gg.PassResult:
    model, gm = traced(arch)
    result = gg.get_pass("upcycle")(experts=4, top_k=2)(gm)
    p = result.preservation
    assert p.eval.ok and p.train.ok and p.eval.max_abs_ref > 0 and p.trainable_ok and not p.dead
    routers = [n for n in p.trainable if n.endswith("router.weight")]
    copies = [n for n in p.trainable if ".expert" in n]
    assert routers and len(copies) >= 3 * 2 * len(routers)  # ≥ 2 layers in each of 3 copies per MLP
    for batch in (2, 3):  # again, independently: other inputs, both modes
        inputs = spec_inputs(model, parse_spec(SPEC), seed=batch + 10, batch=batch)
        for train in (False, True):
            assert _same_function(gm, result.gm, inputs, train) <= 1e-5, (arch, batch, train)
    gg.save_model(result.gm, tmp_path / "moe.pt")
    back = gg.load_model(tmp_path / "moe.pt").module
    x = spec_inputs(model, parse_spec(SPEC), seed=1, batch=2)
    assert _same_function(result.gm, back, x, train=False) == 0.0
    if onnx:
        assert_onnx_agrees(result.gm, SPEC, tmp_path / "moe.onnx")
    return result


@pytest.mark.slow  # several seconds: the pass's own check, two more comparisons, a file written and read
def test_plain_transformer_upcycles_exactly_saves_and_reloads(tmp_path):
    result = full_check("plain", tmp_path, onnx=False)
    assert result.targets["mlps"] == "blocks.0.mlp (2 Linear layers), blocks.1.mlp (2 Linear layers)"
    assert any("dropout inside an MLP" in n for n in result.notes)  # its own mask per expert: said
    gm = result.gm
    for e in (1, 2, 3):  # the copies are exact, on their own storage
        a, b = gm.get_parameter("blocks.0.mlp.0.weight"), gm.get_parameter(f"upcycle_blocks_0_mlp.expert{e}.0.weight")
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert gm.get_submodule("upcycle_blocks_0_mlp.router").bias is None


@pytest.mark.slow
def test_plain_transformer_on_onnxruntime(tmp_path):
    _, gm = traced("plain")
    assert_onnx_agrees(gg.get_pass("upcycle")(experts=3, top_k=3)(gm).gm, SPEC, tmp_path / "moe.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hugging_face_families_upcycle_with_the_full_check(arch, tmp_path):
    result = full_check(arch, tmp_path, onnx=True)
    layers = "3 Linear layers" if arch == "llama" else "2 Linear layers"  # gate/up/down; GPT-2's c_fc/c_proj
    assert result.targets["mlps"].endswith(f"mlp ({layers})")
    if arch == "gpt2":  # no mixture-of-experts class of its own: said, and the GraphModule is what there is
        with pytest.raises(gg.NotApplicable, match=r"GPT2LMHeadModel \(gpt2\) has no mixture-of-experts class"):
            gg.as_native(result.gm, traced(arch)[0])


def test_experts_diverge_through_routing_and_the_router_learns_a_step_later():
    """At insertion the router's gradient is zero (the chosen weights sum to one and the experts are equal, up to
    rounding); each copy gets the gradient of its own tokens, so the copies differ after one step, and then the router
    has a gradient."""
    model, gm = traced("plain")
    moe = gg.get_pass("upcycle")(experts=4, top_k=2, at="blocks.0")(gm).gm.train()
    x = spec_inputs(model, parse_spec(SPEC), seed=3, batch=4)
    opt = torch.optim.SGD(moe.parameters(), lr=0.5)
    grads = []
    for _ in range(2):
        opt.zero_grad()
        with dropout_off(moe):  # dropout in each expert draws its own mask: the copies would differ at once
            moe(**x).square().mean().backward()
        router = moe.get_parameter("upcycle_blocks_0_mlp.router.weight").grad
        experts = [moe.get_parameter("blocks.0.mlp.3.weight").grad] + [
            moe.get_parameter(f"upcycle_blocks_0_mlp.expert{e}.3.weight").grad for e in (1, 2, 3)
        ]
        grads.append((router.abs().max().item(), experts))
        opt.step()
    (router0, experts0), (router1, _) = grads
    scale = max(g.abs().max().item() for g in experts0)
    assert router0 <= 1e-6 * scale  # zero in exact arithmetic
    assert sum(g.abs().sum().item() > 0 for g in experts0) >= 2  # several experts chosen by some token
    assert not torch.allclose(experts0[0], experts0[1])  # each from its own tokens
    assert router1 > 1e-4 * scale


def test_at_upcycles_one_mlp_and_names_the_others_when_it_matches_none():
    _, gm = traced("plain")
    pass_ = gg.get_pass("upcycle")
    assert [c.args["at"] for c in pass_().candidates(gm)] == ["blocks.0.mlp", "blocks.1.mlp"]
    result = pass_(experts=2, top_k=2, at="blocks.1")(gm)
    assert result.targets["mlps"] == "blocks.1.mlp (2 Linear layers)" and result.targets["chosen"] == "given"
    with pytest.raises(gg.NotApplicable, match=r"no MLP at 'blocks\.7'.*blocks\.0\.mlp, blocks\.1\.mlp"):
        pass_(at="blocks.7")(gm)


class LeakyMlp(nn.Module):
    """An MLP whose hidden activation is also read by the head: not a function of its input alone to copy."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.aux = nn.LayerNorm(d), nn.Linear(d, 16), nn.Linear(16, d), nn.Linear(16, 2)

    def forward(self, x):
        h = F.relu(self.fc1(self.norm(x)))
        return x + self.fc2(h), self.aux(h)


def test_refusals_say_why():
    upcycle = gg.get_pass("upcycle")
    with pytest.raises(gg.NotApplicable, match="no transformer MLP found"):
        upcycle()(gg.trace(small_cnn(8).eval(), (2, 3, 16, 16)))
    with pytest.raises(gg.NotApplicable, match=r"inner value '\w+' is also read outside it"):
        upcycle()(gg.trace(LeakyMlp(), (2, 5, 8)))
    short = gg.trace(TinyLM(layers=1), input_shape=parse_spec("input_ids:1x2:int64"))  # 4 × 2 tokens to route
    with pytest.raises(
        gg.NotApplicable,
        match=r"no token that the output reads chooses expert\(s\) .* of 64 \(8 of the example input's 8 tokens",
    ):
        upcycle(experts=64, top_k=2)(short)
    _, gm = traced("plain")
    once = upcycle(experts=2, top_k=2, at="blocks.0.mlp")(gm).gm
    with pytest.raises(gg.NotApplicable, match=r"no MLP at 'blocks.0.mlp'; .* already a mixture of experts"):
        upcycle(at="blocks.0.mlp")(once)  # already a mixture: not offered again
    again = upcycle(experts=2, top_k=2)(once)  # the default takes the MLP still dense, and says what it left
    assert again.targets["mlps"] == "blocks.1.mlp (2 Linear layers)"
    assert "blocks.0.mlp' is already a mixture of experts" in again.targets["skipped"]


@pytest.mark.parametrize(
    "spec, message, argument",
    [
        ("upcycle(experts=1)", "upcycle(experts=...) must be in [2, 64], got 1", "experts"),
        ("upcycle(experts=4,top_k=5)", "top_k=5 is more than experts=4", "top_k"),
        ("upcycle(top_k=1)", "upcycle(top_k=...) must be ≥ 2, got 1", "top_k"),
        ("upcycle(router_std=0)", "upcycle(router_std=...) must be in (0, 1], got 0", "router_std"),
    ],
)
def test_bad_arguments_are_spec_errors_at_parse_time(spec, message, argument):
    with pytest.raises(gg.SpecError) as e:
        gg.build_pipeline(spec)
    assert message in e.value.message and e.value.argument == argument


def _moe_family(family: str):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config, cls = (
        (tf.LlamaConfig, tf.LlamaForCausalLM) if family == "llama" else (tf.MistralConfig, tf.MistralForCausalLM)
    )
    extra = {"sliding_window": 4} if family == "mistral" else {}
    cfg = config(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        use_cache=False,
        **extra,
    )
    return cls(cfg).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_native_mixtral_from_a_dense_model_loads_and_matches(family, tmp_path):
    """as_native hands back MixtralForCausalLM: the router and experts of each layer where Mixtral keeps them, equal
    to the graph after the experts have moved apart (as training moves them: a swapped expert or router row would
    show), saved and loaded with from_pretrained, with Mixtral's load-balancing loss when training."""
    tf = pytest.importorskip("transformers")
    dense, gm = traced(family)
    moe = gg.get_pass("upcycle")(experts=4, top_k=2)(gm).gm
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    native = gg.as_native(moe, dense)
    assert type(native).__name__ == "MixtralForCausalLM"
    assert (native.config.num_local_experts, native.config.num_experts_per_tok) == (4, 2)
    with torch.no_grad():
        assert torch.allclose(native(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5)
        g = torch.Generator().manual_seed(1)
        for name, p in moe.named_parameters():  # every expert and router its own way, as after training
            if "upcycle_" in name or ".mlp." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    native = gg.as_native(moe, dense)
    with torch.no_grad():
        want = moe.eval()(input_ids=ids)["logits"]
        assert not torch.allclose(want, dense(input_ids=ids).logits, atol=1e-3)  # the experts did move
        assert torch.allclose(native(input_ids=ids).logits, want, atol=1e-5)
    native.save_pretrained(tmp_path / "moe")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    with torch.no_grad():
        assert type(back).__name__ == "MixtralForCausalLM" and torch.allclose(
            back(input_ids=ids).logits, want, atol=1e-5
        )
    out = back.train()(input_ids=ids, labels=ids, output_router_logits=True)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss) and out.aux_loss > 0


@pytest.mark.slow
def test_native_refuses_what_mixtral_cannot_hold():
    dense, gm = traced("llama")
    one = gg.get_pass("upcycle")(experts=2, top_k=2, at="model.layers.0.mlp")(gm).gm
    with pytest.raises(gg.NotApplicable, match=r"model\.layers\.1\.mlp is not upcycled"):
        gg.as_native(one, dense)
    mixed = gg.get_pass("upcycle")(experts=3, top_k=2, at="model.layers.1.mlp")(one).gm
    with pytest.raises(gg.NotApplicable, match=r"\[2, 3\] experts"):
        gg.as_native(mixed, dense)


def test_the_router_spreads_tokens_over_the_experts_when_every_token_shares_a_direction():
    """A trained norm's output has a direction every token shares: random router rows then rank the experts alike for
    every token, and experts no token chooses never train. The rows are whitened on the example input, off that
    direction: every expert is chosen, and the pass verifies on such a model (its check fails on an untrained
    expert)."""
    from graphgrow.passes.upcycle import router_rows

    g = torch.Generator().manual_seed(0)
    shared = F.normalize(torch.randn(16, generator=g), dim=0)
    seen = 0.1 * torch.randn(512, 16, generator=g) + 5 * shared
    chosen = {
        name: set(torch.topk(seen @ rows.T, 2, dim=-1).indices.flatten().tolist())
        for name, rows in (
            ("plain", router_rows(None, 16, 8, 0.02, torch.Generator().manual_seed(1))),
            ("whitened", router_rows(seen, 16, 8, 0.02, torch.Generator().manual_seed(1))),
        )
    }
    assert len(chosen["plain"]) <= 4 and chosen["whitened"] == set(range(8))
    torch.manual_seed(0)
    model = TinyLM(layers=1)
    with torch.no_grad():
        model.blocks[0].norm2.bias.copy_(5 * shared)
    result = gg.get_pass("upcycle")(experts=8, top_k=2)(gg.trace(model, input_shape=parse_spec(SPEC)))
    assert result.preservation.trainable_ok and not result.preservation.dead


@pytest.mark.slow
def test_the_measured_example_in_a_few_steps():
    """examples/upcycle_gpt.py (docs/upcycle.md's table) in a few steps: the loss is the same before and after
    upcycling, the mixture has more parameters and graph FLOPs, and its sparse cost is the dense one plus one MLP and
    the router per layer."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import upcycle_gpt

    summary = upcycle_gpt.run(pretrain=3, steps=3, experts=[4], every=3, limit=100_000, log=lambda *a: None)
    dense, moe = summary["runs"]["dense"], summary["runs"]["upcycled E=4 top-2"]
    assert abs(moe["val_after"] - moe["val_before"]) <= 1e-6 * moe["val_before"]
    assert moe["params"] > dense["params"] and moe["graph_flops_per_token"] > moe["sparse_flops_per_token"]
    d, layers = upcycle_gpt.SMALL["d"], upcycle_gpt.SMALL["layers"]
    assert moe["sparse_flops_per_token"] - dense["graph_flops_per_token"] == layers * (16 * d * d + 2 * d * 4)


@pytest.mark.slow
def test_a_dense_llama_folder_becomes_a_mixtral_folder_through_the_cli(runner, tmp_path):
    """graphgrow mutate FOLDER --pass upcycle -o OUT: a folder of MixtralForCausalLM that from_pretrained loads and
    that computes what the dense folder did."""
    tf = pytest.importorskip("transformers")
    from graphgrow.cli.commands import main

    dense = _moe_family("llama")
    dense.save_pretrained(tmp_path / "dense")
    result = runner.invoke(
        main, ["mutate", str(tmp_path / "dense"), "--pass", "upcycle(experts=4,top_k=2)", "-o", str(tmp_path / "moe")]
    )
    assert result.exit_code == 0, result.output
    moe = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == 4
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(moe(input_ids=ids).logits, dense(input_ids=ids).logits, atol=1e-5)


def test_an_mlp_written_as_f_linear_calls_gets_its_parameters_copied():
    """Layers written as F.linear(x, weight=…, bias=…) on the model's own parameters (timm's BEiT calls its projections
    so): each expert holds copies of the parameters, and the file reads back."""
    from test_grow_hidden import NamedLinear

    torch.manual_seed(0)
    result = gg.get_pass("upcycle")(experts=3, top_k=2)(gg.trace(NamedLinear(), input_shape=(1, 4, 5)))
    p = result.preservation
    assert p.eval.ok and p.train.ok and p.trainable_ok and "(2 Linear layers)" in result.targets["mlps"]
    root = result.targets["experts"].split(" copies in ")[1].split(".expert")[0]
    for e in (1, 2):
        assert torch.equal(result.gm.get_parameter(f"{root}.expert{e}.w_in"), result.gm.get_parameter("w_in"))


class LastTokenLM(TinyLM):
    """Reads the last position only (a classifier on one token): the last block's MLP matters there alone."""

    def forward(self, input_ids):
        return super().forward(input_ids)[:, -1]


def test_an_mlp_whose_output_is_read_at_few_tokens_is_left_dense_by_default_and_refused_when_named():
    """Experts are trained only by the tokens the output reads: in the last block of a model that reads one position
    (a ViT's class token, BERT's pooler), 4 example tokens do not reach all 8 experts. The default leaves that MLP dense
    and says so (verification would otherwise fail on the untrained experts); named with at=, it is refused."""
    torch.manual_seed(0)
    gm = gg.trace(LastTokenLM(), input_shape=parse_spec(SPEC))
    upcycle = gg.get_pass("upcycle")
    result = upcycle(experts=8, top_k=2)(gm)
    assert result.targets["mlps"] == "blocks.0.mlp (2 Linear layers)" and result.preservation.trainable_ok
    assert "at 'blocks.1.mlp', no token that the output reads" in result.targets["skipped"]
    assert "4 of the example input's 32 tokens reach the output from here" in result.targets["skipped"]
    with pytest.raises(gg.NotApplicable, match=r"at 'blocks\.1\.mlp', no token that the output reads chooses"):
        upcycle(experts=8, top_k=2, at="blocks.1")(gm)
