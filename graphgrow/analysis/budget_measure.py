"""Activation memory measured on a real run, for a model the meta device cannot run (budget.py's fallback).

The meta-device estimate (budget_estimate.py) has no values: a model that reads a number from its data (`.item()`,
`.tolist()`: a mixture of experts' routing sizes), or that mixes a tensor made on a real device into its arithmetic,
stops it. Such a model is still sized before anything unbounded runs: one forward at the estimate's batch, on the
model's own weights and seeded example inputs, under an AllocationGuard at the memory limit (each allocation sized
before it happens, the one past the limit refused), counting every node's output as the estimate does. It runs in
eval mode without gradients (nothing the model holds changes: no BatchNorm statistics, no dropout) and with the
random generators forked, so what runs after sees the state it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..core.allocation import AllocationGuard, MemoryLimitExceeded
from ..core.errors import first_line
from ..core.state import training_mode
from ..graph.inputs import InputSpec, positional
from ..graph.shapes import _target_name, example_input, shape_of
from .budget_estimate import _bytes


@dataclass(frozen=True)
class Measured:
    """A real run's outcome: `bytes` (every node's output, as the meta estimate counts them, or the most held at
    once if more), or `over` (the allocation the guard refused, with `held` bytes live) or `failure` (why it
    cannot run: the node and the error)."""

    bytes: int = 0
    over: int = 0
    held: int = 0
    failure: str = ""


def measured_bytes(gm: fx.GraphModule, input_shape: InputSpec, batch: int, limit: int) -> Measured:
    """One real forward of `gm` at `batch` under an AllocationGuard at `limit` bytes (the example inputs count)."""
    guard = AllocationGuard(limit)
    total = 0

    class Count(fx.Interpreter):
        def run_node(self, n):
            nonlocal total
            try:
                out = super().run_node(n)
            except MemoryLimitExceeded:
                raise
            except Exception as e:
                shapes = [shape_of(self.env.get(a)) for a in n.all_input_nodes]
                raise _Failed(
                    f"node '{n.name[:80]}' ({n.op} {_target_name(n)[:80]}) fails on inputs of shapes {shapes}: "
                    f"{type(e).__name__}: {first_line(e, 200)}"
                ) from e
            total += _bytes(out)
            return out

    try:
        with torch.random.fork_rng(devices=[]), training_mode(gm, False), torch.no_grad(), guard:
            x = example_input(gm, input_shape, batch=batch)
            Count(gm, garbage_collect_values=True).run(*positional(x))
    except _Failed as e:
        return Measured(failure=str(e))
    except MemoryLimitExceeded:
        pass
    except Exception as e:  # the example inputs themselves (a spec the model's embedding cannot take)
        if guard.refusal is None:
            return Measured(failure=f"{type(e).__name__}: {first_line(e, 200)}")
    if guard.refusal is not None:  # refused, even where the model caught it and went on
        return Measured(over=getattr(guard.refusal, "needed", 0), held=getattr(guard.refusal, "held", 0))
    return Measured(bytes=max(total, guard.peak))


class _Failed(Exception):
    """A node the real run could not run (its message names it)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # fx's Interpreter appends the graph to args[0] on the way out
        return self.message
