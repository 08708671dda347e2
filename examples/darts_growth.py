"""Growth during training on a DARTS-style network, the scenario graphgrow was born from.

A small DARTS evaluation network (examples/darts_net.py: cells of separable and dilated convs,
pooling and skips, drop-path while training, an auxiliary head) learns scikit-learn's handwritten
digits (shipped with the package, no download; 8×8 images scaled to 32×32 RGB). As in the DARTS
training script, `model.drop_path_prob` rises every epoch and the loss adds 0.4 × the auxiliary
head's. At set epochs the model grows inside its cells through the Python API; the optimizer's
state is carried over. Before and after each event the loss on the same batch is measured in eval
mode and in train mode (drop-path on, the same random draws) and must agree to 1e-5.

    python examples/darts_growth.py [--epochs 8] [--json]
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
from torch import nn

import graphgrow as gg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import darts_net as dn  # noqa: E402

SHAPE = (2, 3, 32, 32)
DROP_PATH_MAX = 0.2  # the DARTS script's schedule: drop_path_prob = max × epoch / epochs
EVENTS = {  # epoch → pass spec; node and module names are those of the traced network
    2: "grow_width(target=cells.1.preprocess1.1)",  # a cell's preprocessing ReLU-conv-BN, into later cells
    3: "add_branch(op=sepconv3x3,at=cells_2__ops_0_1_3)",  # a separable-conv branch beside an edge of a cell
    4: "grow_width(target=cells.2._ops.2.1.2)",  # a node's separable conv, through the concat into later cells
    5: "deepen(after=cells_2__ops_0_1_3)",  # a gated conv block inside a cell
}


def digits(n_train: int = 600, n_test: int = 300, seed: int = 0):
    """(train, test): 8×8 digits scaled to 32×32 and repeated over 3 channels, as CIFAR-shaped input."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return (x[:n_train], y[:n_train]), (x[n_train : n_train + n_test], y[n_train : n_train + n_test])


def probe_loss(model: nn.Module, x, y, train: bool, seed: int = 7) -> float:
    """The DARTS loss on one batch without changing the model (train mode: drop-path draws seeded, buffers kept)."""
    m = copy.deepcopy(model)
    m.train(train)
    torch.manual_seed(seed)
    with torch.no_grad():
        return dn.darts_loss(m(x), y).item()


def accuracy(model: nn.Module, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return (dn.split_output(model(x))[0].argmax(1) == y).float().mean().item()


def run(epochs: int = 8, lr: float = 0.05, seed: int = 0, log=print) -> dict:
    (xtr, ytr), (xte, yte) = digits(seed=seed)
    torch.manual_seed(seed)
    # trace the train-mode structure: the auxiliary head stays in the graph and in the loss
    model = gg.trace(dn.small_darts(seed=seed), SHAPE, mode="train")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=3e-4)
    gen = torch.Generator().manual_seed(seed)
    probe_x, probe_y = xtr[:64], ytr[:64]
    events, losses, start = [], [], time.perf_counter()
    for epoch in range(epochs):
        model.drop_path_prob = DROP_PATH_MAX * epoch / epochs  # the schedule: a plain attribute, read at run time
        if epoch in EVENTS:
            spec = EVENTS[epoch]
            before = (probe_loss(model, probe_x, probe_y, False), probe_loss(model, probe_x, probe_y, True))
            result = gg.Pipeline.from_spec(spec, seed=epoch).run(model).results[0]
            opt = gg.carry_optimizer(opt, model, result.gm)
            model = result.gm
            after = (probe_loss(model, probe_x, probe_y, False), probe_loss(model, probe_x, probe_y, True))
            events.append(
                {
                    "epoch": epoch,
                    "pass": spec,
                    "params": [result.params_before, result.params_after],
                    "drop_path_prob": model.drop_path_prob,
                    "loss_eval": [before[0], after[0]],
                    "loss_train": [before[1], after[1]],
                }
            )
            log(
                f"epoch {epoch}: {spec}: params {result.params_before:,} → {result.params_after:,}; probe loss "
                f"{before[0]:.6f} → {after[0]:.6f} (eval), {before[1]:.6f} → {after[1]:.6f} (train, drop-path "
                f"{model.drop_path_prob:.3f})"
            )
            if abs(before[0] - after[0]) > 1e-5 or abs(before[1] - after[1]) > 1e-5:
                raise SystemExit(f"growth changed the loss at epoch {epoch}")
        model.train()
        perm = torch.randperm(len(ytr), generator=gen)
        total = 0.0
        for i in range(0, len(ytr), 50):
            idx = perm[i : i + 50]
            opt.zero_grad()
            loss = dn.darts_loss(model(xtr[idx]), ytr[idx])
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(ytr))
        log(
            f"epoch {epoch}: training loss {losses[-1]:.4f}, drop-path {model.drop_path_prob:.3f}, "
            f"test accuracy {accuracy(model, xte, yte):.3f}"
        )
    acc = accuracy(model, xte, yte)
    summary = {
        "events": events,
        "train_loss": losses,
        "test_accuracy": acc,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": time.perf_counter() - start,
    }
    log(
        f"final test accuracy {acc:.3f} after {epochs} epochs; {summary['params']:,} parameters; "
        f"{summary['seconds']:.0f} s"
    )
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    summary = run(args.epochs, args.lr)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
