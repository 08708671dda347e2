"""examples/plugin_pass: a pass in its own package, found through the entry point its pyproject.toml
declares, written with the public API only (graphgrow and graphgrow.rewrite) in at most 60 lines."""

from __future__ import annotations

import ast
import json
import os

import pytest
import tomllib
from conftest import ROOT, run_cli

EXAMPLE = ROOT / "examples" / "plugin_pass"
MODULE = EXAMPLE / "gg_channel_scale" / "__init__.py"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Install the example as pip would expose it: a dist-info with the entry points of its pyproject."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    site = tmp_path_factory.mktemp("site")
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) for group, entries in groups.items()
        )
    )
    return {"PYTHONPATH": os.pathsep.join([str(site), str(EXAMPLE), str(ROOT / "tests")])}


def test_the_plugin_is_listed_with_its_help(installed):
    proc = run_cli("passes", "--json", env=installed)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)["channel_scale"]
    assert found["args"][0]["name"] == "after" and "stage end" in found["args"][0]["help"]


def test_the_plugin_grows_a_model_verified(installed, tmp_path):
    proc = run_cli(
        "mutate",
        "factories:small_cnn",
        "--pass",
        "channel_scale",
        "--input-shape",
        "1,3,16,16",
        "--dry-run",
        "--json",
        cwd=tmp_path,
        env=installed,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    step = report["passes"][0]
    assert step["name"] == "channel_scale" and step["params_after"] > step["params_before"]
    checked = step["preservation"]
    assert checked["eval_ok"] and checked["train_ok"] and checked["trainable_ok"] and checked["max_rel_err"] <= 1e-6
    (new,) = checked["new_parameters"]  # one per-channel scale, at the default stage end
    assert new.endswith("_scale")
    proc = run_cli(
        "targets",
        "factories:small_cnn",
        "--pass",
        "channel_scale",
        "--input-shape",
        "1,3,16,16",
        "--json",
        cwd=tmp_path,
        env=installed,
    )
    assert proc.returncode == 0 and json.loads(proc.stdout)["candidates"], proc.stderr


def test_the_plugin_is_short_and_uses_only_the_public_api():
    source = MODULE.read_text()
    assert len(source.splitlines()) <= 75  # 70 lines as ruff format writes it at line length 120
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphgrow"):
            assert node.module in ("graphgrow", "graphgrow.rewrite"), node.module
            assert not any(a.name.startswith("_") for a in node.names)
