"""ONNX with external data (issue 27): weights past protobuf's 2 GiB go to NAME.onnx.data beside NAME.onnx; the
pair is written whole or not at all, read back through check/inspect, and a file's external-data entries are
obeyed only when they point into its own NAME.onnx.data (a name read from a file never chooses what is read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import pytest
import torch
from conftest import run_cli
from torch import nn

import graphgrow as gg
from graphgrow.io import export as export_mod
from graphgrow.io.export import describe_onnx, export_onnx, load_onnx
from graphgrow.io.runtime import open_session
from graphgrow.verify.equivalence import check_equivalence

SHAPE = (1, 3, 8, 8)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    ).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """m.onnx + m.onnx.data exported from the traced model, and the model."""
    folder = tmp_path_factory.mktemp("ext")
    gm = gg.trace(_model(), SHAPE)
    export_onnx(gm, SHAPE, folder / "m.onnx", external_data=True)
    return folder / "m.onnx", gm


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_the_weights_go_beside_the_graph_and_onnxruntime_agrees(pair):
    path, gm = pair
    assert _files(path.parent) == ["m.onnx", "m.onnx.data"]  # no staging files left
    proto = load_onnx(path)
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(e.value == "m.onnx.data" for t in external for e in t.external_data if e.key == "location")
    weights = sum(p.numel() * 4 for p in gm.parameters())
    assert path.stat().st_size < weights < (path.parent / "m.onnx.data").stat().st_size + 1024
    assert describe_onnx(str(path))["external_data"]["files"] == ["m.onnx.data"]
    report = check_equivalence(gm, open_session(path, "cpu"), SHAPE)
    assert report.passed, report.to_json()


@pytest.mark.slow  # CLI processes that export and check: make test runs it, not the edit loop
def test_the_cli_writes_checks_and_shows_the_pair(tmp_path):
    torch.save(_model(), tmp_path / "m.pt")
    proc = run_cli(
        "export", "m.pt", "-o", "m.onnx", "--input-shape", "1,3,8,8", "--external-data", "--json", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["outputs"] == ["m.onnx", "m.onnx.data"]
    proc = run_cli("check", "m.onnx", "m.pt", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["equivalence"]["passed"] is True
    proc = run_cli("inspect", "m.onnx", cwd=tmp_path)
    assert proc.returncode == 0 and "weights in m.onnx.data" in proc.stdout, proc.stdout + proc.stderr


def test_past_the_one_file_limit_external_data_is_automatic(tmp_path, monkeypatch):
    gm = gg.trace(_model(), SHAPE)
    monkeypatch.setattr(export_mod, "ONE_FILE_MAX", 1024)  # as if the weights were past 1.75 GiB
    export_onnx(gm, SHAPE, tmp_path / "big.onnx")
    assert _files(tmp_path) == ["big.onnx", "big.onnx.data"]
    with pytest.raises(gg.ExportError, match="--external-data"):
        export_onnx(gm, SHAPE, tmp_path / "one.onnx", external_data=False)
    with pytest.raises(gg.ExportError, match="give an output path"):
        export_onnx(gm, SHAPE)
    assert _files(tmp_path) == ["big.onnx", "big.onnx.data"]  # refused before anything was written


def test_a_failed_check_leaves_the_old_pair_and_no_staging_files(pair, tmp_path, monkeypatch):
    path, gm = pair
    for name in ("m.onnx", "m.onnx.data"):
        (tmp_path / name).write_bytes((path.parent / name).read_bytes())
    before = {n: (tmp_path / n).read_bytes() for n in _files(tmp_path)}

    def failing(_):
        raise gg.ExportError("the checker says no", "")

    monkeypatch.setattr(export_mod, "check_proto", failing)
    with pytest.raises(gg.ExportError, match="checker says no"):
        export_onnx(nn.Sequential(nn.Linear(4, 4)), (1, 4), tmp_path / "m.onnx", external_data=True)
    assert {n: (tmp_path / n).read_bytes() for n in _files(tmp_path)} == before


def _copy(pair, tmp: Path, name: str = "m.onnx") -> tuple[Path, onnx.ModelProto]:
    path, _ = pair
    (tmp / f"{name}.data").write_bytes((path.parent / "m.onnx.data").read_bytes())
    proto = onnx.load(str(path), load_external_data=False)
    return tmp / name, proto


def _edit(proto: onnx.ModelProto, key: str, value: str | None) -> None:
    """Set (or, with None, remove) `key` in the first external initializer's entries."""
    t = next(t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    kept = [(e.key, e.value) for e in t.external_data if e.key != key]
    del t.external_data[:]
    for k, v in kept + ([(key, value)] if value is not None else []):
        e = t.external_data.add()
        e.key, e.value = k, v


HOSTILE = {
    "another file": (lambda p: _edit(p, "location", "secret.bin"), "names the external file 'secret.bin'"),
    "a parent folder": (lambda p: _edit(p, "location", "../m.onnx.data"), "only from 'm.onnx.data' beside it"),
    "an absolute path": (lambda p: _edit(p, "location", "/etc/passwd"), "only from 'm.onnx.data' beside it"),
    "past the end": (lambda p: _edit(p, "offset", str(10**9)), "needs"),
    "a short length": (lambda p: _edit(p, "length", "4"), "needs"),
    "a length that is not a number": (lambda p: _edit(p, "length", "-4"), "not a byte count"),
    "an unknown entry": (lambda p: _edit(p, "basepath", "/"), "external-data entry 'basepath'"),
    "no location": (lambda p: _edit(p, "location", None), "names the external file ''"),
    "a wrong shape": (lambda p: next(t for t in p.graph.initializer if t.external_data).dims.append(7), "needs"),
    "data inline too": (
        lambda p: setattr(next(t for t in p.graph.initializer if t.external_data), "raw_data", b"\0" * 4),
        "both inline and in an external file",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_external_data_entries_are_refused_before_anything_is_read(pair, tmp_path, case):
    path, proto = _copy(pair, tmp_path)
    (tmp_path / "secret.bin").write_bytes(b"\x01" * (1 << 16))
    change, message = HOSTILE[case]
    change(proto)
    path.write_bytes(proto.SerializeToString())  # as written (onnx.save would act on the entries)
    for read in (lambda: load_onnx(path), lambda: open_session(path, "cpu")):
        with pytest.raises(gg.LoadError, match=message):
            read()


def test_a_renamed_model_or_a_data_file_linked_from_elsewhere_is_refused(pair, tmp_path):
    src, proto = _copy(pair, tmp_path)
    onnx.save(proto, str(tmp_path / "renamed.onnx"))  # still names m.onnx.data
    with pytest.raises(gg.LoadError, match="only from 'renamed.onnx.data' beside it"):
        load_onnx(tmp_path / "renamed.onnx")
    outside, inside = tmp_path / "outside", tmp_path / "model"
    outside.mkdir(), inside.mkdir()
    (outside / "m.onnx.data").write_bytes((tmp_path / "m.onnx.data").read_bytes())
    onnx.save(proto, str(inside / "m.onnx"))
    os.symlink(outside / "m.onnx.data", inside / "m.onnx.data")
    with pytest.raises(gg.LoadError, match="is a link"):
        load_onnx(inside / "m.onnx")
    (inside / "m.onnx.data").unlink()
    with pytest.raises(gg.LoadError, match="cannot be read beside the model"):
        load_onnx(inside / "m.onnx")
    os.symlink(inside / "m.onnx", tmp_path / "link.onnx")  # a link to the model reads the data beside the model
    (inside / "m.onnx.data").write_bytes((tmp_path / "m.onnx.data").read_bytes())
    assert load_onnx(tmp_path / "link.onnx").graph.initializer


def test_a_session_is_not_opened_on_a_pipe(tmp_path):
    """open_session(path) reads the file: a pipe would block for ever (the CLI reads through load_onnx first)."""
    os.mkfifo(tmp_path / "m.onnx")
    with pytest.raises(gg.InputError, match="not a regular file"):
        open_session(tmp_path / "m.onnx", "cpu")
