"""An ONNX file handed to graphgrow (check, inspect, replay) is untrusted input like a model file: its
metadata is validated (a malformed value is exit 2 naming it, never an internal error or a huge
allocation) and tensors kept in external files are refused unless in NAME.onnx.data beside NAME.onnx
(test_onnx_external.py): a name read from the file must not choose what is read."""

from __future__ import annotations

import onnx
import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import InputError, LoadError
from graphgrow.jobs import workflow

SHAPE = (1, 3, 16, 16)


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onnx")
    torch.save(small(), folder / "m.pt")
    gg.export_onnx(
        gg.trace(small(), input_shape=SHAPE),
        SHAPE,
        folder / "m.onnx",
        metadata={"graphgrow.source": "factories:small_cnn", "graphgrow.factory_seed": "0"},
    )
    return folder


def _with(folder, key, value):
    proto = onnx.load(str(folder / "m.onnx"))
    entry = next(p for p in proto.metadata_props if p.key == key)
    entry.value = value
    out = folder / "hostile.onnx"
    onnx.save(proto, str(out))
    return str(out)


@pytest.mark.parametrize(
    "value",
    [
        "[[[[[[[",
        "[1e400]",
        '"abc"',
        "[-1, 3, 16, 16]",
        "[1, 3, 16, 16, 1, 1, 1, 1, 1]",
        "[true, 3, 16, 16]",
        "[" * 50_000,
    ],
)
def test_a_malformed_stored_input_shape_is_a_load_error(exported, value):
    path = _with(exported, "graphgrow.input_shape", value)
    for run in (lambda: workflow.check(path, str(exported / "m.pt")), lambda: workflow.inspect(path)):
        with pytest.raises(LoadError, match="stores the input shape"):
            run()
    _, report = workflow.check(path, str(exported / "m.pt"), input_shape="1,3,16,16")  # the user's shape wins
    assert report.passed


def test_a_huge_stored_input_shape_is_refused_before_anything_is_allocated(exported):
    path = _with(exported, "graphgrow.input_shape", "[100000, 3, 4096, 4096]")
    with pytest.raises(InputError, match="not a valid example shape .*at most 2\\^26 elements"):
        workflow.check(path, str(exported / "m.pt"))


@pytest.mark.parametrize("value", ["abc", "-1", "9" * 5000, str(2**63), "1e3", " 1"])
def test_a_malformed_factory_seed_is_a_load_error(exported, value):
    path = _with(exported, "graphgrow.factory_seed", value)
    with pytest.raises(LoadError, match="factory seed"):
        workflow.check(path, "factories:small_cnn")


def test_tensors_in_external_files_are_refused(exported, tmp_path):
    proto = onnx.load(str(exported / "m.onnx"))
    onnx.save(
        proto,
        str(tmp_path / "ext.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    for run in (
        lambda: workflow.check(str(tmp_path / "ext.onnx"), str(exported / "m.pt")),
        lambda: workflow.inspect(str(tmp_path / "ext.onnx")),
    ):
        with pytest.raises(LoadError, match="only from 'ext.onnx.data' beside it"):
            run()
