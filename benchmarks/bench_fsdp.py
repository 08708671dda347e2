"""A growth event inside a job sharded with FSDP2 against one training step, and what it costs in memory per rank.

Run under torchrun (gloo on the CPU with one thread per process; NCCL when every rank has a GPU):

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_fsdp.py [--dim 512] [--layers 8] [--events 3]

The model is examples/grow_fsdp.py's decoder, sharded one unit per layer (gg.distributed.shard), trained with AdamW.
The training step is forward, backward (FSDP's all-gathers and reduce-scatters) and the optimiser step, after
warm-up; the growth event is gg.distributed.grow as the loop calls it (gather, grow with rank 0 verifying, re-shard,
AdamW's state carried), repeated on the same model after one warm-up event (growth leaves its input untouched; each
result is dropped) — one layer at a time (`layerwise`, the default) and the whole model on the host (`whole`), each
with events of its own. Memory: on the CPU the process's resident set (sampled every 2 ms; freed heap handed back
with malloc_trim before each measured call and large tensors always mmapped (live_heap), so a phase is not charged
another's high-water mark), on a GPU
torch.cuda.max_memory_allocated; the growth peak is set against the training peak and the steady state before a
step. Rank 0 prints one JSON line per rank with the medians, the peaks and the sizes they compare with (the full
model, one layer, the sharded state). `--release-old` grows each event's result again after one training step (the
old model is empty then); `--verify none` measures the growth without rank 0's checks. Numbers from this machine
(2 cores shared with other jobs, load 10–12): docs/distributed.md, "What a growth event costs here".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import graphgrow as gg  # noqa: E402
from examples import grow_fsdp as ex  # noqa: E402
from graphgrow.jobs import fsdp  # noqa: E402

MB = 2**20


class PeakRSS:
    """The largest resident set size seen while the block runs (a thread reads /proc/self/statm every 2 ms)."""

    def __enter__(self):
        self.peak, self._stop = rss(), False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, rss())


def rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim), so that the resident set sampled next is what
    the process holds, not the high-water mark of what an earlier phase freed."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc: the resident set keeps earlier peaks
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def live_heap() -> None:
    """Tensors of 128 KiB and more from mmap, always (glibc's M_MMAP_THRESHOLD fixed; by default it rises to 32 MiB
    after the first large free, and the heap then keeps what a phase freed): the resident set follows what the
    process holds, so a growth event's peak is its own, not the high-water mark of every window before it."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


def measure(cuda: bool, fn):
    """(result, seconds, peak bytes during fn, bytes before it): device peak on a GPU, resident set on the CPU."""
    gc.collect()
    trim()
    before = torch.cuda.memory_allocated() if cuda else rss()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as host:
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return out, seconds, (torch.cuda.max_memory_allocated() if cuda else host.peak), before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--spec", default="grow_hidden(by=64)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--events", type=int, default=3)
    ap.add_argument("--release-old", action="store_true", help="grow(release_old=True): old state off the device")
    ap.add_argument(
        "--verify", choices=("rank0", "none"), default="rank0", help="grow(verify=...): none measures growth alone"
    )
    ap.add_argument(
        "--layerwise",
        choices=("both", "on", "off"),
        default="both",
        help="grow one layer at a time (on), the whole model on the host (off), or both in turn (each its own events)",
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    cuda = torch.cuda.is_available()
    torch.set_num_threads(1)
    live_heap()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    base = ex.traced(dim=args.dim, layers=args.layers)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if n.startswith("layers.0."))
    model = gg.distributed.shard(base.to(device), [f"layers.{i}" for i in range(args.layers)], mesh=mesh)
    del base
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for n in range(3):  # warm-up: AdamW's state exists, FSDP's buffers are allocated
        ex.train_step(model, opt, n, rank, world)
    steps = [measure(cuda, lambda n=n: ex.train_step(model, opt, n, rank, world)) for n in range(args.steps)]
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    released: list = []
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.layerwise]

    class Counted(fsdp.Released):  # what release_old freed on the device and what it had to keep
        def __init__(self, tensors):
            super().__init__(tensors)
            released.append((sum(n for _, n, _ in self.saved), self.kept))

    class Spilled(fsdp.Spill):  # what release_old wrote to its file on the layer-by-layer path
        def close(self):
            super().close()
            released.append((self.nbytes, self.kept))

    fsdp.Released = Counted  # type: ignore[misc]
    fsdp.Spill = Spilled  # type: ignore[misc]
    step_s = statistics.median(s[1] for s in steps)
    record: dict = {
        "rank": rank,
        "world": world,
        "device": str(device),
        "spec": args.spec,
        "params": full_bytes // 4,
        "step_s": round(step_s, 4),
        "train_peak_mb": round(max(s[2] for s in steps) / MB, 1),
        "steady_mb": round(min(s[3] for s in steps) / MB, 1),  # before a step: shards, AdamW state, the process
        "full_model_mb": round(full_bytes / MB, 1),
        "one_layer_mb": round(layer_bytes / MB, 1),
        "param_shard_mb": round(shard_bytes / MB, 1),
        "memory": "cuda max_memory_allocated" if cuda else "resident set (host)",
        "release_old": args.release_old,
        "verify": args.verify,
    }
    for layerwise in modes:
        events = []
        for i in range(args.events + 1):
            layer = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers.0."))
            g, seconds, peak, before = measure(
                cuda,
                lambda i=i, m=model, o=opt, lw=layerwise: gg.distributed.grow(
                    m, o, args.spec, seed=i, timeout=600, release_old=args.release_old, layerwise=lw, verify=args.verify
                ),
            )
            if i:  # the first event warms up
                events.append((seconds, peak, g.seconds, before, layer))
            if args.release_old:  # the old model is empty now: train on the grown one (a step: its gradients exist)
                model, opt = g.model, g.optimizer
                ex.train_step(model, opt, 0, rank, world)
            del g
        event_s = statistics.median(e[0] for e in events)
        record["layerwise" if layerwise else "whole"] = {
            "event_s": round(event_s, 3),
            "event_per_step": round(event_s / step_s, 1),
            "phases_s": {k: round(statistics.median(e[2][k] for e in events), 3) for k in events[0][2]},
            "growth_peak_mb": round(max(e[1] for e in events) / MB, 1),
            "before_mb": round(min(e[3] for e in events) / MB, 1),
            # each event against the resident set just before it, and the size of a layer of the model it grew
            # (with release_old each event grows the model the one before grew)
            "rise_mb": [round((e[1] - e[3]) / MB, 1) for e in events],
            "layer_mb": [round(e[4] / MB, 1) for e in events],
            "events_s": [round(e[0], 2) for e in events],
        }
    record["released_mb"] = round(max((r for r, _ in released), default=0) / MB, 1)
    record["kept_mb"] = round(max((k for _, k in released), default=0) / MB, 1)
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        for r in records:
            print(json.dumps(r))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
