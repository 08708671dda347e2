"""What growth costs at deployment, and what fold gives back: onnxruntime latency of the original,
the grown and the grown-then-folded model, measured side by side.

Linear-only growth (branches: conv3x3, identity, average pooling; a 1×1 adapter; an adapter-mode
widening) with trained-looking gates and BatchNorm statistics. onnxruntime CPU provider, all graph
optimisations, one intra-op thread, batch 1, 224×224; rounds interleave the three models; median
and minimum per-inference wall time over ROUNDS rounds after warm-up. The op histogram column says
whether the folded model runs exactly the original's kernels after onnxruntime's own fusions.

    python benchmarks/bench_fold.py [--rounds 30] [--models resnet18,mobilenet_v2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import graphgrow as gg  # noqa: E402
from conftest import randomize_bn, trained_looking  # noqa: E402
from graphgrow.export import export_onnx  # noqa: E402
from graphgrow.runtime import max_ir_version, open_session, optimized_op_counts  # noqa: E402

SPECS = {
    "resnet18": "add_branch(op=conv3x3),add_branch(op=identity),add_branch(op=avgpool3x3),insert_adapter,"
                "grow_width(target=layer2.0.conv1,to=160,mode=adapter)",
    "mobilenet_v2": "add_branch(at=features.17.conv.1.0,op=avgpool3x3),add_branch(at=features.17.conv.1.0,op=identity),"
                    "insert_adapter,grow_width(target=features.18.0,to=1400,mode=adapter)",
}
SHAPE = (1, 3, 224, 224)


def latency(session, x: np.ndarray) -> float:
    start = time.perf_counter()
    session.run(x)
    return time.perf_counter() - start


def bench(name: str, rounds: int, tmp: Path) -> dict:
    model = randomize_bn(getattr(torchvision.models, name)(), 5).eval()
    original = gg.trace(model, SHAPE)
    grown = trained_looking(gg.Pipeline.from_spec(SPECS[name]).run(original).gm)
    t = time.perf_counter()
    folded = gg.fold(grown)
    fold_s = time.perf_counter() - t
    sessions, counts = {}, {}
    for key, gm in (("original", original), ("grown", grown), ("folded", folded.gm)):
        path = tmp / f"{name}_{key}.onnx"
        export_onnx(gm, SHAPE, path, max_ir_version=max_ir_version())
        sessions[key] = open_session(path, "cpu", threads=1)
        counts[key] = optimized_op_counts(str(path))
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).numpy()
    for s in sessions.values():
        for _ in range(3):
            s.run(x)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(rounds):
        for k, s in sessions.items():
            times[k].append(latency(s, x))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    low = {k: min(v) * 1e3 for k, v in times.items()}
    return {
        "model": name, "growth": SPECS[name], "fold_seconds": round(fold_s, 2),
        "params": {"original": sum(p.numel() for p in original.parameters()), "grown": folded.params_before,
                   "folded": folded.params_after},
        "median_ms": med, "min_ms": low,
        "grown_over_original": med["grown"] / med["original"], "folded_over_original": med["folded"] / med["original"],
        "same_kernels_as_original": counts["folded"] == counts["original"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            rows.append(bench(name, args.rounds, Path(d)))
    print(f"\nfold: onnxruntime CPU, 1 thread, batch 1, 224², median (min) of {args.rounds} interleaved rounds")
    print(f"{'model':14s} {'original ms':>14s} {'grown ms':>14s} {'folded ms':>14s} {'grown/orig':>10s} {'folded/orig':>11s} "
          f"{'same kernels':>12s} {'params orig → grown → folded':>32s}")
    for r in rows:
        m, lo, p = r["median_ms"], r["min_ms"], r["params"]
        print(f"{r['model']:14s} {m['original']:8.2f} ({lo['original']:5.2f}) {m['grown']:8.2f} ({lo['grown']:5.2f}) "
              f"{m['folded']:8.2f} ({lo['folded']:5.2f}) {r['grown_over_original']:10.3f} {r['folded_over_original']:11.3f} "
              f"{str(r['same_kernels_as_original']):>12s} {p['original']:>10,} → {p['grown']:,} → {p['folded']:,}")
    if os.environ.get("BENCH_JSON"):
        Path(os.environ["BENCH_JSON"]).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
