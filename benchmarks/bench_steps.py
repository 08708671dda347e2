"""`make bench`: what each step costs on torchvision models, as a table.

Columns: trace, pass + verification, export (graphgrow's share beside torch.onnx.export
itself), equivalence check; and the DESIGN §9 ratio "verified pass / forward of the
grown model on the verification input" (target: about 8 or less).
Usage: python benchmarks/bench_steps.py [model ...] [--threads N] [--size 224]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torchvision
from rich.console import Console
from rich.table import Table

import graphgrow as gg
from graphgrow.equivalence import check_equivalence
from graphgrow.export import export_onnx
from graphgrow.runtime import max_ir_version, open_session
from graphgrow.shapes import example_input
from graphgrow.verify import BATCHES


def timed(fn, repeat: int = 1):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def bench(name: str, size: int) -> dict:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    shape = (1, 3, size, size)
    gm, t_trace = timed(lambda: gg.trace(model, shape), repeat=3)
    gg.annotate(gm, shape)
    result, t_pass = timed(lambda: gg.Pipeline.from_spec("add_residual").run(gm).results[0], repeat=3)
    grown = result.gm.eval()
    x = example_input(grown, shape, batch=BATCHES[0])
    with torch.no_grad():
        grown(x)
        _, t_fwd = timed(lambda: grown(x), repeat=5)
    parts: dict[str, float] = {}
    proto = export_onnx(grown, shape, max_ir_version=max_ir_version(), timings=parts)
    t_export, t_torch_export = parts["total"], parts["torch_onnx_export"]
    session = open_session(proto.SerializeToString(), "cpu", threads=torch.get_num_threads())
    report, t_check = timed(lambda: check_equivalence(grown, session, shape))
    x1 = example_input(grown, shape, batch=1)
    with torch.no_grad():
        _, t_eager = timed(lambda: grown(x1), repeat=10)
    xn = x1.numpy()
    session.run(xn)
    _, t_ort = timed(lambda: session.run(xn), repeat=10)
    return {
        "model": name, "nodes": len(gm.graph.nodes), "trace": t_trace, "pass": t_pass, "fwd": t_fwd,
        "ratio": t_pass / t_fwd, "export": t_export, "export_share": max(t_export - t_torch_export, 0.0) / t_export,
        "check": t_check, "passed": report.passed, "ort_vs_eager": t_ort / t_eager,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("models", nargs="*", default=["resnet18", "resnet50", "mobilenet_v2", "vit_b_16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    t = Table(title=f"graphgrow step costs: add_residual, input 1×3×{args.size}×{args.size}, {args.threads} threads, CPU")
    for col in ("model", "nodes", "trace", "pass+verify", "÷ forward (b=2)", "export", "graphgrow share of export",
                "check", "equivalent", "ORT/eager latency (b=1)"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for name in args.models:
        with console.status(f"benchmarking {name}"):
            r = bench(name, args.size)
        t.add_row(r["model"], str(r["nodes"]), f"{r['trace']:.3f}s", f"{r['pass']:.2f}s", f"{r['ratio']:.1f}×",
                  f"{r['export']:.1f}s", f"{100 * r['export_share']:.1f}%", f"{r['check']:.2f}s",
                  "yes" if r["passed"] else "NO", f"{r['ort_vs_eager']:.2f}×")
    Console(width=200).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
