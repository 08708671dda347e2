"""Building the native instance and checking it against the grown graph (jobs/native.py's last steps).

A graph grown in bfloat16 or float16 is run in float32 on its stored values (verify.low_precision); the caller
widens the native instance in place for the check (low_precision.widened), so both sides compute in float32 and the
check protocol's tolerance holds: where the class and the graph's stand-in layers round in the half dtype does not
enter.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from ..core.errors import GraphgrowError, NotApplicable
from ..core.protocol import compare_outputs
from ..core.state import module_dtype
from ..graph.float32_run import HALF, float32_output, wide
from ..graph.graph_meta import input_spec_of
from ..graph.shapes import example_input


def build(cls: type, config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A fresh instance (its own init: buffers the state dict does not hold, such as RoPE's inv_freq, are computed
    from the config) in `dtype`, built as from_pretrained builds one: with `dtype` the default while it is made."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return cls(config)
    finally:
        torch.set_default_dtype(before)


def own_buffers(native: nn.Module, original: nn.Module) -> None:
    """The original's values for buffers the state dict does not hold (RoPE's inv_freq) where only their precision
    differs: a fresh build computes them in float32 (as from_pretrained does), while a model converted with
    .to(torch.bfloat16) holds them rounded, and the grown graph computes with the original's. A buffer whose value
    depends on a grown size (Gemma's embed_scale, sqrt(hidden size)) differs by more than rounding and is kept:
    copying it would make the instance agree with the graph and then differ once saved and loaded again."""
    theirs = dict(original.named_buffers())
    persistent = set(native.state_dict())
    with torch.no_grad():
        for name, b in native.named_buffers():
            t = theirs.get(name)
            if name in persistent or t is None or t.shape != b.shape or t.dtype == b.dtype or not b.is_floating_point():
                continue
            if torch.allclose(t.float(), b.float(), rtol=torch.finfo(t.dtype).eps, atol=0.0):
                b.data = t.detach().clone()


def check(grown: fx.GraphModule, native: nn.Module, cls: type) -> None:
    spec = input_spec_of(grown)
    for seed, batch in ((0, 1), (1, 2)):
        x = example_input(grown, spec, seed=seed, batch=batch)
        kwargs = x if isinstance(x, dict) else {getattr(native, "main_input_name", "input_ids"): x}
        was = grown.training
        grown.eval()
        try:
            with torch.no_grad():  # a half-precision graph in float32 on its stored values (native: widened)
                if module_dtype(grown) in HALF:
                    want = main_output(float32_output(grown, x, "eval", 0))
                else:
                    want = main_output(grown(**kwargs) if isinstance(x, dict) else grown(x))
                got = main_output(native(**tree_map(wide, kwargs)))
        finally:
            grown.train(was)
        try:  # the project's one check protocol (core.protocol): its tolerance, relative and max-abs
            check = compare_outputs(want, got, "eval")
        except GraphgrowError as e:
            raise NotApplicable(
                f"{cls.__name__} with the solved config gives another output shape than the grown graph ({e.message})",
                "keep the GraphModule",
            ) from e
        if not check.ok:
            raise NotApplicable(
                f"{cls.__name__} with the solved config does not compute what the grown graph does "
                f"(relative error {check.rel_err:.3g} at batch {batch})",
                "keep the GraphModule",
            )


def main_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        for k in ("logits", "last_hidden_state"):
            if k in out and out[k] is not None:
                return out[k]
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    return next(v for v in out if isinstance(v, torch.Tensor))
