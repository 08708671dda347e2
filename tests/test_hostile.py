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
from conftest import ROOT, run_cli, small_cnn
from torch import nn

import graphgrow as gg
from graphgrow.capture.input_shape import parse_input_shape
from graphgrow.io.load import load_model
from graphgrow.io.save import save_model
from graphgrow.jobs.workflow import mutate, open_model

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
    files = {
        "good": tmp / "good.pt",
        "empty": tmp / "empty.pt",
        "truncated": tmp / "trunc.pt",
        "corrupted": tmp / "corrupt.pt",
        "onnx": tmp / "m.onnx",
        "text": tmp / "notes.pt",
        "code": tmp / "code.pt",
        "raw_pickle": tmp / "raw.pkl",
        "custom": tmp / "custom.pt",
        "nan": tmp / "nan.pt",
        "inf": tmp / "inf.pt",
    }
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
    (
        "diagram format",
        ["mutate", "{good}", "--pass", "deepen", "--input-shape", "1,3,32,32", "--diagram", "{tmp}/d.txt"],
        "cannot draw to a .txt file",
    ),
    ("diff diagram format", ["diff", "{good}", "{good}", "--diagram", "{tmp}/d.jpg"], "cannot draw to a .jpg file"),
    ("text file", ["mutate", "{text}", "--pass", "add_residual"], "is a text file"),
    ("code in a pickle", ["mutate", "{code}", "--pass", "add_residual"], "refused, nothing was run"),
    ("raw pickle", ["mutate", "{raw_pickle}", "--pass", "add_residual"], "refused without --trust"),
    ("custom class", ["mutate", "{custom}", "--pass", "add_residual"], "contains the custom class test_hostile.Custom"),
    (
        "unknown pass",
        ["mutate", "{good}", "--pass", "grow_depth", "--input-shape", "1,3,32,32"],
        "unknown pass 'grow_depth' (valid passes:",
    ),
    (
        "unknown argument",
        ["mutate", "{good}", "--pass", "grow_width(size=3)", "--input-shape", "1,3,32,32"],
        "pass grow_width has no argument 'size' (valid arguments: target, factor, to, mode, init, data)",
    ),
    (
        "wrong argument type",
        ["mutate", "{good}", "--pass", "grow_width(factor=big)", "--input-shape", "1,3,32,32"],
        "grow_width(factor=...) must be float, got 'big'",
    ),
    (
        "wrong choice",
        ["mutate", "{good}", "--pass", "grow_width(mode=wide)", "--input-shape", "1,3,32,32"],
        "grow_width(mode=...) must be one of group, adapter",
    ),
    (
        "missing target",
        ["mutate", "{good}", "--pass", "grow_width(target=layer9)", "--input-shape", "1,3,32,32"],
        "no node or module named 'layer9'",
    ),
    (
        "target of the wrong kind",
        ["mutate", "{good}", "--pass", "grow_width(target=1)", "--input-shape", "1,3,32,32"],
        "'1' is BatchNorm2d; grow_width widens a conv or Linear layer",
    ),
    (
        "impossible input shape",
        ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32"],
        "cannot run on an input of shape (1, 3, 32)",
    ),
    (
        "malformed input shape",
        ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,-32,32"],
        "is not a valid shape",
    ),
    (
        "NaN weights",
        ["mutate", "{nan}", "--pass", "add_residual", "--input-shape", "1,3,32,32"],
        "has NaN or Inf values in '3.weight'",
    ),
    (
        "Inf weights",
        ["export", "{inf}", "-o", "{tmp}/inf.onnx", "--input-shape", "1,3,32,32"],
        "has NaN or Inf values in '3.weight'",
    ),
    (
        "output in a missing folder",
        ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", "{tmp}/no/x.pt"],
        "does not exist",
    ),
    (
        "output in a read-only folder",
        ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", f"{READ_ONLY}/x.pt"],
        "is not writable",
    ),
    (
        "ONNX output in a read-only folder",
        [
            "mutate",
            "{good}",
            "--pass",
            "add_residual",
            "--input-shape",
            "1,3,32,32",
            "-o",
            "{tmp}/ok.pt",
            "--onnx",
            f"{READ_ONLY}/x.onnx",
        ],
        "is not writable",
    ),
    (
        "output equal to the input",
        ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", "{good}"],
        "is the input file",
    ),
    (
        "a pass that cannot apply",
        ["mutate", "{good}", "--pass", "grow_width(target=3,to=8)", "--input-shape", "1,3,32,32"],
        "would narrow it",
    ),
    (
        "a character device as output",
        ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", "/dev/null"],
        "is not a regular file",
    ),
    (
        "the same file for -o and --onnx",
        [
            "mutate",
            "{good}",
            "--pass",
            "add_residual",
            "--input-shape",
            "1,3,32,32",
            "-o",
            "{tmp}/x",
            "--onnx",
            "{tmp}/x",
        ],
        "(-o, --onnx, --diagram) name the same file",
    ),
    ("a factory that exits", ["inspect", "factories:exits"], "factories:exits() failed: SystemExit"),
    (
        "the standard library as a factory",
        ["inspect", "builtins:exit"],
        "in Python's standard library, not a model factory",
    ),
    (
        "markup in a pass spec",
        ["mutate", "{good}", "--pass", "add_residual(start=[/x])", "--input-shape", "1,3,32,32"],
        "[/x]",
    ),
    (
        "a huge factor",
        ["mutate", "{good}", "--pass", "grow_width(factor=1e9)", "--input-shape", "1,3,32,32"],
        "grow_width(factor=...) must be in (0, 16]",
    ),
    (
        "a NaN factor",
        ["mutate", "{good}", "--pass", "grow_width(factor=nan)", "--input-shape", "1,3,32,32"],
        "must be a finite number",
    ),
    (
        "an infinite factor",
        ["mutate", "{good}", "--pass", "grow_width(factor=inf)", "--input-shape", "1,3,32,32"],
        "must be a finite number",
    ),
    (
        "100,000 branches",
        ["mutate", "{good}", "--pass", "add_branch(count=100000)", "--input-shape", "1,3,32,32"],
        "add_branch(count=...) must be in [1, 16]",
    ),
    (
        "a huge input shape",
        ["mutate", "{good}", "--pass", "add_residual", "--input-shape", "1,3,50000,50000"],
        "too large for an example input",
    ),
    (
        "more parameters than allowed",
        ["mutate", "{good}", "--pass", "grow_width(factor=16)", "--input-shape", "1,3,32,32", "--max-params", "1000"],
        "parameters (limit 1,000)",
    ),
    (
        "more activation memory than allowed",
        ["mutate", "{good}", "--pass", "deepen", "--input-shape", "1,3,32,32", "--max-memory", "1K"],
        "of activations on an input of shape (1, 3, 32, 32)",
    ),
    (
        "a limit that is not a size",
        ["mutate", "{good}", "--pass", "deepen", "--input-shape", "1,3,32,32", "--max-params", "lots"],
        "is not a size",
    ),
    (
        "a 100 kB argument",
        ["mutate", "{good}", "--pass", "add_residual(start=" + "a" * 100_000 + ")", "--input-shape", "1,3,32,32"],
        "more characters)",
    ),
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
    lines = [
        l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("  ")
    ]  # a spec error adds spec + caret
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
        path = Path(getattr(f, "name", f))  # torch.save gets a file object (outputs.torch_save) or a path
        path.write_bytes(path.read_bytes()[:1000])  # half written ...
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
    proc = run_cli(
        "mutate",
        str(files["good"]),
        "--pass",
        "add_residual",
        "--input-shape",
        "1,3,32,32",
        "--seed",
        str(2**70),
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert digest(tmp_path) == before


def test_a_printing_factory_keeps_json_parseable(tmp_path):
    import json

    from conftest import ROOT

    proc = run_cli(
        "inspect", "test_hostile:noisy_factory", "--json", cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")}
    )
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
    import graphgrow.io.export as export

    src = tmp_path / "m.pt"
    torch.save(cnn, src)

    def broken(*a, **k):
        raise gg.ExportError("the disk is full")

    monkeypatch.setattr(export, "export_onnx", broken)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(gg.ExportError):
        mutate(
            str(src),
            ["add_residual"],
            out=str(tmp_path / "g.pt"),
            onnx_out=str(tmp_path / "g.onnx"),
            input_shape="1,3,32,32",
        )
    assert sorted(os.listdir(tmp_path)) == before  # neither the .pt nor a temp file


def test_sigterm_mid_command_leaves_nothing_behind(tmp_path, cnn):
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "m.pt"
    torch.save(cnn, src)
    before = sorted(os.listdir(tmp_path))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graphgrow.cli",
            "mutate",
            str(src),
            "--pass",
            "add_residual",
            "--input-shape",
            "1,3,32,32",
            "-o",
            str(tmp_path / "g.pt"),
            "--onnx",
            str(tmp_path / "g.onnx"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    from graphgrow.analysis.budget import Limits, activation_bytes, meta_copy
    from graphgrow.graph.inputs import plain_spec
    from graphgrow.jobs.pipeline import Pipeline

    gm = gg.trace(cnn, (1, 3, 32, 32))
    gg.annotate(gm, (1, 3, 32, 32))
    pipeline = Pipeline.from_spec(["deepen"])
    pipeline.limits = Limits(
        max_memory=activation_bytes(meta_copy(gm), plain_spec((1, 3, 32, 32))) + 1
    )  # the model fits, deepened it does not
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
def test_low_precision_models_grow_in_their_dtype_and_say_how_they_were_compared(dtype, cnn):
    """Once refused ("grow a float32 copy"); since issue 40 a half-precision model grows in its own dtype, compared in
    float32 on its stored values (BatchNorm's running statistics updated in train mode included)."""
    gm = gg.trace(cnn.to(dtype), (1, 3, 32, 32), check=False)
    (step,) = gg.Pipeline.from_spec("add_residual").run(gm).results
    assert {p.dtype for p in step.gm.parameters()} == {dtype}
    pres = step.preservation
    assert pres.eval.ok and pres.train.ok and pres.trainable_ok
    assert pres.eval.low_precision is not None and pres.eval.low_precision.dtype == str(dtype).removeprefix("torch.")
    assert any("compared in float32 on the stored values" in note for note in step.notes), step.notes


@pytest.mark.slow
def test_check_on_a_float64_model_is_a_clear_refusal_and_writes_nothing(tmp_path):
    src = tmp_path / "m.pt"
    torch.save(small_cnn().double(), src)
    before = digest(tmp_path)
    proc = run_cli(
        "mutate",
        str(src),
        "--pass",
        "add_residual",
        "--input-shape",
        "1,3,32,32",
        "--onnx",
        str(tmp_path / "m.onnx"),
        "--check",
        cwd=tmp_path,
    )
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
        p["root"]._modules = type(p["root"]._modules)(
            (evil if k == "6" else k, v) for k, v in p["root"]._modules.items()
        )
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


NAME_CASES = [(c, "module_name") for c in NAME_COMMANDS] + [
    (c, f) for c in ("inspect", "mutate --trust") for f in ("placeholder", "keyword")
]


@pytest.mark.parametrize("command, field", NAME_CASES)
def test_code_in_a_stored_name_runs_nothing_on_any_command(tmp_path, field, command):
    """A module name is data (issue 38): the command runs, the name reached through a generated identifier. An
    input or keyword name is Python syntax in the forward: one that is not a plain name is refused."""
    marker = tmp_path / "pwned"
    bad = _hostile_graphgrow_file(tmp_path, field, marker)
    before = digest(tmp_path)
    source = bad.read_bytes()
    proc = run_cli(*NAME_COMMANDS[command](bad, tmp_path), cwd=tmp_path)
    assert not marker.exists() and bad.read_bytes() == source
    if field == "module_name":
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not a plain name" in lines[0], proc.stderr
    assert digest(tmp_path) == before and not proc.stdout


def test_code_in_a_pickled_module_name_runs_nothing(tmp_path):
    """A plain torch.save file of standard layers: its module names are data when fx traces it (issue 38)."""
    import json

    marker = tmp_path / "pwned"
    model = small_cnn()
    evil = f'0")if(getattr(__import__("os"),"system")("touch\\x20{marker}"))else(getattr)(self,"0'
    model._modules = type(model._modules)((evil if k == "0" else k, v) for k, v in model._modules.items())
    f = tmp_path / "evil.pt"
    torch.save(model, f)
    source = f.read_bytes()
    for argv in (
        ["inspect", str(f), "--input-shape", "1,3,16,16"],
        ["mutate", str(f), "--pass", "deepen", "--input-shape", "1,3,16,16"],
    ):
        proc = run_cli(*argv, cwd=tmp_path)  # kept as data (issue 38): traced through generated identifiers
        assert proc.returncode == 0, proc.stderr
    shown = run_cli("inspect", str(tmp_path / "evil.grown.pt"), "--json", cwd=tmp_path).stdout
    assert json.dumps(evil)[1:-1] in shown  # the name came back as it was
    assert not marker.exists() and f.read_bytes() == source


# --- issue 20: ONNX external data anywhere, sessions sealed; memory estimates fail closed ---
def _leak_tensor(name: str = "leak", dims=(1, 4), location: int | None = None):
    """A float tensor whose bytes, it says, are in secret.bin beside the model (the folder the command runs in)."""
    import onnx

    t = onnx.TensorProto(
        name=name,
        data_type=onnx.TensorProto.FLOAT,
        dims=list(dims),
        data_location=onnx.TensorProto.EXTERNAL if location is None else location,
    )
    for key, value in (("location", "secret.bin"), ("offset", "0"), ("length", "16")):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _sparse_leak():
    import onnx

    indices = onnx.helper.make_tensor("idx", onnx.TensorProto.INT64, [4], [0, 1, 2, 3])
    return onnx.SparseTensorProto(values=_leak_tensor("vals", (4,)), indices=indices, dims=[1, 4])


def leaky_onnx(where: str):
    """y = x + c for x of shape (batch, 4), where c comes from a tensor naming external data at `where`."""
    from onnx import TensorProto, helper

    def const(out: str, **value):
        return helper.make_node("Constant", [], [out], **value)

    def branch(nodes, out: str):
        return helper.make_graph(nodes, "branch", [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, 4])])

    def if_node(then_nodes, out: str):
        zeros = const("z", value=helper.make_tensor("zeros", TensorProto.FLOAT, [1, 4], [0.0] * 4))
        return helper.make_node(
            "If", ["cond"], [out], then_branch=branch(then_nodes, "t"), else_branch=branch([zeros], "z")
        )

    cond = const("cond", value=helper.make_tensor("true", TensorProto.BOOL, [], [True]))
    nodes, inits, sparse, functions, domains = [], [], [], [], [helper.make_opsetid("", 18)]
    if where == "constant":
        nodes = [const("c", value=_leak_tensor())]
    elif where == "sparse constant":
        nodes = [const("c", sparse_value=_sparse_leak())]
    elif where == "default location":  # DEFAULT, yet external_data entries: refused too
        nodes = [const("c", value=_leak_tensor(location=TensorProto.DEFAULT))]
    elif where == "if branch":
        nodes = [cond, if_node([const("t", value=_leak_tensor())], "c")]
    elif where == "nested if":
        nodes = [cond, if_node([cond, if_node([const("t", value=_leak_tensor())], "t")], "c")]
    elif where == "function":
        functions = [
            helper.make_function(
                "leak.custom", "Leak", [], ["out"], [const("out", value=_leak_tensor())], [helper.make_opsetid("", 18)]
            )
        ]
        domains.append(helper.make_opsetid("leak.custom", 1))
        nodes = [helper.make_node("Leak", [], ["c"], domain="leak.custom")]
    elif where == "initializer":
        inits = [_leak_tensor("c")]
    elif where == "sparse initializer":
        s = _sparse_leak()
        s.values.name = "c"
        sparse = [s]
    graph = helper.make_graph(
        nodes + [helper.make_node("Add", ["x", "c"], ["y"])],
        "leaky",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=inits,
        sparse_initializer=sparse,
    )
    model = helper.make_model(graph, opset_imports=domains, functions=functions)
    model.ir_version = 10
    return model


LEAKS = [
    "constant",
    "sparse constant",
    "default location",
    "if branch",
    "nested if",
    "function",
    "initializer",
    "sparse initializer",
]
SECRET = torch.tensor([4242.25, -4242.5, 4243.75, -4244.0], dtype=torch.float32).numpy().tobytes()


def _leaky_folder(tmp: Path, where: str) -> Path:
    import onnx

    (tmp / "secret.bin").write_bytes(SECRET)
    torch.save(nn.Sequential(nn.Linear(4, 4)), tmp / "m.pt")
    onnx.save(leaky_onnx(where), str(tmp / "leak.onnx"))
    return tmp / "leak.onnx"


def _refused_without_reading(proc, tmp: Path, before: dict, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(")"), proc.stderr
    assert message in lines[0], lines[0]
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert not any(v in proc.stderr for v in ("4242", "4243", "4244")), "the secret's values were shown"
    assert digest(tmp) == before


@pytest.mark.parametrize("where", LEAKS)
def test_check_refuses_external_data_anywhere_in_an_onnx_file(tmp_path, where):
    leak = _leaky_folder(tmp_path, where)
    before = digest(tmp_path)
    proc = run_cli("check", str(leak), "m.pt", "--input-shape", "1,4", cwd=tmp_path)  # run from the model's folder
    _refused_without_reading(proc, tmp_path, before, "external file")


@pytest.mark.parametrize("where", ["constant", "if branch", "function"])
@pytest.mark.parametrize("command", ["inspect", "replay"])
def test_inspect_and_replay_refuse_external_data_outside_the_initializers(tmp_path, where, command):
    _leaky_folder(tmp_path, where)
    before = digest(tmp_path)
    argv = ["inspect", "leak.onnx"] if command == "inspect" else ["replay", "m.pt", "leak.onnx", "--input-shape", "1,4"]
    proc = run_cli(*argv, cwd=tmp_path)
    _refused_without_reading(proc, tmp_path, before, "external file")


def test_every_place_a_tensor_can_sit_is_searched():
    import onnx

    from graphgrow.io.onnx_external import MAX_GRAPH_DEPTH, external_tensors

    for where in LEAKS:
        assert external_tensors(leaky_onnx(where)), where
    model = leaky_onnx("constant")
    model.graph.node[0].attribute[0].t.Clear()
    assert external_tensors(model) == []  # self-contained again
    lists = onnx.helper.make_attribute("ts", [_leak_tensor()])  # a `tensors` list attribute
    model.graph.node[0].attribute.append(lists)
    assert external_tensors(model) == ["graph node 'Constant' attribute 'ts'"]
    model = leaky_onnx("constant")
    info = model.training_info.add()  # training graphs are graphs too
    info.initialization.initializer.append(_leak_tensor("trained"))
    model.graph.node[0].attribute[0].t.Clear()
    assert external_tensors(model) == ["training graph 0 initializer 'trained'"]
    model = leaky_onnx("function")
    model.functions[0].node[0].attribute[0].t.Clear()
    model.functions[0].attribute_proto.append(onnx.helper.make_attribute("default", _leak_tensor()))  # a default value
    assert external_tensors(model) == ["function 'Leak' attribute 'default'"]
    deep = onnx.helper.make_graph([], "deep", [], [])
    for _ in range(MAX_GRAPH_DEPTH + 2):  # a chain of Ifs deeper than any real model
        deep = onnx.helper.make_graph([onnx.helper.make_node("If", ["c"], ["o"], then_branch=deep)], "d", [], [])
    model.graph.CopyFrom(deep)
    with pytest.raises(gg.LoadError, match="nests subgraphs"):
        external_tensors(model)


@pytest.mark.parametrize("where", ["initializer", "constant"])
def test_onnxruntime_sessions_cannot_resolve_external_data_even_past_the_reader(tmp_path, monkeypatch, where):
    """Defence in depth: a model that names external data reaches onnxruntime (the API, or a reader bug); from the
    model's folder the session still finds nothing: bytes get an empty external-data folder, and a path is
    checked like a file graphgrow reads (only NAME.onnx.data, which this one does not name)."""
    from graphgrow.core.errors import RuntimeUnavailable
    from graphgrow.io.runtime import open_session

    leak = _leaky_folder(tmp_path, where)
    monkeypatch.chdir(tmp_path)
    for model in (leak, "leak.onnx"):
        with pytest.raises(gg.LoadError, match="external file"):
            open_session(model, "cpu")
    with pytest.raises(RuntimeUnavailable, match="cannot load this model"):
        open_session(leak.read_bytes(), "cpu")


def _peak_rss_of(*argv: str, cwd: Path) -> tuple[int, str]:
    """Run the CLI in a fresh wrapper process; (the CLI's peak resident memory in KiB, its stderr)."""
    import subprocess
    import sys

    wrapper = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stdout.write(str(p.returncode) + ' ' + str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
        "sys.stderr.write(p.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, sys.executable, "-m", "graphgrow.cli", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )
    code, peak = proc.stdout.split()
    assert int(code) == 2, proc.stderr
    return int(peak), proc.stderr


def test_a_model_the_estimate_cannot_size_is_refused_before_any_allocation(tmp_path):
    """The issue's case: batch 1 runs, the verification batch of 3 does not, so the meta-device estimate raised and
    the real forward went ahead (3.0 GB peak with --max-memory 256M). Now: exit 2 with the reason and the way out."""
    src = tmp_path / "batch1.pt"
    torch.save(
        nn.Sequential(nn.Unflatten(0, (1,)), nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1)), src
    )
    before = digest(tmp_path)
    argv = ["mutate", "batch1.pt", "--pass", "deepen", "--max-memory", "256M", "--input-shape"]
    small, _ = _peak_rss_of(*argv, "1,3,8,8", cwd=tmp_path)
    big, err = _peak_rss_of(*argv, "1,3,2048,2048", cwd=tmp_path)  # 1 GiB per activation at batch 1
    assert big < small + (256 << 10), f"{(big - small) >> 10} MiB more than on a tiny input: the real forward ran"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "cannot estimate the model's activation memory" in lines[0], err
    assert "runs at batch 1, not 3" in lines[0] and "--max-memory none" in lines[0], err
    assert digest(tmp_path) == before
    proc = run_cli("inspect", "batch1.pt", "--input-shape", "1,3,8,8", "--max-memory", "none", cwd=tmp_path)
    assert proc.returncode == 2 and "cannot run on an input of shape" in proc.stderr, (
        proc.stderr
    )  # lifted: the real run says why


class NeedsData(nn.Module):
    """Scales by a value read from the data (`.item()` has no value on the meta device)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * (x.abs().sum() > 0).float().item()


def needs_data() -> nn.Module:
    return NeedsData()


class MadeOnCpu(nn.Module):
    """Adds a tensor it makes on a named real device (mixed with meta ones, the meta device stops)."""

    def forward(self, x):
        return x + torch.eye(x.shape[-1], device="cpu")[0]


class TakesNone(nn.Module):
    """Takes None for an optional mask and selects by a boolean mask (a size read from the data)."""

    def forward(self, x, mask=None):
        mask = x > 0 if mask is None else mask
        return x + x[mask].sum()


class CallsLeaf(nn.Module):
    def __init__(self, leaf: nn.Module):
        super().__init__()
        self.fc, self.leaf = nn.Linear(4, 4), leaf

    def forward(self, x):
        return self.leaf(self.fc(x), None) if isinstance(self.leaf, TakesNone) else self.leaf(self.fc(x))


@pytest.mark.parametrize(
    "leaf, why",
    [(NeedsData(), "item"), (MadeOnCpu(), "not on the expected device meta"), (TakesNone(), "nonzero")],
    ids=["item", "real-device", "takes-none"],
)
def test_a_model_the_meta_device_cannot_run_is_measured_on_a_real_run_under_the_limit(leaf, why):
    """`.item()`, a tensor made on a real device, a leaf taking None that reads sizes from its data: the meta device
    cannot size them; one real forward at the estimate's batch, under an allocation guard at the limit, does."""
    from graphgrow.analysis.budget import activation_bytes, check_input_memory, meta_copy
    from graphgrow.analysis.budget_estimate import NoEstimate
    from graphgrow.graph.inputs import plain_spec

    spec = plain_spec((1, 4))
    gm = gg.trace(CallsLeaf(leaf), (1, 4), leaves=["leaf"])
    with pytest.raises(NoEstimate, match=why):
        activation_bytes(meta_copy(gm), spec)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    rng = torch.get_rng_state()
    note = check_input_memory(gm, spec)
    assert note is not None and note.startswith("activation memory measured on a real run at batch 3"), note
    assert why in note  # what stopped the meta device
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in before.items())
    with pytest.raises(gg.InputError, match=r"needs more than 0\.0 MiB of activations .* \(measured on a real run"):
        check_input_memory(gm, spec, max_memory=16)  # the guard refuses the first allocation past it


def test_a_data_dependent_model_runs_with_a_note_and_a_broken_one_says_it_cannot_run(tmp_path):
    env = {"PYTHONPATH": str(ROOT / "tests")}
    proc = run_cli("inspect", "test_hostile:needs_data", "--input-shape", "1,4", cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "trace: activation memory measured on a real run" in proc.stdout, proc.stderr
    from graphgrow.analysis.budget import check_input_memory
    from graphgrow.graph.inputs import plain_spec

    class Broken(nn.Module):  # fails for real at the estimate's batch: the real error is the refusal
        def forward(self, x):
            return x + torch.zeros(5 if x.shape[0] == 3 else 4, device="cpu")

    gm = gg.trace(CallsLeaf(Broken()), (1, 4), leaves=["leaf"], check=False)  # as the CLI opens it: checked after
    with pytest.raises(gg.InputError, match=r"cannot run on an input of shape \(1, 4\) at batch 3: node 'leaf'"):
        check_input_memory(gm, plain_spec((1, 4)))


class NamesItsDevice(nn.Module):
    """Names the device it made its tensors on, as a graph torch.export captured does (`.to(device(type='cpu'))`)."""

    def forward(self, x):
        return x + torch.linspace(0, 1, x.shape[-1]).to(torch.device("cpu")) + torch.ones(x.shape[-1], device="cpu")


def test_the_estimate_runs_a_graph_that_names_its_device():
    from graphgrow.analysis.budget import activation_bytes, meta_copy
    from graphgrow.graph.inputs import plain_spec

    gm = gg.trace(NamesItsDevice(), (1, 8))
    assert activation_bytes(meta_copy(gm), plain_spec((1, 8)), batch=3) >= 4 * 3 * 8  # sized, not NoEstimate


def test_the_estimate_covers_a_batch_larger_than_verifications(tmp_path):
    src = tmp_path / "wide.pt"
    torch.save(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1)), src)
    # 2 MiB of activations an example: batch 3 fits in 32M, the batch of 64 asked for does not
    proc = run_cli("inspect", str(src), "--input-shape", "64,3,64,64", "--max-memory", "32M", cwd=tmp_path)
    assert proc.returncode == 2 and "at batch 64 (limit 32.0 MiB)" in proc.stderr, proc.stderr
    assert (
        run_cli("inspect", str(src), "--input-shape", "2,3,64,64", "--max-memory", "32M", cwd=tmp_path).returncode == 0
    )


def test_a_grown_model_the_meta_device_cannot_run_is_measured_or_refused(cnn):
    from graphgrow.analysis.budget import NO_LIMIT, Limits, check_grown
    from graphgrow.graph.inputs import plain_spec

    gm = gg.trace(cnn, (1, 3, 32, 32))
    grown = gg.trace(NeedsData(), (1, 4))  # what a pass might make: it reads a number from the data
    before = {k: v.data_ptr() for k, v in grown.state_dict().items()}
    note = check_grown("p", gm, grown, plain_spec((1, 4)), Limits())
    assert note is not None and "measured on a real run at batch 3" in note and "node 'item'" in note, note
    assert {k: v.data_ptr() for k, v in grown.state_dict().items()} == before  # the meta-device estimate put them back
    assert all(not t.is_meta for t in grown.state_dict().values())
    with pytest.raises(gg.NotApplicable, match=r"p would need more than .* of activations at batch 3 \(measured"):
        check_grown("p", gm, grown, plain_spec((1, 4)), Limits(max_memory=16))
    assert check_grown("p", gm, grown, plain_spec((1, 4)), Limits(max_memory=NO_LIMIT)) is None  # nothing sized


def test_meta_estimates_cover_tensor_constants_and_leaves_that_make_tensors():
    from graphgrow.analysis.budget import activation_bytes, meta_copy
    from graphgrow.graph.inputs import plain_spec

    class MakesTensors(nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[-1]) + torch.tensor([1.0, 2.0, 3.0, 4.0])  # created without a device

    gm = gg.trace(nn.Sequential(nn.Linear(4, 4), MakesTensors()), (1, 4), leaves=["1"])
    assert activation_bytes(meta_copy(gm), plain_spec((1, 4))) > 0
    gm = gg.trace(nn.Sequential(nn.Linear(4, 4), MakesTensors()), (1, 4))  # traced: a _tensor_constant attribute
    assert activation_bytes(meta_copy(gm), plain_spec((1, 4))) > 0

    class Eye(nn.Module):  # a factory torch.export bakes the device into, that graphgrow's table does not write back
        def forward(self, x):
            return (x.unsqueeze(-1) + torch.eye(x.shape[-1], dtype=x.dtype)).sum(-1)

    gm = gg.trace(nn.Sequential(nn.Linear(4, 4), Eye()), (1, 4), capture="export")
    assert "device(type=" not in gm.code  # made on the input's device: meta while sized, CUDA where it runs
    assert activation_bytes(meta_copy(gm), plain_spec((1, 4))) > 0


# --- issue 20: outputs (write errors, staging files, signals after commit) ---


def _graphgrow(*args: str, cwd: Path, setup: str = "", fsize_kb: int | None = None):
    """The real CLI process; `setup` is Python run first (a fault to inject), `fsize_kb` a `ulimit -f`."""
    import cli_fork

    code = f"{setup}\nimport sys\nsys.argv = ['graphgrow', *sys.argv[1:]]\nfrom graphgrow.cli import main\nmain()"
    return cli_fork.run(list(args), cwd, code=code, fsize_kb=fsize_kb)


def _staging(folder: Path) -> list[str]:
    from graphgrow.io.outputs import is_staging_name

    return sorted(p.name for p in folder.iterdir() if is_staging_name(p.name))


def _one_line_refusal(proc, message: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(")"), proc.stderr
    assert message in lines[0], lines[0]
    return lines[0]


WRITE_CASES = [  # label, argv, the output that cannot be written
    ("model", ["mutate", "m.pt", "--pass", "add_residual", "--input-shape", "1,3,32,32"], "m.grown.pt"),
    ("ONNX", ["export", "m.pt", "-o", "m.onnx", "--input-shape", "1,3,32,32"], "m.onnx"),
    (
        "diagram",
        ["mutate", "m.pt", "--pass", "deepen", "--input-shape", "1,3,32,32", "--dry-run", "--diagram", "d.svg"],
        "d.svg",
    ),
    ("fold", ["fold", "m.pt", "--input-shape", "1,3,32,32"], "m.folded.pt"),
]


@pytest.mark.parametrize("label, argv, output", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
def test_a_file_size_limit_is_exit_2_naming_the_output(tmp_path, cnn, label, argv, output):
    torch.save(cnn, tmp_path / "m.pt")
    before = digest(tmp_path)
    proc = _graphgrow(*argv, cwd=tmp_path, fsize_kb=1)  # EFBIG (SIGXFSZ is ignored): torch.save said RuntimeError
    _one_line_refusal(proc, f"cannot write {output}: File too large")
    assert "ulimit -f" in proc.stderr and proc.stdout == ""
    assert digest(tmp_path) == before, "an output or a staging file was left"


@pytest.mark.parametrize(
    "fault, message, code",
    [
        (
            "RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 6208 vs 6128')",
            "cannot write g.pt: the write stopped part-way",
            2,
        ),
        ("OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))", "cannot write g.pt: No space left on device", 2),
        ("OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))", "cannot write g.pt: Disk quota exceeded", 2),
        ("RuntimeError('a bug, not the disk')", "internal error: RuntimeError: a bug, not the disk", 3),
    ],
    ids=["torch writer", "ENOSPC", "EDQUOT", "not a write error"],
)
def test_a_failing_torch_save_is_exit_2_with_nothing_left(tmp_path, cnn, fault, message, code):
    torch.save(cnn, tmp_path / "m.pt")
    before = digest(tmp_path)
    setup = (
        "import errno, os, torch\ndef save(obj, f, *a, **k):\n    f.write(b'PK' * 100)\n"
        f"    raise {fault}\ntorch.save = save"
    )
    proc = _graphgrow(
        "mutate",
        "m.pt",
        "--pass",
        "add_residual",
        "--input-shape",
        "1,3,32,32",
        "-o",
        "g.pt",
        "--onnx",
        "g.onnx",
        cwd=tmp_path,
        setup=setup,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code and len(lines) == 1 and message in lines[0], proc.stderr
    assert digest(tmp_path) == before, "an output or a staging file was left"


def _fake_staging(folder: Path, output: str, pid: int, start: int = 0, host: str | None = None) -> Path:
    from graphgrow.io import outputs

    path = folder / f".{output}.gg-{pid}-{start}-{host or outputs._host_key()}-abcd1234.part"
    path.write_bytes(b"staged by a writer that may be gone")
    return path


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_staging_files_of_a_killed_run_are_removed_by_the_next_run(tmp_path, cnn):
    import signal
    import subprocess
    import sys
    import time

    from graphgrow.io import outputs

    torch.save(cnn, tmp_path / "m.pt")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graphgrow.cli",
            "mutate",
            "m.pt",
            "--pass",
            "add_residual",
            "--input-shape",
            "1,3,32,32",
            "-o",
            "g.pt",
            "--onnx",
            "g.onnx",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        n.startswith(".g.pt.") and n.endswith(".part") for n in _staging(tmp_path)
    ):
        time.sleep(0.01)
    time.sleep(0.3)  # the model is being written or already is: the export runs next
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed = _staging(tmp_path)
    assert any(n.startswith(".g.pt.gg-") for n in killed), "the killed run left no staging file to clean"
    assert not (tmp_path / "g.pt").exists()

    stale = _fake_staging(tmp_path, "x.pt", _dead_pid())
    live = _fake_staging(tmp_path, "y.pt", os.getpid(), outputs._start())  # this test's process: alive
    elsewhere = _fake_staging(
        tmp_path, "z.pt", _dead_pid(), host="0123456789ab"
    )  # another machine's: not ours to judge
    reused = _fake_staging(tmp_path, "w.pt", os.getpid(), outputs._start() + 1)  # a dead writer whose pid was reused
    kept = {
        name: b"not graphgrow's" for name in (".g.pt.part", ".g.pt.gg-1.part", "notes.part", ".g.pt.gg-x-1-2-3.tmp")
    }
    for name, data in kept.items():
        (tmp_path / name).write_bytes(data)
    target = tmp_path / "target.txt"
    target.write_text("a symlink's target")
    (tmp_path / f".s.pt.gg-{_dead_pid()}-0-{outputs._host_key()}-abcd1234.part").symlink_to(target)
    (tmp_path / f".d.pt.gg-{_dead_pid()}-0-{outputs._host_key()}-abcd1234.part").mkdir()

    proc = _graphgrow("mutate", "m.pt", "--pass", "add_residual", "--input-shape", "1,3,32,32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m.grown.pt").is_file(), "a staging file was taken for an earlier output"
    left = _staging(tmp_path)
    assert not any(n.startswith((".g.pt.", ".g.onnx.", ".x.pt.", ".w.pt.")) for n in left), left
    odd = [n for n in os.listdir(tmp_path) if n.startswith((".s.pt.", ".d.pt."))]  # a symlink and a folder
    assert len(odd) == 2 and sorted(left) == sorted([live.name, elsewhere.name, *odd]), left
    assert not stale.exists() and not reused.exists() and live.exists() and elsewhere.exists()
    assert all((tmp_path / name).read_bytes() == data for name, data in kept.items())
    assert target.read_text() == "a symlink's target"


def test_an_output_named_like_a_staging_file_is_refused(tmp_path, cnn):
    from graphgrow.io import outputs

    torch.save(cnn, tmp_path / "m.pt")
    before = digest(tmp_path)
    name = f".g.pt.gg-{_dead_pid()}-0-{outputs._host_key()}-abcd1234.part"
    proc = _graphgrow(
        "mutate", "m.pt", "--pass", "add_residual", "--input-shape", "1,3,32,32", "-o", name, cwd=tmp_path
    )
    _one_line_refusal(proc, "is named like a graphgrow staging file")
    assert digest(tmp_path) == before


SIGNAL_AFTER_COMMIT = """
import os, signal
real = os.replace
def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    if str(dst).endswith('g.pt'):  # the first output is in place, the second not yet
        os.kill(os.getpid(), signal.{sig})
os.replace = replace
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_during_or_after_the_commit_says_the_outputs_are_complete(tmp_path, cnn, sig):
    import signal

    torch.save(cnn, tmp_path / "m.pt")
    proc = _graphgrow(
        "mutate",
        "m.pt",
        "--pass",
        "add_residual",
        "--input-shape",
        "1,3,32,32",
        "-o",
        "g.pt",
        "--onnx",
        "g.onnx",
        cwd=tmp_path,
        setup=SIGNAL_AFTER_COMMIT.format(sig=sig),
    )
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and lines[0] == f"interrupted ({sig}) after writing g.pt, g.onnx: these outputs are complete"
    ), proc.stderr
    assert isinstance(load_model(tmp_path / "g.pt").module, torch.fx.GraphModule)  # both whole, none left half
    assert (tmp_path / "g.onnx").stat().st_size > 0 and _staging(tmp_path) == []


# --- issue 20: model names by allow-list ---
def _fake_caches(tmp: Path) -> tuple[dict[str, str], Path]:
    """A TORCH_HOME and a Hugging Face cache holding, under the names torchvision and hf_hub_download would read,
    pickles that create a canary when unpickled: a build that reads a cache leaves the canary."""
    checkpoints = tmp / "torch_home" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    canary = tmp / "unpickled"
    for name in ("resnet18-f37072fd.pth", "mobilenet_v3_large-8738ca79.pth"):
        torch.save({"x": RunsCode(canary)}, checkpoints / name)
    repo = tmp / "hf" / "models--someone--weights"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    torch.save({"x": RunsCode(canary)}, repo / "snapshots" / ("0" * 40) / "w.pt")
    env = {
        "TORCH_HOME": str(tmp / "torch_home"),
        "HF_HUB_CACHE": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "tests"),
    }
    return env, canary


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


NAME_ESCAPES = [  # label, model name ({tmp}: the test's folder), message
    ("click empties a file", "click:open_file(filename='{tmp}/keep.txt', mode='w')", "open_file: filename='"),
    (
        "click, a file named without a folder",
        "click:open_file(filename='keep.txt', mode='w')",
        "asks for stored weights or a file",
    ),
    (
        "torchvision weights, another spelling",
        "torchvision.models:resnet18(weights='DEFAULT')",
        "weights='DEFAULT' asks for stored",
    ),
    (
        "torchvision backbone weights",
        "torchvision.models.segmentation:lraspp_mobilenet_v3_large(weights_backbone='DEFAULT')",
        "weights_backbone='DEFAULT' asks for stored",
    ),
    (
        "timm load_checkpoint",
        "timm.models:load_checkpoint(model=None, checkpoint_path='{tmp}/evil.pth', weights_only=False)",
        "load_checkpoint: checkpoint_path='",
    ),  # (a long temp path is cut in the middle of the line)
    (
        "timm create_model with a checkpoint file",
        "timm.models:create_model(model_name='resnet18', pretrained=True, "
        "pretrained_cfg_overlay={{'file': '{tmp}/evil.pth'}})",
        "pretrained=True asks for stored",
    ),
    (
        "timm create_model, a checkpoint in a nested dict",
        "timm:resnet18(pretrained_cfg_overlay={{'file': 'evil.pth'}})",
        "pretrained_cfg_overlay=",
    ),
    (
        "timm create_model without weights",
        "timm.models:create_model(model_name='resnet18')",
        "timm's own create_model, not a model",
    ),
    (
        "torchvision get_model",
        "torchvision.models:get_model(name='resnet18')",
        "torchvision's own get_model, not a model",
    ),
    (
        "torch.hub.load",
        "torch.hub:load(repo_or_dir='pytorch/vision', model='resnet18')",
        "repo_or_dir='pytorch/vision' asks",
    ),
    (
        "a URL",
        "torch.utils.model_zoo:load_url(url='https://download.pytorch.org/models/resnet18-f37072fd.pth')",
        "url=",
    ),
    (
        "a path deep in a list",
        "factories:square_linear(n=4, extra=[1, ('{tmp}/evil.pth',)])",
        "names a file, folder or URL",
    ),
    (
        "an existing file by a bare name",
        "factories:square_linear(n=4, extra='keep.txt')",
        "names a file, folder or URL",
    ),
    ("the running command itself", "__main__:main", "__main__:main is in __main__, not a model factory"),
    (
        "graphgrow's own functions",
        "graphgrow.jobs.workflow:export(source='x', out='y')",
        "is in graphgrow, not a model factory",
    ),
    ("pip", "pip:main", "pip's own main, not a model factory"),
]


@pytest.mark.parametrize("label, name, message", NAME_ESCAPES, ids=[e[0] for e in NAME_ESCAPES])
def test_model_names_outside_the_allow_list_run_nothing(tmp_path, label, name, message):
    env, canary = _fake_caches(tmp_path)
    (tmp_path / "keep.txt").write_text("precious")
    torch.save({"x": RunsCode(canary)}, tmp_path / "evil.pth")
    before = _tree(tmp_path)
    proc = run_cli(
        "mutate",
        name.format(tmp=tmp_path),
        "--pass",
        "add_residual",
        "--input-shape",
        "1,3,32,32",
        cwd=tmp_path,
        env=env,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (label, proc.stderr)
    assert message.format(tmp=tmp_path) in lines[0] and lines[0].endswith(")"), (label, lines[0])
    assert proc.stdout == "" and _tree(tmp_path) == before, f"{label}: something was written or changed"
    assert not canary.exists(), f"{label}: a cached pickle was loaded"


def test_a_zoo_model_whose_backbone_defaults_to_stored_weights_reads_no_cache(tmp_path):
    """torchvision's segmentation and detection builders default to ImageNet backbone weights: by name they build
    random weights; the same for the import-path spelling, which goes through the zoo's path."""
    env, canary = _fake_caches(tmp_path)
    for name in (
        "torchvision:lraspp_mobilenet_v3_large(num_classes=3)",
        "torchvision.models.segmentation:lraspp_mobilenet_v3_large(num_classes=3)",
    ):
        proc = run_cli("inspect", name, "--input-shape", "1,3,64,64", "--json", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert not canary.exists(), f"{name} unpickled the torch hub cache"


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "import torchvision\n\ndef build():\n    return torchvision.models.resnet18(weights='DEFAULT')\n",
            "the model asked to download https://download.pytorch.org/models/resnet18-f37072fd.pth",
        ),
        (
            "import torch\nfrom huggingface_hub import hf_hub_download\n\ndef build():\n"
            "    torch.load(hf_hub_download('someone/weights', 'w.pt'), weights_only=False)\n"
            "    return torch.nn.Linear(4, 2)\n",
            "mymodels:build() failed",
        ),
    ],
    ids=["torch hub", "hugging face"],
)
def test_a_factory_that_loads_cached_weights_itself_finds_no_cache(tmp_path, body, message):
    """The user's own factory may ask for stored weights in its code: while it builds, the caches are an empty
    folder."""
    env, canary = _fake_caches(tmp_path)
    (tmp_path / "mymodels.py").write_text(body)
    before = _tree(tmp_path)
    proc = run_cli("mutate", "mymodels:build", "--pass", "add_residual", "--input-shape", "1,4", cwd=tmp_path, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]  # the factory's own output (torch's
    assert proc.returncode == 2 and message in lines[-1], proc.stderr  # "Downloading: ...") goes to stderr first
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]] and "Traceback" not in proc.stderr
    assert not canary.exists(), "a cached pickle was loaded"
    assert _tree(tmp_path) == before


class BranchesOnData(nn.Module):
    """fx cannot trace the test on data: the submodule becomes a leaf. Its True branch is 8× larger."""

    def forward(self, x):
        if x.sum() > 0:
            return x.repeat(1, 8)
        return x


def test_a_leaf_that_branches_on_its_data_is_sized_by_its_larger_branch():
    from graphgrow.analysis.budget import activation_bytes, meta_copy
    from graphgrow.capture.trace import trace_report
    from graphgrow.graph.inputs import plain_spec

    gm = gg.trace(nn.Sequential(nn.Linear(4, 4), BranchesOnData()), (1, 4))
    assert "1" in trace_report(gm)["auto_leaves"]
    # batch 3, float32: input 3×4, Linear 3×4, the leaf's larger branch 3×32, the output node (the same 3×32)
    assert activation_bytes(meta_copy(gm), plain_spec((1, 4))) == 4 * (12 + 12 + 96 + 96)
