"""What every benchmark shares: a row of the one table `make bench` prints, and timers.

CPU time is `time.thread_time` of the calling thread: with one torch thread and one
onnxruntime intra-op thread, all of the work runs there, so it is steadier than wall time
on a shared machine. Both are reported.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class Row:
    section: str
    model: str
    measure: str
    median: float
    minimum: float
    unit: str = ""
    target: str = ""  # e.g. "≤ 8"; empty when the row is information only
    met: bool | None = None
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, CPU seconds of this thread, wall seconds) of one call."""
    c, w = time.thread_time(), time.perf_counter()
    out = fn()
    return out, time.thread_time() - c, time.perf_counter() - w


def ratio_row(
    section: str,
    model: str,
    measure: str,
    values: list[float],
    limit: float | None,
    note: str = "",
    at_least: bool = False,
) -> Row:
    """A row of ratios with its target (≤ limit, or ≥ limit when at_least), met on the median."""
    med = statistics.median(values)
    if limit is None:
        return Row(section, model, measure, med, min(values), "×", note=note)
    met = med >= limit if at_least else med <= limit
    return Row(section, model, measure, med, min(values), "×", f"{'≥' if at_least else '≤'} {limit:g}", met, note)


def model_rounds_main(
    doc: str, rows: Callable[..., list[Row]], models: tuple[str, ...] | list[str], rounds: int
) -> None:
    """The command line of a benchmark over models and rounds: `--rounds N --models a,b`, one table."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--models", default=",".join(models))
    args = ap.parse_args()
    print_table(rows(args.models.split(","), args.rounds, progress=lambda s: print(s, file=sys.stderr)))


def format_number(v: float, unit: str) -> str:
    if math.isnan(v):
        return "–"
    if unit == "bool":
        return "yes" if v else "no"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def print_table(rows: list[Row], title: str = "graphgrow benchmarks") -> None:
    t = Table(title=title, show_lines=False)
    for col in ("what", "model", "case", "median", "min", "unit", "target", "met", "note"):
        t.add_column(col, justify="right" if col in ("median", "min") else "left", overflow="fold")
    section = None
    for r in rows:
        if r.section != section:
            if section is not None:
                t.add_section()
            section = r.section
        t.add_row(
            r.section,
            r.model,
            r.measure,
            format_number(r.median, r.unit),
            format_number(r.minimum, r.unit),
            "" if r.unit == "bool" else r.unit,
            r.target,
            "" if r.met is None else ("yes" if r.met else "NO"),
            r.note,
        )
    Console(width=230).print(t)
