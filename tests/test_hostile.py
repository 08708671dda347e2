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
from graphgrow.input_shape import parse_input_shape
from graphgrow.workflow import mutate, open_model
from conftest import ROOT, run_cli, small_cnn

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
    ("diagram format", ["mutate", "{good}", "--pass", "deepen", "--input-shape", "1,3,32,32", "--diagram", "{tmp}/d.txt"],
     "cannot draw to a .txt file"),
    ("diff diagram format", ["diff", "{good}", "{good}", "--diagram", "{tmp}/d.jpg"], "cannot draw to a .jpg file"),
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
    ("a character device as output", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32",
                                      "-o", "/dev/null"], "is not a regular file"),
    ("the same file for -o and --onnx", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32",
                                         "-o", "{tmp}/x", "--onnx", "{tmp}/x"], "(-o, --onnx, --diagram) name the same file"),
    ("a factory that exits", ["inspect", "factories:exits"], "factories:exits() failed: SystemExit"),
    ("the standard library as a factory", ["inspect", "builtins:exit"], "in Python's standard library, not a model factory"),
    ("markup in a pass spec", ["mutate", "{good}", "--pass", "add_residual(start=[/x])", "--input-shape", "1,3,32,32"],
     "[/x]"),
    ("a huge factor", ["mutate", "{good}", "--pass", "grow_width(factor=1e9)", "--input-shape", "1,3,32,32"],
     "factor must be in (0, 16]"),
    ("a NaN factor", ["mutate", "{good}", "--pass", "grow_width(factor=nan)", "--input-shape", "1,3,32,32"],
     "must be a finite number"),
    ("an infinite factor", ["mutate", "{good}", "--pass", "grow_width(factor=inf)", "--input-shape", "1,3,32,32"],
     "must be a finite number"),
    ("100,000 branches", ["mutate", "{good}", "--pass", "add_branch(count=100000)", "--input-shape", "1,3,32,32"],
     "count must be 1 to 16"),
    ("a huge input shape", ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,50000,50000"],
     "too large for an example input"),
    ("more parameters than allowed", ["mutate", "{good}", "--pass", "grow_width(factor=16)", "--input-shape", "1,3,32,32",
                                      "--max-params", "1000"], "parameters (limit 1,000)"),
    ("more activation memory than allowed", ["mutate", "{good}", "--pass", "deepen", "--input-shape", "1,3,32,32",
                                             "--max-memory", "1K"], "of activations on an input of shape (1, 3, 32, 32)"),
    ("a limit that is not a size", ["mutate", "{good}", "--pass", "deepen", "--input-shape", "1,3,32,32",
                                    "--max-params", "lots"], "is not a size"),
    ("a 100 kB argument", ["mutate", "{good}", "--pass", "add_residual(start=" + "a" * 100_000 + ")",
                           "--input-shape", "1,3,32,32"], "more characters)"),
]


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("label, argv, message", MATRIX, ids=[m[0] for m in MATRIX])
def test_cli_matrix(tmp_path, label, argv, message):
    files = make_inputs(tmp_path)
    before = digest(tmp_path)
    args = [a.format(tmp=tmp_path, **files) for a in argv]
    proc = run_cli(*args, cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")})  # tests/factories.py
    assert proc.returncode == 2, (label, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("  ")]  # a spec error adds spec + caret
    assert len(lines) == 1 and lines[0].startswith("error: "), (label, proc.stderr)
    pointer = [l for l in proc.stderr.splitlines() if l.startswith("  ")]
    assert not pointer or (len(pointer) == 2 and pointer[1].strip() == "^"), (label, proc.stderr)
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


def test_a_seed_past_64_bits_is_refused(tmp_path):
    files = make_inputs(tmp_path)
    before = digest(tmp_path)
    proc = run_cli("mutate", str(files["good"]), "--pass", "add_residual", "--input-shape", "1,3,32,32", "--seed", str(2**70),
                   cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert digest(tmp_path) == before


def test_a_printing_factory_keeps_json_parseable(tmp_path):
    import json

    from conftest import ROOT

    proc = run_cli("inspect", "test_hostile:noisy_factory", "--json", cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["input_shape"] == [1, 20]
    assert "hello from the factory" in proc.stderr


def noisy_factory():
    print("hello from the factory")
    return nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 2))


def test_saved_files_follow_the_umask(tmp_path, cnn):
    old = os.umask(0o022)
    try:
        out = save_model(gg.trace(cnn, (1, 3, 32, 32)), tmp_path / "m.pt")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644


def test_a_failing_later_step_leaves_no_output_at_all(tmp_path, monkeypatch, cnn):
    import graphgrow.export as export

    src = tmp_path / "m.pt"
    torch.save(cnn, src)

    def broken(*a, **k):
        raise gg.ExportError("the disk is full")

    monkeypatch.setattr(export, "export_onnx", broken)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(gg.ExportError):
        mutate(str(src), ["add_residual"], out=str(tmp_path / "g.pt"), onnx_out=str(tmp_path / "g.onnx"), input_shape="1,3,32,32")
    assert sorted(os.listdir(tmp_path)) == before  # neither the .pt nor a temp file


def test_sigterm_mid_command_leaves_nothing_behind(tmp_path, cnn):
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "m.pt"
    torch.save(cnn, src)
    before = sorted(os.listdir(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "graphgrow.cli", "mutate", str(src), "--pass", "add_residual",
                             "--input-shape", "1,3,32,32", "-o", str(tmp_path / "g.pt"), "--onnx", str(tmp_path / "g.onnx")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.endswith(".part") for p in os.listdir(tmp_path)):
        time.sleep(0.02)
    assert any(p.endswith(".part") for p in os.listdir(tmp_path)), "the command never staged an output"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM)" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before


def test_corrupted_tensor_bytes_are_caught_by_the_crc(tmp_path, cnn):
    import zipfile

    src = tmp_path / "m.pt"
    torch.save(cnn, src)
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        member = next(m for m in z.infolist() if "/data/" in m.filename and m.file_size > 64)
        start = member.header_offset + 30 + len(member.filename.encode()) + len(member.extra)
    data[start + 8] ^= 0xFF  # one flipped byte inside a stored tensor; the zip structure is intact
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    proc = run_cli("mutate", str(bad), "--pass", "add_residual", "--input-shape", "1,3,32,32", cwd=tmp_path)
    assert proc.returncode == 2 and "do not match their checksum (CRC)" in proc.stderr, proc.stderr
    assert not any(p.name.startswith("bad.grown") for p in tmp_path.iterdir())


def test_an_input_shape_whose_activations_exceed_the_limit_is_refused_before_any_forward(tmp_path):
    src = tmp_path / "wide.pt"
    torch.save(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1)), src)
    before = digest(tmp_path)
    # 64 channels × 4000² × 4 bytes × batch 3 ≈ 11 GiB per activation: refused from the meta-device estimate
    proc = run_cli("mutate", str(src), "--pass", "deepen", "--input-shape", "1,3,4000,4000", cwd=tmp_path)
    assert proc.returncode == 2 and "GiB of activations" in proc.stderr and "--max-memory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and digest(tmp_path) == before
    proc = run_cli("inspect", str(src), "--input-shape", "1,3,4000,4000", cwd=tmp_path)
    assert proc.returncode == 2 and "GiB of activations" in proc.stderr, proc.stderr


def test_a_pass_whose_grown_model_needs_more_memory_is_refused_before_it_runs(cnn):
    from graphgrow.budget import Limits, activation_bytes, meta_copy
    from graphgrow.pipeline import Pipeline

    gm = gg.trace(cnn, (1, 3, 32, 32))
    gg.annotate(gm, (1, 3, 32, 32))
    pipeline = Pipeline.from_spec(["deepen"])
    pipeline.limits = Limits(max_memory=activation_bytes(meta_copy(gm), (1, 3, 32, 32)) + 1)  # the model fits, deepened it does not
    with pytest.raises(gg.NotApplicable, match=r"deepen would need about .* MiB of activations at batch 3"):
        pipeline.run(gm)


def test_the_load_size_cap_is_a_flag(tmp_path, cnn):
    src = tmp_path / "m.pt"
    torch.save(cnn, src)
    before = digest(tmp_path)
    proc = run_cli("inspect", str(src), "--input-shape", "1,3,32,32", "--max-load", "1K", cwd=tmp_path)
    assert proc.returncode == 2 and "would unpack to" in proc.stderr and "--max-load" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and digest(tmp_path) == before
    proc = run_cli("inspect", str(src), "--input-shape", "1,3,32,32", "--max-load", "lots", cwd=tmp_path)
    assert proc.returncode == 2 and "is not a size" in proc.stderr, proc.stderr
    assert run_cli("inspect", str(src), "--input-shape", "1,3,32,32", "--max-load", "1G", cwd=tmp_path).returncode == 0


def test_a_decompression_bomb_is_refused_before_it_inflates(tmp_path):
    import zipfile

    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        z.writestr("archive/data/0", b"\x00" * (64 << 20))
    with pytest.raises(gg.LoadError, match="decompression bomb"):
        load_model(bomb)


@pytest.mark.parametrize("spec", ["add_residual", "grow_width", "add_branch", "deepen", "insert_adapter"])
def test_grown_models_keep_the_input_models_training_flags(spec, cnn, tmp_path):
    gm = gg.trace(cnn, (1, 3, 32, 32)).eval()
    grown = gg.Pipeline.from_spec(spec).run(gm).gm
    assert not any(m.training for m in grown.modules())
    save_model(grown, tmp_path / "g.pt")
    assert not any(m.training for m in load_model(tmp_path / "g.pt").module.modules())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_models_are_refused_with_the_reason(dtype, cnn):
    gm = gg.trace(cnn.to(dtype), (1, 3, 32, 32), check=False)
    with pytest.raises(gg.InputError, match="grow a float32 copy"):
        gg.Pipeline.from_spec("add_residual").run(gm)


@pytest.mark.slow
def test_check_on_a_float64_model_is_a_clear_refusal_and_writes_nothing(tmp_path):
    src = tmp_path / "m.pt"
    torch.save(small_cnn().double(), src)
    before = digest(tmp_path)
    proc = run_cli("mutate", str(src), "--pass", "add_residual", "--input-shape", "1,3,32,32", "--onnx", str(tmp_path / "m.onnx"),
                   "--check", cwd=tmp_path)
    assert proc.returncode == 2 and "onnxruntime cannot load this model" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert digest(tmp_path) == before


# --- issue 20: stored names never reach generated code ---

def _hostile_graphgrow_file(tmp: Path, field: str, marker: Path) -> Path:
    """A graphgrow file made by graphgrow, then one name edited by hand (the format kept)."""
    good = tmp / "good.grown.pt"
    save_model(gg.trace(small_cnn(), (1, 3, 16, 16)), good)
    p = torch.load(good, weights_only=False)
    if field == "placeholder":  # fx pastes the target into `def forward(self, <target>)`
        x = next(r for r in p["nodes"] if r["op"] == "placeholder")
        x["target"] = f"input=__import__('os').system('touch {marker}')"
    elif field == "module_name":  # fx writes getattr(self, "NAME") unescaped
        evil = f'6")if(getattr(__import__("os"),"system")("touch\\x20{marker}"))else(getattr)(self,"6'
        p["root"]._modules = type(p["root"]._modules)((evil if k == "6" else k, v) for k, v in p["root"]._modules.items())
        for r in p["nodes"]:
            if r["target"] == "6":
                r["target"] = evil
    else:  # keyword names are written as `key = value`
        rec = next(r for r in p["nodes"] if r["op"] == "call_module")
        rec["kwargs"] = {"dict": [[f"a=__import__('os').system('touch {marker}'),b", 1]]}
    bad = tmp / "evil.grown.pt"
    torch.save(p, bad)
    good.unlink()
    return bad


NAME_COMMANDS = {
    "inspect": lambda f, t: ["inspect", str(f)],
    "targets": lambda f, t: ["targets", str(f), "--pass", "deepen"],
    "export": lambda f, t: ["export", str(f), "-o", str(t / "out.onnx")],
    "diff": lambda f, t: ["diff", str(f), str(f)],
    "fold": lambda f, t: ["fold", str(f), "-o", str(t / "folded.pt")],
    "mutate": lambda f, t: ["mutate", str(f), "--pass", "deepen", "-o", str(t / "out.pt")],
    "mutate --trust": lambda f, t: ["mutate", str(f), "--trust", "--pass", "deepen", "-o", str(t / "out.pt")],
}


@pytest.mark.parametrize("field", ["placeholder", "module_name", "keyword"])
@pytest.mark.parametrize("command", list(NAME_COMMANDS))
def test_code_in_a_stored_name_runs_nothing_on_any_command(tmp_path, field, command):
    marker = tmp_path / "pwned"
    bad = _hostile_graphgrow_file(tmp_path, field, marker)
    before = digest(tmp_path)
    proc = run_cli(*NAME_COMMANDS[command](bad, tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not a plain name" in lines[0], proc.stderr
    assert not marker.exists() and digest(tmp_path) == before and not proc.stdout


def test_code_in_a_pickled_module_name_runs_nothing(tmp_path):
    """A plain torch.save file of standard layers: its module names become code when fx traces it."""
    marker = tmp_path / "pwned"
    model = small_cnn()
    evil = f'0")if(getattr(__import__("os"),"system")("touch\\x20{marker}"))else(getattr)(self,"0'
    model._modules = type(model._modules)((evil if k == "0" else k, v) for k, v in model._modules.items())
    f = tmp_path / "evil.pt"
    torch.save(model, f)
    before = digest(tmp_path)
    for argv in (["inspect", str(f)], ["mutate", str(f), "--pass", "deepen", "--input-shape", "1,3,16,16"]):
        proc = run_cli(*argv, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "not a plain name" in proc.stderr, proc.stderr
    assert not marker.exists() and digest(tmp_path) == before
