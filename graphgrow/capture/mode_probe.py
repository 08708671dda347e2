"""Whether a model's forward does the same in train and eval mode: then one torch.export serves both modes.

Export capture (export_capture.py) exports the model in eval and in train mode and merges the two graphs
(export_modes.py), because published code branches on `self.training` (dropout's flag, drop-path, a mode's own
path). Most models do not: then both exports give the same graph and the second costs a whole trace for nothing
(on a chunked linear attention with symbolic sizes a trace is minutes of CPU). A mode can only change what a model
computes through the torch calls its Python code makes (which functions, with which arguments, in which order) or
through which of the values it computed it returns. So the model is run eagerly once in each mode on the example
inputs, recording every torch call its code makes (a TorchFunctionMode: the function, each tensor argument's shape
and dtype, every other argument's value) and, for each output tensor, which call made it. Where the two records are
equal, the eval-mode graph is the graph of both modes; anything else that differs, or a run that fails, and both
modes are exported and merged as before. The fidelity check then runs the model and the graph in both modes.

The runs keep the caller's autograd mode (a branch on `torch.is_grad_enabled()` sees what the export sees), restore
the random generator and every buffer, and leave the model in the mode it was in. A forward that writes into its
own parameters (Gemma 3n's AltUp clamps weights in place in training) is stopped before the write (self_writes'
op-level watch): nothing is written, and both modes are exported as before (the train-mode export then says why it
cannot hold such a model).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..core.state import preserved_buffers, training_mode
from .self_writes import _storage, _Writes

_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.Size)


def _sig(v: Any, made: dict[int, int] | None = None) -> Any:
    """What a call's argument tells the call: a tensor's shape, dtype and which recorded call made it ("input" for the
    model's inputs and weights: a mode may route another computed tensor into the same call), a plain value itself,
    a container by its items; any other object by its type."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device.type, (made or {}).get(id(v), "input"))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_sig(x, made) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, _sig(x, made)) for k, x in v.items()))
    if isinstance(v, slice):
        return ("slice", _sig(v.start), _sig(v.stop), _sig(v.step))
    if isinstance(v, _PLAIN) or v is Ellipsis:
        return v
    return ("object", type(v).__qualname__)


class _Calls(TorchFunctionMode):
    """The torch calls a forward makes (torch functions, Tensor methods, functional layers), in order; calls made
    inside a recorded call are not recorded (the mode is off while it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []
        self.made: dict[int, int] = {}  # id of a tensor a call returned → the call's index

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls.append((func, _sig(args, self.made), _sig(kwargs, self.made)))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = len(self.calls) - 1
        return out


def _record(model: nn.Module, inputs: dict[str, torch.Tensor], train: bool) -> tuple[Any, ...]:
    params = _Writes({_storage(p): k for k, p in model.named_parameters() if p.numel()}, stop=True)
    with training_mode(model, train), preserved_buffers(model), torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(0)
        with _Calls() as rec, params:  # a write into a parameter stops the run before it happens
            out = model(**inputs)
        leaves, spec = tree_flatten(out)
        made = tuple(rec.made.get(id(t), "input") if isinstance(t, torch.Tensor) else _sig(t) for t in leaves)
        return tuple(rec.calls), str(spec), made


def same_in_both_modes(model: nn.Module, inputs: dict[str, torch.Tensor]) -> bool:
    """True where the model's forward makes the same torch calls and returns the same calls' results in train and in
    eval mode on `inputs` (module docstring); False where anything differs or a run fails."""
    try:
        return _record(model, inputs, False) == _record(model, inputs, True)
    except Exception:  # the exports run it again and say what fails
        return False


def first_call(model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """One eval-mode run before the capture, so that code changing the model on its first call does it now: BigBird
    swaps its block-sparse attention for full attention on a short input, building the new module from the random
    generator; done during the capture, it was done again by the fidelity check's first run (export puts the flags
    back), whose dropout masks then came from a shifted generator. The generator and the buffers are left as they
    were; a run that fails is left for the capture to report."""
    with (
        torch.no_grad(),
        torch.random.fork_rng(devices=[]),
        preserved_buffers(model),
        training_mode(model, False),
        contextlib.suppress(Exception),
    ):
        model(**inputs)
