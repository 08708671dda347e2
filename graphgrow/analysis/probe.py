"""Learn what an opaque operation does to channels by running it, instead of guessing from its class.

The coupling analysis knows standard layers by their semantics. A leaf module nobody
here wrote (timm's DropPath, a custom activation) or a wrapped function
(torchvision's stochastic_depth) is probed: it is *channelwise* when, in eval and in
train mode with the same random draws, (1) permuting the input's channels permutes the
output's channels the same way, and (2) appending channels leaves the old channels'
outputs unchanged. (2) is exactly what exact growth needs: per-element dropout fails
it (a wider tensor draws different masks), per-example drop-path passes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.state import preserved_buffers, seeded, training_mode

PROBE_SEED = _SEED = 1234
_MAX_PROBE_ELEMENTS = 1 << 22  # probing runs the op twice more; skip huge tensors rather than spend memory


def _same(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and torch.allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
    )


def is_channelwise(
    run: Callable[[torch.Tensor, bool], Any],
    shape: tuple[int, ...],
    axis: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> bool:
    """`run(x, training)` applies the op to `x` in the given mode; True when it is channelwise (see module doc)."""
    if axis is None or len(shape) <= axis or shape[axis] < 2 or torch.Size(shape).numel() > _MAX_PROBE_ELEMENTS:
        return False
    g = torch.Generator().manual_seed(_SEED)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    extra_shape = list(shape)
    extra_shape[axis] = 2
    wider = torch.cat([x, torch.randn(extra_shape, generator=g).to(device=device, dtype=dtype)], axis)
    perm = torch.randperm(shape[axis], generator=g).to(device)
    try:
        for training in (False, True):
            base = run(x, training)
            if not isinstance(base, torch.Tensor) or base.shape != x.shape:
                return False
            permuted = run(x.index_select(axis, perm), training)
            if not _same(permuted, base.index_select(axis, perm)):
                return False
            grown = run(wider, training)
            if not isinstance(grown, torch.Tensor) or grown.shape != wider.shape:
                return False
            if not _same(grown.narrow(axis, 0, shape[axis]), base):
                return False
    except Exception:  # an op that cannot take other channel counts is not channelwise for our purpose
        return False
    return True


def module_is_channelwise(m: nn.Module, shape: tuple[int, ...], axis: int) -> bool:
    """Probe a parameter-free, buffer-free module (one with weights would have to be resized: not ours to guess)."""
    if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
        return False

    def run(x: torch.Tensor, training: bool):
        with torch.no_grad(), training_mode(m, training), preserved_buffers(m), seeded(_SEED):
            return m(x)

    return is_channelwise(run, shape, axis)


def function_is_channelwise(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    index: int,
    shape: tuple[int, ...],
    axis: int,
    flag_args: dict[int | str, Callable[[bool], Any]] | None = None,
) -> bool:
    """Probe `fn(*args, **kwargs)` with a tensor in `args[index]`; `flag_args` map positions/keywords
    whose value follows the mode (a traced read of `training`) to that value."""
    flag_args = flag_args or {}

    def run(x: torch.Tensor, training: bool):
        a = list(args)
        a[index] = x
        kw = dict(kwargs)
        for key, value_of in flag_args.items():
            if isinstance(key, int):
                a[key] = value_of(training)
            else:
                kw[key] = value_of(training)
        with torch.no_grad(), seeded(_SEED):
            return fn(*a, **kw)

    return is_channelwise(run, shape, axis)


def elementwise_is_channelwise(
    fn: Callable, args: tuple, kwargs: dict, full: list[tuple[int, torch.dtype]], shape: tuple[int, ...], axis: int
) -> bool:
    """Probe `fn(*args, **kwargs)` whose tensor arguments at the positions `full` (position, dtype) have the output's
    shape and whose other tensors hold one value each (learned scalars: xIELU's α, a clamp's ε): each full argument is
    a different function of the probe tensor (a bool one its sign), so an op mixing channels shows it.
    Channelwise in every argument at once: `x > 0`, `torch.where(c, a, b)`, `torch.min(x, eps)`."""

    def run(x: torch.Tensor, training: bool):
        a = list(args)
        for k, (i, dtype) in enumerate(full):
            a[i] = x > 0.1 * k if dtype == torch.bool else (x * (1.0 + 0.25 * k) - 0.1 * k).to(dtype)
        with torch.no_grad(), seeded(_SEED):
            return fn(*a, **kwargs)

    return is_channelwise(run, shape, axis)
