"""Does growth pay on a GPT? examples/grow_gpt.py as benchmark rows (issue 23, item 6).

A byte-level GPT on the Python standard library's source: (a) small, grown mid-training by one verified
pipeline (hidden size, heads, MLP, a layer) into (b)'s architecture, (b) trained large from scratch with the
same schedule. Rows: the validation loss change at growth (target: none beyond float rounding) and the FLOPs
and wall time (a) needs to reach the best validation loss both reach, as a fraction of (b)'s (information).

    python benchmarks/bench_gpt.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import grow_gpt  # noqa: E402
from common import Row, print_table  # noqa: E402


def rows(quick: bool = False, progress: Callable[[str], None] = lambda s: None) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the example's setting: one thread is fastest for this small model
    try:
        progress("GPT: grown mid-training vs trained large (about 4 minutes)" if not quick else "GPT: a few steps")
        kw = dict(steps=20, grow_at=10, every=5, limit=200_000) if quick else {}
        s = grow_gpt.run(None, log=lambda *a: None, **kw)
    finally:
        torch.set_num_threads(threads)
    g = s["growth"]
    change = abs(g["val_after"] - g["val_before"]) / abs(g["val_before"])
    model = f"byte GPT d32→48, {s['steps']} steps"
    out = [
        Row(
            "gpt",
            model,
            "val. loss change at growth (relative)",
            change,
            change,
            "",
            "≤ 1e-6",
            change <= 1e-6,
            f"{g['val_before']:.7f} → {g['val_after']:.7f}",
        )
    ]
    reach = s["to_target"]
    if {"grown", "large"} <= set(reach):
        for key, what in (("flops", "FLOPs"), ("seconds", "wall time")):
            ratio = reach["grown"][key] / reach["large"][key]
            out.append(
                Row(
                    "gpt",
                    model,
                    f"{what} to val. loss {s['target_val_loss']:.3f}: grown ÷ large",
                    ratio,
                    ratio,
                    "×",
                    "",
                    None,
                    f"steps {reach['grown']['step']} vs {reach['large']['step']}",
                )
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few steps (seconds)")
    args = ap.parse_args(argv)
    print_table(rows(args.quick), "grown mid-training vs trained large from scratch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
