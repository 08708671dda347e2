"""Soak: the growth-loop pattern, N mutate → export → check cycles in one process, memory watched.

Each cycle grows the current model (alternating passes), exports it to ONNX in memory,
checks it on onnxruntime, and keeps the grown model for the next cycle, as a growth
loop does; every 10 cycles the model is reset to the original so it stays small.
Prints the resident set size (RSS) at chosen cycles. --no-isolate exports in-process.
Usage: python benchmarks/soak.py [--cycles 200]
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time

import torch
from torch import nn

import graphgrow as gg
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import max_ir_version, open_session
from graphgrow.verify.equivalence import check_equivalence

SPECS = ["add_residual", "grow_width(factor=1.25)", "deepen", "add_branch(op=sepconv3x3)", "insert_adapter"]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, 2, 1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="export in a forked child (torch.export leaks about 0.3 MiB per export in-process)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    shape = (1, 3, 16, 16)
    original = gg.trace(model(), shape)
    gm = original
    marks = {1, 10, 50, 100, 150, args.cycles}
    start = time.perf_counter()
    failures = 0
    for cycle in range(1, args.cycles + 1):
        if cycle % 10 == 1:
            gm = original
        gm = gg.Pipeline.from_spec(SPECS[cycle % len(SPECS)], seed=cycle).run(gm).results[0].gm
        proto = export_onnx(gm, shape, max_ir_version=max_ir_version(), isolate=args.isolate)
        report = check_equivalence(gm, open_session(proto.SerializeToString(), "cpu"), shape)
        failures += not report.passed
        del proto, report
        if cycle in marks:
            gc.collect()
            print(f"cycle {cycle:4d}: RSS {rss_mb():7.1f} MiB, {time.perf_counter() - start:6.1f}s elapsed", flush=True)
    print(f"{args.cycles} cycles, {failures} equivalence failures, {time.perf_counter() - start:.1f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
