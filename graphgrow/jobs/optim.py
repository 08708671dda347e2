"""Carry an optimiser across a growth event.

After a pass none of the old parameters is the same tensor object, so an optimiser built
for the old model points at tensors the grown model no longer uses, and a fresh one forgets
momentum, Adam's moments and step counts: the next update differs from the one training
would have made, a jump in the training curve. `carry_optimizer` builds an optimiser of the
same class and settings over the grown model and moves each old parameter's state by name:
tensors of the same shape are copied; a grown tensor keeps its old state in the old region
(the leading box, where passes keep the old values) and zeros in the new slices; new
parameters start with no state, as in a fresh optimiser.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.errors import InputError


def carry_optimizer(
    optimizer: torch.optim.Optimizer,
    old: nn.Module,
    new: nn.Module,
    fit: Callable[[Any, torch.Tensor, torch.Tensor], Any] | None = None,
) -> torch.optim.Optimizer:
    """An optimiser like `optimizer` (same class, parameter groups and settings) over `new`'s
    parameters, with the state of `old`'s parameters carried over by name. `fit(value, old
    parameter, new parameter)` makes one state entry for the new parameter (default `_fit`;
    fsdp.py gives one for DTensor shards).

    Parameters new in `new` join the first parameter group. `optimizer` and `old` are not changed.
    """
    names = {id(p): n for n, p in old.named_parameters()}
    new_params = dict(new.named_parameters())
    group_of: dict[str, int] = {}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise InputError(
                    "the optimiser holds a parameter that is not in the old model",
                    "pass the model the optimiser was built for as `old`",
                )
            group_of[names[id(p)]] = i
    groups: list[dict[str, Any]] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer.param_groups
    ]
    for name, p in new_params.items():
        groups[group_of.get(name, 0)]["params"].append(p)
    kept = [g for g in groups if g["params"]] or [{**groups[0], "params": list(new_params.values())}]
    accepted = inspect.signature(type(optimizer)).parameters
    carried = type(optimizer)(kept, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    carried.defaults = dict(optimizer.defaults)
    old_params = dict(old.named_parameters())
    for name, q in new_params.items():
        p = old_params.get(name)
        state = optimizer.state.get(p) if p is not None else None
        if state:
            carried.state[q] = {k: (fit or _fit)(v, p, q) for k, v in state.items()}
    return carried


def _fit(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """One state entry for `new`: a copy when shapes agree, else the old values in the leading box and zeros
    elsewhere (per-parameter tensors only; scalars such as the step count are copied)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape != old.shape or value.dim() == 0:
        return value.detach().clone()
    if value.shape == new.shape:
        return value.detach().clone().to(new.device)
    if value.dim() != new.dim() or any(a > b for a, b in zip(value.shape, new.shape)):
        return torch.zeros_like(new, dtype=value.dtype)  # reshaped, not grown: no region to keep
    out = torch.zeros(new.shape, dtype=value.dtype, device=new.device)
    out[tuple(slice(0, s) for s in value.shape)] = value.detach()
    return out
