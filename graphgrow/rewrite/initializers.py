"""Function-preserving initialisers shared by passes (architecture.md §4: the zero last factor)."""

from __future__ import annotations

import math

import torch
from torch import nn


def kaiming_(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """nn.Conv2d/nn.Linear's default init, drawn from `generator` (never the global RNG)."""
    fan_in = weight[0].numel() if weight.dim() > 1 else weight.numel()
    bound = 1.0 / math.sqrt(max(fan_in, 1)) * math.sqrt(3.0)  # kaiming_uniform(a=sqrt(5)) bound
    with torch.no_grad():
        sample = torch.rand(weight.shape, generator=generator, dtype=torch.float32) * 2 - 1
        weight.copy_(sample.to(weight) * bound)
    return weight


def zero_last_bn(channels: int, like: torch.Tensor, dims: int = 2) -> nn.Module:
    """A BatchNorm whose γ = β = 0: outputs exactly zero in eval and train mode, and γ, β get gradients at once."""
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims](channels, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        bn.weight.zero_()
        bn.bias.zero_()
    return bn
