"""`make bench`: every benchmark in one run, one table; BENCH_JSON=path also writes the rows as JSON.

Sections (each is also a script of its own):
  steps  bench_steps.py  pass + verification ÷ forward, per pass and model; export ÷ bare torch.onnx.export
  fold   bench_fold.py   onnxruntime latency of original / grown / folded; same kernels; ORT ÷ eager; peak memory
  scale  bench_scale.py  graph-side cost per fx node on 1k / 4k / 12k-node chains; small models at 32×32 in seconds;
                         a 125 M / 350 M / 1 B decoder grown, verified, saved, exported: s and peak memory per stage;
                 bench_stream.py a 3 B bfloat16 checkpoint grown streamed (docs/streaming.md): s and peak per stage
  gpu    bench_gpu.py    onnxruntime CUDA vs PyTorch CUDA (one "skipped" row without a GPU)
  ddp    bench_ddp.py    a growth event in a 2-process DDP job (torchrun, gloo) ÷ one training step
  tp     compare_tp.py   per model, the channel groups Torch-Pruning prunes that graphgrow grows (information only)
  gpt    bench_gpt.py    a GPT grown mid-training vs trained large: loss at growth, FLOPs/time to the same loss
  gradmax bench_gradmax.py new units' init: today's, gradmax, gromo TINY on two MLP tasks (loss after growth, schedule)

    python benchmarks/run.py [--only steps,fold] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, format_number, print_table  # noqa: E402

SECTIONS = ("steps", "fold", "scale", "gpu", "ddp", "tp", "gpt", "gradmax")


def machine() -> dict:
    def version(*names: str) -> str:
        for n in names:
            try:
                return metadata.version(n)
            except metadata.PackageNotFoundError:
                continue
        return "-"

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "onnxruntime": version("onnxruntime-gpu", "onnxruntime"),
        "onnx": version("onnx"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    ap.add_argument("--quick", action="store_true", help="resnet18 only, fewer rounds (a smoke run)")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    import bench_ddp
    import bench_fold
    import bench_gpt
    import bench_gpu
    import bench_gradmax
    import bench_scale
    import bench_steps
    import bench_stream
    import compare_tp

    quick = {"models": ("resnet18",)} if args.quick else {}
    jobs = {
        "steps": lambda p: bench_steps.rows(
            **quick, rounds=1 if args.quick else 3, export_rounds=1 if args.quick else 2, progress=p
        ),
        "fold": lambda p: bench_fold.rows(**quick, rounds=5 if args.quick else 20, progress=p),
        "scale": lambda p: (
            bench_scale.rows(
                (300, 1000) if args.quick else (1000, 4000, 12000),
                progress=p,
                decoder=("125m",) if args.quick else ("125m", "350m", "1b"),
            )
            + bench_stream.rows("tiny" if args.quick else "3b", progress=p)
        ),
        "gpu": lambda p: bench_gpu.rows(**quick, rounds=10 if args.quick else 50, progress=p),
        "ddp": lambda p: bench_ddp.rows(events=1 if args.quick else 3, steps=5 if args.quick else 20, progress=p),
        "tp": lambda p: compare_tp.rows(**quick, progress=p),
        "gpt": lambda p: bench_gpt.rows(quick=args.quick, progress=p),
        "gradmax": lambda p: bench_gradmax.rows(quick=args.quick, progress=p),
    }
    console = Console(stderr=True)
    rows: list[Row] = []
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with console.status("starting") as status:
        for name in wanted:
            t = time.perf_counter()
            rows += jobs[name](
                lambda s, name=name: status.update(f"[{name}] {s}  ({time.perf_counter() - start:.0f} s so far)")
            )
            seconds[name] = round(time.perf_counter() - t, 1)
            console.log(f"{name}: {seconds[name]:.0f} s")
    info = machine()
    print_table(
        rows,
        f"graphgrow benchmarks — {info['processor']}, {info['cpus']} CPUs, torch {info['torch']}, "
        f"onnxruntime {info['onnxruntime']}; one thread unless said; {time.perf_counter() - start:.0f} s",
    )
    missed = [r for r in rows if r.met is False]
    print(
        f"targets: {sum(r.met is True for r in rows)} met, {len(missed)} missed"
        + (
            "".join(
                f"\n  missed: {r.section} — {r.model} {r.measure}: "
                f"{format_number(r.median, r.unit)} (target {r.target})"
                for r in missed
            )
        )
    )
    if os.environ.get("BENCH_JSON"):
        Path(os.environ["BENCH_JSON"]).write_text(
            json.dumps(
                {"machine": info, "seconds": seconds, "rows": [r.to_json() for r in rows]}, indent=2, allow_nan=True
            )
        )
        print(f"rows written to {os.environ['BENCH_JSON']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
