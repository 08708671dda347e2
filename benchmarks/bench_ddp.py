"""A growth event inside a data-parallel job against one training step: 2 processes (torchrun, gloo, one CPU
thread each), DDP over a traced model, SGD with momentum and a StepLR schedule.

The growth event is gg.distributed.grow as a training loop calls it: agree on the spec and seed, grow on every
rank (rank 0 also verifies; the others wait for it), the checksum all-gather, the optimiser and scheduler
carried, DDP rebuilt. It is repeated on the same model (growth leaves its input untouched), after one warm-up
event; the training step is forward, backward (with DDP's all-reduce) and the optimiser step, after warm-up
steps. Reported: the median event, the median step, and their ratio.

    python benchmarks/bench_ddp.py [--events 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, print_table, ratio_row  # noqa: E402

# name → (model factory, per-rank batch shape, growth spec)
CASES = {
    "digits CNN": ("digits", (32, 1, 8, 8), "grow_width(factor=2)"),
    "resnet18": ("resnet18", (8, 3, 64, 64), "deepen"),
}


def _model(kind: str):
    import torch

    torch.manual_seed(0)
    if kind == "digits":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
        from digits_task import model

        return model(), 10
    import torchvision

    return torchvision.models.resnet18(num_classes=10), 10


def worker(out: Path, events: int, steps: int) -> None:
    """One rank of the 2-process job: every case, its steps and its events; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import graphgrow as gg

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name, (kind, shape, spec) in CASES.items():
        net, classes = _model(kind)
        gm = gg.trace(net, input_shape=(2, *shape[1:]))
        ddp = DDP(gm)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 10)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)
        step_s = []
        for i in range(steps + 3):
            start = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            sched.step()
            if i >= 3:  # warm-up steps first
                step_s.append(time.perf_counter() - start)
        event_s, parts = [], []
        for i in range(events + 1):
            dist.barrier()
            start = time.perf_counter()
            grown = gg.distributed.grow(ddp, opt, spec, sched, seed=i, timeout=600)
            if i:  # one warm-up event first
                event_s.append(time.perf_counter() - start)
                parts.append(grown.seconds)
            sched.optimizer = opt  # undo the re-pointing: the next event grows the same model again
        results[name] = {
            "step_s": step_s,
            "event_s": event_s,
            "parts": parts,
            "spec": spec,
            "batch": list(shape),
            "params": [sum(p.numel() for p in gm.parameters()), sum(p.numel() for p in grown.gm.parameters())],
        }
    gathered: list = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


def rows(events: int = 3, steps: int = 20, progress=lambda _: None) -> list[Row]:
    progress(f"2-process DDP job (torchrun, gloo): {steps} training steps and {events} growth events per model")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            __file__,
            "--worker",
            str(out),
            "--events",
            str(events),
            "--steps",
            str(steps),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"the 2-process benchmark job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        ranks = json.loads(out.read_text())
    section = "growth in a 2-process DDP job (gloo, 1 thread each)"
    out_rows: list[Row] = []
    for name, r0 in ranks[0].items():
        r1 = ranks[1][name]
        event = [max(a, b) for a, b in zip(r0["event_s"], r1["event_s"])]  # the event ends on the slower rank
        step = statistics.median(r0["step_s"])
        verify = statistics.median(p["grow"] for p in r0["parts"])
        wait = statistics.median(p["wait"] for p in r1["parts"])
        rebuild = statistics.median(p["rebuild"] for p in r0["parts"])
        model = f"{name} ({r0['params'][0]:,} → {r0['params'][1]:,} params)"
        out_rows.append(
            Row(
                section,
                model,
                f"one training step (batch {r0['batch'][0]} per rank)",
                step * 1000,
                min(r0["step_s"]) * 1000,
                "ms",
            )
        )
        out_rows.append(
            Row(
                section,
                model,
                f"growth event: {r0['spec']}",
                statistics.median(event),
                min(event),
                "s",
                note=f"rank 0 grows + verifies {verify:.2f} s; rank 1 waits {wait:.2f} s; "
                f"DDP rebuilt {rebuild * 1000:.1f} ms",
            )
        )
        out_rows.append(ratio_row(section, model, "growth event ÷ one training step", [e / step for e in event], None))
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.events, args.steps)
        return
    print_table(rows(args.events, args.steps, progress=lambda s: print(s, file=sys.stderr)))


if __name__ == "__main__":
    main()
