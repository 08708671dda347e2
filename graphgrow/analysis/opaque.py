"""Opaque steps the coupling analysis learns by looking inside or by running them: a mode switch's
per-path bodies (probed), a plain slice that keeps the channel axis whole, the current value of a
flag or number node (a module attribute read at run time, and arithmetic on it)."""

from __future__ import annotations

import torch
from torch import fx

from ..core.state import seeded
from ..graph.fx_edit import tensor_shape
from ..io.mode_switch import ModeSwitch
from .axes import index_of, indexed_axis, node_axis
from .probe import PROBE_SEED, is_channelwise


def switch_is_channelwise(m: ModeSwitch, x: fx.Node, n: fx.Node) -> bool:
    """Probe every body of a mode switch with its one tensor input varied (its numbers at their current values)."""
    shape = tensor_shape(x)
    if shape is None or shape != tensor_shape(n) or node_axis(x) is None:
        return False
    args = list(n.args[m.conditions :])
    if args.count(x) != 1:
        return False
    index = args.index(x)
    try:
        values = [a if i == index else number_value(a) for i, a in enumerate(args)]
    except ValueError:
        return False
    for body in m._bodies():

        def run(t: torch.Tensor, training: bool, body=body):
            with torch.no_grad(), seeded(PROBE_SEED):  # the same draws for every probe input
                return body(*[t if i == index else v for i, v in enumerate(values)])

        if not is_channelwise(run, tuple(shape), node_axis(x)):
            return False
    return True


def slice_keeps_channels(n: fx.Node, x: fx.Node) -> bool:
    """x[i0, i1, ...] with plain slices (at most one `...`) and integers on other axes (`x[:, 0]`, a class
    token; `x.select(2, 0)`, one half of a gated MLP's `view(B, T, 2, C)`), taking the channel axis whole."""
    found = index_of(n)
    if found is None or found[0] is not x:
        return False
    index, shape, axis = found[1], tensor_shape(x), node_axis(x)
    out_axis = indexed_axis(n)
    index = index if isinstance(index, tuple) else (index,)
    if shape is None or axis is None or out_axis is None or node_axis(n) != out_axis:
        return False
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    whole = axis >= len(index) or (
        index[axis] == slice(None) or index[axis] == slice(None, None, 1) or index[axis] == slice(0, None, None)
    )
    out = tensor_shape(n)
    return (
        bool(whole)
        and out is not None
        and out[out_axis] == shape[axis]
        and all(  # bounds read at run time (`[:, :, :seq_len]`) only on other axes: they never cut channels
            not isinstance(b, fx.Node)
            for d, i in enumerate(index)
            if isinstance(i, slice) and d == axis
            for b in (i.start, i.stop, i.step)
        )
    )


def eval_passthrough(gm: fx.GraphModule, n: fx.Node) -> fx.Node | None:
    """The input a mode switch hands back unchanged in eval mode (every `training` flag False, numbers at
    their current values) — drop-path's identity path — or None."""
    m = gm.get_submodule(n.target) if n.op == "call_module" else None
    if not isinstance(m, ModeSwitch):
        return None

    try:
        answers = [bool(number_value(c, training=False)) for c in n.args[: m.conditions]]
    except (ValueError, TypeError):
        return None
    index = m.passthrough(answers)
    value = n.args[m.conditions + index] if index is not None else None
    return value if isinstance(value, fx.Node) else None


def number_value(a, training: bool | None = None):
    """The current value of a flag/number node (a module attribute and arithmetic on it); ValueError otherwise.
    `training` given: every module's `training` flag reads as that value (eval_passthrough asks with False)."""
    if not isinstance(a, fx.Node):
        return a
    if a.op == "get_attr":
        if training is not None and str(a.target).split(".")[-1] == "training":
            return training
        value = a.graph.owning_module
        for part in str(a.target).split("."):
            value = getattr(value, part)
        if type(value) in (bool, int, float):
            return value
    elif a.op == "call_function" and getattr(a.target, "__module__", "") in ("_operator", "operator"):
        return a.target(*[number_value(b, training) for b in a.args])
    raise ValueError(a.name)
