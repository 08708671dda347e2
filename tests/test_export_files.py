"""graphgrow files of models captured with torch.export (issue 22): Hugging Face transformers and token ids.

A captured graph (position ids from arange, embeddings, causal masks, dict outputs, dropout read from the
module's training flag) is saved and read back without --trust; the loaded model computes bit for bit what
the saved one did, in eval and train mode, on its stored input spec; growth and fold work after loading.
What the closed list cannot read back is refused at save time, naming the node and the function.
Small configs with random weights (nothing downloaded); traces skip the fidelity check (test_export_capture's).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

import graphgrow as gg
from graphgrow.graph.graph_meta import input_spec_of
from graphgrow.graph.inputs import spec_inputs
from graphgrow.io import serialize
from graphgrow.io.load import load_model

tf = pytest.importorskip("transformers")


class TokenEncoder(nn.Module):
    """A plain nn.TransformerEncoder over token ids (torch.nn only)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2, enable_nested_tensor=False
        )
        self.head = nn.Linear(32, 50)

    def forward(self, input_ids):
        return self.head(self.enc(self.emb(input_ids)))


def _gpt2():
    return tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4, use_cache=False)
    )


def _llama():
    return tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attention_dropout=0.1,
            use_cache=False,
        )
    )


MODELS = {  # name → (builder, input spec)
    "gpt2": (_gpt2, "input_ids:1x8:int64"),
    "llama": (_llama, "input_ids:1x8:int64"),
    "bert": (
        lambda: tf.BertForSequenceClassification(
            tf.BertConfig(
                vocab_size=100,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=32,
                num_labels=3,
            )
        ),
        "input_ids:1x8:int64,attention_mask:1x8:int64",
    ),
    "vit": (
        lambda: tf.ViTForImageClassification(
            tf.ViTConfig(
                image_size=16,
                patch_size=4,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                num_labels=5,
                hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.1,
            )
        ),
        "pixel_values:1x3x16x16",
    ),
    "bart": (
        lambda: tf.BartForConditionalGeneration(
            tf.BartConfig(
                vocab_size=100,
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=32,
                use_cache=False,
            )
        ),
        "input_ids:1x8:int64,decoder_input_ids:1x8:int64",
    ),
    "token_encoder": (TokenEncoder, "input_ids:1x8:int64"),
}
_TRACED: dict[str, fx.GraphModule] = {}


def traced(name: str) -> fx.GraphModule:
    """The captured graph of MODELS[name], traced once per session (read-only for the tests)."""
    if name not in _TRACED:
        build, spec = MODELS[name]
        torch.manual_seed(0)
        _TRACED[name] = gg.trace(build(), spec, check=False)
    return _TRACED[name]


def _saved_and_loaded(gm: fx.GraphModule, tmp_path, name: str = "m.pt") -> fx.GraphModule:
    loaded = load_model(gg.save_model(gm, tmp_path / name))  # no trust: graphgrow reads its own files back
    assert loaded.kind == "graphgrow"
    return loaded.module


def _run(gm: fx.GraphModule, x: dict, train: bool):
    gm.train(train)
    torch.manual_seed(1)  # the same dropout masks on both sides
    with torch.no_grad():
        return gm(**x)


def _identical(a, b) -> bool:
    la, lb = tree_flatten(a), tree_flatten(b)
    return la[1] == lb[1] and all(torch.equal(x, y) for x, y in zip(la[0], lb[0]))


@pytest.mark.parametrize(
    "name", [n if n == "bert" else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]
)  # one fast
def test_a_captured_model_comes_back_bit_identical(name, tmp_path):
    gm = traced(name)
    assert gm.meta["graphgrow"]["trace"]["capture"] == "export"
    back = _saved_and_loaded(gm, tmp_path)
    assert input_spec_of(back) == input_spec_of(gm)  # names, shapes, dtypes and ranges of the inputs kept
    assert [n.name for n in back.graph.nodes if n.op == "placeholder"] == [t.name for t in input_spec_of(gm)]
    x = spec_inputs(back, input_spec_of(back), seed=3, batch=2)
    for train in (False, True):
        want, got = _run(gm, x, train), _run(back, x, train)
        assert _identical(want, got), f"{name} differs after loading in {'train' if train else 'eval'} mode"
    assert not _identical(_run(gm, x, True), _run(gm, x, False))  # dropout is live: train mode is a real check
    gm.eval()


def test_growth_and_fold_work_on_a_loaded_model(tmp_path):
    back = _saved_and_loaded(traced("llama"), tmp_path)
    deepened = gg.get_pass("deepen")()(back, seed=0)  # verified: exact in eval and train mode, trainable
    assert deepened.changed and deepened.modules_added
    again = _saved_and_loaded(deepened.gm, tmp_path, "deep.pt")
    x = spec_inputs(again, input_spec_of(again), seed=4)
    assert _identical(_run(deepened.gm, x, False), _run(again, x, False))
    adapted = gg.get_pass("insert_adapter")()(again, seed=0)
    folded = gg.fold(_saved_and_loaded(adapted.gm, tmp_path, "adapted.pt"))  # token ids: fold runs on the stored spec
    assert any("one Linear" in line for line in folded.targets["folded"])
    ref, got = _run(adapted.gm, x, False)["logits"], _run(folded.gm, x, False)["logits"]
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def _with_node(gm: fx.GraphModule, target, args_of) -> fx.GraphModule:
    """A copy of `gm` with one more node, fed by its first input (a dead end: never run, only saved)."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), "GraphModule")
    ids = next(n for n in new.graph.nodes if n.op == "placeholder")
    with new.graph.inserting_after(ids):
        new.graph.call_function(target, args_of(ids))
    new.meta["graphgrow"] = dict(gm.meta["graphgrow"])
    return new


@pytest.mark.parametrize(
    "target, args_of, named",
    [
        (
            torch.ops.aten.as_strided.default,
            lambda ids: (ids, [1], [1]),
            "'as_strided.default' (storage: ",
        ),  # an ATen class
        # the principle excludes (io/aten_policy.py); ATen ops it allows, such as full_like, are saved
        (
            torch.is_tensor,
            lambda ids: (ids,),
            "torch.is_tensor",
        ),  # a torch function the closed list lacks, binding no ATen op
        (lambda t: t + 1, lambda ids: (ids,), "a lambda or a local function"),  # nothing a file can name
    ],
)
def test_what_cannot_be_read_back_is_refused_at_save_time(target, args_of, named, tmp_path):
    gm = _with_node(traced("gpt2"), target, args_of)
    with pytest.raises(gg.SaveError, match=r"cannot save the model: node '\w+'") as e:
        gg.save_model(gm, tmp_path / "m.pt")
    assert named in str(e.value) and "--leaf" in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing written


def _payload_with(nodes: list[dict], meta: dict | None = None) -> dict:
    return {
        "format": serialize.FORMAT,
        "version": serialize.VERSION,
        "class_name": "GraphModule",
        "root": nn.Module(),
        "nodes": nodes,
        "meta": meta or {"input_shape": [1, 8], "log": []},
    }


def _node(name, op, target, *args) -> dict:
    return {
        "name": name,
        "op": op,
        "target": target,
        "args": {"tuple": list(args)},
        "kwargs": {"dict": []},
        "scope": [],
    }


X = {"node": "x"}


@pytest.mark.parametrize(
    "args, ok",
    [
        ((16,), True),
        ((0, {"node": "n"}), True),
        ((0, 1, 0.5), True),
        ((1 << 40,), False),  # a memory bomb from a constant
        ((0, {"node": "n"}, 1e-9), False),  # a run-time bound with a tiny step: as many elements as the step asks
        ((0, 8, {"node": "n"}), False),  # a step computed at run time
        ((-(1 << 40), {"node": "n"}), False),
    ],
)
def test_arange_from_a_file_is_bounded(args, ok):
    nodes = [
        _node("x", "placeholder", "x"),
        _node("n", "call_method", "size", X, 1),
        _node("a", "call_function", "torch.arange", *args),
        _node("output", "output", "output", {"node": "a"}),
    ]
    if ok:
        assert serialize.from_payload(_payload_with(nodes))(torch.zeros(1, 4)).numel() > 0
    else:
        with pytest.raises(gg.LoadError, match="arange"):
            serialize.from_payload(_payload_with(nodes))


@pytest.mark.parametrize(
    "inputs",
    [
        [{"name": "__import__", "shape": [1, 8], "dtype": "int64", "high": None}],
        [{"name": "x.y", "shape": [1, 8], "dtype": "int64", "high": None}],
        [{"name": "ids", "shape": [1, 1 << 40], "dtype": "int64", "high": None}],
        [{"name": "ids", "shape": [1, 8], "dtype": "object", "high": None}],
        [{"name": "ids", "shape": [1, 8], "dtype": "int64", "high": -3}],
        [{"name": "ids", "shape": "1x8", "dtype": "int64"}],
        "input_ids:1x8:int64",
        [{"name": f"i{k}", "shape": [1], "dtype": "int64"} for k in range(10_000)],
    ],
)
def test_a_stored_input_spec_is_validated(inputs):
    nodes = [_node("x", "placeholder", "x"), _node("output", "output", "output", X)]
    with pytest.raises(gg.LoadError, match="input spec"):
        serialize.from_payload(_payload_with(nodes, {"input_shape": [1, 8], "log": [], "inputs": inputs}))
