"""A golden printout per pass (architecture.md §8): the pass's report and the graph's code before → after as a
diff, on the small CNN, compared exactly. A change in what a pass builds shows up here as a reviewable
diff; after reviewing it, regenerate with GRAPHGROW_UPDATE_GOLDEN=1."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from conftest import randomize_bn, small_cnn

import graphgrow as gg

GOLDEN = Path(__file__).parent / "golden"
PASSES = {  # golden file → the spec (and what it runs on)
    "grow_width": "grow_width",
    "insert_adapter": "insert_adapter",
    "add_branch": "add_branch",
    "deepen": "deepen",
    "fold": "add_branch,fold",
}


def printout(spec: str) -> str:
    gm = gg.trace(randomize_bn(small_cnn()).eval(), input_shape=(1, 3, 32, 32))
    result = gg.Pipeline.from_spec(spec).run(gm)
    before = (result.results[-2].gm if len(result.results) > 1 else gm).code.strip().splitlines()
    last = result.results[-1]
    diff = difflib.unified_diff(before, last.gm.code.strip().splitlines(), "before", "after", lineterm="", n=1)
    old_gm = result.results[-2].gm if len(result.results) > 1 else gm
    return (
        last.summary()
        + "\n\nlayers:\n"
        + "\n".join(layer_changes(old_gm, last.gm))
        + "\n\ngraph:\n"
        + "\n".join(diff)
        + "\n"
    )


def layer_changes(old, new) -> list[str]:
    """Leaf layers added, removed or rebuilt (their repr: sizes and settings), in the new model's order."""

    def leaves(m):
        return {path: repr(mod) for path, mod in m.named_modules() if path and not list(mod.children())}

    a, b = leaves(old), leaves(new)
    lines = [f"  + {p}: {r}" if p not in a else f"  ~ {p}: {a[p]} → {r}" for p, r in b.items() if a.get(p) != r]
    return lines + [f"  - {p}: {r}" for p, r in a.items() if p not in b] or ["  (none)"]


@pytest.mark.parametrize("name", sorted(PASSES))
def test_golden_printout(name):
    got = printout(PASSES[name])
    path = GOLDEN / f"{name}_small_cnn.txt"
    if os.environ.get("GRAPHGROW_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"{name}'s printout changed; review the diff, then GRAPHGROW_UPDATE_GOLDEN=1"
