"""What growth costs at deployment, and what fold gives back: onnxruntime latency of the original,
the grown and the grown-then-folded model, measured side by side.

Linear-only growth (branches: conv3x3, identity, average pooling; a 1×1 adapter; an adapter-mode
widening) with trained-looking gates and BatchNorm statistics: folded ÷ original should be about 1.
Capacity growth (grow_width's default, a whole channel group doubled): folded ÷ the same
architecture built directly (the folded graph with freshly initialised layers) should be about 1.
onnxruntime CPU provider, all graph optimisations, one intra-op thread, batch 1, 224×224; PyTorch
eager with one thread beside it; rounds interleave all models; median and minimum per-inference
wall time over ROUNDS rounds after warm-up. "same kernels" says whether the folded model runs
exactly the original's kernels after onnxruntime's own fusions. The last line is the peak memory
of one `graphgrow mutate … --onnx --check` process. BENCH_JSON=path also writes the rows as JSON.

    python benchmarks/bench_fold.py [--rounds 30] [--models resnet18,mobilenet_v2]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
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


def eager(gm: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        gm(x)
        return time.perf_counter() - start


def built_directly(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same architecture at the same size, every layer freshly initialised (what training from scratch deploys)."""
    fresh = copy.deepcopy(gm)
    torch.manual_seed(1)
    for m in fresh.modules():
        if hasattr(m, "reset_parameters") and m is not fresh:
            m.reset_parameters()
    return randomize_bn(fresh, 6).eval()


def bench(name: str, spec: str, rounds: int, tmp: Path, capacity: bool = False) -> dict:
    model = randomize_bn(getattr(torchvision.models, name)(), 5).eval()
    original = gg.trace(model, SHAPE)
    grown = trained_looking(gg.Pipeline.from_spec(spec).run(original).gm)
    t = time.perf_counter()
    folded = gg.fold(grown)
    fold_s = time.perf_counter() - t
    reference = built_directly(folded.gm) if capacity else original
    sessions, counts, modules = {}, {}, {}
    for key, gm in (("original", reference), ("grown", grown), ("folded", folded.gm)):
        path = tmp / f"{name}_{key}.onnx"
        export_onnx(gm, SHAPE, path, max_ir_version=max_ir_version())
        sessions[key] = open_session(path, "cpu", threads=1)
        counts[key] = optimized_op_counts(str(path))
        modules[key] = gm.eval()
    xt = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    x = xt.numpy()
    for k, s in sessions.items():
        for _ in range(3):
            s.run(x)
            eager(modules[k], xt)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    eager_times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(rounds):
        for k, s in sessions.items():
            times[k].append(latency(s, x))
            eager_times[k].append(eager(modules[k], xt))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    low = {k: min(v) * 1e3 for k, v in times.items()}
    med_eager = {k: statistics.median(v) * 1e3 for k, v in eager_times.items()}
    return {
        "model": name, "growth": spec, "kind": "capacity" if capacity else "linear only", "fold_seconds": round(fold_s, 2),
        "reference": "same architecture built directly" if capacity else "original",
        "params": {"reference": sum(p.numel() for p in reference.parameters()), "grown": folded.params_before,
                   "folded": folded.params_after},
        "median_ms": med, "min_ms": low, "eager_median_ms": med_eager,
        "ort_over_eager": {k: med[k] / med_eager[k] for k in med},
        "grown_over_reference": med["grown"] / med["original"], "folded_over_reference": med["folded"] / med["original"],
        "same_kernels_as_reference": counts["folded"] == counts["original"],
    }


def mutate_peak_memory(tmp: Path) -> tuple[float, float]:
    """(seconds, peak resident MiB) of one `graphgrow mutate` process on resnet18 at 224² with --onnx --check."""
    exe = Path(sys.executable).with_name("graphgrow")
    start = time.perf_counter()
    subprocess.run([str(exe), "mutate", "torchvision.models:resnet18", "--pass", "grow_width", "--input-shape", "1,3,224,224",
                    "-o", str(tmp / "m.pt"), "--onnx", str(tmp / "m.onnx"), "--check"], check=True, capture_output=True)
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            rows.append(bench(name, SPECS[name], args.rounds, Path(d)))
        rows.append(bench("resnet18", "grow_width", args.rounds, Path(d), capacity=True))
        mutate_s, mutate_mib = mutate_peak_memory(Path(d))
    print(f"\nfold: onnxruntime CPU, 1 thread, batch 1, 224², median (min) of {args.rounds} interleaved rounds; "
          "ref = the original (linear-only growth) or the same architecture built directly (capacity growth)")
    print(f"{'model':14s} {'growth':12s} {'ref ms':>14s} {'grown ms':>14s} {'folded ms':>14s} {'grown/ref':>9s} {'folded/ref':>10s} "
          f"{'ORT/eager (folded)':>18s} {'same kernels':>12s}   params ref → grown → folded")
    for r in rows:
        m, lo, p = r["median_ms"], r["min_ms"], r["params"]
        print(f"{r['model']:14s} {r['kind']:12s} {m['original']:8.2f} ({lo['original']:5.2f}) {m['grown']:8.2f} ({lo['grown']:5.2f}) "
              f"{m['folded']:8.2f} ({lo['folded']:5.2f}) {r['grown_over_reference']:9.3f} {r['folded_over_reference']:10.3f} "
              f"{r['ort_over_eager']['folded']:18.2f} {str(r['same_kernels_as_reference']):>12s}   "
              f"{p['reference']:,} → {p['grown']:,} → {p['folded']:,}")
    print(f"graphgrow mutate torchvision.models:resnet18 --pass grow_width --onnx --check (224²): {mutate_s:.1f} s, "
          f"peak resident memory {mutate_mib:,.0f} MiB")
    if os.environ.get("BENCH_JSON"):
        Path(os.environ["BENCH_JSON"]).write_text(json.dumps({"rows": rows, "mutate_seconds": mutate_s,
                                                              "mutate_peak_mib": mutate_mib}, indent=2))


if __name__ == "__main__":
    main()
