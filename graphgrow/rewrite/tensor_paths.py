"""Parameters and buffers by their attribute path: read one, put a new tensor in its place (a Parameter stays a
Parameter), and find every path a tensor is reachable under (tied weights have several)."""

from __future__ import annotations

import torch
from torch import fx, nn


def owners(gm: fx.GraphModule) -> dict[int, list[str]]:
    """Tensor identity → every path it is reachable under."""
    out: dict[int, list[str]] = {}
    for path, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        out.setdefault(id(t), []).append(path)
    return out


def tensor_at(gm: fx.GraphModule, path: str) -> torch.Tensor:
    owner, _, name = path.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def put_tensor(gm: nn.Module, path: str, value: torch.Tensor, old: torch.Tensor | None = None) -> None:
    """Put `value` at `path` (a Parameter when `old` was one, with its requires_grad; `old` defaults to the tensor now
    there; pass one Parameter to several paths to keep a tie)."""
    owner_path, _, name = path.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if name in owner._parameters:
        if not isinstance(value, nn.Parameter):
            was = owner._parameters[name] if old is None else old
            value = nn.Parameter(value, requires_grad=True if was is None else was.requires_grad)
        owner._parameters[name] = value
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)
