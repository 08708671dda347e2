"""Each pass's default target and the time of the pass with its verification, per torchvision model.

Usage: python benchmarks/bench_passes.py [--passes grow_width,insert_adapter] [--size 224] [model ...]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torchvision
from rich.console import Console
from rich.table import Table

import graphgrow as gg

MODELS = ["resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "densenet121", "vit_b_16"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("models", nargs="*", default=MODELS)
    ap.add_argument("--passes", default="grow_width,grow_width(init=net2net),grow_width(mode=adapter),insert_adapter")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = gg.pipeline._split_top(args.passes)
    t = Table(title=f"verified passes: default target and time (input 1×3×{args.size}×{args.size}, {args.threads} threads, CPU)")
    for col in ("model", "pass", "default target", "params before → after", "pass + verify", "max rel err"):
        t.add_column(col, justify="right" if col in ("pass + verify", "max rel err") else "left")
    status = Console(stderr=True)
    for name in args.models:
        torch.manual_seed(0)
        gm = gg.trace(getattr(torchvision.models, name)().eval(), (1, 3, args.size, args.size))
        gg.annotate(gm, (1, 3, args.size, args.size))
        for spec in specs:
            with status.status(f"{name}: {spec}"):
                start = time.perf_counter()
                try:
                    r = gg.Pipeline.from_spec(spec).run(gm).results[0]
                except gg.GraphgrowError as e:
                    t.add_row(name, spec, f"[red]{type(e).__name__}[/]: {e.message[:80]}", "", "", "")
                    continue
                seconds = time.perf_counter() - start
            target = r.targets.get("target") or r.targets.get("after") or r.targets.get("end", "")
            t.add_row(name, spec, target, f"{r.params_before:,} → {r.params_after:,}", f"{seconds:.2f}s",
                      f"{r.preservation.max_rel_err:.1e}")
    Console(width=220).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
