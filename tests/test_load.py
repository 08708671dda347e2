"""Model files (architecture.md §7): safe loading, refusing code, graphgrow's own format, atomic writes."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import small_cnn
from graphgrow.passes.add_residual import AddResidual
from torch import nn

import graphgrow as gg
from graphgrow.graph.inputs import plain_spec
from graphgrow.io.load import load_model, standard_layer_classes
from graphgrow.io.save import atomic_write, default_output_path, save_model


class Custom(nn.Module):  # a class torch.nn does not define
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x).relu()


class RunsCode:
    """Unpickling this runs a command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_standard_layers_load_without_trust(cnn_file):
    loaded = load_model(cnn_file)
    assert isinstance(loaded.module, nn.Sequential) and loaded.kind == "file"


@pytest.mark.parametrize("via", ["torch.save", "pickle.dump"])
def test_code_in_a_pickle_is_refused_and_does_not_run(tmp_path, via):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    payload = {"model": RunsCode(marker)}
    if via == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    with pytest.raises(gg.LoadError) as e:
        load_model(path)
    assert "--trust" in str(e.value)
    assert not marker.exists()


def test_custom_class_needs_trust(tmp_path):
    path = tmp_path / "custom.pt"
    torch.save(Custom(), path)
    with pytest.raises(gg.LoadError, match=r"custom class test_load.Custom.*pass --trust"):
        load_model(path)
    assert isinstance(load_model(path, trust=True).module, Custom)


def test_factory_name_imports_installed_code():
    loaded = load_model("torchvision.models:resnet18")
    assert loaded.kind == "factory" and type(loaded.module).__name__ == "ResNet"


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_pkg_xyz:build", "cannot import 'no_such_pkg_xyz'"),
        ("torchvision.models:not_a_model", "has no callable 'not_a_model'"),
        ("factories:fails", "fails() failed: ValueError: no model today"),
        ("torch:zeros", "torch's own zeros, not a model factory"),
    ],
)
def test_bad_factory_names(name, message):
    with pytest.raises(gg.LoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(name)


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = io.BytesIO()
    torch.save(small_cnn(), good)
    data = good.getvalue()
    files = {
        "missing": (tmp_path / "missing.pt", "no such file"),
        "directory": (tmp_path, "is a directory"),
        "empty": (tmp_path / "empty.pt", "is empty"),
        "text": (tmp_path / "notes.pt", "is a text file"),
        "onnx": (tmp_path / "m.onnx", "is an ONNX file"),
        "truncated": (tmp_path / "trunc.pt", "truncated or corrupted"),
        "corrupted": (tmp_path / "corrupt.pt", "corrupted"),
        "state_dict": (tmp_path / "sd.pt", "holds only weights"),
        "not a model": (tmp_path / "list.pt", "holds a list, not a model"),
    }
    files["empty"][0].write_bytes(b"")
    files["text"][0].write_text("hello, this is not a model\n")
    files["onnx"][0].write_bytes(b"\x08\x07\x12\x07pytorch")
    files["truncated"][0].write_bytes(data[: len(data) // 2])
    files["corrupted"][0].write_bytes(data[:100] + bytes(200) + data[300:])
    torch.save(small_cnn().state_dict(), files["state_dict"][0])
    torch.save([1, 2, 3], files["not a model"][0])
    return files


def test_bad_files_give_one_line_errors(tmp_path):
    for label, (path, message) in _bad_files(tmp_path).items():
        with pytest.raises(gg.LoadError) as e:
            load_model(path)
        assert message in str(e.value), label
        assert "\n" not in str(e.value), label


def test_graphgrow_outputs_reload_without_trust_and_keep_the_log(tmp_path, cnn):
    r = AddResidual()(gg.trace(cnn, (1, 3, 32, 32)))
    path = save_model(r.gm, tmp_path / "grown.pt")
    loaded = load_model(path)  # weights_only, no trust
    assert loaded.kind == "graphgrow"
    assert loaded.input_shape == plain_spec([1, 3, 32, 32], "input")  # the one input of nn.Sequential's forward
    assert [e["pass"] for e in loaded.log] == ["add_residual"]
    x = torch.randn(3, 3, 32, 32)
    r.gm.eval(), loaded.module.eval()
    assert torch.equal(r.gm(x), loaded.module(x))
    # and chaining: the reloaded model grows again
    r2 = AddResidual(start="_3", end="_8")(gg.trace(loaded.module))
    assert [e["pass"] for e in r2.gm.meta["graphgrow"]["log"]] == ["add_residual", "add_residual"]


def test_a_file_written_before_the_layers_moved_still_loads_without_trust(tmp_path, cnn, monkeypatch):
    """A graph grown by add_branch holds graphgrow's AverageMerge; files written before issue 21 name it
    graphgrow.layers.AverageMerge (the module is graphgrow.graph.layers now): still read, without --trust."""
    import sys

    from graphgrow.passes.add_branch import AddBranch

    from graphgrow.graph import layers

    r = AddBranch()(gg.trace(cnn, (1, 3, 32, 32)))
    monkeypatch.setitem(sys.modules, "graphgrow.layers", layers)  # as the file was written then
    monkeypatch.setattr(layers.AverageMerge, "__module__", "graphgrow.layers")
    path = save_model(r.gm, tmp_path / "old.pt")
    monkeypatch.undo()
    assert b"graphgrow.layers" in path.read_bytes() and "graphgrow.layers" not in sys.modules
    loaded = load_model(path)  # weights_only, no trust
    merges = [m for m in loaded.module.modules() if type(m).__name__ == "AverageMerge"]
    assert merges and all(type(m) is layers.AverageMerge for m in merges)
    x = torch.randn(2, 3, 32, 32)
    r.gm.eval(), loaded.module.eval()
    assert torch.equal(r.gm(x), loaded.module(x))


def test_a_crafted_graph_cannot_call_unsafe_functions(tmp_path, cnn):
    r = AddResidual()(gg.trace(cnn, (1, 3, 32, 32)))
    path = save_model(r.gm, tmp_path / "grown.pt")
    with torch.serialization.safe_globals(standard_layer_classes()):
        payload = torch.load(path, weights_only=True)
    node = next(n for n in payload["nodes"] if n["op"] == "call_function")
    node["target"] = "os.system"
    torch.save(payload, tmp_path / "crafted.pt")
    with pytest.raises(gg.LoadError, match="'os.system', which is not on graphgrow's closed list of safe operations"):
        load_model(tmp_path / "crafted.pt")
    node["target"] = "torch.load"  # in the torch namespace, but not an op
    torch.save(payload, tmp_path / "crafted2.pt")
    with pytest.raises(gg.LoadError, match="torch.load"):
        load_model(tmp_path / "crafted2.pt")


def test_interrupted_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "out.pt"
    target.write_bytes(b"old contents")

    def crash(tmp: Path):
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt  # the process dies mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, crash)
    assert target.read_bytes() == b"old contents"
    assert list(tmp_path.iterdir()) == [target]  # no temp file left behind


def test_outputs_never_overwrite_the_input(tmp_path, cnn_file, cnn):
    gm = gg.trace(cnn, (1, 3, 32, 32))
    before = cnn_file.read_bytes()
    with pytest.raises(gg.SaveError, match="is the input file"):
        save_model(gm, cnn_file, inputs=(str(cnn_file),))
    assert cnn_file.read_bytes() == before
    with pytest.raises(gg.SaveError, match="does not exist"):
        save_model(gm, tmp_path / "nope" / "x.pt")


def test_default_output_is_beside_the_input_under_a_new_name(tmp_path):
    src = tmp_path / "net.pt"
    src.write_bytes(b"x")
    assert default_output_path(str(src)) == tmp_path / "net.grown.pt"
    (tmp_path / "net.grown.pt").write_bytes(b"x")
    assert default_output_path(str(src)) == tmp_path / "net.grown-1.pt"


def test_infinite_bounds_in_buffers_open_and_grow_a_nan_buffer_is_refused(tmp_path):
    """±inf in a buffer means 'no bound' (clip bounds before calibration); NaN there is a broken model."""
    from graphgrow.jobs.workflow import mutate, open_model

    opened = open_model("tests.factories:clipped_mlp", (1, 8))
    assert torch.isinf(opened.gm.get_buffer("0.input_max")).all()
    report = mutate("tests.factories:clipped_mlp", ["grow_width"], out=str(tmp_path / "g.pt"), input_shape="1,8")
    grown = report["passes"][0]
    assert grown["exact"] and grown["params_after"] > grown["params_before"]
    assert grown["preservation"]["eval_ok"] and grown["preservation"]["train_ok"]
    with pytest.raises(gg.LoadError, match="NaN values in the buffer '0.input_min'"):
        open_model("tests.factories:clipped_mlp(broken=True)", (1, 8))
