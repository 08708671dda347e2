"""How graph-side costs scale with graph size: synthetic residual chains of about 1,000, 4,000 and
12,000 fx nodes (tiny 1×1 convs on a 4×4 map, so tensor arithmetic is negligible and what is
measured is graphgrow's own work), time per node of trace (with its fidelity check), one pass
(deepen, default target) and that pass's verification. DESIGN §9's target: the per-node cost at
12,000 nodes within 1.5× of that at 1,000.

And the other way (issue 27): small models at 32×32, as growth during training meets them —
seconds of trace + fidelity check and of one verified pass (every built-in pass at its default
target) through the API, torch's default thread count (target ≤ 2 s each). The DARTS networks of
examples/darts_net.py (traced in train mode, as examples/darts_growth.py does) and a CIFAR
ResNet-20. Warm: one pass runs first, so the process's one-time imports are not counted (the
first FLOP count imports torch._dynamo, about 2 s here).

    python benchmarks/bench_scale.py [--nodes 1000,4000,12000] [--small-only]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graphgrow as gg  # noqa: E402
from common import Row, print_table, ratio_row  # noqa: E402
from graphgrow.passes.deepen import deepen  # noqa: E402
from graphgrow.verify.verify import verify  # noqa: E402


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.conv(x))


def chain(nodes: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(4) for _ in range(max(1, nodes // 3))])  # 3 nodes per block
    with torch.no_grad():  # small residual branches, so thousands of blocks neither explode nor vanish
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_(1.0 / len(model))
                m.bias.zero_()
    return model


def measure(nodes: int) -> dict:
    model = chain(nodes).eval()
    shape = (1, 4, 4, 4)
    t = time.perf_counter()
    gm = gg.trace(model, shape)
    gg.annotate(gm, shape)
    t_trace = time.perf_counter() - t
    n = len(gm.graph.nodes)
    t = time.perf_counter()
    rw = deepen(gm)
    gg.annotate(rw.gm, shape)
    t_pass = time.perf_counter() - t
    t = time.perf_counter()
    verify(gm, rw.gm, shape)
    t_verify = time.perf_counter() - t
    return {"nodes": n, "trace_s": t_trace, "pass_s": t_pass, "verify_s": t_verify,
            "trace_us_per_node": 1e6 * t_trace / n, "pass_us_per_node": 1e6 * t_pass / n, "verify_us_per_node": 1e6 * t_verify / n}


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + self.short(x))


def resnet20() -> nn.Module:
    """He et al.'s CIFAR ResNet-20: 3 stages of 3 basic blocks, 16/32/64 channels (0.27 M parameters)."""
    torch.manual_seed(0)
    blocks, cin = [], 16
    for i, c in enumerate((16, 32, 64)):
        for j in range(3):
            blocks.append(_Basic(cin, c, 2 if i and not j else 1))
            cin = c
    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), *blocks,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def small_models() -> dict:
    """name → (build, trace mode)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import darts_net as dn

    return {"DARTS 5 cells C=8": (lambda: dn.small_darts(seed=0), "train"),
            "DARTS 8 cells C=16": (lambda: dn.NetworkCIFAR(C=16, layers=8), "train"),
            "ResNet-20 (CIFAR)": (lambda: resnet20().eval(), "eval")}


SMALL_PASSES = ("grow_width", "insert_adapter", "add_residual", "add_branch", "deepen")
DARTS_EVENTS = ("grow_width(target=cells.1.preprocess1.1)", "add_branch(op=sepconv3x3,at=cells_2__ops_0_1_3)",
                "grow_width(target=cells.2._ops.2.1.2)", "deepen(after=cells_2__ops_0_1_3)")  # examples/darts_growth.py


def small_rows(rounds: int = 3, progress=lambda _: None) -> list[Row]:
    """Seconds of trace + fidelity and of one verified pass on small models at 32×32 (target ≤ 2 s)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # what a user's process has (other sections set one thread)
    out = []
    try:
        for name, (build, mode) in small_models().items():
            progress(f"small model: {name}")
            model = build()
            params = sum(p.numel() for p in model.parameters())
            times, gm = [], None
            for _ in range(rounds):
                t = time.perf_counter()
                gm = gg.trace(model, (2, 3, 32, 32), mode=mode)
                times.append(time.perf_counter() - t)
            out.append(_seconds_row(name, "trace + fidelity", times, f"{params / 1e6:.2f} M parameters, {mode} mode"))
            _try(lambda gm=gm: gg.Pipeline.from_spec("insert_adapter").run(gm))  # warm-up: one-time imports
            for spec in SMALL_PASSES + (DARTS_EVENTS if name == "DARTS 5 cells C=8" else ()):
                times, refused = [], ""
                for _ in range(rounds):
                    t = time.perf_counter()
                    refused = _try(lambda spec=spec, gm=gm: gg.Pipeline.from_spec(spec).run(gm))
                    times.append(time.perf_counter() - t)
                out.append(_seconds_row(name, f"verified {spec}", times, refused))
    finally:
        torch.set_num_threads(saved)
    return out


def _try(fn) -> str:
    try:
        fn()
    except gg.GraphgrowError as e:
        return f"refused: {e.message[:70]}"
    return ""


def _seconds_row(model: str, measure: str, times: list[float], note: str) -> Row:
    med = statistics.median(times)
    return Row("small models at 32×32 (s, API, default threads)", model, measure, med, min(times), "s", "≤ 2",
               med <= 2, note)


def rows(sizes=(1000, 4000, 12000), progress=lambda _: None, small: bool = True) -> list[Row]:
    torch.set_num_threads(1)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))  # deep Sequential copies recurse per level
    measure(300)  # warm-up: first-call costs (imports, caches) are not per-node costs
    runs = []
    for n in sizes:
        progress(f"residual chain of {n:,} nodes")
        runs.append(measure(int(n)))
    out = []
    for r in runs:
        for key in ("trace", "pass", "verify"):
            out.append(Row("graph-side µs per fx node", f"chain of {r['nodes']:,} nodes", key, r[f"{key}_us_per_node"],
                           r[f"{key}_us_per_node"], "µs", note=f"{r[f'{key}_s']:.2f} s in all"))
    first, last = runs[0], runs[-1]
    for key in ("trace", "pass", "verify"):
        out.append(ratio_row("per-node cost, largest ÷ smallest chain", f"{last['nodes']:,} ÷ {first['nodes']:,} nodes", key,
                             [last[f"{key}_us_per_node"] / first[f"{key}_us_per_node"]], 1.5))
    return out + (small_rows(progress=progress) if small else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,4000,12000")
    ap.add_argument("--small-only", action="store_true", help="only the small models at 32×32")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the small-model rows")
    args = ap.parse_args()
    progress = lambda s: print(s, file=sys.stderr)  # noqa: E731
    print_table(small_rows(args.rounds, progress) if args.small_only
                else rows([int(n) for n in args.nodes.split(",")], progress=progress))


if __name__ == "__main__":
    main()
