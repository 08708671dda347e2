"""The zoo test: every built-in pass with its default target on 12 timm architectures nobody here wrote.

Each (model, pass) runs the CLI's job (load by factory name, trace, fidelity check, pass,
verification, save, ONNX export, onnxruntime check against the grown *and* the original
module in eval mode) and must either pass (exit 0) or be refused with a reason (exit 2).
A failed check (exit 1) or an internal error (exit 3) fails the test. The table of outcomes
is written to out/zoo.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import graphgrow as gg
from graphgrow import workflow
from zoo import ZOO

pytestmark = pytest.mark.slow
pytest.importorskip("timm")

PASSES = ("grow_width", "add_residual", "insert_adapter", "add_branch", "deepen")
RESULTS: dict[tuple[str, str], tuple[int, str]] = {}
TABLE = Path(__file__).resolve().parent.parent / "out" / "zoo.md"


def run_job(name: str, spec: str, tmp: Path) -> tuple[int, str]:
    """(exit code the CLI would give, what happened)."""
    try:
        report = workflow.mutate(f"zoo:{name}", [spec], out=str(tmp / f"{spec}.pt"), onnx_out=str(tmp / f"{spec}.onnx"),
                                 check=True, input_shape=ZOO[name][1])
    except gg.GraphgrowError as e:
        return e.exit_code, e.message
    except Exception as e:  # what the CLI reports as an internal error
        return 3, f"{type(e).__name__}: {e}"
    eq = report["equivalence"]
    if not eq["passed"]:
        return 1, f"onnxruntime differs: grown max abs {eq['max_abs_err']:.3g}, vs original {eq['vs_original']['max_abs_err']:.3g}"
    targets = report["passes"][0]["targets"]
    where = next(iter(targets.values())) if targets else ""
    return 0, f"{where}; params {report['passes'][0]['params_before']:,} → {report['passes'][0]['params_after']:,}"


@pytest.mark.parametrize("name", list(ZOO))
def test_every_pass_verifies_or_is_refused(name, tmp_path):
    outcomes = {}
    for spec in PASSES:
        code, what = run_job(name, spec, tmp_path)
        RESULTS[(name, spec)] = (code, what)
        outcomes[spec] = (code, what)
    _write_table()
    bad = {spec: o for spec, o in outcomes.items() if o[0] not in (0, 2)}
    assert not bad, f"{name}: {bad}"


def test_grow_width_accepts_at_least_9_of_the_12():
    if len({n for n, _ in RESULTS}) < len(ZOO):
        pytest.skip("runs after the whole zoo")
    accepted = [n for n in ZOO if RESULTS[(n, "grow_width")][0] == 0]
    assert len(accepted) >= 9, {n: RESULTS[(n, "grow_width")] for n in ZOO}


def _write_table() -> None:
    TABLE.parent.mkdir(exist_ok=True)
    lines = ["| model | covers | " + " | ".join(PASSES) + " |", "|---|---|" + "---|" * len(PASSES)]
    for name, (_, _, covers) in ZOO.items():
        cells = []
        for spec in PASSES:
            code, what = RESULTS.get((name, spec), (None, ""))
            word = {0: "ok", 2: "refused", None: ""}.get(code, f"FAIL (exit {code})")
            cells.append(f"{word}: {what[:160]}" if code is not None else "")
        lines.append(f"| {name} | {covers} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    TABLE.write_text("\n".join(lines) + "\n")
