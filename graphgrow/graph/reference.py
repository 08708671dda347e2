"""Outputs a model already gave on the check input, so a pipeline never computes them twice.

After a pass is verified, the grown model's eval- and train-mode outputs on the check input are
kept; the next pass's verification needs exactly those as its reference ("old") outputs. The
trace's fidelity check leaves the traced graph's eval output the same way for the first pass.

An entry is valid only while the model is unchanged: it is keyed by the model object and
checked against a fingerprint of its graph, its modules' settings and every parameter and buffer
(storage and version counter, which any in-place change bumps), and against the input itself.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..graph.shapes import same_inputs

_kept: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[tuple[Any, ...], torch.Tensor, Any]]] = (
    weakref.WeakKeyDictionary()
)


def fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """Cheap identity of a module's function: its code, its modules' types and settings (stride,
    padding, eps, ...), and its tensors' storage, version and shape."""
    code = getattr(model, "code", None)
    modules = tuple((n, type(m), m.extra_repr()) for n, m in model.named_modules())
    tensors = tuple(
        (n, t.data_ptr(), t._version, tuple(t.shape), t.dtype) for n, t in model.state_dict(keep_vars=True).items()
    )
    return code, modules, tensors


def _detached(out: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def remember(model: nn.Module, protocol: str, x: Any, output: Any) -> None:
    """Keep `output`, which `model` gave on `x` (a tensor, or a dict of named inputs) under `protocol`
    (a name for mode, seed and dropout)."""
    _kept.setdefault(model, {})[protocol] = (fingerprint(model), _detached(x), _detached(output))


def recall(model: nn.Module, protocol: str, x: Any) -> Any | None:
    """The output `model` gave on `x` under `protocol`, if it is known and the model has not changed since."""
    entry = _kept.get(model, {}).get(protocol)
    if entry is None:
        return None
    fp, x_then, out = entry
    if not same_inputs(x_then, x):
        return None
    return out if fp == fingerprint(model) else None
