"""Preservation of a bfloat16 or float16 model, grown in its own dtype (issue 40, item 4).

A pass applied to a half-precision graph writes its new and changed tensors in that dtype: zeros, copies and
halvings are stored exactly, a rescaled value (grow_hidden's norm weights times sqrt(new/old), grow_heads' query
rows) is rounded to the dtype. Comparing the two models' half-precision runs would mostly measure the dtype's own
arithmetic (each op rounds its output), so both graphs are run in float32 on their stored values instead, node by
node: a node reading parameters gets float32 copies of that module's tensors only for its own call (never a float32
copy of the whole model), every half-precision output is widened, and the graph's own casts to the half dtype
(`.to(torch.bfloat16)`, `dtype=` of a factory) compute in float32. What differs is then only what the growth stored.

Tolerance: the growth may change the output by no more than one unit in the last place of the dtype
(torch.finfo(dtype).eps: 2^-7 for bfloat16, 2^-10 for float16) or than running the original in its own dtype does
(its half-precision output against its float32 run, measured on the same input), whichever is larger. A growth
whose stored values reproduce the function measures at float32 rounding and passes the ordinary 1e-5 tolerance;
the report says which held (ModeCheck.low_precision).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..core.protocol import LowPrecision, ModeCheck, compare_outputs
from ..core.state import module_dtype
from ..graph.float32_run import float32_output


def compare_half(old: fx.GraphModule, new: fx.GraphModule, x: Any, mode: str, seed: int, old_out: Any) -> ModeCheck:
    """The growth's change measured in float32 on the stored values, with the dtype's tolerance (module docstring).
    `old_out`: the old model's output in its own dtype (its own arithmetic's error is measured against it)."""
    dtype = module_dtype(new)
    want = float32_output(old, x, mode, seed)
    check = compare_outputs(want, float32_output(new, x, mode, seed), mode)
    own = compare_outputs(want, old_out, mode).rel_err
    check.low_precision = LowPrecision(str(dtype).removeprefix("torch."), torch.finfo(dtype).eps, own)
    return check
