"""How graph-side costs scale with graph size: synthetic residual chains of about 1,000, 4,000 and
12,000 fx nodes (tiny 1×1 convs on a 4×4 map, so tensor arithmetic is negligible and what is
measured is graphgrow's own work), time per node of trace (with its fidelity check), one pass
(deepen, default target) and that pass's verification. DESIGN §9's target: the per-node cost at
12,000 nodes within 1.5× of that at 1,000.

    python benchmarks/bench_scale.py [--nodes 1000,4000,12000]
"""
from __future__ import annotations

import argparse
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


def rows(sizes=(1000, 4000, 12000), progress=lambda _: None) -> list[Row]:
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
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,4000,12000")
    args = ap.parse_args()
    print_table(rows([int(n) for n in args.nodes.split(",")], progress=lambda s: print(s, file=sys.stderr)))


if __name__ == "__main__":
    main()
