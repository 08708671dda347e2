"""Options objects (issue 41): what a command was asked travels cli → jobs → search in LoadOptions, OutputOptions
and Limits, every argument by name; no limit lives in a global."""

from __future__ import annotations

import ast

import pytest
import torch
from conftest import ROOT, small_cnn

from graphgrow.analysis.budget import DEFAULT_MAX_MEMORY, NO_LIMIT, Limits
from graphgrow.core.errors import InputError


def test_one_commands_memory_limit_does_not_reach_the_next(runner, tmp_path):
    """Two commands in one process (as tests, notebooks and the search's driver run them): the first one's
    --max-memory must not stay behind (a click callback used to set a process-wide limit)."""
    from graphgrow.cli.commands import main

    src = tmp_path / "m.pt"
    torch.save(small_cnn(), src)
    refused = runner.invoke(main, ["inspect", str(src), "--input-shape", "1,3,32,32", "--max-memory", "1K", "--json"])
    assert refused.exit_code == 2, refused.output
    again = runner.invoke(main, ["inspect", str(src), "--input-shape", "1,3,32,32", "--json"])
    assert again.exit_code == 0, again.output


def test_one_commands_load_limit_does_not_reach_the_next(runner, tmp_path):
    """--max-load likewise: it travels in LoadOptions to load_model, and no module attribute keeps it."""
    from graphgrow.cli.commands import main
    from graphgrow.io import load

    src = tmp_path / "m.pt"
    torch.save(small_cnn(), src)
    refused = runner.invoke(main, ["inspect", str(src), "--input-shape", "1,3,32,32", "--max-load", "1K", "--json"])
    assert refused.exit_code == 2 and "would unpack to" in refused.output, refused.output
    assert not hasattr(load, "MAX_LOAD_BYTES")
    again = runner.invoke(main, ["inspect", str(src), "--input-shape", "1,3,32,32", "--json"])
    assert again.exit_code == 0, again.output
    bad = runner.invoke(main, ["inspect", str(src), "--input-shape", "1,3,32,32", "--max-load", "lots"])
    assert bad.exit_code == 2 and "--max-load" in bad.output, bad.output


def test_limits_parse_the_flags_values():
    assert Limits.parse() == Limits() and Limits().max_memory == DEFAULT_MAX_MEMORY
    assert Limits.parse("2M", "512M") == Limits(2_000_000, 512 << 20)
    assert Limits.parse(max_memory="none").max_memory == NO_LIMIT
    with pytest.raises(InputError, match="--max-memory"):
        Limits.parse(max_memory="lots")


def test_mutate_passes_its_memory_limit_to_the_model_it_opens(tmp_path):
    from graphgrow.jobs import workflow

    src = tmp_path / "m.pt"
    torch.save(small_cnn(), src)
    with pytest.raises(InputError, match="activations"):
        workflow.mutate(str(src), ["add_residual"], input_shape="1,3,32,32", max_memory="1K", dry_run=True)


def test_the_cli_calls_its_jobs_by_keyword():
    """A job of graphgrow.jobs.workflow or the search is called with at most its subject(s) by position: eleven
    positional arguments (mutate's, before) let a swapped pair pass unnoticed."""
    trees = [ast.parse(f.read_text()) for f in sorted((ROOT / "graphgrow" / "cli").glob("commands*.py"))]
    nodes = [n for tree in trees for n in ast.walk(tree)]
    calls = [
        n
        for n in nodes
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "workflow"
    ]
    calls += [n for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "run"]
    assert len(calls) >= 9  # mutate, replay, fold, export, check, inspect, targets, diff, search
    crowded = [f"line {c.lineno}: {len(c.args)} positional" for c in calls if len(c.args) > 2]
    assert not crowded, crowded


@pytest.mark.parametrize(
    "text, size", [("20G", 20 * 2**30), ("20GiB", 20 * 2**30), ("512MiB", 512 * 2**20), ("8gb", 8 * 2**30)]
)
def test_byte_limits_take_the_binary_spelling_too(text, size):
    from graphgrow.analysis.budget import parse_size

    assert parse_size(text, "--max-memory") == size


@pytest.mark.parametrize("text, what", [("20iB", "--max-memory"), ("5Gi", "--max-params"), ("5GiBB", "--max-load")])
def test_a_binary_unit_without_a_size_letter_or_on_a_count_is_refused(text, what):
    from graphgrow.analysis.budget import parse_size
    from graphgrow.core.errors import InputError

    with pytest.raises(InputError, match="is not a size"):
        parse_size(text, what)
