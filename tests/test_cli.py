"""The `graphgrow` command as a user meets it: outputs, JSON, exit codes, one-line errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import ROOT, run_cli

from graphgrow.cli import main


def invoke(runner, *args):
    return runner.invoke(main, list(args), catch_exceptions=False)


@pytest.mark.slow
def test_mutate_onnx_check_json_end_to_end(tmp_path, cnn_file):
    onnx_path = tmp_path / "out.onnx"
    proc = run_cli(
        "mutate",
        "--pass",
        "add_residual",
        str(cnn_file),
        "--onnx",
        str(onnx_path),
        "--check",
        "--input-shape",
        "1,3,32,32",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # exactly one JSON object on stdout
    p = report["passes"][0]
    assert {"name", "args", "targets", "params_before", "params_after"} <= p.keys()
    assert p["name"] == "add_residual" and p["params_after"] - p["params_before"] == 8448
    assert (
        report["preservation"]["eval_ok"]
        and report["preservation"]["train_ok"]
        and report["preservation"]["trainable_ok"]
    )
    assert report["preservation"]["max_rel_err"] <= 1e-5
    eq = report["equivalence"]
    assert eq["passed"] and eq["provider"] == "cpu" and eq["max_abs_err"] < 1e-4 and eq["vs_original"]["passed"]
    grown = tmp_path / "model.grown.pt"  # beside the input, under a new name
    assert report["outputs"] == [str(grown), str(onnx_path)]
    assert grown.exists() and onnx_path.exists()
    assert "Traceback" not in proc.stderr


def test_mutate_human_output_says_what_it_did(runner, tmp_path, cnn_file):
    out = tmp_path / "g.pt"
    res = invoke(
        runner, "mutate", str(cnn_file), "--pass", "add_residual", "-o", str(out), "--input-shape", "1,3,32,32"
    )
    assert res.exit_code == 0
    assert "skip: 1×1 conv 64→128 stride 2 + BatchNorm(γ=β=0)" in res.output
    assert "params: 94,986 → 103,434" in res.output and f"wrote {out}" in res.output
    # chaining: the output is a graphgrow file and loads without --trust, remembering its input shape
    res2 = invoke(runner, "mutate", str(out), "--pass", "add_residual(start=_3,end=_8)", "-o", str(tmp_path / "g2.pt"))
    assert res2.exit_code == 0, res2.output
    res3 = invoke(runner, "inspect", str(tmp_path / "g2.pt"))
    assert "mutation 1: add_residual()" in res3.output and "mutation 2: add_residual(start=_3, end=_8)" in res3.output


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ["mutate", "{cnn}", "--pass", "add_resdiual", "--input-shape", "1,3,32,32"],
            2,
            "unknown pass 'add_resdiual' (valid passes: ",
        ),
        (
            ["mutate", "{cnn}", "--pass", "add_residual(x=1)", "--input-shape", "1,3,32,32"],
            2,
            "has no argument 'x' (valid arguments: start, end)",
        ),
        (
            ["mutate", "{cnn}", "--pass", "add_residual(start=nope)", "--input-shape", "1,3,32,32"],
            2,
            "no node or module named 'nope'",
        ),
        (["mutate", "{cnn}", "--pass", "add_residual"], 2, "cannot tell the example input shape of"),
        (["mutate", "{cnn}", "--pass", "add_residual", "--input-shape", "1,3,x"], 2, "is not a list of integers"),
        (
            ["mutate", "{cnn}", "--pass", "add_residual", "--input-shape", "1,5,32,32"],
            2,
            "cannot run on an input of shape (1, 5, 32, 32)",
        ),
        (
            ["mutate", "{cnn}", "--pass", "add_residual", "-o", "{cnn}", "--input-shape", "1,3,32,32"],
            2,
            "is the input file",
        ),
        (["mutate", "{tmp}/missing.pt", "--pass", "add_residual"], 2, "no such file"),
        (
            ["mutate", "{cnn}", "--pass", "add_residual", "-o", "{tmp}/no/dir/x.pt", "--input-shape", "1,3,32,32"],
            2,
            "does not exist",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, cnn_file, args, code, message):
    before = sorted(os.listdir(tmp_path))
    content = cnn_file.read_bytes()
    args = [a.format(cnn=cnn_file, tmp=tmp_path) for a in args]
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    lines = [
        l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("  ")
    ]  # a spec error adds spec + caret
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(os.listdir(tmp_path)) == before and cnn_file.read_bytes() == content


def test_json_errors_are_json_too(tmp_path):
    proc = run_cli("mutate", str(tmp_path / "nope.pt"), "--pass", "add_residual", "--json")
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"]["type"] == "LoadError"


def test_debug_shows_the_traceback(tmp_path):
    proc = run_cli("mutate", str(tmp_path / "nope.pt"), "--pass", "add_residual", "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_refuses_code_in_a_model_file_without_trust(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save(RunsCode(), evil)
    proc = run_cli("mutate", str(evil), "--pass", "add_residual", "--input-shape", "1,3,32,32")
    assert proc.returncode == 2 and "refused, nothing was run" in proc.stderr and "--trust" in proc.stderr
    assert not marker.exists()


def test_inspect_and_passes(runner, cnn_file):
    res = invoke(runner, "inspect", str(cnn_file), "--input-shape", "1,3,32,32", "--json")
    data = json.loads(res.output)
    assert data["params"] == 94_986 and data["nodes"][1]["shape"] == [1, 32, 32, 32]
    res = invoke(runner, "passes", "--json")
    info = json.loads(res.output)["add_residual"]
    assert [a["name"] for a in info["args"]] == ["start", "end"] and all(a["default"] is None for a in info["args"])
    assert "add_residual" in invoke(runner, "--help").output or "mutate" in invoke(runner, "--help").output


@pytest.mark.slow
def test_export_then_check(tmp_path, cnn_file):
    onnx_path = tmp_path / "m.onnx"
    proc = run_cli("export", str(cnn_file), "-o", str(onnx_path), "--input-shape", "1,3,32,32")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("check", str(onnx_path), str(cnn_file), "--json")  # input shape read from the ONNX file
    assert proc.returncode == 0, proc.stderr
    eq = json.loads(proc.stdout)["equivalence"]
    assert eq["passed"] and len(eq["cases"]) == 3


@pytest.mark.slow
def test_check_fails_with_exit_1_when_models_differ(tmp_path, cnn_file):
    onnx_path = tmp_path / "m.onnx"
    assert run_cli("export", str(cnn_file), "-o", str(onnx_path), "--input-shape", "1,3,32,32").returncode == 0
    other = tmp_path / "other.pt"
    from conftest import randomize_bn, small_cnn

    torch.save(randomize_bn(small_cnn(), seed=5), other)
    proc = run_cli("check", str(onnx_path), str(other))
    assert proc.returncode == 1 and "FAIL" in proc.stdout


def fixed_size_cnn() -> torch.nn.Sequential:
    """A Sequential of standard layers whose Flatten → Linear fixes a 28×28 input."""
    torch.manual_seed(3)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 14 * 14, 10),
    )


@pytest.mark.slow
def test_issue_command_works_without_input_shape_and_onnx_matches_the_original(tmp_path):
    """`graphgrow mutate --pass add_residual model.pt --onnx out.onnx --check` on a pickled Sequential."""
    import numpy as np
    import onnxruntime as ort

    original = fixed_size_cnn().eval()
    model = tmp_path / "model.pt"
    torch.save(original, model)
    proc = run_cli(
        "mutate", "--pass", "add_residual", str(model), "--onnx", str(tmp_path / "out.onnx"), "--check", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "input shape inferred: the Linear 7 after _6 takes 3136 features; square sides 27 to 28 all give that, "
        "using 28×28, which strides divide evenly"
    ) in proc.stdout
    assert "equivalence vs original model: PASS" in proc.stdout
    sess = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = torch.randn(batch, 1, 28, 28, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            ref = original(x).numpy()
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        assert np.all(np.abs(got - ref) <= 1e-5 * np.abs(ref).max() + 1e-4 * np.abs(ref))


def test_input_sizes_are_never_guessed(tmp_path, cnn_file):
    nn = torch.nn
    exact = tmp_path / "exact.pt"
    torch.save(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 9 * 9, 2)), exact)
    nothing = tmp_path / "nothing.pt"
    torch.save(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(7, 2)), nothing)  # 4·s² is never 7
    from graphgrow.graph.inputs import plain_spec
    from graphgrow.jobs.workflow import open_model

    assert open_model(str(exact)).input_shape == plain_spec([1, 1, 9, 9], "input")  # inferred: a bare shape's spec
    for path, message in [
        (nothing, "takes 7 features, which no square input gives"),
        (cnn_file, "takes any image size"),
    ]:
        proc = run_cli("mutate", str(path), "--pass", "add_residual")
        assert proc.returncode == 2 and message in proc.stderr and "pass --input-shape" in proc.stderr


def test_inspect_groups_shows_what_can_grow_and_why_not(runner, cnn_file):
    res = invoke(runner, "inspect", str(cnn_file), "--input-shape", "1,3,32,32", "--groups", "--json")
    groups = json.loads(res.output)["groups"]
    assert [(g["channels"], g["sources"], g["consumers"]) for g in groups] == [
        (3, [], ["_0"]),
        (32, ["_0"], ["_3"]),
        (64, ["_3"], ["_6"]),
        (128, ["_6"], ["_11"]),
        (10, ["_11"], []),
    ]
    assert groups[0]["blocked_by"][0] == "'input_1': it is the model's input"
    assert groups[1]["blocked_by"] == [] and groups[4]["blocked_by"] == ["'_11': it is the model's output"]
    text = invoke(runner, "inspect", str(cnn_file), "--input-shape", "1,3,32,32", "--groups").output
    assert "growable" in text and "frozen" in text


def test_inspect_says_each_automatic_leaf_reason_once(capsys):
    from graphgrow.cli.show import print_trace

    trace = {
        "auto_leaves": {
            **{f"blocks.{i}.bn": "BatchNormAct2d: branches on self.training" for i in range(5)},
            "head": "Head: data-dependent control flow",
        },
        "fidelity": ["eval@2"],
    }
    print_trace(trace)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "automatic leaves (6):"
    assert lines[1].startswith(
        "  5 × BatchNormAct2d: branches on self.training: blocks.0.bn, blocks.1.bn, blocks.2.bn, …"
    )
    assert lines[2] == "  head: Head: data-dependent control flow"
    print_trace(trace, show_all=True)
    assert sum("blocks." in line for line in capsys.readouterr().out.splitlines()) == 5


def test_a_saved_model_that_needs_trust_says_so_when_written_and_when_read(tmp_path):
    env = {"PYTHONPATH": str(ROOT / "tests")}
    proc = run_cli(
        "mutate",
        "factories:cnn_with_custom_leaf",
        "--pass",
        "deepen",
        "--input-shape",
        "1,3,16,16",
        "-o",
        str(tmp_path / "g.pt"),
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "note: reading g.pt back needs --trust" in proc.stdout and "factories.ModeGate" in proc.stdout
    proc = run_cli("inspect", str(tmp_path / "g.pt"), cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "contains the custom class factories.ModeGate" in proc.stderr
    assert "graphgrow keeps such modules whole" in proc.stderr  # not the factory hint: this is a graphgrow file
    assert run_cli("inspect", str(tmp_path / "g.pt"), "--trust", cwd=tmp_path, env=env).returncode == 0
    proc = run_cli(
        "mutate",
        "factories:small_cnn",
        "--pass",
        "deepen",
        "--input-shape",
        "1,3,16,16",
        "-o",
        str(tmp_path / "plain.pt"),
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0 and "needs --trust" not in proc.stdout
