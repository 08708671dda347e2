"""ONNX export and the onnxruntime check for models with named inputs and structured outputs (issue 22, items 3 and 5).

Hugging Face models from small configs (random weights, nothing downloaded) and a plain nn.TransformerEncoder over
token ids are captured on an input spec, exported with their inputs' names and dtypes, a dynamic batch and a dynamic
sequence length, and checked in onnxruntime at two batch sizes and two sequence lengths, every output by name.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import LoadError
from graphgrow.graph.inputs import parse_spec, plain_spec
from graphgrow.io.export import describe_onnx, export_onnx, metadata, onnx_input_shape
from graphgrow.io.onnx_spec import INPUTS_KEY, name_outputs, named_leaves, read_spec
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence, first_divergence

TOKENS = "input_ids:1x16:int64"


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


class TokenEncoder(nn.Module):
    """nn.Embedding → nn.TransformerEncoder → Linear over token ids: no Hugging Face code involved."""

    def __init__(self, vocab: int = 50, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        return self.head(self.encoder(self.embed(input_ids)))


class FlatHead(nn.Module):
    """A classifier over the flattened sequence: it only works at its one length; nested outputs."""

    def __init__(self, length: int = 16):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.fc = nn.Linear(length * 8, 3)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return {"scores": self.fc(h.flatten(1)), "pair": (h.mean(1), h)}


class LengthBranch(nn.Module):
    """Runs at any length, but computes something else at length 16 than at the others."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if input_ids.shape[1] == 16:
            h = h * 2
        return self.fc(h)


class DictHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x)
        return {"logits": h.relu(), "aux": (h * 2,)}


# --- fast: naming, metadata, the single-input path ------------------------------------------------------------


def test_outputs_are_named_after_their_key_paths():
    t = torch.zeros(1)
    assert [n for n, _ in named_leaves(t)] == ["output"]
    assert [n for n, _ in named_leaves((t, [t, 3]))] == ["output.0", "output.1.0"]
    assert [n for n, _ in named_leaves({"logits": t, "past": ((t, t), (t, t)), "none": None})] == [
        "logits",
        "past.0.0",
        "past.0.1",
        "past.1.0",
        "past.1.1",
    ]


def test_naming_outputs_survives_collisions_passthrough_and_duplicates():
    """An inner value already called `logits`, an output that is the graph input, the same value twice,
    and a wanted name that is an input's: all renamed without breaking the graph."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["logits"]), helper.make_node("Neg", ["logits"], ["y"])],
        "g",
        [x],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("y", "x", "y", "logits")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=max_ir_version())
    name_outputs(proto, ["logits", "copy", "again", "x"])
    onnx.checker.check_model(proto, full_check=True)
    assert [o.name for o in proto.graph.output] == ["logits", "copy", "again", "x_1"]
    sess = open_session(proto.SerializeToString(), "cpu")
    v = np.array([-1.0, 2.0], dtype=np.float32)
    logits, copy, again, relu = sess.run(v)
    assert np.array_equal(logits, [0.0, -2.0]) and np.array_equal(copy, v) and np.array_equal(again, logits)
    assert np.array_equal(relu, [0.0, 2.0])


def test_stored_input_spec_is_read_back_and_a_hostile_one_refused():
    spec = parse_spec("input_ids:1x16:int64,attention_mask:1x16:int64")
    proto = onnx.ModelProto()
    entry = proto.metadata_props.add()
    entry.key, entry.value = INPUTS_KEY, json.dumps([t.record() for t in spec])
    assert onnx_input_shape(proto) == spec
    for bad in (
        "{",
        "[]",
        '{"a": 1}',
        '[{"name": "x"}]',
        '[{"name": "x", "shape": [1, -4], "dtype": "int64"}]',
        '[{"name": "x", "shape": [1, 4], "dtype": "int64", "high": -3}]',
        '[{"name": "os.system", "shape": [1]}]',
        json.dumps([{"name": f"x{i}", "shape": [1]} for i in range(17)]),
        "[" * 100000,
    ):
        entry.value = bad
        with pytest.raises(LoadError, match="input spec"):
            read_spec(metadata(proto))


@pytest.mark.slow
def test_one_float_input_is_exported_as_before(tmp_path):
    """The old path: one input called `input`, no spec in the metadata, the exporter's output name, the old cases."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).eval()
    gm = gg.trace(model, (1, 3, 8, 8))
    proto = export_onnx(gm, (1, 3, 8, 8), tmp_path / "cnn.onnx", max_ir_version=max_ir_version())
    (inp,) = proto.graph.input
    assert inp.name == "input" and inp.type.tensor_type.elem_type == TensorProto.FLOAT and _dims(inp)[1:] == [3, 8, 8]
    assert isinstance(_dims(inp)[0], str) and len(proto.graph.output) == 1 and proto.graph.output[0].name != "output"
    meta = metadata(proto)
    assert json.loads(meta["graphgrow.input_shape"]) == [1, 3, 8, 8] and INPUTS_KEY not in meta
    assert "graphgrow.dynamic_dims" not in meta and onnx_input_shape(proto) == plain_spec([1, 3, 8, 8], "input")
    rep = check_equivalence(gm, open_session(tmp_path / "cnn.onnx", "cpu"), (1, 3, 8, 8))
    assert rep.passed and [o.case for o in rep.outputs] == ["seed 0, batch 1", "seed 1, batch 1", "seed 2, batch 3"]
    assert describe_onnx(str(tmp_path / "cnn.onnx"))["input_shape"] == [1, 3, 8, 8]
    heads = gg.trace(DictHeads().eval(), (1, 6))  # one float input, a dict output: the outputs take the keys' names
    proto = export_onnx(heads, (1, 6))
    assert [i.name for i in proto.graph.input] == ["input"] and [o.name for o in proto.graph.output] == [
        "logits",
        "aux.0",
    ]
    rep = check_equivalence(heads, open_session(proto.SerializeToString(), "cpu"), (1, 6), raise_on_failure=True)
    assert set(rep.per_output) == {"logits", "aux.0"}


# --- the models of issue 22 -----------------------------------------------------------------------------------

tf = pytest.importorskip("transformers")


def _gpt2():
    return tf.GPT2LMHeadModel(
        tf.GPT2Config(
            vocab_size=100,
            n_embd=32,
            n_layer=1,
            n_head=4,
            n_positions=32,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
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
            max_position_embeddings=32,
            use_cache=False,
        )
    )


def _bert():
    return tf.BertForSequenceClassification(
        tf.BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    )


def _vit():
    return tf.ViTForImageClassification(
        tf.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=5,
        )
    )


CASES = {  # model, spec, the ONNX inputs' dims, the outputs' names and dims
    "gpt2": (_gpt2, TOKENS, ["batch", "sequence"], {"logits": ["batch", "sequence", 100]}),
    "llama": (_llama, TOKENS, ["batch", "sequence"], {"logits": ["batch", "sequence", 100]}),
    "bert": (_bert, "input_ids:1x16:int64,attention_mask:1x16:int64", ["batch", "sequence"], {"logits": ["batch", 2]}),
    "transformer_encoder": (TokenEncoder, TOKENS, ["batch", "sequence"], {"output": ["batch", "sequence", 50]}),
    "vit": (_vit, "pixel_values:1x3x16x16", ["batch", 3, 16, 16], {"logits": ["batch", 5]}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_named_inputs_exported_and_checked_at_two_lengths(name, tmp_path):
    make, text, input_dims, outputs = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    spec = parse_spec(text)
    gm = gg.trace(model, input_shape=spec)
    path = tmp_path / f"{name}.onnx"
    proto = export_onnx(gm, spec, path, max_ir_version=max_ir_version())
    assert [(i.name, _dims(i)) for i in proto.graph.input] == [(t.name, input_dims) for t in spec]
    dtype = TensorProto.INT64 if "int64" in text else TensorProto.FLOAT
    assert all(i.type.tensor_type.elem_type == dtype for i in proto.graph.input)
    assert {o.name: _dims(o) for o in proto.graph.output} == outputs
    meta = metadata(proto)
    assert onnx_input_shape(proto) == spec and json.loads(meta["graphgrow.input_shape"]) == list(spec[0].shape)
    assert "graphgrow.static_sequence" not in meta
    session = open_session(path, "cpu")
    for reference, m in (("grown model", gm), ("original model", model)):
        report = check_equivalence(m, session, spec, reference=reference)
        assert report.passed, report.to_json()
        assert set(report.per_output) == set(outputs) and report.max_abs_err <= 1e-4
        cases = {o.case for o in report.outputs}
        assert {"seed 0, batch 1", "seed 2, batch 3"} <= cases
        assert ("seed 3, batch 1, sequence 8" in cases) == ("sequence" in input_dims)
    assert first_divergence(gm, proto, spec, report.rtol, report.atol) is None
    described = describe_onnx(str(path))
    assert described["input_spec"] == [t.record() for t in spec] and described["input_shape"] == list(spec[0].shape)


@pytest.mark.slow
def test_a_model_tied_to_its_length_is_exported_with_a_static_length_and_says_why():
    """Captured with one branch for its length (torch.export fixed it), or failing at a shorter length (the probe,
    for a graph that no longer carries capture's example values, as after a file round trip): the length stays the
    example's, the metadata names the inputs and the reason; the check skips the second length."""
    spec = parse_spec(TOKENS)
    for model, why, forget in (
        (FlatHead(), "torch.export fixed sequence (dim 1 of input_ids) at 16", False),
        (FlatHead(), "the model fails at sequence=8: mat1 and mat2", True),
        (LengthBranch(), "torch.export fixed sequence (dim 1", False),
    ):
        gm = gg.trace(model.eval(), input_shape=spec)
        for n in gm.graph.nodes if forget else []:
            n.meta.pop("val", None)
        proto = export_onnx(gm, spec, max_ir_version=max_ir_version())
        assert _dims(proto.graph.input[0]) == ["batch", 16]
        static = json.loads(metadata(proto)["graphgrow.static_sequence"])
        assert static["inputs"] == {"input_ids": 16} and why in static["reason"]
        assert json.loads(metadata(proto)["graphgrow.dynamic_dims"]) == {"input_ids": {"0": "batch"}}
        report = check_equivalence(model, open_session(proto.SerializeToString(), "cpu"), spec, raise_on_failure=True)
        assert not any("sequence" in o.case for o in report.outputs)
        assert [o.name for o in proto.graph.output] == (
            ["output"] if isinstance(model, LengthBranch) else ["scores", "pair.0", "pair.1"]
        )


@pytest.mark.slow
def test_export_failing_with_a_dynamic_length_falls_back_to_the_static_one():
    """A plain module (not captured) that branches on its length: torch.export refuses the dynamic length,
    the export is made again with the example's length, in a child process too."""
    spec = parse_spec(TOKENS)
    model = LengthBranch().eval()
    proto = export_onnx(model, spec, isolate=True)
    static = json.loads(metadata(proto)["graphgrow.static_sequence"])
    assert "inferred a static shape of 16" in static["reason"] and _dims(proto.graph.input[0]) == ["batch", 16]
    assert check_equivalence(model, open_session(proto.SerializeToString(), "cpu"), spec).passed


@pytest.mark.slow
def test_declared_dynamic_dimensions_are_exported_and_checked_at_a_second_size():
    """`input:float32[1,1,samples=400]`: a float waveform whose length the user declares dynamic (no rule would
    guess it): the ONNX input keeps that name, the check runs a second, halved length."""
    model = nn.Sequential(
        nn.Conv1d(1, 4, 9, stride=4, padding=4), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 3)
    ).eval()
    spec = parse_spec("input:float32[1,1,samples=400]")
    assert spec[0].dynamic == ((2, "samples"),) and spec[0].record()["dynamic"] == {"2": "samples"}
    gm = gg.trace(model, input_shape=spec)
    proto = export_onnx(gm, spec, max_ir_version=max_ir_version())
    assert _dims(proto.graph.input[0]) == ["batch", 1, "samples"]
    report = check_equivalence(model, open_session(proto.SerializeToString(), "cpu"), spec, raise_on_failure=True)
    assert any("1×1×200" in o.case for o in report.outputs), [o.case for o in report.outputs]
