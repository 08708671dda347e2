"""Static checks run with the tests, so CI enforces them: ruff (pyflakes, bugbear, banned imports for
architecture.md §2's boundaries) over the whole tree, mypy over the package (configured in pyproject.toml), the
pass author's API as the only way passes reach the core (the docs' generated parts: tests/test_docs.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_tree_is_formatted():
    """`ruff format` (line length 120, pyproject.toml) has nothing to change: `make lint` runs the same check."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_is_strict_on_the_lower_layers():
    """core, graph and io are checked with mypy's strict settings (every def typed, generics with their
    arguments, no Any returned as a declared type): the one place that says so is pyproject.toml."""
    import tomllib

    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    strict = next(o for o in overrides if "graphgrow.core.*" in o["module"])
    assert {"graphgrow.core.*", "graphgrow.graph.*", "graphgrow.io.*"} <= set(strict["module"])
    for flag in (
        "disallow_untyped_defs",
        "disallow_incomplete_defs",
        "disallow_any_generics",
        "warn_return_any",
        "disallow_untyped_calls",
        "check_untyped_defs",
        "no_implicit_reexport",
        "strict_equality",
        "warn_unused_ignores",
        "disallow_untyped_decorators",
    ):
        assert strict.get(flag) is True, flag


@pytest.mark.slow  # a minute on two busy cores: `make lint` runs it in the edit loop
def test_mypy_finds_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


def test_built_in_passes_use_only_the_public_api():
    """A built-in pass imports graphgrow only as `graphgrow` and `graphgrow.rewrite` (the pass author's
    API), never a private name nor a sibling module: a plugin can do everything they do. A pass that is a
    package (passes/fold/) may also import its own modules, by absolute path."""
    import ast

    problems = []
    for path in sorted((ROOT / "passes").rglob("*.py")):
        rel = path.relative_to(ROOT / "passes")
        own = f"graphgrow.passes.{rel.parts[0]}" if len(rel.parts) > 1 else None  # the package a file belongs to
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    problems.append(f"{rel}: relative import from .{module}")
                elif own and (module == own or module.startswith(own + ".")):
                    pass
                elif module.split(".")[0] == "graphgrow" and module not in ("graphgrow", "graphgrow.rewrite"):
                    problems.append(f"{rel}: from {module} import …")
                problems += [
                    f"{rel}: private name {a.name} from {module}" for a in node.names if a.name.startswith("_")
                ]
            elif isinstance(node, ast.Import):
                problems += [f"{rel}: import {a.name}" for a in node.names if a.name.startswith("graphgrow.")]
    assert not problems, "\n".join(problems)


def test_the_pass_author_api_lists_what_it_exports():
    import graphgrow.rewrite as api

    missing = [name for name in api.__all__ if not hasattr(api, name)]
    undocumented = [name for name in api.__all__ if name not in (api.__doc__ or "")]
    assert not missing and not undocumented, (missing, undocumented)


def test_every_built_in_pass_argument_has_help():
    from graphgrow.jobs.registry import all_passes

    for name, cls in all_passes().items():
        if getattr(cls, "__module__", "").startswith("graphgrow.passes"):
            assert all(cls.argument_help().values()), name


@pytest.mark.parametrize(
    "where, code",
    [
        ("graphgrow/verify/verify.py", "import onnxruntime\n"),
        ("graphgrow/graph/shapes.py", "import torch\n\ntorch.onnx.export\n"),
        ("graphgrow/jobs/pipeline.py", "from graphgrow.passes import fold\n"),
        ("graphgrow/jobs/workflow.py", "import ray\n"),
        ("passes/deepen/__init__.py", "import onnxruntime\n"),
        ("passes/fold/rules/relus.py", "import onnxruntime\n"),  # a pass package's own modules are checked too
    ],
)
def test_the_layout_boundaries_are_enforced_by_ruff(where, code):
    """architecture.md §2: one module owns onnxruntime, one torch.onnx; the core never imports a pass; Ray stays in
    search/."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--stdin-filename", where, "-"],
        cwd=ROOT,
        input=code,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "TID251" in proc.stdout, proc.stdout + proc.stderr
