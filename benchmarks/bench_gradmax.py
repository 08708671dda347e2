"""init=gradmax against today's init (random in, zero out) after one growth event on the digits task.

The digits CNN (examples/digits_task.py) trains for a few epochs, grows one layer 2× with each init
(the same seed, the same batch order afterwards), then trains on; the full training-set loss after
k = 1, 10, 100 SGD steps is reported as mean ± spread (half the max − min) over seeds, with the loss
just before growth (both inits keep it exactly) and the seconds the data-driven step took.

    python benchmarks/bench_gradmax.py            # 3 seeds, both conv layers

`rows()` (make bench --only gradmax) is the MLP comparison of examples/growth_init_compare.py as table
rows: today's init, gradmax and gromo's TINY (when gromo is installed) on digits and diabetes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import graphgrow as gg

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # examples.digits_task; growth_init_compare (in rows())
from examples.digits_task import BATCH, batch, digits, model  # noqa: E402

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
        idx = order[i * BATCH : (i + 1) * BATCH]
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


def rows(quick: bool = False, progress=lambda s: None) -> list:
    """The init comparison as `make bench` rows (information only): per task and init, the training loss 100
    steps after a growth at step 300 and at the end of the growth schedule, the test metric, and the
    data-driven step's seconds ÷ one forward + backward over its batch."""
    import growth_init_compare as gic
    from common import Row

    progress("init comparison (examples/growth_init_compare.py)" + (" --quick" if quick else ""))
    out = gic.run(quick=quick, seeds=3)
    table = []
    for name, task in out["tasks"].items():
        model_name = f"{name} MLP {task.h}→{2 * task.h}"
        ev = [r for r in out["event"] if r["task"] == name and r["at"] == max(r["at"] for r in out["event"])]
        for init in dict.fromkeys(r["init"] for r in ev):
            mine = [r for r in ev if r["init"] == init]
            losses = [r["curve"][-1] for r in mine]
            table.append(
                Row(
                    "gradmax",
                    model_name,
                    f"loss {len(mine[0]['curve'])} steps after growth: {init}",
                    statistics.median(losses),
                    min(losses),
                    note=f"{len(mine)} seeds, grown at step {mine[0]['at']}",
                )
            )
            if init in out["cost"][name]:
                ratio = out["cost"][name][init] / out["cost"][name]["fwd+bwd"]
                table.append(
                    Row(
                        "gradmax",
                        model_name,
                        f"data step ÷ fwd+bwd: {init}",
                        ratio,
                        ratio,
                        "×",
                        note="medians after a warm-up",
                    )
                )
        sc = [r for r in out["schedule"] if r["task"] == name]
        for init in dict.fromkeys(r["init"] for r in sc):
            mine = [r for r in sc if r["init"] == init]
            for key, what in (("loss", "schedule final loss"), ("score", f"schedule test {task.metric}")):
                values = [r[key] for r in mine]
                table.append(
                    Row(
                        "gradmax",
                        f"{name} MLP {task.h}→{mine[0]['width']}",
                        f"{what}: {init}",
                        statistics.median(values),
                        min(values),
                        note=f"{len(mine)} seeds",
                    )
                )
    return table


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
            print(
                f"| {target} | {init} | {_pm([r['before'] for r in mine])} | {' | '.join(cells)} | "
                f"{statistics.mean(r[init + '_s'] for r in mine):.2f} |"
            )


if __name__ == "__main__":
    main()
