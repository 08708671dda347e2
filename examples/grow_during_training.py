"""Growth during training: a small CNN on scikit-learn's handwritten digits (shipped with the
package, no download) grows at set epochs through the Python API and keeps training.

Events: grow_width, add_residual, add_branch and deepen. Before and after each one the
loss on the same batch is measured (eval and train mode) and must agree to 1e-5; the
run ends beside an un-grown copy of the same model trained for the same number of
steps, and writes a PNG of loss and accuracy with each growth event marked.

    python examples/grow_during_training.py [--out growth_training.png] [--epochs 40]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

import graphgrow as gg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_task import digits  # noqa: E402  (the small CNN and the data, shared with search_digits.py)
from digits_task import model as base_model  # noqa: E402

EVENTS = {  # epoch → pass spec (node names are those of the traced Sequential below)
    6: "grow_width(target=0,factor=2)",
    12: "add_residual(start=_2,end=_5)",
    18: "add_branch(at=_3,op=sepconv3x3,count=2)",
    24: "deepen(after=_5)",
}


@dataclass
class History:
    loss: list[float] = field(default_factory=list)  # mean training loss per epoch
    acc: list[float] = field(default_factory=list)  # test accuracy per epoch
    events: list[dict] = field(default_factory=list)


def accuracy(model: nn.Module, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def batch_loss(model: nn.Module, x, y, train: bool) -> float:
    """Loss on one batch without changing the model (train mode: batch statistics, buffers restored)."""
    m = copy.deepcopy(model)
    m.train(train)
    with torch.no_grad():
        return nn.functional.cross_entropy(m(x), y).item()


def train(
    model: nn.Module, epochs: int, data, grow: bool, lr: float, seed: int = 0, log=print
) -> tuple[nn.Module, History]:
    (xtr, ytr), (xte, yte) = data
    gen = torch.Generator().manual_seed(seed)
    hist = History()
    probe_x, probe_y = xtr[:128], ytr[:128]  # the same batch before and after each growth event
    if grow:
        model = gg.trace(model, input_shape=(1, 1, 8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        if grow and epoch in EVENTS:
            spec = EVENTS[epoch]
            before = (batch_loss(model, probe_x, probe_y, False), batch_loss(model, probe_x, probe_y, True))
            result = gg.Pipeline.from_spec(spec, seed=epoch).run(model).results[0]
            # the old parameters keep their momentum (by name; new slices and new parameters start at zero)
            opt = gg.carry_optimizer(opt, model, result.gm)
            model = result.gm
            after = (batch_loss(model, probe_x, probe_y, False), batch_loss(model, probe_x, probe_y, True))
            hist.events.append(
                {
                    "epoch": epoch,
                    "pass": spec,
                    "params": [result.params_before, result.params_after],
                    "loss_eval": before[0],
                    "loss_eval_after": after[0],
                    "loss_train": before[1],
                    "loss_train_after": after[1],
                }
            )
            log(
                f"epoch {epoch:2d}: {spec}: params {result.params_before:,} → {result.params_after:,}; "
                f"loss on the probe batch {before[0]:.6f} → {after[0]:.6f} (eval), "
                f"{before[1]:.6f} → {after[1]:.6f} (train)"
            )
        model.train()
        perm = torch.randperm(len(ytr), generator=gen)
        total = 0.0
        for i in range(0, len(ytr), 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        hist.loss.append(total / len(ytr))
        hist.acc.append(accuracy(model, xte, yte))
    return model, hist


def plot(grown: History, base: History, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    epochs = np.arange(1, len(grown.loss) + 1)
    for ax, key, label in ((a, "loss", "training loss"), (b, "acc", "test accuracy")):
        ax.plot(epochs, getattr(base, key), label="not grown", color="tab:gray")
        ax.plot(epochs, getattr(grown, key), label="grown with graphgrow", color="tab:blue")
        for e in grown.events:
            ax.axvline(e["epoch"] + 0.5, color="tab:orange", linestyle="--", linewidth=1)
            ax.text(
                e["epoch"] + 0.7,
                ax.get_ylim()[1],
                e["pass"].split("(")[0],
                rotation=90,
                va="top",
                fontsize=8,
                color="tab:orange",
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.set_yscale("log")
    b.legend(loc="lower right")
    fig.suptitle("scikit-learn digits: growing a small CNN during training (growth events dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out: Path, epochs: int = 30, lr: float = 0.05, log=print) -> dict:
    data = digits()
    start = time.perf_counter()
    grown_model, grown = train(base_model(), epochs, data, grow=True, lr=lr, log=log)
    _, base = train(base_model(), epochs, data, grow=False, lr=lr, log=log)
    plot(grown, base, out)
    summary = {
        "final_acc_grown": grown.acc[-1],
        "final_acc_base": base.acc[-1],
        "params_base": sum(p.numel() for p in base_model().parameters()),
        "params_grown": sum(p.numel() for p in grown_model.parameters()),
        "events": grown.events,
        "seconds": time.perf_counter() - start,
        "plot": str(out),
    }
    log(
        f"final test accuracy: grown {grown.acc[-1]:.3f}, not grown {base.acc[-1]:.3f} "
        f"(same {epochs} epochs of SGD); plot: {out}"
    )
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("growth_training.png"))
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    summary = run(args.out, args.epochs, args.lr)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
