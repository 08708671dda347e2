"""The norms the residual-stream analysis (stream.py) recognises: a LayerNorm or RMSNorm over the last dimension,
as a module or a function call, and the width it normalises."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..graph.fx_edit import tensor_shape
from .stream_ops import arg as _arg
from .stream_ops import base_name

# torch.export leaves F.rms_norm as the ATen op (aten.rms_norm.default: the same arguments, the same positions)
LAYER_NORMS = (F.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm.default)
NORM_FUNCTIONS = (*LAYER_NORMS, F.rms_norm, torch.ops.aten.rms_norm.default) + (
    (torch.rms_norm,) if hasattr(torch, "rms_norm") else ()
)


@dataclass
class Norm:
    node: str
    rms: bool
    input: str
    module: str | None  # module path for a call_module (normalized_shape and eps live there)
    weight: str | None  # parameter paths (None: no affine)
    bias: str | None
    eps: float | None
    inner: tuple[str, ...] = ()  # a norm written out (x · rsqrt(mean(x²) + eps)): its ops on x, nothing to resize
    l2: bool = False  # x · rsqrt(sum(x²) + eps): onto the unit sphere (nGPT), kept by zero new coordinates alone


def written_rms(n: fx.Node) -> tuple[fx.Node, float | None, list[fx.Node], bool] | None:
    """(x, eps, the ops between, whether it sums) when `n` = x · rsqrt(mean(x², -1, keepdim) + eps), an RMSNorm
    without a weight written out (HRM's, as x.pow(2), x.square() or x · x), or with sum for mean (Dory's L2 norm),
    each op read by the next alone; else None."""
    if n.op != "call_function" or n.target not in (operator.mul, torch.mul) or len(n.args) != 2:
        return None
    for x, r in (n.args, n.args[::-1]):
        if not (isinstance(r, fx.Node) and isinstance(x, fx.Node) and base_name(r) == "rsqrt" and len(r.users) == 1):
            continue
        chain, a, eps = [r], r.args[0], None
        if isinstance(a, fx.Node) and base_name(a) == "add" and len(a.users) == 1:
            eps = next((c for c in a.args if isinstance(c, float)), None)
            chain, a = chain + [a], next((c for c in a.args if isinstance(c, fx.Node)), None)
            if eps is None or a is None:
                continue
        if not (isinstance(a, fx.Node) and base_name(a) in ("mean", "sum") and len(a.users) == 1):
            continue
        if _arg(a, 1, "dim") not in ([-1], -1, (-1,)) or _arg(a, 2, "keepdim", False) is not True:
            continue
        q = a.args[0]
        square = (
            isinstance(q, fx.Node)
            and len(q.users) == 1
            and (
                (base_name(q) in ("pow", "square") and q.args[0] is x and (base_name(q) == "square" or q.args[1] == 2))
                or (base_name(q) == "mul" and q.args[0] is x and q.args[1] is x)
            )
        )
        if square:
            return x, eps, chain + [a, q], base_name(a) == "sum"  # type: ignore[list-item]
    return None


def _weighted_after(n: fx.Node) -> bool:
    """Whether the written-out norm `n` is multiplied by a parameter next (through casts): an RMSNorm with a weight
    written out (LLaMA's in a streamed window), which is no norm without a weight and is not read as one."""
    while len(n.users) == 1 and base_name(u := next(iter(n.users))) in ("to", "float", "type_as") and u.args[0] is n:
        n = u
    for u in n.users:
        if base_name(u) == "mul" and any(isinstance(a, fx.Node) and a.op == "get_attr" for a in u.args):
            return True
    return False


def norm_of(gm: fx.GraphModule, n: fx.Node) -> Norm | None:
    """A LayerNorm / RMSNorm over the last dimension (module or function), else None."""
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        if type(m) not in (nn.LayerNorm, nn.RMSNorm) or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        w, b = getattr(m, "weight", None), getattr(m, "bias", None)
        return Norm(
            n.name,
            isinstance(m, nn.RMSNorm),
            n.args[0].name,
            n.target,
            f"{n.target}.weight" if w is not None else None,
            f"{n.target}.bias" if b is not None else None,
            m.eps,
        )
    written = written_rms(n)
    if written is not None and not _weighted_after(n):
        x, eps, inner, l2 = written
        return Norm(n.name, True, x.name, None, None, None, eps, tuple(v.name for v in inner), l2)
    if n.op != "call_function" or n.target not in NORM_FUNCTIONS or not isinstance(n.args[0], fx.Node):
        return None
    rms = n.target not in LAYER_NORMS
    weight = _arg(n, 2, "weight")
    bias = None if rms else _arg(n, 3, "bias")
    eps = _arg(n, 3 if rms else 4, "eps", None if rms else 1e-5)
    paths = []
    for a in (weight, bias):
        if a is not None and not (isinstance(a, fx.Node) and a.op == "get_attr" and len(a.users) == 1):
            return None
        paths.append(a.target if a is not None else None)
    return Norm(n.name, rms, n.args[0].name, None, paths[0], paths[1], eps)


def normalised(gm: fx.GraphModule, n: fx.Node) -> int | None:
    """The width a last-dimension norm normalises, else None."""
    if written_rms(n) is not None:  # over the last axis of its input, whatever its size
        return (tensor_shape(n) or (None,))[-1]
    if n.op == "call_module":
        shape = getattr(gm.get_submodule(n.target), "normalized_shape", None)
    else:
        shape = _arg(n, 1, "normalized_shape")
    shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
    x = tensor_shape(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    return shape[0] if len(shape) == 1 and isinstance(shape[0], int) and x and x[-1] == shape[0] else None
