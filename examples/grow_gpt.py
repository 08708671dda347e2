"""Does growth pay? A small GPT on the Python standard library's own source (byte level, no download).

(a) grown: a GPT with d=32, 2 heads, 2 layers trains for a part of the steps, then graphgrow grows it mid-training,
    exactly, with "grow_hidden(to=48),grow_heads(heads=3),grow_width(...),deepen(block=transformer)" into the large
    architecture (d=48, 3 heads, 3 layers, MLP 4·d); AdamW's moments follow the parameters (gg.carry_optimizer) and
    training continues to the same total number of steps, on the same learning-rate schedule.
(b) large: the large architecture trained from scratch with the same data, schedule, steps and learning rate.
    (The grown model is the large architecture but for the inserted block: its key projection has no bias and its
    norms' eps follow the model's, rescaled by grow_hidden.)

The training and validation loss right before and after growth are printed (they agree to float rounding), and
a table gives the wall time and the training FLOPs (counted by torch's FlopCounterMode per step of each
architecture) each run needs to reach the same validation loss. Writes a plot of validation loss against
training FLOPs and wall time with the growth point marked.

    python examples/grow_gpt.py [--out examples/gpt_growth.png] [--steps 3000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

# A fixed, sorted list of pure-Python stdlib modules: the corpus is the same on every machine with this Python.
MODULES = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "configparser.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "pathlib.py",
    "pprint.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "typing.py",
    "zipfile.py",
)

SMALL = dict(d=32, heads=2, layers=2)
LARGE = dict(d=48, heads=3, layers=3)
CONTEXT, BATCH, VOCAB = 64, 32, 256


# ---------------------------------------------------------------------------------------------------- data


def corpus(limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of MODULES (those present), concatenated in order; the last 10 % held out for validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / name).read_bytes() for name in sorted(MODULES) if (root / name).is_file()]
    if not parts:
        raise SystemExit(f"none of the corpus modules found under {root}")
    data = torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8).long()
    if limit:
        data = data[:limit]
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:]


def batch(data: torch.Tensor, gen: torch.Generator, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    at = torch.randint(0, len(data) - CONTEXT - 1, (size,), generator=gen)
    x = torch.stack([data[i : i + CONTEXT] for i in at])
    y = torch.stack([data[i + 1 : i + CONTEXT + 1] for i in at])
    return x, y


# ---------------------------------------------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int, heads: int, layers: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(CONTEXT, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def growth_spec() -> str:
    """SMALL → LARGE: the stream, the heads, each block's MLP (4·32 → 4·48), then a third block (identity at first)."""
    mlps = ",".join(f"grow_width(target=blocks.{i}.fc1,to={4 * LARGE['d']})" for i in range(SMALL["layers"]))
    return f"grow_hidden(to={LARGE['d']}),grow_heads(heads={LARGE['heads']}),{mlps},deepen(block=transformer)"


# ---------------------------------------------------------------------------------------------------- training


@dataclass
class Run:
    name: str
    steps: list[int] = field(default_factory=list)  # step at each evaluation
    val: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # training wall time (growth included) at each evaluation
    flops: list[float] = field(default_factory=list)  # training FLOPs at each evaluation
    growth: dict = field(default_factory=dict)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak over the whole run (the same for both runs)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def loss_on(model: nn.Module, batches) -> float:
    """Mean cross-entropy over fixed batches, without gradients (dropout-free model: train and eval mode agree)."""
    with torch.no_grad():
        return sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches) / len(batches)


def step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """FLOPs of one training step's forward and backward (torch's counter; AdamW's update is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def train(
    name: str, model: nn.Module, data, total: int, grow_at: int | None, lr: float, every: int, seed: int, log=print
) -> tuple[nn.Module, Run]:
    (train_data, val_data) = data
    gen = torch.Generator().manual_seed(seed)  # the same batches for both runs
    val_batches = [batch(val_data, torch.Generator().manual_seed(10_000 + i)) for i in range(8)]
    probe = [batch(train_data, torch.Generator().manual_seed(20_000))]  # a fixed training batch
    model = gg.trace(model, input_shape=f"idx:{BATCH}x{CONTEXT}:int64")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    per_step = step_flops(model, *probe[0])
    run, seconds, flops = Run(name), 0.0, 0.0

    def evaluate(step: int) -> None:
        run.steps.append(step)
        run.val.append(loss_on(model, val_batches))
        run.seconds.append(seconds)
        run.flops.append(flops)

    evaluate(0)
    for step in range(total):
        if step == grow_at:
            before = (loss_on(model, probe), loss_on(model, val_batches))  # a fixed training batch, the validation set
            start = time.perf_counter()  # growth's wall time counts (its verification's FLOPs are not counted)
            result = gg.Pipeline.from_spec(growth_spec(), seed=seed).run(model)  # each pass verified
            old_params = sum(p.numel() for p in model.parameters())
            opt = gg.carry_optimizer(opt, model, result.gm)  # AdamW's moments by name; new slices start at zero
            model = result.gm
            grow_seconds = time.perf_counter() - start
            seconds += grow_seconds
            after = (loss_on(model, probe), loss_on(model, val_batches))
            per_step = step_flops(model, *probe[0])
            run.growth = {
                "step": step,
                "train_before": before[0],
                "train_after": after[0],
                "val_before": before[1],
                "val_after": after[1],
                "params_before": old_params,
                "params_after": sum(p.numel() for p in model.parameters()),
                "seconds": grow_seconds,
            }
            log(
                f"[{name}] step {step}: grew {old_params:,} → {run.growth['params_after']:,} parameters in "
                f"{run.growth['seconds']:.1f} s; training loss {before[0]:.7f} → {after[0]:.7f}, "
                f"validation loss {before[1]:.7f} → {after[1]:.7f}"
            )
        start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, lr, warmup=max(total // 20, 1))
        x, y = batch(train_data, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seconds += time.perf_counter() - start
        flops += per_step
        if (step + 1) % every == 0 or step + 1 == total:
            evaluate(step + 1)
            log(
                f"[{name}] step {step + 1}: train {loss.item():.4f}, val {run.val[-1]:.4f}, "
                f"{seconds:.1f} s, {flops / 1e12:.3f} TFLOP"
            )
    return model, run


def first_reach(run: Run, target: float) -> tuple[int, float, float] | None:
    """(step, seconds, FLOPs) at the first evaluation whose validation loss is at or below `target`."""
    for s, v, t, f in zip(run.steps, run.val, run.seconds, run.flops):
        if v <= target:
            return s, t, f
    return None


def plot(runs: list[Run], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = {"grown": ("grown mid-training (a)", "tab:blue"), "large": ("large from scratch (b)", "tab:gray")}
    for ax, key, label in (
        (axes[0], "flops", "training FLOPs (×10¹²)"),
        (axes[1], "seconds", "training wall time (s)"),
    ):
        scale = 1e12 if key == "flops" else 1.0
        for r in runs:
            xs = [v / scale for v in getattr(r, key)]
            ax.plot(xs, r.val, label=labels[r.name][0], color=labels[r.name][1])
            if r.growth and r.growth["step"] in r.steps:
                x = xs[r.steps.index(r.growth["step"])]
                ax.axvline(x, color="tab:orange", linestyle="--", linewidth=1)
                ax.text(
                    x, 0.97, " growth", transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="tab:orange"
                )
        ax.axhline(target, color="tab:green", linestyle=":", linewidth=1, label=f"loss both reach ({target:.3f})")
        ax.set_ylim(min(min(r.val) for r in runs) - 0.05, 3.0)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right")
    fig.suptitle("byte-level GPT on Python stdlib source: d 32→48, heads 2→3, MLP 128→192, layers 2→3 (grown exactly)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    out: Path | None,
    steps: int = 3000,
    grow_at: int | None = None,
    lr: float = 3e-3,
    every: int = 50,
    seed: int = 0,
    limit: int | None = None,
    log=print,
) -> dict:
    torch.manual_seed(seed)
    data = corpus(limit)
    grow_at = steps // 3 if grow_at is None else grow_at
    log(
        f"corpus: {len(data[0]):,} training bytes, {len(data[1]):,} validation bytes; {steps} steps of "
        f"{BATCH}×{CONTEXT} tokens; growth at step {grow_at}: {growth_spec()}"
    )
    torch.manual_seed(seed)
    grown_model, grown = train("grown", GPT(**SMALL), data, steps, grow_at, lr, every, seed, log)
    torch.manual_seed(seed)
    large_model, large = train("large", GPT(**LARGE), data, steps, None, lr, every, seed, log)
    # the best validation loss both runs reach (evaluated every `every` steps)
    target = max(min(grown.val), min(large.val))
    reach = {r.name: first_reach(r, target) for r in (grown, large)}
    summary = {
        "target_val_loss": target,
        "growth": grown.growth,
        "steps": steps,
        "params": {
            "grown_final": sum(p.numel() for p in grown_model.parameters()),
            "large": sum(p.numel() for p in large_model.parameters()),
        },
        "final_val": {"grown": grown.val[-1], "large": large.val[-1]},
        "total": {r.name: {"seconds": r.seconds[-1], "flops": r.flops[-1]} for r in (grown, large)},
        "to_target": {k: {"step": v[0], "seconds": v[1], "flops": v[2]} for k, v in reach.items() if v},
    }
    log(f"\nvalidation loss both reach: {target:.4f}")
    log(
        f"{'run':<7}{'final val':>10}{'total s':>9}{'TFLOP':>8}  "
        f"| to reach {target:.4f}:{'step':>6}{'wall s':>8}{'TFLOP':>8}"
    )
    for r in (grown, large):
        s, t, f = reach[r.name]
        log(
            f"{r.name:<7}{r.val[-1]:>10.4f}{r.seconds[-1]:>9.1f}{r.flops[-1] / 1e12:>8.3f}  | {'':>16}{s:>6}{t:>8.1f}"
            f"{f / 1e12:>8.3f}"
        )
    g, la = reach["grown"], reach["large"]
    log(f"grown ÷ large to reach it: wall time {g[1] / la[1]:.2f}×, FLOPs {g[2] / la[2]:.2f}×")
    if out is not None:
        plot([grown, large], target, out)
        summary["plot"] = str(out)
        log(f"plot: {out}")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "gpt_growth.png")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--grow-at", type=int, default=None, help="the growth step (default: a third of the steps)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one is fastest for this small model)")
    ap.add_argument("--quick", action="store_true", help="a few steps on a small part of the corpus, no plot (seconds)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        summary = run(None, steps=20, grow_at=10, lr=args.lr, every=5, seed=args.seed, limit=200_000)
    else:
        summary = run(args.out, args.steps, args.grow_at, args.lr, seed=args.seed)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
