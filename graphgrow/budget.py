"""How much a pass may add, estimated before anything real is allocated.

A pass first runs on a meta-device copy of the model (shapes, no storage): the parameters
it would add and the activation memory the grown model would need for verification are
counted there, and the real pass runs only when both are within the limits. The
defaults keep a typo (`factor=1e9`, `count=100000`) from allocating for minutes; raise
them with `--max-params` / `--max-memory` (Python: `Pipeline(..., limits=Limits(...))`).
"""
from __future__ import annotations

import copy
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


def activation_bytes(gm: fx.GraphModule, input_shape: Sequence[int], batch: int = VERIFY_BATCH) -> int:
    """Sum of every node's output size on the meta device (an upper bound of what a forward keeps)."""
    total = 0

    class Count(fx.Interpreter):
        def run_node(self, n):
            nonlocal total
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
