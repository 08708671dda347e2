"""One example-input type (issue 41, item 2): every description of a model's example input becomes an input spec.

A bare shape is a one-tensor spec marked positional; named inputs, TensorSpecs, dicts and example tensors give
the same stored metadata (`gm.meta["graphgrow"]["inputs"]`, the one key) as the spec they describe. Files
written before that key was the only one (`input_shape` alone, or both keys) still load.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.graph.graph_meta import input_shape_of, input_spec_of
from graphgrow.graph.inputs import TensorSpec, plain_spec, records, report_fields
from graphgrow.io.load import load_model
from graphgrow.io.save import save_model


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )


class TwoInputs(nn.Module):
    """A forward with two named float inputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(5, 4)

    def forward(self, image, extra):
        return self.conv(image).mean((2, 3)) + self.fc(extra)


class TinyLM(nn.Module):
    """Token ids in, logits out: its input must be int64, drawn within the embedding's vocabulary."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, ids):
        return self.head(torch.relu(self.emb(ids)))


def _stored(gm) -> list[dict]:
    info = gm.meta["graphgrow"]
    assert "input_shape" not in info  # one key: the spec
    return info["inputs"]


@pytest.mark.parametrize(
    "given",
    [
        (1, 3, 8, 8),
        [1, 3, 8, 8],
        torch.Size([1, 3, 8, 8]),
        "1,3,8,8",
        "1x3x8x8",
        torch.randn(1, 3, 8, 8),
        (torch.randn(1, 3, 8, 8),),
    ],
    ids=["tuple", "list", "size", "text", "text-x", "tensor", "tensors"],
)
def test_a_bare_shape_in_any_form_is_the_one_positional_spec(given):
    gm = gg.trace(_cnn(), given)
    want = plain_spec([1, 3, 8, 8], "input")  # nn.Sequential's forward takes `input`
    assert _stored(gm) == records(want) and input_spec_of(gm) == want and input_shape_of(gm) == [1, 3, 8, 8]
    assert report_fields(input_spec_of(gm)) == {"input_shape": [1, 3, 8, 8]}  # reports show it as before


@pytest.mark.parametrize(
    "given",
    [
        {"input": (1, 3, 8, 8)},
        {"input": ((1, 3, 8, 8), "float32")},
        {"input": ((1, 3, 8, 8), torch.float32)},
        {"input": gg.TensorSpec("input", (1, 3, 8, 8))},
        {"input": torch.zeros(1, 3, 8, 8)},  # the public class
        TensorSpec("input", (1, 3, 8, 8)),
        (TensorSpec("input", (1, 3, 8, 8)),),
        "input:1x3x8x8",
        "input:float32[1,3,8,8]",
    ],
    ids=[
        "dict-shape",
        "dict-dtype-name",
        "dict-dtype",
        "dict-spec",
        "dict-tensor",
        "spec",
        "specs",
        "text",
        "bracketed",
    ],
)
def test_named_forms_store_the_equivalent_spec(given):
    gm = gg.trace(_cnn(), given)
    want = (TensorSpec("input", (1, 3, 8, 8), "float32"),)
    assert _stored(gm) == records(want) and input_spec_of(gm) == want
    assert report_fields(want) == {"input_shape": [1, 3, 8, 8], "inputs": records(want)}  # named: reported by name


def test_two_named_inputs_from_a_dict_specs_text_or_example_tensors_agree():
    model = TwoInputs()
    want = (TensorSpec("image", (1, 3, 8, 8)), TensorSpec("extra", (1, 5)))
    forms = [
        {"image": (1, 3, 8, 8), "extra": (1, 5)},
        want,
        "image:1x3x8x8,extra:1x5",
        (torch.randn(1, 3, 8, 8), torch.randn(1, 5)),  # example tensors: named after forward's parameters in order
        {"image": TensorSpec("image", (1, 3, 8, 8)), "extra": torch.ones(1, 5)},
    ]
    stored = [_stored(gg.trace(model, f)) for f in forms]
    assert all(s == records(want) for s in stored), stored
    gm = gg.trace(model, forms[0])
    x = {"image": torch.randn(2, 3, 8, 8), "extra": torch.randn(2, 5)}
    with torch.no_grad():
        assert torch.allclose(model.eval()(**x), gm.eval()(**x), atol=1e-6)


def test_an_example_int64_tensor_traces_an_embedding_model_with_its_dtype():
    model = TinyLM()
    gm = gg.trace(model, torch.randint(0, 50, (1, 6)))  # the dtype comes from the example, not float32
    spec = input_spec_of(gm)
    assert spec == (TensorSpec("ids", (1, 6), "int64", high=50, positional=True),)  # range from the embedding
    ids = torch.randint(0, 50, (3, 6))
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids), gm.eval()(ids), atol=1e-6)
    gg.annotate(gm, spec)  # the checks draw int64 ids below 50: the graph runs on them
    assert [n.meta["gg_shape"] for n in gm.graph.nodes if n.op == "output"] == [(1, 6, 50)]


def test_a_float_shape_for_token_ids_is_refused_by_the_model_not_misread():
    with pytest.raises(gg.GraphgrowError):
        gg.trace(TinyLM(), (1, 6))  # float ids into an embedding: torch refuses; graphgrow never casts silently


@pytest.mark.parametrize(
    "bad, says",
    [
        ("banana", "not a list of integers"),
        ({"not ok": (1, 3, 8, 8)}, "not a plain identifier"),
        ({"input": TensorSpec("other", (1, 3, 8, 8))}, "is given a TensorSpec named 'other'"),
        ([[1, 3], [8]], "cannot read an example input from list"),
        ({"input": [[1, 3], [8]]}, "is not a shape"),
        (3.5, "cannot read an example input from float"),
        ([1, 0, 8, 8], "not a valid shape"),
        ({"input": torch.zeros(1, 3, dtype=torch.complex64)}, "is not supported"),
    ],
)
def test_bad_example_inputs_are_clear_input_errors(bad, says):
    with pytest.raises(gg.InputError) as e:
        gg.trace(_cnn(), bad)
    assert says in str(e.value)


def test_metadata_written_before_the_one_key_still_loads(tmp_path):
    gm = gg.trace(_cnn(), (1, 3, 8, 8))
    info = gm.meta["graphgrow"]
    del info["inputs"]
    info["input_shape"] = [1, 3, 8, 8]  # an older file: the bare shape only
    assert input_spec_of(gm) == plain_spec([1, 3, 8, 8], "input")
    loaded = load_model(save_model(gm, tmp_path / "old.pt"))
    assert loaded.input_shape == plain_spec([1, 3, 8, 8], "input") == input_spec_of(loaded.module)
    lm = gg.trace(TinyLM(), {"ids": ((1, 6), "int64")})
    both = lm.meta["graphgrow"]
    both["input_shape"] = [1, 6]  # files written between: both keys, the spec wins
    loaded = load_model(save_model(lm, tmp_path / "both.pt"))
    assert loaded.input_shape == (TensorSpec("ids", (1, 6), "int64", high=50),) == input_spec_of(loaded.module)
