"""One intra-op thread for the checks of a small model.

A small model's forward at the check batch (a 32×32 CNN of a few hundred thousand parameters)
is a few milliseconds of many tiny kernels: extra OpenMP threads buy nothing there, and on a
machine whose cores are busy (a training job, other processes) every kernel waits for a
descheduled thread at its barrier — measured on a 2-core machine under load: a DARTS growth event
took 15–70 s with torch's default two threads and 1–4.5 s with one. Big models keep the
caller's setting. The caller's thread count is restored on exit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

SMALL_PARAMETERS = 2_000_000  # parameters of a "small" model
SMALL_INPUT = 3 * 64 * 64  # elements of one example (a 64×64 RGB image, or a 12k-token sequence)


def _example_elements(input_shape: Any) -> int:
    """Elements of one example of `input_shape` (a shape, or an input spec of named tensors)."""
    try:
        if isinstance(input_shape, (tuple, list)) and all(isinstance(d, int) for d in input_shape):
            return math.prod(input_shape[1:])
        return sum(math.prod(tuple(t.shape)[1:]) for t in input_shape)
    except (TypeError, AttributeError):
        return SMALL_INPUT + 1  # unknown: not small


def is_small(model: nn.Module, input_shape: Any) -> bool:
    """Whether `model` on `input_shape` is small enough that one thread is as fast as several."""
    params = sum(p.numel() for p in model.parameters())
    return params <= SMALL_PARAMETERS and _example_elements(input_shape) <= SMALL_INPUT


@contextlib.contextmanager
def check_threads(model: nn.Module, input_shape: Any) -> Iterator[None]:
    """One intra-op thread inside the block when `model` is small (see the module docstring)."""
    saved = torch.get_num_threads()
    if saved <= 1 or input_shape is None or not is_small(model, input_shape):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
