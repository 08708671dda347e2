"""Which submodules a model calls, and on what: one eval-mode run of the whole model with forward pre-hooks on every
submodule, recording per module path how often it was called and the shape and dtype of each argument it received.

capture/parts.py reads this to find the parts of a model that cannot be captured whole (a part's example input is
what it actually received); io/part_file.py reads it to check that a stored part fits the model rebuilt around it.
Only signatures are kept (shapes, dtypes, the kinds of the other arguments), never the tensors themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ArgSig:
    """One argument a call received: a tensor's shape and dtype, or the name of another value's type."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    kind: str  # "tensor", or the type name of anything else ("list", "dict", "NoneType", ...)

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"


@dataclass
class Calls:
    """What one submodule received: its calls' count, the first call's positional and keyword arguments."""

    count: int = 0
    args: tuple[ArgSig, ...] = ()
    kwargs: dict[str, ArgSig] = field(default_factory=dict)


def _sig(value: Any) -> ArgSig:
    if isinstance(value, torch.Tensor):
        return ArgSig(tuple(int(d) for d in value.shape), value.dtype, "tensor")
    return ArgSig(None, None, type(value).__name__)


def record_calls(model: nn.Module, run: Callable[[nn.Module], Any]) -> tuple[dict[str, Calls], Any]:
    """{module path: Calls} of every submodule `run(model)` calls (the root is left out), and what `run` returned.
    The hooks are removed afterwards, also when `run` fails."""
    calls: dict[str, Calls] = {}
    handles = []

    def hook_for(path: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            rec = calls.setdefault(path, Calls())
            rec.count += 1
            if rec.count == 1:
                rec.args = tuple(_sig(a) for a in args)
                rec.kwargs = {k: _sig(v) for k, v in kwargs.items()}

        return hook

    try:
        for path, sub in model.named_modules():
            if path:
                handles.append(sub.register_forward_pre_hook(hook_for(path), with_kwargs=True))
        out = run(model)
    finally:
        for h in handles:
            h.remove()
    return calls, out


def record_outputs(model: nn.Module, paths: list[str], run: Callable[[nn.Module], Any]) -> tuple[dict[str, Any], Any]:
    """{path: the output of that submodule's first call} for the given paths during `run(model)`, and what `run`
    returned (the outputs are detached)."""
    got: dict[str, Any] = {}
    handles = []
    for path in paths:

        def hook(_m: nn.Module, _a: Any, out: Any, path: str = path) -> None:
            got.setdefault(path, torch.utils._pytree.tree_map(_detached, out))

        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        result = run(model)
    finally:
        for h in handles:
            h.remove()
    return got, result


def _detached(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def spec_matches(spec: Any, calls: Calls | None) -> bool:
    """Does a recorded call receive what an input spec (graph.inputs) says: once, the same number of tensors, each of
    the spec's shape and dtype, in order?"""
    from .inputs import DTYPES

    if calls is None or calls.count != 1:
        return False
    got = [*calls.args, *calls.kwargs.values()]
    if len(got) != len(spec) or not all(s.is_tensor for s in got):
        return False
    return all(s.shape == tuple(t.shape) and s.dtype == DTYPES.get(t.dtype) for s, t in zip(got, spec))
