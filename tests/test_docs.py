"""The documentation is checked like code: every code block in README.md and docs/*.md runs or is
compared with what it shows (tools/docs.py says how each one is checked), generated regions (the CLI
reference, the pass arguments) match the code, and every relative link and anchor resolves.

Blocks under one heading run in order in one scratch folder (a later block may use an earlier one's
files), with the venv's `graphgrow` first on PATH and the repository on PYTHONPATH (for `examples.…`)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import cli_fork
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("graphgrow_docs_tool", ROOT / "tools" / "docs.py")
docs = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules[_spec.name] = docs  # dataclasses look their module up while the class is built
_spec.loader.exec_module(docs)  # type: ignore[union-attr]

ALL = [b for path in docs.doc_files() for b in docs.blocks(path)]
RUN_GROUPS: dict[str, list] = defaultdict(list)
for _b in ALL:
    if _b.kind == "run":
        RUN_GROUPS[f"{_b.path.relative_to(ROOT)}#{_b.section}"].append(_b)


def test_there_are_docs_and_blocks():
    assert (ROOT / "README.md").exists() and len(docs.doc_files()) > 1
    assert len(RUN_GROUPS) >= 5, sorted(RUN_GROUPS)


def test_every_code_block_has_a_check():
    known = {"run", "make", "layout", "generated", "install"}
    unchecked = [
        f"{b.where} ({b.lang or 'no language'}: {b.kind or 'nothing says how it is checked'})"
        for b in ALL
        if b.kind not in known and not b.kind.startswith("in ")
    ]
    bad_language = [b.where for b in ALL if b.kind == "run" and b.lang not in ("sh", "python")]
    assert not unchecked and not bad_language, unchecked + bad_language


def test_generated_regions_are_current():
    for path in docs.doc_files():
        text = path.read_text()
        assert docs.regenerate(text) == text, f"{path.name} is stale: run `make docs` (python tools/docs.py)"
    cli = (ROOT / "docs" / "cli.md").read_text()
    assert "<!-- generated: cli-reference -->" in cli and "<!-- generated: passes-table -->" in "".join(
        p.read_text() for p in docs.doc_files()
    )


def test_the_cli_reference_covers_every_command():
    from graphgrow.cli import main

    cli = (ROOT / "docs" / "cli.md").read_text()
    for name in main.commands:
        assert f"<code>graphgrow {name} --help</code>" in cli, name


def test_the_readme_is_a_front_door():
    """README.md stays short (issue 41: about 300 lines): what graphgrow is, install, a Python and a CLI example,
    what you get back, the promise, links; the references live in docs/."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 320, len(readme.splitlines())
    for heading in (
        "## Install",
        "## In Python",
        "## On the command line",
        "## What you get back",
        "## The promise",
        "## Documentation",
    ):
        assert f"\n{heading}" in readme, heading


def _env(tmp_path: Path) -> dict:
    """The venv's commands first on PATH, and before them a `graphgrow` that runs forked from a warm server
    (tests/cli_fork.py: the command as installed, without importing torch anew each time)."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": os.pathsep.join([cli_fork.bin_dir(), bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": str(ROOT),
        "MPLBACKEND": "Agg",
        "COLUMNS": "120",
        "HOME": os.environ.get("HOME", str(tmp_path)),
    }


def _run_block(block, cwd: Path, env: dict, n: int) -> None:
    if block.lang == "python":
        script = cwd / f"block_{n}.py"
        script.write_text(block.code)
        proc = cli_fork.run([], cwd, env, script=script.name)
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.code]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"{block.where} failed (exit {proc.returncode}) in {cwd}\n{block.code}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(RUN_GROUPS))
def test_code_blocks_run(group, tmp_path):
    env = _env(tmp_path)
    for n, block in enumerate(RUN_GROUPS[group]):
        _run_block(block, tmp_path, env, n)


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.slow
def test_make_blocks_name_real_targets_and_the_demo_runs(tmp_path):
    """`make test` is what CI runs (.ci/run); `make demo` runs here, as its recipe (the venv exists);
    every other target named must exist in the Makefile."""
    blocks = [b for b in ALL if b.kind == "make"]
    assert blocks
    targets = _makefile_targets()
    named = set()
    for b in blocks:
        for line in b.code.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                assert words[0] == "make" and len(words) == 2, f"{b.where}: not a make line: {line}"
                named.add(words[1])
    assert named <= targets, named - targets
    assert {"demo", "test"} <= named
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    recipe = re.search(r"^demo:.*\n\t\$\(BIN\)/python (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "make demo's recipe is no longer `$(BIN)/python SCRIPT`"
    proc = cli_fork.run([], tmp_path, _env(tmp_path), script=ROOT / recipe.group(1))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "equivalence vs original model: PASS" in proc.stdout


def test_install_blocks_name_real_extras_and_commands():
    """An install block cannot run here (it would install); what it names must exist: the extras in
    pyproject.toml, and every other command is graphgrow's own."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    blocks = [b for b in ALL if b.kind == "install"]
    assert blocks
    for b in blocks:
        for line in b.code.splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if words[:2] == ["pip", "install"]:
                named = {e for w in words[2:] for e in re.findall(r"\[([\w,]+)\]", w) for e in e.split(",")}
                assert named <= extras, f"{b.where}: extras pyproject.toml lacks: {named - extras}"
            else:
                assert words[0] == "graphgrow", f"{b.where}: not an install or graphgrow line: {line}"
                proc = cli_fork.run(words[1:], timeout=120)
                assert proc.returncode == 0, proc.stderr[-2000:]


def test_excerpts_match_their_files():
    for b in (b for b in ALL if b.kind.startswith("in ")):
        source = (ROOT / b.kind[3:]).read_text()
        assert b.code.strip() in source, f"{b.where} is no longer an excerpt of {b.kind[3:]}"


def test_the_layout_names_every_module_and_only_real_ones():
    (block,) = [b for b in ALL if b.kind == "layout"]
    named_dirs = re.findall(r"^(\w[\w/]*/)", block.code, re.M)
    assert all((ROOT / d).is_dir() for d in named_dirs), named_dirs
    words = set(re.findall(r"\b(\w+)\b", block.code))
    modules = {p.stem for p in (ROOT / "graphgrow").rglob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in (ROOT / "graphgrow").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert not modules - words, f"modules the layout does not name: {sorted(modules - words)}"


def test_relative_links_and_anchors_resolve():
    broken = []
    for path in docs.doc_files():
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file_part, _, frag = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in docs.headings(dest):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken
