"""deepen(block=copy) (issue 40, item 3): a copy of the model's own layer, output projections at zero, placed in its
stack so that the native config holds it. On tiny LLaMA and GPT-2 (Conv1D, biases, n_layer) the pass verifies in eval
and train mode and on onnxruntime, the zero projections learn at once, and as_native gives the same class with one
more layer that saves, loads and computes the original's logits and greedy tokens; on Qwen2 with sliding and full
layers a copy placed in the middle keeps its place and its layer type once it has learned; OPT, which the stream
analysis refuses, through its layers' branches; refusals say why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import parse_spec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SPEC = "input_ids:1x8:int64"
V = 100
_CACHE: dict[str, tuple] = {}


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    sizes = {"vocab_size": V, "use_cache": False, "bos_token_id": 1, "eos_token_id": 2}
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, **sizes)).eval()
    layers = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    if family == "qwen2":
        config = transformers.Qwen2Config(
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention"],
            **layers,
            **sizes,
        )
        return transformers.Qwen2ForCausalLM(config).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **layers, **sizes)).eval()


def traced(family: str):
    """(model, traced graph), once per family."""
    if family not in _CACHE:
        model = _model(family)
        _CACHE[family] = (model, gg.trace(model, input_shape=parse_spec(SPEC)))
    return _CACHE[family]


def grown(family: str):
    """(model, traced graph, PassResult of deepen(block=copy) at its default place), once per family."""
    key = f"{family}+copy"
    if key not in _CACHE:
        model, gm = traced(family)
        _CACHE[key] = (model, gm, gg.get_pass("deepen")(block="copy")(gm))
    return _CACHE[key]


STACK = {"llama": ("model.layers", "num_hidden_layers"), "gpt2": ("transformer.h", "n_layer")}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(STACK))
def test_the_copy_is_the_identity_learns_and_matches_on_onnxruntime(family, tmp_path):
    from graphgrow.io.export import export_onnx
    from graphgrow.io.runtime import max_ir_version, open_session
    from graphgrow.verify.equivalence import check_equivalence

    model, gm, result = grown(family)
    stack, _ = STACK[family]
    assert result.preservation.eval.ok and result.preservation.train.ok
    assert f"copy ({stack}.2) of {stack}.1, after {stack}.1" in result.targets["block"]
    assert result.gm.meta["graphgrow"]["layer_copies"] == {f"{stack}.2": f"{stack}.1"}
    source, copy = gm.get_submodule(f"{stack}.1"), result.gm.get_submodule(f"{stack}.2")
    projections = (
        {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
        if family == "llama"
        else {"attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"}
    )
    # the output projections, found through the stream's writers, are zero; every other tensor is the source layer's
    for n, p in copy.named_parameters():
        assert not p.any() if n in projections else torch.equal(p, source.get_parameter(n)), n
    assert all(source.get_parameter(n).any() for n in projections if n.endswith("weight"))  # zeroed by the copy
    learns = result.preservation.trainable
    assert {f"{stack}.2.{n}" for n, _ in copy.named_parameters()} <= set(learns)
    assert all(learns[f"{stack}.2.{n}"] == 0 for n in projections)  # the zero projections get a gradient at once
    assert not result.preservation.dead
    export_onnx(result.gm, parse_spec(SPEC), tmp_path / "deeper.onnx", max_ir_version=max_ir_version())
    report = check_equivalence(
        result.gm, open_session(tmp_path / "deeper.onnx", "cpu"), parse_spec(SPEC), raise_on_failure=True
    )
    assert report.passed


def _same_behaviour(a: nn.Module, b: nn.Module) -> None:
    """Equal logits on a left-padded batch, the same greedy tokens with the KV cache, a loss from labels."""
    x = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    with torch.no_grad():
        la = a(input_ids=x, attention_mask=mask).logits
        lb = b(input_ids=x, attention_mask=mask).logits
    assert (la - lb)[mask.bool()].abs().max().item() <= 1e-5 * max(1.0, la.abs().max().item())
    a.generation_config.use_cache = b.generation_config.use_cache = True
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert a.generate(x, attention_mask=mask, **kw).tolist() == b.generate(x, attention_mask=mask, **kw).tolist()
    assert torch.isfinite(b(input_ids=x, attention_mask=mask, labels=x).loss)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(STACK))
def test_native_has_one_more_layer_and_the_originals_behaviour(family, tmp_path):
    model, _, result = grown(family)
    stack, field = STACK[family]
    native = gg.as_native(result.gm, model)
    assert type(native) is type(model)
    assert getattr(native.config, field) == getattr(model.config, field) + 1
    assert len(native.get_submodule(stack)) == 3
    native.save_pretrained(tmp_path / "deeper")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deeper").eval()
    assert getattr(loaded.config, field) == 3
    _same_behaviour(model, loaded)


@pytest.mark.slow
def test_a_copy_in_the_middle_keeps_its_place_and_layer_type_once_it_learns():
    model, gm = traced("qwen2")
    places = gg.get_pass("deepen")(block="copy").candidates(gm)  # graphgrow targets: after each layer, or before all
    assert [c.args["after"] for c in places] == ["model.layers.1", "model.layers.0", "model_embed_tokens"]
    assert places[0].default and "a copy of model.layers.1" in places[0].where
    # a copy of the sliding layer 1 after layer 0, then a copy of that copy after it: run order 0, 2, 3, 1
    spec = "deepen(block=copy,after=model.layers.0,source=1),deepen(block=copy,after=model.layers.2)"
    deeper = gg.Pipeline.from_spec(spec).run(gm).gm
    assert deeper.meta["graphgrow"]["layer_copies"] == {
        "model.layers.2": "model.layers.1",
        "model.layers.3": "model.layers.2",
    }
    with torch.no_grad():  # as if trained: the copies now change the function, so their places and types matter
        for i in (2, 3):
            deeper.get_submodule(f"model.layers.{i}.self_attn.o_proj").weight.normal_(0, 0.2)
            deeper.get_submodule(f"model.layers.{i}.mlp.down_proj").weight.normal_(0, 0.2)
    native = gg.as_native(deeper, model)  # checked against the grown graph inside
    assert native.config.num_hidden_layers == 4
    assert native.config.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    assert torch.equal(
        native.model.layers[1].mlp.down_proj.weight, deeper.get_submodule("model.layers.2.mlp.down_proj").weight
    )
    x = torch.randint(3, V, (2, 8), generator=torch.Generator().manual_seed(3))
    deeper.eval()
    with torch.no_grad():
        want, got, old = deeper(input_ids=x)["logits"], native(input_ids=x).logits, model(input_ids=x).logits
    assert (want - got).abs().max().item() <= 1e-5 and (want - old).abs().max().item() > 1e-2


@pytest.mark.slow
def test_where_the_stream_analysis_refuses_the_branches_lead_to_the_projections():
    """OPT: the stream analysis refuses its offset position embedding; each layer's residual branches are followed
    back to their Linear (out_proj, fc2), and the stream's reshape around the MLP is passed."""
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32
    )
    model = transformers.OPTForCausalLM(config).eval()
    result = gg.get_pass("deepen")(block="copy")(gg.trace(model, input_shape=parse_spec(SPEC)))
    assert result.preservation.eval.ok and result.preservation.train.ok
    for name in ("self_attn.out_proj.weight", "self_attn.out_proj.bias", "fc2.weight", "fc2.bias"):
        assert f"model.decoder.layers.2.{name}" in result.targets["block"]
    native = gg.as_native(result.gm, model)
    assert native.config.num_hidden_layers == 3
    _same_behaviour(model, native)


@pytest.mark.slow
def test_refusals_name_why():
    deepen = gg.get_pass("deepen")
    bert, spec = _bert()
    with pytest.raises(gg.NotApplicable, match=r"bert.encoder.layer.0 is post-norm: .*LayerNorm after the residual"):
        deepen(block="copy")(gg.trace(bert, input_shape=spec))
    _, gm = traced("llama")
    with pytest.raises(gg.NotApplicable, match=r"source=5: model.layers has layers \[0, 1\]"):
        deepen(block="copy", source=5)(gm)
    first_q = next(n.name for n in gm.graph.nodes if n.target == "model.layers.0.self_attn.q_proj")
    with pytest.raises(gg.NotApplicable, match=f"'{first_q}' is not a layer's output"):
        deepen(block="copy", after=first_q)(gm)
    # a layer that depends on its index: the copy appended at the end is the identity, so the first check passes;
    # the second, with the copy's zero projections moved as training moves them, sees that layer 3 is scaled by 1/3
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=V, use_cache=False, scale_attn_by_inverse_layer_idx=True
    )
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    deeper = deepen(block="copy")(gg.trace(gpt2, input_shape=parse_spec(SPEC))).gm
    with pytest.raises(gg.NotApplicable, match="would run the copied layers otherwise than the grown graph once they"):
        gg.as_native(deeper, gpt2)


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    return transformers.BertForMaskedLM(config).eval(), parse_spec(SPEC)


def test_a_model_without_a_stack_and_contradicting_arguments_are_refused():
    net = gg.trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), input_shape=(2, 8))
    with pytest.raises(gg.NotApplicable, match="no stack of numbered layers holding the same parameters"):
        gg.get_pass("deepen")(block="copy")(net)
    with pytest.raises(gg.SpecError, match="source= names the layer block=copy copies"):
        gg.Pipeline.from_spec("deepen(source=1)")
    with pytest.raises(gg.SpecError, match="block=copy starts as the identity"):
        gg.Pipeline.from_spec("deepen(block=copy,init=gradmax)")


class Block(nn.Module):
    """A pre-norm residual MLP block, as a user writes one."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TwoStacks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList([Block() for _ in range(2)])
        self.b = nn.ModuleList([Block() for _ in range(3)])
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 5)

    def forward(self, x):
        for m in [*self.a, *self.b]:
            x = m(x)
        return self.head(self.norm(x))


def test_a_users_model_with_two_stacks_grows_the_one_named():
    torch.manual_seed(0)
    gm = gg.trace(TwoStacks(), input_shape=(2, 4, 16))
    deepen = gg.get_pass("deepen")
    default = deepen(block="copy")(gm)  # the larger stack, after its last layer
    assert default.targets["block"].startswith("copy (b.3) of b.2, after b.2: its output projections b.3.fc2.bias")
    named = deepen(block="copy", after="a.1", source=0)(gm)
    assert named.targets["block"].startswith("copy (a.2) of a.0, after a.1")
    for result in (default, named):
        assert result.preservation.eval.ok and result.preservation.train.ok
