"""The small digits task the examples share: a deliberately small CNN and scikit-learn's
handwritten digits (8×8 images shipped with the package, no download), plus the two
functions `graphgrow search` calls: `train_epoch(model, optimizer)` and `evaluate(model)`.

    graphgrow search examples.digits_task:model --train examples.digits_task:train_epoch \\
        --eval examples.digits_task:evaluate --input-shape 1,1,8,8 \\
        --mutations "grow_width(factor=2);deepen;add_residual;noop"
"""

from __future__ import annotations

import torch
from torch import nn

INPUT_SHAPE = (1, 1, 8, 8)
BATCH = 64


def model() -> nn.Sequential:
    """4 and 8 channels, then global pooling: room to grow."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


_DATA: dict = {}  # loaded once per process (a plain dict: an lru_cache wrapper cannot travel by value to Ray workers)


def digits(seed: int = 0):
    """(train, test) tensors: 1,400 training images, 397 held out."""
    if seed in _DATA:
        return _DATA[seed]
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    _DATA[seed] = (x[:1400], y[:1400]), (x[1400:], y[1400:])
    return _DATA[seed]


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """One epoch of minibatch training in place; the batch order comes from torch's global RNG."""
    (x, y), _ = digits()
    model.train()
    total = 0.0
    for idx in torch.randperm(len(y)).split(BATCH):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        total += loss.item() * len(idx)
    return {"train_loss": total / len(y)}


def evaluate(model: nn.Module) -> dict:
    """Held-out loss and accuracy (eval mode, no gradient)."""
    _, (x, y) = digits()
    model.eval()
    with torch.no_grad():
        out = model(x)
    return {
        "val_loss": nn.functional.cross_entropy(out, y).item(),
        "val_acc": (out.argmax(1) == y).float().mean().item(),
    }


def batch(size: int = 256) -> tuple:
    """A training batch and its loss, what init=gradmax and `graphgrow targets --data` read: (inputs, loss_fn).

    graphgrow targets examples.digits_task:model --input-shape 1,1,8,8 --pass grow_width \\
        --data examples.digits_task:batch
    """
    (x, y), _ = digits()
    return x[:size], lambda out: nn.functional.cross_entropy(out, y[:size])
