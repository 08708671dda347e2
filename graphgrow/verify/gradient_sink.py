"""Gradients read as backward makes them, then freed: what the trainability check asks of a gradient (does it
reach the new region, is it non-zero) without holding every watched parameter's gradient at once.

At step 0 of the check the gradients of everything watched would otherwise be alive together — for a pass
that rebuilds every weight (grow_hidden) one more copy of the model. When step 0 settles every new parameter
(the usual case) no SGD step follows and the gradients are never needed whole; when a step must follow, the
check runs step 0 again with the gradients kept, from the same random state (so with the same result).
"""

from __future__ import annotations

from typing import Any

import torch

from .zero_factor import new_region

LEAN_BYTES = 64 << 20  # gradients of at least this many bytes at step 0 are read as they come, not held


def gradient_bytes(params: dict[str, torch.Tensor], names: set[str]) -> int:
    return sum(params[n].numel() * params[n].element_size() for n in names)


class GradientSink:
    """Post-accumulate hooks on the watched parameters: which got a gradient on their new region (`reached`),
    which a non-zero one anywhere (`nonzero`); each gradient is freed at once unless its name is in `keep`."""

    def __init__(self, params: dict[str, torch.Tensor], watched: set[str], old_shapes: dict[str, Any], keep: set[str]):
        self.reached: set[str] = set()
        self.nonzero: set[str] = set()
        self.handles = [
            params[n].register_post_accumulate_grad_hook(self._reader(n, old_shapes, n in keep)) for n in watched
        ]

    def _reader(self, name: str, old_shapes: dict[str, Any], keep: bool):
        def read(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            with torch.no_grad():
                if name in old_shapes and new_region(g, old_shapes[name]).abs().sum() > 0:
                    self.reached.add(name)
                if bool((g != 0).any()):
                    self.nonzero.add(name)
            if not keep:
                p.grad = None

        return read

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def rng_state() -> tuple:
    """The random state a step starts from (CPU, and every CUDA device when CUDA is in use)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def restore_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
