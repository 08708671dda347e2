"""Coupling of reductions the plain rule (`axes.reduced_axis`: mean/sum/amax/amin over other dims) does not take.

- A vector norm over other dims than the channels (ConvNeXt-V2's GRN: ‖x‖₂ over height and width, one value per
  channel) keeps each channel apart, like a mean over them: its output is in the input's group.
- A reduction *across* the channel axis (an L2 norm x / ‖x‖ over the hidden channels, a mean of per-channel values
  dividing each of them) gives every channel a result that depends on all of them, so a new channel changes the old
  ones: such a group cannot grow exactly (zero or copied new channels alike change a sum or a norm; copies keep a
  mean, which this analysis does not follow). The group is frozen with that reason instead of "not understood".
"""

from __future__ import annotations

from torch import fx

from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .axes import node_axis

NORMS = ops.VECTOR_NORMS
ACROSS = ops.MIXING_REDUCTIONS


def _name(n: fx.Node) -> str:
    t = n.target
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    return name.split(".")[0]


def _dims(n: fx.Node, x: fx.Node) -> set[int] | None:
    """The dims `n` reduces of its input `x` (all of them when it names none), or None when not literal."""
    shape = tensor_shape(x)
    if shape is None:
        return None
    dims = n.kwargs.get("dim", None)
    if dims is None and _name(n) in NORMS:
        dims = n.args[2] if len(n.args) > 2 else None  # vector_norm(x, ord, dim, keepdim)
    elif dims is None:
        dims = n.args[1] if len(n.args) > 1 else None
    if dims is None:
        return set(range(len(shape)))
    dims = (dims,) if isinstance(dims, int) else dims
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return None
    return {d % len(shape) for d in dims}


def keeps_channels(n: fx.Node, x: fx.Node | None) -> bool:
    """A vector norm over other dims than the channels (the channels stay on the same axis of the output)."""
    if x is None or n.op not in ("call_function", "call_method") or _name(n) not in NORMS or n.args[:1] != (x,):
        return False
    dims, axis, shape, out = _dims(n, x), node_axis(x), tensor_shape(x), tensor_shape(n)
    if dims is None or axis is None or axis in dims or shape is None or out is None or len(out) != len(shape):
        return False  # without keepdim the channels would move: not this case
    if out[axis] != shape[axis]:
        return False
    n.meta["gg_channel_axis"] = axis  # the layout guess of a [B, 1, 1, C] norm is wrong: its channels stay put
    return True


def across_channels(n: fx.Node, x: fx.Node | None) -> str | None:
    """Why a reduction across the channel axis of `x` freezes its channels, else None."""
    if x is None or n.op not in ("call_function", "call_method") or _name(n) not in ACROSS or n.args[:1] != (x,):
        return None
    dims, axis, shape = _dims(n, x), node_axis(x), tensor_shape(x)
    if dims is None or axis is None or shape is None or axis not in dims or shape[axis] == 1:
        return None
    return (
        f"'{n.name}' ({_name(n)}) reduces across these {shape[axis]} channels, so each channel's result depends on "
        "all of them: a new channel changes the old ones, so growth would not be exact (a sum or a norm changes with "
        "zero or copied channels alike)"
    )
