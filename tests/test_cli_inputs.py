"""Named model inputs on the command line (issue 22): --input NAME:DTYPE[SHAPE], --capture, and files that remember
them."""

from __future__ import annotations

import json

from graphgrow.cli import main

MODEL = "factories:token_classifier"  # token ids → Embedding → nn.TransformerEncoder → Linear


def invoke(runner, *args):
    return runner.invoke(main, list(args), catch_exceptions=False)


def test_mutate_a_token_model_with_a_named_int_input(runner, tmp_path):
    out = tmp_path / "g.pt"
    res = invoke(
        runner,
        "mutate",
        MODEL,
        "--input",
        "input_ids:int64[2,12]",
        "--pass",
        "insert_adapter",
        "-o",
        str(out),
        "--json",
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["inputs"] == [
        {"name": "input_ids", "shape": [2, 12], "dtype": "int64", "high": 50}
    ]  # the embedding's vocabulary
    assert report["input_shape"] == [2, 12]
    assert report["preservation"]["eval_ok"] and report["preservation"]["train_ok"]
    # the file remembers its inputs: no --input needed to open it again, and the text report names them
    res = invoke(runner, "inspect", str(out), "--summary")
    assert res.exit_code == 0, res.output
    assert "input_ids:int64[2, 12]" in res.output


def test_input_and_input_shape_together_are_refused(runner):
    res = runner.invoke(main, ["inspect", MODEL, "--input", "input_ids:int64[1,8]", "--input-shape", "1,8"])
    assert res.exit_code == 2 and "not both" in res.output


def test_a_bad_input_spec_is_one_line_with_the_way_out(runner):
    res = runner.invoke(main, ["inspect", MODEL, "--input", "input_ids:int7[1,8]"])
    assert res.exit_code == 2 and "unknown dtype 'int7'" in res.output and "int64" in res.output
    res = runner.invoke(main, ["inspect", MODEL, "--input", "input_ids"])
    assert res.exit_code == 2 and "NAME:SHAPE[:DTYPE] or NAME:DTYPE[SHAPE]" in res.output


def test_a_float_input_for_token_ids_names_the_input_and_the_fix(runner):
    res = runner.invoke(main, ["inspect", MODEL, "--input-shape", "1,8"])
    assert res.exit_code == 2, res.output
    assert "goes into an embedding" in res.output and "--input input_ids:int64[1,16]" in res.output


def test_capture_choice_reaches_the_trace(runner):
    res = invoke(runner, "inspect", MODEL, "--input", "input_ids:int64[1,8]", "--capture", "export", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["trace"]["capture"] == "export"
    res = invoke(runner, "inspect", MODEL, "--input", "input_ids:int64[1,8]", "--capture", "fx", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["trace"]["capture"] == "fx"


def test_named_sizes_declare_dynamic_dimensions_and_bad_ones_are_refused():
    import pytest

    from graphgrow.core.errors import InputError
    from graphgrow.graph.inputs import parse_spec

    spec = parse_spec("input_ids:int64[1,seq=128],attention_mask:int64[1,seq=128] pixel_values:float32[1,3,8,8]")
    assert [t.dynamic for t in spec] == [((1, "seq"),), ((1, "seq"),), ()]
    assert parse_spec([t.record() for t in spec]) == spec  # stored and read back as it was
    for bad, why in (
        ("x:int64[1,seq=1]", "which torch.export fixes"),
        ("x:int64[batch=2,4]", "cannot be declared dynamic"),
        ("a:int64[1,seq=4],b:int64[1,seq=5]", "one name, one size"),
        ("x:int64[1,se q=4]", "not integers"),
    ):
        with pytest.raises(InputError, match=why):
            parse_spec(bad)
