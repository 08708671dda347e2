"""Capture with torch.export (issue 22): Hugging Face transformers models, token-id inputs, dict outputs.

Small configs with random weights (nothing downloaded). The captured graph must be the model in eval
and train mode (trace's fidelity check), keep torch.nn layers as call_module nodes under their paths,
and return the model's output as a dict.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from graphgrow.capture.trace import trace
from graphgrow.core.errors import InputError, TraceError
from graphgrow.graph.graph_meta import input_spec_of
from graphgrow.graph.inputs import TensorSpec, parse_spec, plain_spec, spec_inputs

tf = pytest.importorskip("transformers")


def _bert(cls=None):
    cfg = tf.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return (cls or tf.BertModel)(cfg)


def _max_error(model, gm, inputs) -> float:
    with torch.no_grad():
        ref, got = model.eval()(**inputs), gm.eval()(**inputs)
    a = [t for t in tree_flatten(ref)[0] if isinstance(t, torch.Tensor)]
    b = [t for t in tree_flatten(got)[0] if isinstance(t, torch.Tensor)]
    assert len(a) == len(b) and a
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _layer(gm, path):
    node = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == path), None)
    assert node is not None, f"{path} is not a call_module node"
    return gm.get_submodule(path)


def test_input_spec_text_and_dict():
    spec = parse_spec("input_ids:1x16:int64,attention_mask:1x16:int64")
    assert [(t.name, t.shape, t.dtype) for t in spec] == [
        ("input_ids", (1, 16), "int64"),
        ("attention_mask", (1, 16), "int64"),
    ]
    assert parse_spec({"x": (2, 3)}) == (TensorSpec("x", (2, 3), "float32"),)
    assert parse_spec({"ids": torch.zeros(1, 4, dtype=torch.long)})[0].dtype == "int64"
    with pytest.raises(InputError, match="NAME:SHAPE"):
        parse_spec("input_ids")
    with pytest.raises(InputError, match="unknown dtype"):
        parse_spec("input_ids:1x4:int7")
    with pytest.raises(InputError, match="distinct names"):
        parse_spec("a:1x4,a:1x4")


def test_token_ids_are_drawn_below_the_vocabulary():
    model = nn.Sequential(nn.Embedding(7, 4))
    x = spec_inputs(
        model, parse_spec("input_ids:2x50:int64,attention_mask:2x50:int64,token_type_ids:2x50:int64"), batch=3
    )
    assert x["input_ids"].shape == (3, 50) and x["input_ids"].dtype == torch.int64
    assert x["input_ids"].min() >= 0 and x["input_ids"].max() == 6  # the whole range is used: 150 draws of 7 values
    assert torch.equal(x["attention_mask"], torch.ones(3, 50, dtype=torch.long))
    assert x["token_type_ids"].max() <= 1


@pytest.mark.slow
def test_bert_captured_exactly_with_named_inputs():
    model = _bert()
    gm = trace(model, "input_ids:1x8:int64,attention_mask:1x8:int64")
    report = gm.meta["graphgrow"]["trace"]
    assert report["capture"] == "export" and report["fidelity"] == ["eval@2", "eval@3", "train@2", "train@3"]
    assert report["mode_switches"] > 0  # attention dropout follows the module's training flag at run time
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["input_ids", "attention_mask"]
    assert isinstance(_layer(gm, "encoder.layer.0.attention.self.query"), nn.Linear)
    assert (
        _layer(gm, "encoder.layer.0.attention.self.query").weight is model.encoder.layer[0].attention.self.query.weight
    )
    assert isinstance(_layer(gm, "embeddings.word_embeddings"), nn.Embedding)
    assert isinstance(_layer(gm, "encoder.layer.1.output.LayerNorm"), nn.LayerNorm)
    assert not any("aten" in str(n.target) for n in gm.graph.nodes)  # written as torch functions
    inputs = spec_inputs(model, parse_spec("input_ids:3x11:int64,attention_mask:3x11:int64"), seed=5)
    out = gm(**inputs)
    assert isinstance(out, dict) and set(out) == {"last_hidden_state", "pooler_output"}
    assert _max_error(model, gm, inputs) <= 1e-5  # another batch size and sequence length: dimensions stayed dynamic


@pytest.mark.slow
def test_bert_for_sequence_classification():
    model = _bert(tf.BertForSequenceClassification)
    gm = trace(model, {"input_ids": ((1, 8), "int64"), "attention_mask": ((1, 8), "int64")})
    assert isinstance(_layer(gm, "bert.encoder.layer.0.attention.self.query"), nn.Linear)
    assert isinstance(_layer(gm, "classifier"), nn.Linear)
    inputs = spec_inputs(model, parse_spec("input_ids:2x8:int64,attention_mask:2x8:int64"), seed=1)
    assert set(gm(**inputs)) == {"logits"}
    assert _max_error(model, gm, inputs) <= 1e-5


@pytest.mark.slow
def test_gpt2_lm_head():
    model = tf.GPT2LMHeadModel(
        tf.GPT2Config(
            vocab_size=100,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    gm = trace(model, "input_ids:1x8:int64")
    assert gm.meta["graphgrow"]["trace"]["capture"] == "export"
    assert isinstance(_layer(gm, "transformer.wte"), nn.Embedding)
    assert _layer(gm, "lm_head").weight is model.transformer.wte.weight  # tied weights stay one parameter
    inputs = spec_inputs(model, parse_spec("input_ids:2x8:int64"), seed=2)
    assert _max_error(model, gm, inputs) <= 1e-5


@pytest.mark.slow
def test_llama_causal_lm():
    cfg = tf.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    model = tf.LlamaForCausalLM(cfg)
    gm = trace(model, "input_ids:1x8:int64")
    for path in (
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.k_proj",
        "lm_head",
    ):
        assert isinstance(_layer(gm, path), nn.Linear)
    inputs = spec_inputs(model, parse_spec("input_ids:2x8:int64"), seed=3)
    assert _max_error(model, gm, inputs) <= 1e-5


@pytest.mark.slow
def test_vit_falls_back_from_fx_to_export():
    cfg = tf.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    model = tf.ViTForImageClassification(cfg)
    gm = trace(model, (1, 3, 16, 16))
    report = gm.meta["graphgrow"]["trace"]
    assert report["capture"] == "export" and "symbolic tracing failed" in report["notes"][0]
    assert input_spec_of(gm) == plain_spec(
        [1, 3, 16, 16], "pixel_values"
    )  # still a bare shape, named as the forward's input
    assert isinstance(_layer(gm, "vit.embeddings.patch_embeddings.projection"), nn.Conv2d)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert (model.eval()(x).logits - gm.eval()(x)["logits"]).abs().max() <= 1e-5


def test_capture_choice_is_reported_and_checked():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert trace(model, (1, 4)).meta["graphgrow"]["trace"]["capture"] == "fx"
    gm = trace(model, (1, 4), capture="export")
    assert gm.meta["graphgrow"]["trace"]["capture"] == "export"
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1", "2"]
    x = torch.randn(3, 4)
    assert torch.allclose(gm(x), model(x))
    with pytest.raises(InputError, match="capture must be"):
        trace(model, (1, 4), capture="jit")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="needs an example input"):
        trace(model, capture="export")


@pytest.mark.slow
def test_passes_grow_a_captured_bert_verified():
    """The captured graph is one graphgrow's passes grow: verified at two batch sizes, in eval and train mode,
    on named token-id inputs (verification draws them from the stored input spec)."""
    from graphgrow.jobs.pipeline import Pipeline

    model = _bert(tf.BertForSequenceClassification)
    gm = trace(model, "input_ids:1x8:int64,attention_mask:1x8:int64")
    result = Pipeline.from_spec(
        "grow_width(target=bert.encoder.layer.0.intermediate.dense),"
        "insert_adapter(after=bert.encoder.layer.1.intermediate.dense)"
    ).run(gm)
    widen, adapter = result.results
    assert (
        widen.params_after - widen.params_before == 2 * 64 * 32 + 64
    )  # 64 new hidden units: in-weights, biases, out-weights
    assert "bert.encoder.layer.0.output.dense" in widen.targets["rebuilt"]
    for r in (widen, adapter):
        assert r.preservation.eval.max_abs_err <= 1e-6 and r.preservation.train.max_abs_err <= 1e-6
        assert r.preservation.trainable and not r.preservation.dead
    grown = result.gm
    assert grown.get_submodule("bert.encoder.layer.0.intermediate.dense").out_features == 128
    inputs = spec_inputs(model, parse_spec("input_ids:3x8:int64,attention_mask:3x8:int64"), seed=9)
    assert _max_error(model, grown, inputs) <= 1e-5


def _drop_path_fn(x, p, training):  # Hugging Face's / timm's spelling: a function told the mode
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    r = keep + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
    r.floor_()
    return x.div(keep) * r


class _DropPathFn(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return _drop_path_fn(x, self.p, self.training)


class _DropPathBranch(nn.Module):  # a branch on self.training, the mask drawn in place
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training:
            return x
        return x * x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - self.p) / (1 - self.p)


class _DropPathNet(nn.Module):
    """Token ids through two residual MLP blocks, a layer scale beside each drop-path (BEiT's layout)."""

    def __init__(self, drop: type[nn.Module]):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.up = nn.ModuleList([nn.Linear(16, 32) for _ in range(2)])
        self.down = nn.ModuleList([nn.Linear(32, 16) for _ in range(2)])
        self.scale = nn.Parameter(torch.full((16,), 0.5))
        self.drop_path = nn.ModuleList([drop(0.2), drop(0.3)])
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for up, down, dp in zip(self.up, self.down, self.drop_path):
            h = h + dp(self.scale * down(torch.relu(up(h))))
        return self.head(h)


@pytest.mark.parametrize("drop", [_DropPathFn, _DropPathBranch])
def test_work_of_one_mode_becomes_a_mode_switch(drop, tmp_path):
    """torch.export gives eval mode the identity and train mode a random draw for drop-path: the run that differs
    becomes a mode switch under the drop-path module (not the layer scale beside it), its draw on the input's
    device; the graph is the model in both modes (trace's check), grows with grow_width and is read back."""
    import graphgrow as gg
    from graphgrow.io.load import load_model
    from graphgrow.jobs.pipeline import Pipeline

    torch.manual_seed(0)
    model = _DropPathNet(drop)
    gm = trace(model, "input_ids:1x8:int64", capture="export")
    assert gm.meta["graphgrow"]["trace"]["merged_blocks"] == [
        "drop_path.0.mode_switch_0",
        "drop_path.1.mode_switch_0",
    ]
    eval_body, train_body = gm.get_submodule("drop_path.0.mode_switch_0").bodies()
    assert [n.op for n in eval_body.graph.nodes if n.op != "placeholder"] == ["output"]  # the identity
    assert "device(type=" not in train_body.code and "scale" not in train_body.code
    x = spec_inputs(model, parse_spec("input_ids:3x8:int64"), seed=1)
    torch.manual_seed(2)
    a = model.train()(**x)
    torch.manual_seed(2)
    assert torch.equal(gm.train()(**x), a) and not torch.equal(gm.eval()(**x), a)
    grown = Pipeline.from_spec("grow_width(target=up.0)").run(gm).results[0]
    assert grown.preservation.train.max_abs_err <= 1e-6 and grown.preservation.eval.max_abs_err <= 1e-6
    back = load_model(gg.save_model(gm, tmp_path / "m.pt")).module  # no trust needed
    torch.manual_seed(2)
    assert torch.equal(back.train()(**x), a)


class _NoGradBuckets(nn.Module):
    """Relative-position buckets computed under torch.no_grad() (CPM-Ant's spelling), then used with gradients."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids):
        with torch.no_grad():
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)
            bucket = (pos[:, None] - pos[None, :]).abs().clamp(max=7) * self.scale[0]
        return self.head(self.emb(input_ids) + bucket.mean(-1)[None, :, None])


def test_a_no_grad_block_is_inlined_with_its_outputs_detached():
    torch.manual_seed(0)
    model = _NoGradBuckets()
    gm = trace(model, "input_ids:1x8:int64", capture="export")  # was: 'submod_1 references nonexistent attribute'
    x = spec_inputs(model, parse_spec("input_ids:2x8:int64"), seed=1)
    assert torch.equal(gm(**x), model(**x)) and ".detach()" in gm.code
    gm(**x).sum().backward()
    assert gm.scale.grad is None and gm.head.weight.grad is not None  # no gradient through the block, as in eager


def test_the_cache_is_off_in_every_config_the_model_holds():
    """A vision-language model's language model reads its own config's use_cache (Gemma 3, GOT-OCR2): with only
    the top config's off, its output held a DynamicCache and torch.export refused it ('Found DynamicCache in
    output'). Every config the modules hold is off while capturing, and given back after."""
    from types import SimpleNamespace

    from graphgrow.capture.export_capture import _cache_off

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    model.config = SimpleNamespace(use_cache=False)
    text = model[1].config = SimpleNamespace(use_cache=True)
    model[1][0].config = text  # one config held by two modules
    notes: list[str] = []
    with _cache_off(model, notes):
        assert text.use_cache is False and model.config.use_cache is False
    assert text.use_cache is True and model.config.use_cache is False and len(notes) == 1


def test_a_model_that_changes_itself_on_its_first_call_is_captured_as_changed():
    """BigBird swaps its block-sparse attention for full attention on a short input, building the new module (from
    the random generator) in its first forward. Built during the capture it failed (or shifted the fidelity check's
    dropout masks); one eval-mode run before the capture settles it."""
    from graphgrow.capture.export_capture import capture_by_export

    class SelfChanging(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drop, self.kind = nn.Linear(4, 4), nn.Dropout(0.5), "sparse"

        def forward(self, x):
            if self.kind == "sparse":
                self.kind = "full"
                fresh = nn.Linear(4, 4)
                fresh.weight, fresh.bias = self.lin.weight, self.lin.bias
                self.lin = fresh
            return self.drop(self.lin(x))

    model = SelfChanging()
    gm = capture_by_export(model, parse_spec("x:1x4:float32"), True, [])  # True: the fidelity check in both modes
    assert model.kind == "full"
    x = torch.randn(3, 4)
    assert torch.allclose(gm.eval()(x=x), model.eval()(x), atol=1e-6)


def test_an_unused_random_draw_before_a_used_one_is_kept():
    """CanineForSequenceClassification classifies from the pooled token; its final character encoder's output is
    unused, but its dropouts draw before the classifier's. Dropped as dead code, they shifted the classifier's
    dropout mask in train mode (the fidelity check failed); kept, the graph draws as the model does."""
    from graphgrow.capture.export_capture import capture_by_export

    class DeadDraw(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.unused, self.used = nn.Linear(4, 4), nn.Dropout(0.5), nn.Dropout(0.5)

        def forward(self, x):
            self.unused(self.lin(x))  # a head nobody reads, drawing first
            return self.used(x)

    gm = capture_by_export(DeadDraw(), parse_spec("x:1x4:float32"), True, [])  # True: checked in train mode too
    modules = dict(gm.named_modules())
    draws = [
        n
        for n in gm.graph.nodes
        if isinstance(modules.get(str(n.target)), nn.Dropout) or "dropout" in getattr(n.target, "__name__", "")
    ]
    assert len(draws) == 2 and "lin" in [n.target for n in gm.graph.nodes]


@pytest.mark.parametrize("copied", [True, False])
def test_a_model_that_writes_its_weights_in_train_mode_is_refused_with_that_reason(copied, monkeypatch):
    """Gemma 3n's AltUp clamps its coefficient weights in place in train mode (weight.data.clamp_ to ±120, which
    random weights never reach): torch.export said 'a fake tensor in the exported program constant's list'. The
    refusal names the weights the forward writes, whether their values change or not, and not batch norm's running
    statistics (updated in place, which the export holds); the weights are put back where the state was small
    enough to copy (Gemma 3n's 300 M parameters are not)."""
    from graphgrow.capture import self_writes
    from graphgrow.capture.export_capture import capture_by_export

    monkeypatch.setattr(self_writes, "MAX_ELEMENTS", 1 << 26 if copied else 0)

    class Clamping(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.coefs, self.other = nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            if self.training:
                self.coefs.weight.data.clamp_(-0.01, 0.01)
                self.other.weight.data.clamp_(-120, 120)
            return self.other(self.coefs(self.norm(x)))

    model = Clamping()
    weight = model.coefs.weight.detach().clone()
    assert self_writes.written_state(model, {"x": torch.randn(3, 4)}) == ["coefs.weight", "other.weight"]
    model.coefs.weight.data.copy_(weight)
    with pytest.raises(TraceError, match="in train mode: its forward writes its own state, 'coefs.weight' and 1 more"):
        capture_by_export(model, parse_spec("x:2x4:float32"), True, [])
    assert torch.equal(model.coefs.weight, weight) == copied
