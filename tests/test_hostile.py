"""The bad-input matrix (issue: hostile input), through the CLI and the API: exit code 2, one line
that names the problem and the way out, nothing written, the input untouched; and transactions."""
from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.load import load_model, save_model
from graphgrow.workflow import mutate, open_model, parse_input_shape
from conftest import run_cli, small_cnn

READ_ONLY = Path("/sys")  # not writable even for root (the CI user)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def make_inputs(tmp: Path) -> dict[str, Path]:
    """Every kind of bad model file, plus a good one."""
    good = io.BytesIO()
    torch.save(small_cnn(), good)
    data = good.getvalue()
    files = {"good": tmp / "good.pt", "empty": tmp / "empty.pt", "truncated": tmp / "trunc.pt",
             "corrupted": tmp / "corrupt.pt", "onnx": tmp / "m.onnx", "text": tmp / "notes.pt",
             "code": tmp / "code.pt", "raw_pickle": tmp / "raw.pkl", "custom": tmp / "custom.pt", "nan": tmp / "nan.pt",
             "inf": tmp / "inf.pt"}
    files["good"].write_bytes(data)
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(data[: len(data) // 3])
    files["corrupted"].write_bytes(data[:64] + b"\xff" * 256 + data[320:])
    files["onnx"].write_bytes(b"\x08\x07\x12\x07pytorch")
    files["text"].write_text("name,value\nlr,0.1\n")
    torch.save({"x": RunsCode(tmp / "ran")}, files["code"])
    files["raw_pickle"].write_bytes(pickle.dumps(RunsCode(tmp / "ran")))
    torch.save(Custom(), files["custom"])
    for key, value in (("nan", float("nan")), ("inf", float("inf"))):
        m = small_cnn()
        with torch.no_grad():
            m[3].weight[0, 0, 0, 0] = value
        torch.save(m, files[key])
    return files


MATRIX = [  # label, argv (after `graphgrow`), message
    ("missing file", ["mutate", "{tmp}/missing.pt", "--pass", "add_residual"], "no such file"),
    ("directory", ["mutate", "{tmp}", "--pass", "add_residual"], "is a directory"),
    ("empty file", ["mutate", "{empty}", "--pass", "add_residual"], "is empty"),
    ("truncated pickle", ["mutate", "{truncated}", "--pass", "add_residual"], "truncated or corrupted"),
    ("corrupted pickle", ["mutate", "{corrupted}", "--pass", "add_residual"], "corrupted"),
    ("ONNX file", ["mutate", "{onnx}", "--pass", "add_residual"], "is an ONNX file"),
    ("text file", ["mutate", "{text}", "--pass", "add_residual"], "is a text file"),
    ("code in a pickle", ["mutate", "{code}", "--pass", "add_residual"], "refused, nothing was run"),
    ("raw pickle", ["mutate", "{raw_pickle}", "--pass", "add_residual"], "refused without --trust"),
    ("custom class", ["mutate", "{custom}", "--pass", "add_residual"], "contains the custom class test_hostile.Custom"),
    ("unknown pass", ["mutate", "{good}", "--pass", "grow_depth", "--input-shape", "1,3,32,32"], "unknown pass 'grow_depth' (valid passes:"),
    ("unknown argument", ["mutate", "{good}", "--pass", "grow_width(size=3)", "--input-shape", "1,3,32,32"],
     "pass grow_width has no argument 'size' (valid arguments: target, factor, to, mode, init)"),
    ("wrong argument type", ["mutate", "{good}", "--pass", "grow_width(factor=big)", "--input-shape", "1,3,32,32"],
     "grow_width(factor=...) must be float, got 'big'"),
    ("wrong choice", ["mutate", "{good}", "--pass", "grow_width(mode=wide)", "--input-shape", "1,3,32,32"],
     "grow_width(mode=...) must be one of group, adapter"),
    ("missing target", ["mutate", "{good}", "--pass", "grow_width(target=layer9)", "--input-shape", "1,3,32,32"],
     "no node or module named 'layer9'"),
    ("target of the wrong kind", ["mutate", "{good}", "--pass", "grow_width(target=1)", "--input-shape", "1,3,32,32"],
     "'1' is BatchNorm2d; grow_width widens a conv or Linear layer"),
    ("impossible input shape", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32"],
     "cannot run on an input of shape (1, 3, 32)"),
    ("malformed input shape", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,-32,32"], "is not a valid shape"),
    ("NaN weights", ["mutate", "{nan}", "--pass", "add_residual", "--input-shape", "1,3,32,32"], "has NaN or Inf values in '3.weight'"),
    ("Inf weights", ["export", "{inf}", "-o", "{tmp}/inf.onnx", "--input-shape", "1,3,32,32"], "has NaN or Inf values in '3.weight'"),
    ("output in a missing folder", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", "{tmp}/no/x.pt"],
     "does not exist"),
    ("output in a read-only folder", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", f"{READ_ONLY}/x.pt"],
     "is not writable"),
    ("ONNX output in a read-only folder", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32",
                                           "-o", "{tmp}/ok.pt", "--onnx", f"{READ_ONLY}/x.onnx"], "is not writable"),
    ("output equal to the input", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", "{good}"],
     "is the input file"),
    ("a pass that cannot apply", ["mutate", "{good}", "--pass", "grow_width(target=3,to=8)", "--input-shape", "1,3,32,32"],
     "would narrow it"),
]


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("label, argv, message", MATRIX, ids=[m[0] for m in MATRIX])
def test_cli_matrix(tmp_path, label, argv, message):
    files = make_inputs(tmp_path)
    before = digest(tmp_path)
    args = [a.format(tmp=tmp_path, **files) for a in argv]
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, (label, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (label, proc.stderr)
    assert message in lines[0], (label, lines[0])
    assert lines[0].endswith(")"), "every message ends with the way out, in parentheses"
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert digest(tmp_path) == before, f"{label}: something was written or changed"
    assert not (tmp_path / "ran").exists()


def test_api_matrix(tmp_path):
    files = make_inputs(tmp_path)
    for key in ("empty", "truncated", "corrupted", "onnx", "text", "code", "raw_pickle", "custom"):
        with pytest.raises(gg.LoadError):
            load_model(files[key])
    assert not (tmp_path / "ran").exists()
    with pytest.raises(gg.LoadError, match="NaN or Inf"):
        open_model(str(files["nan"]), (1, 3, 32, 32))
    with pytest.raises(gg.InputError):
        parse_input_shape("1,3,0,32")
    with pytest.raises(gg.SpecError):
        gg.build_pipeline("grow_width(factor=big)")
    with pytest.raises(gg.SaveError, match="is not writable"):
        mutate(str(files["good"]), ["add_residual"], out=str(READ_ONLY / "x.pt"), input_shape="1,3,32,32")
    assert isinstance(load_model(files["custom"], trust=True).module, Custom)  # the explicit way out works


def test_success_leaves_the_input_file_and_model_bit_identical(tmp_path):
    files = make_inputs(tmp_path)
    before = files["good"].read_bytes(), files["good"].stat().st_mtime_ns
    report = mutate(str(files["good"]), ["grow_width", "add_residual"], input_shape="1,3,32,32")
    assert (files["good"].read_bytes(), files["good"].stat().st_mtime_ns) == before
    assert Path(report["outputs"][0]).name == "good.grown.pt"


def test_crash_during_save_leaves_the_old_output_or_none(tmp_path, monkeypatch, cnn):
    gm = gg.Pipeline.from_spec("add_residual").run(gg.trace(cnn, (1, 3, 32, 32))).gm
    out = tmp_path / "grown.pt"
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        Path(f).write_bytes(Path(f).read_bytes()[:1000])  # half written ...
        raise KeyboardInterrupt  # ... when the process is killed

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_model(gm, out)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # none, and no temp file left
    monkeypatch.setattr(torch, "save", real_save)
    save_model(gm, out)
    old = out.read_bytes()
    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_model(gm, out)
    assert out.read_bytes() == old and list(tmp_path.iterdir()) == [out]  # the old file, whole
    assert isinstance(load_model(out).module, torch.fx.GraphModule)
