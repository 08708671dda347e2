"""Sparse upcycling, measured: a small dense GPT trained here, then either trained on as it is or upcycled into a
mixture of experts (graphgrow's `upcycle` pass, exact at insertion) and trained on, for the same steps on the same
batches. Byte-level, on the Python standard library's own source (examples/grow_gpt.py's corpus and model).

1. dense: GPT d=32, 2 heads, 2 layers, trained for --pretrain steps (AdamW, warm-up then a constant rate);
2. from that checkpoint, on the same batches for --steps more steps at the same rate:
   - dense continued (its AdamW state kept),
   - upcycle(experts=E, top_k=2) for each E of --experts (AdamW's moments carried by name: gg.carry_optimizer;
     the copies and the router start with none).
Prints the validation loss before and after upcycling (equal: the pass is exact), a table of the validation loss
at the end and the compute per token of each model, and writes a plot of the loss curves side by side.

    python examples/upcycle_gpt.py [--pretrain 300] [--steps 300] [--experts 4,8] [--out examples/upcycle_gpt.png]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import graphgrow as gg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grow_gpt import BATCH, CONTEXT, GPT, SMALL, batch, corpus, loss_on  # noqa: E402

LR, WARMUP, TOP_K = 3e-3, 30, 2


def forward_flops_per_token(model) -> float:
    """Forward FLOPs of one sequence of CONTEXT tokens, per token (torch's counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.zeros(1, CONTEXT, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() / CONTEXT


def train(model, opt, data, gen, steps: int, start: int, val, every: int, curve: list, log) -> None:
    """`steps` AdamW steps from step `start` (warm-up over the first WARMUP steps of the whole run)."""
    began = time.perf_counter()
    for step in range(start, start + steps):
        for g in opt.param_groups:
            g["lr"] = LR * min(1.0, (step + 1) / WARMUP)
        x, y = batch(data, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % every == 0:
            curve.append((step + 1, loss_on(model, val)))
            log(f"  step {step + 1}: train {loss.item():.4f}, val {curve[-1][1]:.4f}")
    curve_seconds = time.perf_counter() - began
    log(f"  {steps} steps in {curve_seconds:.1f} s")


def run(pretrain: int, steps: int, experts: list[int], every: int, limit: int | None, log=print) -> dict:
    torch.manual_seed(0)
    train_data, val_data = corpus(limit)
    val = [batch(val_data, torch.Generator().manual_seed(10_000 + i)) for i in range(8)]
    dense = gg.trace(GPT(**SMALL), input_shape=f"idx:{BATCH}x{CONTEXT}:int64")
    opt = torch.optim.AdamW(dense.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    start_curve: list = [(0, loss_on(dense, val))]
    log(f"dense pre-training, {pretrain} steps")
    train(dense, opt, train_data, gen, pretrain, 0, val, every, start_curve, log)
    checkpoint = (
        {k: v.clone() for k, v in dense.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
        gen.get_state(),
    )
    d, layers = SMALL["d"], SMALL["layers"]
    dense_flops = forward_flops_per_token(dense)
    mlp_flops = 2 * (d * 4 * d + 4 * d * d)  # one MLP's forward multiply-adds ×2, per token
    runs: dict[str, dict] = {}
    for e in [1] + experts:  # 1: the dense model continued
        dense.load_state_dict(checkpoint[0])
        opt.load_state_dict(checkpoint[1])
        gen.set_state(checkpoint[2])
        model, name, o = dense, "dense", opt
        summary: dict = {}
        if e > 1:
            name = f"upcycled E={e} top-{TOP_K}"
            before = loss_on(dense, val)
            result = gg.get_pass("upcycle")(experts=e, top_k=TOP_K)(dense)
            model, o = result.gm, gg.carry_optimizer(opt, dense, result.gm)
            after = loss_on(model, val)
            log(f"{name}: validation loss {before:.7f} → {after:.7f} at insertion")
            summary = {"val_before": before, "val_after": after}
        log(f"{name}, {steps} steps")
        curve = list(start_curve)
        began = time.perf_counter()
        train(model, o, train_data, gen, steps, pretrain, val, every, curve, log)
        graph_flops = forward_flops_per_token(model)
        active = dense_flops + (layers * ((TOP_K - 1) * mlp_flops + 2 * d * e) if e > 1 else 0)
        runs[name] = {
            **summary,
            "curve": curve,
            "val_end": curve[-1][1],
            "params": sum(p.numel() for p in model.parameters()),
            "graph_flops_per_token": graph_flops,
            "sparse_flops_per_token": active,
            "seconds": time.perf_counter() - began,
        }
    return {"pretrain": pretrain, "steps": steps, "runs": runs}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in summary["runs"].items():
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, label=name)
    ax.axvline(summary["pretrain"], color="grey", ls=":", label="upcycled here")
    ax.set_xlabel("training step (batch 32 × 64 bytes)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_ylim(top=min(3.2, max(max(l for _, l in r["curve"][2:]) for r in summary["runs"].values()) + 0.1))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrain", type=int, default=300)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--experts", default="4,8")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("upcycle_gpt.png"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # a model this small: one thread is faster than several waiting at each other's barriers
    summary = run(args.pretrain, args.steps, [int(e) for e in args.experts.split(",")], args.every, None)
    print("\n| model | parameters | val loss at the end | forward FLOPs/token: graph (dense form) | sparse top-2 |")
    print("|---|---|---|---|---|")
    for name, r in summary["runs"].items():
        print(
            f"| {name} | {r['params']:,} | {r['val_end']:.4f} | {r['graph_flops_per_token']:,.0f} | "
            f"{r['sparse_flops_per_token']:,.0f} |"
        )
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in summary["runs"].items()}))
    plot(summary, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
