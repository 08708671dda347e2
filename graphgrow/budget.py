"""How much a pass may add, estimated before anything real is allocated.

A pass first runs on a meta-device copy of the model (shapes, no storage): the parameters
it would add and the activation memory the grown model would need for verification are
counted there, and the real pass runs only when both are within the limits. The
defaults keep a typo (`factor=1e9`, `count=100000`) from allocating for minutes; raise
them with `--max-params` / `--max-memory` (Python: `Pipeline(..., limits=Limits(...))`).
"""
from __future__ import annotations

import copy
import operator
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import fx, nn

from .errors import InputError, NotApplicable

DEFAULT_MAX_NEW_PARAMS = 100_000_000  # parameters one pass may add
DEFAULT_MAX_MEMORY = 8 << 30  # bytes of activations the grown model may need at the verification batch
VERIFY_BATCH = 3


@dataclass(frozen=True)
class Limits:
    max_new_params: int = DEFAULT_MAX_NEW_PARAMS
    max_memory: int = DEFAULT_MAX_MEMORY


BYTE_SIZES = ("--max-memory", "--max-load")  # sizes in bytes count in powers of 1024


def parse_size(text: str | int, what: str) -> int:
    """'8G', '512M', '100000' → an integer (K/M/G/T = powers of 1024 for bytes, of 1000 for counts)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?\s*", str(text))
        if not m:
            raise InputError(f"{what} {str(text)[:40]!r} is not a size", "write e.g. 8G, 512M or 100000")
        base = 1024 if what in BYTE_SIZES else 1000
        value = int(float(m.group(1)) * base ** " kmgt".index((m.group(2) or " ").lower()))
    if value <= 0:
        raise InputError(f"{what} must be positive", "write e.g. 8G, 512M or 100000")
    return value


_SAME_SHAPE = (nn.modules.batchnorm._NormBase, nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid,
               nn.Tanh, nn.LeakyReLU, nn.Identity, nn.modules.dropout._DropoutNd, nn.LayerNorm, nn.GroupNorm)
_ELEMENTWISE = (operator.add, operator.mul, operator.sub, torch.add, torch.mul, torch.sub)


def _fast_shape(gm: fx.GraphModule, n: fx.Node, args: tuple) -> torch.Tensor | None:
    """The output of common layers as an empty meta tensor, from shape rules instead of the meta kernels
    (which cost about a millisecond a node); None where no rule applies."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if n.op == "call_module" and x is not None and len(args) == 1 and not n.kwargs:
        m = gm.get_submodule(n.target)  # type: ignore[arg-type]
        if isinstance(m, _SAME_SHAPE) and type(m).__module__.startswith("torch.nn.modules."):  # torch's own, not a subclass
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        if type(m) is nn.Conv2d and x.dim() == 4 and isinstance(m.padding, tuple):
            h, w = (
                (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
                for size, pad, dil, k, stride in zip(x.shape[2:], m.padding, m.dilation, m.kernel_size, m.stride)
            )
            return torch.empty((x.shape[0], m.out_channels, h, w), dtype=x.dtype, device="meta")
        if type(m) is nn.Linear:
            return torch.empty((*x.shape[:-1], m.out_features), dtype=x.dtype, device="meta")
    if n.op == "call_function" and n.target in _ELEMENTWISE and not n.kwargs and len(args) == 2:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and all(isinstance(a, (torch.Tensor, int, float)) for a in args):
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
            return torch.empty(shape, dtype=tensors[0].dtype, device="meta")
    return None


def activation_bytes(gm: fx.GraphModule, input_shape: Sequence[int], batch: int = VERIFY_BATCH) -> int:
    """Sum of every node's output size on the meta device (an upper bound of what a forward keeps)."""
    total = 0

    class Count(fx.Interpreter):
        def run_node(self, n):
            nonlocal total
            out = None
            if n.op in ("call_module", "call_function"):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                out = _fast_shape(gm, n, args) if all(not isinstance(a, torch.Tensor) or a.is_meta for a in args) else None
            if out is None:
                out = super().run_node(n)
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
            return out

    shape = [batch] + list(input_shape[1:])
    dtype = next((p.dtype for p in gm.parameters() if p.is_floating_point()), torch.float32)
    with torch.no_grad():
        Count(gm).run(torch.empty(shape, device="meta", dtype=dtype))
    return total


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with every parameter and buffer on the meta device, without copying their bytes."""
    memo: dict = {}
    for m in gm.modules():
        for p in m.parameters(recurse=False):
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in m.buffers(recurse=False):
            memo[id(b)] = torch.empty_like(b, device="meta")
    out = copy.deepcopy(gm, memo)
    out.meta = copy.deepcopy(gm.meta)  # the pass reads graphgrow's bookkeeping (input shape, log) from it
    return out


def check_input_memory(gm: fx.GraphModule, input_shape: Sequence[int], max_memory: int = DEFAULT_MAX_MEMORY) -> None:
    """Before any real forward: the activations the model needs at the verification batch, estimated on the
    meta device, must stay under the limit (an input shape can ask for any amount of memory)."""
    try:
        needed = activation_bytes(meta_copy(gm), input_shape)
    except Exception:  # code the meta device cannot run (data-dependent): the input-size cap still bounds it
        return
    if needed > max_memory:
        raise InputError(f"the model needs about {human_bytes(needed)} of activations on an input of shape "
                         f"{tuple(input_shape)} at batch {VERIFY_BATCH} (limit {human_bytes(max_memory)})",
                         "give a smaller --input-shape, or raise the limit with --max-memory SIZE")


def check_budget(name: str, apply: Callable[[fx.GraphModule], fx.GraphModule], gm: fx.GraphModule,
                 input_shape: Sequence[int], limits: Limits) -> str | None:
    """Dry-run `apply` on a meta copy of `gm`; NotApplicable past the limits. Returns a note when no estimate was possible."""
    try:
        meta = meta_copy(gm)
        grown = apply(meta)
    except NotApplicable:
        raise
    except Exception as e:  # a third-party pass that cannot run on meta tensors: no estimate, no refusal
        return f"no size estimate before the pass ({type(e).__name__} on the meta device)"
    before = sum(p.numel() for p in gm.parameters())
    after = sum(p.numel() for p in grown.parameters())
    if after - before > limits.max_new_params:
        raise NotApplicable(f"{name} would add {after - before:,} parameters (limit {limits.max_new_params:,})",
                            "choose a smaller growth, or raise the limit with --max-params N")
    try:
        needed = activation_bytes(grown, input_shape)
    except Exception:
        return None
    if needed > limits.max_memory:
        raise NotApplicable(f"{name} would need about {human_bytes(needed)} of activations at batch {VERIFY_BATCH} "
                            f"(limit {human_bytes(limits.max_memory)})",
                            "choose a smaller growth or input shape, or raise the limit with --max-memory SIZE")
    return None
