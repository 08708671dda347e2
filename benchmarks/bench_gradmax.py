"""init=gradmax against today's init (random in, zero out) after one growth event on the digits task.

The digits CNN (examples/digits_task.py) trains for a few epochs, grows one layer 2× with each init
(the same seed, the same batch order afterwards), then trains on; the full training-set loss after
k = 1, 10, 100 SGD steps is reported as mean ± spread (half the max − min) over seeds, with the loss
just before growth (both inits keep it exactly) and the seconds the data-driven step took.

    python benchmarks/bench_gradmax.py            # 3 seeds, both conv layers
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import graphgrow as gg
from examples.digits_task import BATCH, batch, digits, model

STEPS = (1, 10, 100)


def _loss(m) -> float:
    (x, y), _ = digits()
    with torch.no_grad():
        return F.cross_entropy(m(x), y).item()


def _train(m, steps: int, seed: int, record=()) -> dict[int, float]:
    """`steps` SGD steps (lr 0.05, momentum 0.9) on minibatches in a seeded order; the loss at `record`."""
    (x, y), _ = digits()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(y), generator=g) for _ in range(steps * BATCH // len(y) + 1)])
    out = {}
    for i in range(steps):
        idx = order[i * BATCH:(i + 1) * BATCH]
        m.train()
        opt.zero_grad()
        F.cross_entropy(m(x[idx]), y[idx]).backward()
        opt.step()
        if i + 1 in record:
            m.eval()
            out[i + 1] = _loss(m)
            m.train()
    return out


def run(seeds: int = 3, targets=("0", "3"), pretrain: int = 60) -> list[dict]:
    rows = []
    for target in targets:
        for seed in range(seeds):
            torch.manual_seed(seed)
            base = gg.trace(model(), input_shape=(1, 1, 8, 8))
            _train(base, pretrain, seed + 100)
            base.eval()
            row = {"target": target, "seed": seed, "before": _loss(base)}
            for init in ("zero", "gradmax"):
                p = gg.get_pass("grow_width")(target=target, init=init, data=batch if init == "gradmax" else None)
                t = time.perf_counter()
                grown = p(base, seed=seed).gm
                row[f"{init}_s"] = time.perf_counter() - t
                row[init] = _train(grown, max(STEPS), seed, STEPS)
            rows.append(row)
    return rows


def _pm(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ± {(max(values) - min(values)) / 2:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    rows = run(args.seeds)
    print("| grown layer | init | before growth | after 1 step | after 10 | after 100 | pass seconds |")
    print("|---|---|---|---|---|---|---|")
    for target in sorted({r["target"] for r in rows}):
        mine = [r for r in rows if r["target"] == target]
        for init in ("zero", "gradmax"):
            cells = [_pm([r[init][k] for r in mine]) for k in STEPS]
            print(f"| {target} | {init} | {_pm([r['before'] for r in mine])} | {' | '.join(cells)} | "
                  f"{statistics.mean(r[init + '_s'] for r in mine):.2f} |")


if __name__ == "__main__":
    main()
