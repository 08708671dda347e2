"""A bfloat16 or float16 model run in float32 on its stored values (verify/low_precision.py says why): a graph node
by node (Float32Run: each module's tensors widened for its own call only, never a float32 copy of the model; the
graph's casts to the half dtype computed in float32), and a model that is not a graph widened in place and put back
(`widened`). Here, below capture and verify, because both run models this way (capture.fidelity's trace check,
verify's preservation check, jobs' native checks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

from ..core.state import dropout_off, module_dtype, seeded, training_mode
from .inputs import positional

HALF = (torch.bfloat16, torch.float16)


def is_half(model: nn.Module) -> bool:
    return module_dtype(model) in HALF


def wide(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.dtype in HALF:
        return v.float()
    if isinstance(v, torch.dtype) and v in HALF:
        return torch.float32
    return v


class Float32Run(fx.Interpreter):
    """Runs a half-precision GraphModule in float32, one node at a time (module docstring)."""

    def run_node(self, n: fx.Node) -> Any:
        return tree_map(wide, super().run_node(n))

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_function(target, tree_map(wide, args), tree_map(wide, kwargs))

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_method(target, tree_map(wide, args), tree_map(wide, kwargs))

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return wide(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        m = self.fetch_attr(target)
        # buffers are always copies (a train-mode BatchNorm moves its statistics and counter): the run never writes
        # the model's own tensors, so it can run between another forward and its backward (verify's trainability
        # check hands its train-mode output here) without bumping a saved tensor's version
        state = {k: v.float() for k, v in m.named_parameters(remove_duplicate=False) if v.dtype in HALF}
        state.update({k: wide(v.detach()).clone() for k, v in m.named_buffers(remove_duplicate=False)})
        if not state:
            return m(*args, **kwargs)
        return functional_call(m, state, tuple(args), kwargs, strict=False)


class Float32Graph(nn.Module):
    """A half-precision GraphModule as a module that computes in float32 (Float32Run); it holds the graph, not a copy
    of its tensors. For checks that call a model (capture.fidelity)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.meta = gm.meta

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return Float32Run(self.gm).run(*tree_map(wide, (*args, *kwargs.values())))


def float32_output(gm: fx.GraphModule, x: Any, mode: str, seed: int) -> Any:
    """`gm`'s output computed in float32 from its stored values, in eval mode or the train protocol's run."""
    xs = tree_map(wide, positional(x))
    with torch.no_grad():
        if mode == "eval":
            with training_mode(gm, False):
                return Float32Run(gm).run(*xs)
        with training_mode(gm, True), dropout_off(gm), seeded(seed):  # buffers: copies (Float32Run.call_module)
            return Float32Run(gm).run(*xs)


@contextmanager
def widened(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with its half-precision tensors in float32 while inside, each put back in its own dtype after (a
    lossless round trip: every bfloat16/float16 value is a float32 value). For a model that is not a graph (a class's
    own forward cannot be run node by node), as jobs/native checks one against its grown graph."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.dtype in HALF]
    dtypes = [t.dtype for t in tensors]
    for t in tensors:
        t.data = t.data.float()
    try:
        yield model
    finally:
        for t, d in zip(tensors, dtypes):
            t.data = t.data.to(d)
