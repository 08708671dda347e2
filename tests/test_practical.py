"""What a new user runs into: an honest check against factories, tolerances and opsets on the command
line, inspect on ONNX files, choices in `passes`, announced output names, typed errors."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

import graphgrow as gg
from graphgrow.cli import main
from graphgrow.jobs import workflow

FACTORY = "factories:small_cnn"
SHAPE = "1,3,16,16"


def invoke(runner, *args):
    return runner.invoke(main, list(args), catch_exceptions=False)


def test_export_then_check_against_the_same_factory_passes(runner, tmp_path):
    """A factory builds random weights; export records their seed and check rebuilds them."""
    onnx_path = tmp_path / "m.onnx"
    res = invoke(runner, "export", FACTORY, "-o", str(onnx_path), "--input-shape", SHAPE)
    assert res.exit_code == 0, res.output
    meta = {p.key: p.value for p in onnx.load(str(onnx_path)).metadata_props}
    assert meta["graphgrow.source"] == FACTORY and meta["graphgrow.factory_seed"] == "0"
    res = invoke(runner, "check", str(onnx_path), FACTORY, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["equivalence"]["passed"] and report["factory_seed"] == 0
    # another seed is another model: the comparison says so (exit 1), it does not pass by accident
    res = invoke(runner, "check", str(onnx_path), FACTORY, "--seed", "7")
    assert res.exit_code == 1 and "FAIL" in res.output


def test_check_against_a_factory_refuses_when_the_weights_cannot_be_the_same(runner, tmp_path):
    gm = gg.trace(__import__("factories").small_cnn(), (1, 3, 16, 16))
    bare = tmp_path / "bare.onnx"
    gg.export_onnx(gm, (1, 3, 16, 16), bare)  # written without graphgrow's provenance metadata
    res = invoke(runner, "check", str(bare), FACTORY)
    assert res.exit_code == 2
    assert "does not record how its weights were made" in res.output and "--seed" in res.output


def test_check_tolerances_and_export_opset_come_from_the_command_line(runner, tmp_path):
    onnx_path = tmp_path / "m.onnx"
    assert (
        invoke(runner, "export", FACTORY, "-o", str(onnx_path), "--input-shape", SHAPE, "--opset", "18").exit_code == 0
    )
    assert [o.version for o in onnx.load(str(onnx_path)).opset_import if o.domain in ("", "ai.onnx")] == [18]
    res = invoke(runner, "check", str(onnx_path), FACTORY, "--rtol", "0.01", "--atol", "0.002", "--json")
    eq = json.loads(res.output)["equivalence"]
    assert (eq["rtol"], eq["atol"]) == (0.01, 0.002)
    res = invoke(runner, "export", FACTORY, "-o", str(tmp_path / "x.onnx"), "--input-shape", SHAPE, "--opset", "7")
    assert res.exit_code == 2 and "--opset 7 is outside" in res.output


def test_inspect_reads_an_onnx_file_with_its_mutation_log(runner, tmp_path):
    grown, onnx_path = tmp_path / "g.pt", tmp_path / "g.onnx"
    res = invoke(
        runner,
        "mutate",
        FACTORY,
        "--pass",
        "insert_adapter",
        "-o",
        str(grown),
        "--onnx",
        str(onnx_path),
        "--input-shape",
        SHAPE,
    )
    assert res.exit_code == 0, res.output
    res = invoke(runner, "inspect", str(onnx_path))
    assert res.exit_code == 0, res.output
    assert "input input: float [batch, 3, 16, 16]" in res.output
    assert "mutation 1: insert_adapter(" in res.output and "Conv" in res.output
    data = json.loads(invoke(runner, "inspect", str(onnx_path), "--json").output)
    assert (
        data["format"] == "onnx"
        and data["input_shape"] == [1, 3, 16, 16]
        and data["log"][0]["pass"] == "insert_adapter"
    )
    n_params = sum(p.numel() for p in gg.load_model(grown).module.parameters())
    assert 0.9 * n_params < data["params"] <= n_params  # the exporter folds BatchNorm into the conv before it
    assert invoke(runner, "inspect", str(onnx_path), "--groups").exit_code == 2


def test_passes_lists_the_choices_of_an_argument(runner):
    res = invoke(runner, "passes")
    assert (
        "op: one of conv3x3|conv5x5|sepconv3x3|sepconv5x5|dilconv3x3|avgpool3x3|maxpool3x3|identity = 'conv3x3'"
        in res.output
    )
    assert "at: str | None = None" in res.output


def test_a_second_mutate_without_output_says_where_the_result_went(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = invoke(runner, "mutate", FACTORY, "--pass", "insert_adapter", "--input-shape", SHAPE)
    assert first.exit_code == 0 and "note:" not in first.output
    second = invoke(runner, "mutate", FACTORY, "--pass", "insert_adapter", "--input-shape", SHAPE)
    assert second.exit_code == 0
    assert (
        "small_cnn.grown.pt already exists: the result went to small_cnn.grown-1.pt (give -o to choose the name)"
        in second.output
    )
    assert (tmp_path / "small_cnn.grown-1.pt").exists()


def test_a_module_that_was_not_traced_is_a_typed_error():
    model = __import__("factories").small_cnn()
    with pytest.raises(gg.InputError, match="passes run on a traced model .*got Sequential"):
        gg.Pipeline.from_spec("insert_adapter").run(model)
    with pytest.raises(gg.InputError, match="trace it first"):
        gg.get_pass("insert_adapter")()(model)


def test_progress_names_the_step_in_progress_during_export(tmp_path):
    seen: list[str] = []
    workflow.export(FACTORY, str(tmp_path / "m.onnx"), SHAPE, progress=seen.append)
    assert seen[-1].startswith("exporting to ONNX")
    assert seen.index("propagating shapes") < len(seen) - 1


def test_factories_build_the_same_weights_every_time():
    a = gg.load_model(FACTORY).module.state_dict()
    b = gg.load_model(FACTORY).module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = gg.load_model(FACTORY, factory_seed=1).module.state_dict()
    assert not torch.equal(a["0.weight"], c["0.weight"])


def test_the_readmes_pass_table_is_one_table_with_a_row_per_pass():
    from pathlib import Path

    lines = (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| pass | what it does"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break  # a blank line ends a markdown table: every pass must come before it
        rows.append(line.split("|")[1].strip().strip("`"))
    import tomllib

    root = Path(__file__).resolve().parent.parent
    built_in = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["graphgrow.passes"]
    assert sorted(rows) == sorted(built_in)
