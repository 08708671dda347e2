"""Every built-in pass at its default place, through the Python API, on the models people bring (issue 22 item 6).

Hugging Face transformers models from small configs with random weights (GPT-2, LLaMA with RoPE, RMSNorm,
grouped-query attention and SwiGLU, BERT, a BART encoder-decoder, ViT, ConvNeXt, ResNet), a plain
nn.TransformerEncoder over token ids and a Conv1d stack over audio. Each (architecture, pass) either applies —
and then the result is checked here again, on fresh inputs drawn from the input spec, in eval and train mode —
or refuses with a typed error whose message says why, as decided in EXPECTED. Also: layers of a model's own
classes that behave as torch.nn layers (GPT-2's Conv1D, LlamaRMSNorm) are captured as those layers.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import graphgrow as gg
from graphgrow.core.state import dropout_off
from graphgrow.graph.inputs import parse_spec, spec_inputs

PASSES = ["add_branch", "add_residual", "deepen", "fold", "grow_width", "insert_adapter", "remove_branch"]
NO_MAPS = "this model has none"  # add_branch on a model without a Conv2d
NO_MERGE = "no branch merge to remove"  # remove_branch before any add_branch
# architecture → (capture path, {pass: substring of the refusal}); a pass not named applies
EXPECTED: dict[str, tuple[str, dict[str, str]]] = {
    "gpt2": ("export", {"add_branch": NO_MAPS, "remove_branch": NO_MERGE}),
    "llama": ("export", {"add_branch": NO_MAPS, "remove_branch": NO_MERGE}),
    "bert": ("export", {"add_branch": NO_MAPS, "remove_branch": NO_MERGE}),
    "bart": ("export", {"add_branch": NO_MAPS, "remove_branch": NO_MERGE}),
    "vit": ("export", {"add_branch": "read the raw input (a patch embedding)", "remove_branch": NO_MERGE}),
    "convnext": ("export", {"remove_branch": NO_MERGE}),
    "resnet": ("export", {"remove_branch": NO_MERGE}),  # fx keeps layers in leaves: capture auto exports (e2377de)
    "token_encoder": ("export", {"add_branch": NO_MAPS, "remove_branch": NO_MERGE}),
    "audio_conv1d": ("fx", {"add_branch": "its convs are Conv1d", "remove_branch": NO_MERGE}),
}


class TokenEncoder(nn.Module):
    """Embedding → nn.TransformerEncoder (batch_first) → a per-token Linear."""

    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, 5)

    def forward(self, input_ids):
        return self.head(self.encoder(self.embed(input_ids)))


class AudioConv1d(nn.Module):
    """Raw audio [N, 1, 16000] → strided Conv1d stem → Conv1d blocks with pooling → global pooling → Linear."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, 8, 80, stride=16),
            nn.BatchNorm1d(8),
            nn.ReLU(),
            nn.MaxPool1d(4),
            nn.Conv1d(8, 16, 3, padding=1),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.MaxPool1d(4),
            nn.Conv1d(16, 16, 3, padding=1),
            nn.BatchNorm1d(16),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def build(arch: str) -> tuple[nn.Module, str]:
    """The smallest configs that still have each architecture's features; random weights."""
    torch.manual_seed(0)
    if arch in ("token_encoder", "audio_conv1d"):
        return (TokenEncoder(), "input_ids:1x8:int64") if arch == "token_encoder" else (AudioConv1d(), "x:1x1x16000")
    tf = pytest.importorskip("transformers")
    ids = "input_ids:1x8:int64"
    if arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=50,
            n_embd=16,
            n_layer=1,
            n_head=2,
            n_positions=16,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return tf.GPT2LMHeadModel(cfg), ids
    if arch == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            use_cache=False,
        )
        return tf.LlamaForCausalLM(cfg), ids
    if arch == "bert":
        cfg = tf.BertConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
        )
        return tf.BertForSequenceClassification(cfg), ids
    if arch == "bart":
        cfg = tf.BartConfig(
            vocab_size=50,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=16,
            use_cache=False,
        )
        return tf.BartForConditionalGeneration(cfg), "input_ids:1x8:int64,decoder_input_ids:1x4:int64"
    if arch == "vit":
        cfg = tf.ViTConfig(
            image_size=16,
            patch_size=4,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=3,
        )
        return tf.ViTForImageClassification(cfg), "pixel_values:1x3x16x16"
    if arch == "convnext":
        cfg = tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3)
        return tf.ConvNextForImageClassification(cfg), "pixel_values:1x3x32x32"
    cfg = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    return tf.ResNetForImageClassification(cfg), "pixel_values:1x3x32x32"


_TRACED: dict[str, tuple[nn.Module, str, torch.fx.GraphModule, float]] = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def traced(arch: str):
    """(model, spec, graph, trace seconds), traced once per architecture."""
    if arch not in _TRACED:
        model, spec = build(arch)
        start = time.perf_counter()
        gm = gg.trace(model, input_shape=parse_spec(spec))
        _TRACED[arch] = (model, spec, gm, time.perf_counter() - start)
    return _TRACED[arch]


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _max_rel(a, b) -> float:
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb) and ta
    return max(((x - y).norm() / x.norm().clamp_min(1e-30)).item() for x, y in zip(ta, tb))


def _same_function(old: nn.Module, new: nn.Module, inputs: dict, train: bool) -> float:
    """Relative error of new against old on `inputs`: train mode with dropout off (nn.Dropout and the attention
    dropout inside scaled_dot_product_attention, core.state.dropout_off) and the same random draws, as verification
    does."""
    outs = []
    for m in (old, new):
        was = m.training
        m.train(train)
        try:
            with torch.no_grad(), dropout_off(m):
                torch.manual_seed(11)
                outs.append(m(**inputs))
        finally:
            m.train(was)
    return _max_rel(*outs)


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_trace_is_exact_in_both_modes(arch):
    model, spec, gm, seconds = traced(arch)
    report = gm.meta["graphgrow"]["trace"]
    assert report["capture"] == EXPECTED[arch][0]
    assert report["fidelity"] == ["eval@2", "eval@3", "train@2", "train@3"]
    assert seconds < 120, (
        f"tracing {arch} took {seconds:.1f} s"
    )  # a few seconds idle: catches minutes, not a busy machine
    inputs = spec_inputs(model, parse_spec(spec), seed=3, batch=2)
    assert _same_function(model, gm, inputs, train=False) <= 1e-5


@pytest.mark.parametrize("arch,name", [(a, p) for a in EXPECTED for p in PASSES])
def test_default_pass(arch, name):
    model, spec, gm, _ = traced(arch)
    refusal = EXPECTED[arch][1].get(name)
    if refusal is not None:
        with pytest.raises((gg.NotApplicable, gg.TraceError), match=re.escape(refusal)):
            gg.get_pass(name)()(gm)
        return
    result = gg.get_pass(name)()(gm)
    if not result.changed:  # fold with nothing to fold
        assert name == "fold" and result.gm.code == gm.code
        return
    checked = result.preservation
    assert checked is not None and checked.eval.ok and checked.eval.max_abs_ref > 0
    if name != "fold":  # fold is checked in eval mode (deployment semantics)
        assert checked.train is not None and checked.train.ok and checked.train.max_abs_ref > 0
    # again, independently: other inputs from the spec (another batch size), both modes
    inputs = spec_inputs(model, parse_spec(spec), seed=5, batch=3)
    for train in (False, True) if name != "fold" else (False,):
        assert _same_function(gm, result.gm, inputs, train) <= 1e-5, f"{name} on {arch}, train={train}"


class TransposedLinear(nn.Module):
    """A Linear with its weight stored in × out (GPT-2's Conv1D), under another name."""

    def __init__(self, cin, cout):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cin, cout))
        self.bias = nn.Parameter(torch.randn(cout))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class ScaledRMS(nn.Module):
    """An RMSNorm (LlamaRMSNorm's arithmetic) under another name."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.tiny = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.tiny))


class NotALinear(TransposedLinear):
    def forward(self, x):
        return super().forward(x) * 2


class OwnLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.up, self.norm, self.down, self.odd = (
            TransposedLinear(8, 16),
            ScaledRMS(16),
            TransposedLinear(16, 8),
            NotALinear(8, 8),
        )

    def forward(self, input_ids):
        return self.odd(self.down(self.norm(self.up(self.embed(input_ids)))))


def test_own_layers_that_behave_as_torch_layers_are_captured_as_them():
    model = OwnLayers()
    gm = gg.trace(model, "input_ids:1x6:int64")
    kinds = {str(n.target): type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"}
    assert kinds == {"embed": nn.Embedding, "up": nn.Linear, "norm": nn.RMSNorm, "down": nn.Linear}  # not `odd`
    assert gm.norm.weight is model.norm.weight and gm.up.bias is model.up.bias  # shared where the layout is the same
    assert torch.equal(gm.up.weight, model.up.weight.t()) and gm.norm.eps == 1e-5
    assert gm.meta["graphgrow"]["trace"]["standins"] == {"up": "Linear", "norm": "RMSNorm", "down": "Linear"}
    assert gm.meta["graphgrow"]["inputs"][0]["high"] == 20  # token ids' range is fixed at trace time
    # the RMSNorm couples the 16 channels between up and down: they grow only by replication
    with pytest.raises(gg.NotApplicable, match="init=net2net"):
        gg.get_pass("grow_width")()(gm)
    grown = gg.get_pass("grow_width")(target="up", init="net2net")(gm)
    assert grown.gm.norm.normalized_shape == (32,) and grown.preservation.train.ok
