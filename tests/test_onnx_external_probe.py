"""Hostile NAME.onnx / NAME.onnx.data pairs found by probing the external-data reader (issue 27): each one must be
a graphgrow error with one line, never an internal error, and never read a file that is not beside the model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.io.export import export_onnx, load_onnx
from graphgrow.io.runtime import open_session

SHAPE = (1, 16)


def _gm():
    torch.manual_seed(0)
    return gg.trace(nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 10)).eval(), SHAPE)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("probe")
    export_onnx(_gm(), SHAPE, folder / "m.onnx", external_data=True)
    return folder / "m.onnx"


def _copy(pair: Path, folder: Path, name: str = "m.onnx") -> tuple[Path, onnx.ModelProto]:
    """The pair copied into `folder` as NAME.onnx (its entries renamed to NAME.onnx.data; the data file not copied)."""
    proto = onnx.load(str(pair), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = name + ".data"
    (folder / name).write_bytes(proto.SerializeToString())
    return folder / name, proto


def _refused(path: Path, match: str) -> None:
    for read in (lambda: load_onnx(path), lambda: open_session(path, "cpu")):
        with pytest.raises(gg.GraphgrowError, match=match) as e:
            read()
        assert "\n" not in str(e.value)


def test_a_data_file_that_links_to_itself_is_a_load_error(pair, tmp_path):
    path, _ = _copy(pair, tmp_path)
    os.symlink("m.onnx.data", tmp_path / "m.onnx.data")  # resolve() raises RuntimeError('Symlink loop') on 3.11
    _refused(path, "m.onnx.data")


def test_a_model_name_too_long_for_its_data_file_is_a_load_error(pair, tmp_path):
    path, _ = _copy(pair, tmp_path, "a" * 250 + ".onnx")  # NAME.onnx.data is 256 bytes: ENAMETOOLONG
    _refused(path, "onnx.data")


def test_a_model_name_too_long_for_its_data_file_cannot_be_exported(tmp_path):
    with pytest.raises(gg.GraphgrowError):
        export_onnx(_gm(), SHAPE, tmp_path / ("a" * 250 + ".onnx"), external_data=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("digits", ["\u0660", "\uff10"])  # Arabic-Indic and fullwidth zero: re's \d takes them
def test_an_offset_in_non_ascii_digits_is_not_a_byte_count(pair, tmp_path, digits):
    path, proto = _copy(pair, tmp_path)
    shutil.copy(pair.with_name("m.onnx.data"), tmp_path / "m.onnx.data")
    t = next(t for t in proto.graph.initializer if t.external_data)
    next(e for e in t.external_data if e.key == "offset").value = digits  # int() reads 0; onnxruntime refuses it
    path.write_bytes(proto.SerializeToString())
    _refused(path, "not a byte count")


def test_a_data_file_linked_into_a_subfolder_is_refused(pair, tmp_path):
    """Only the file beside the model: a link into a subfolder reads any file under the model's folder (a model
    unpacked into the home folder could read .ssh/id_rsa: offsets and lengths need only lie inside it)."""
    path, _ = _copy(pair, tmp_path)
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "id_rsa").write_bytes(pair.with_name("m.onnx.data").read_bytes() + b"secret" * 100)
    os.symlink(tmp_path / ".ssh" / "id_rsa", tmp_path / "m.onnx.data")
    _refused(path, "m.onnx.data")


def test_a_model_name_that_is_not_utf8_cannot_be_exported_with_external_data(tmp_path):
    """The data file's name goes into the graph as a protobuf string, which must be UTF-8 (onnx_ir's SerdeError)."""
    with pytest.raises(gg.GraphgrowError):
        export_onnx(_gm(), SHAPE, tmp_path / os.fsdecode(b"m\xff.onnx"), external_data=True)
    assert list(tmp_path.iterdir()) == []
