"""The ops the residual-stream walk (stream.py) passes the stream through unchanged in kind: each acts on every hidden
coordinate alike and linearly (views, transposes, token selection and pooling, dropout, scalar multiples, drop-path
modules and export's mode switches found by running them, tiles along other axes)."""

from __future__ import annotations

from torch import fx, nn

from ..graph.fx_edit import tensor_shape
from ..io.mode_switch import ModeSwitch
from .stream_ops import (
    PASS_FUNCTIONS,
    PASS_METHODS,
    TILES,
    arithmetic,
    averages_trailing,
    base_name,
    is_scalar_factor,
    pools_others,
    zero_pad,
)
from .stream_regions import number_of, scales_tokens


def through(gm: fx.GraphModule, n: fx.Node, width: int) -> fx.Node | None:
    """The stream input of an op that acts on every hidden coordinate alike and linearly, else None."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if x is None and arithmetic(n) == "mul" and len(n.args) == 2 and is_scalar_factor(n.args[0]):
        return n.args[1] if isinstance(n.args[1], fx.Node) else None  # c · x (FocalNet's 1.0 * x)
    if n.op == "call_module" and isinstance(switch := gm.get_submodule(n.target), ModeSwitch):
        inputs, shape = n.args[switch.conditions :], tensor_shape(n)  # (flags, x, numbers…): export's drop-path
        at = [i for i, a in enumerate(inputs) if isinstance(a, fx.Node) and tensor_shape(a) == shape]
        numbers = tuple(number_of(gm, a) for i, a in enumerate(inputs) if i not in at)  # keep_prob = 1 - drop_prob
        if len(at) != 1 or any(r is None for r in numbers):
            return None
        return inputs[at[0]] if scales_tokens(switch, shape, width, switch.conditions, numbers, at[0]) else None  # type: ignore[return-value,arg-type]
    if base_name(n) in ("matmul", "bmm") and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args):
        # H @ x: every hidden coordinate (x's last axis) mixed alike across x's rows (hyper-connections' H_res)
        hs, xs = tensor_shape(n.args[0]), tensor_shape(n.args[1])  # type: ignore[arg-type]
        mixes_rows = hs and xs and len(xs) >= 2 and xs[-1] == width and hs[-1] == xs[-2] != width
        if mixes_rows:
            return n.args[1]  # type: ignore[return-value]
        # x @ M: each hidden coordinate (x's rows, its second last axis) mapped alike by M, which does not carry the
        # hidden size (EfficientViM's state-space mixer: h = x @ (a·b)ᵀ over the tokens, then y = h @ c)
        maps_rows = hs and xs and len(hs) >= 2 and len(xs) >= 2 and hs[-2] == width and width not in xs[-2:]
        return n.args[0] if maps_rows else None  # type: ignore[return-value]
    if x is None:
        return None
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        shape = tensor_shape(n)
        linear = isinstance(m, (nn.Dropout, nn.Identity, nn.Flatten)) or (
            shape is not None and shape == tensor_shape(x) and scales_tokens(m, shape, width)
        )
        if averages_trailing(gm, n):  # tokens averaged channels first (forward_axis keeps the axes before)
            return x if len(n.args) == 1 else None
        return x if linear and len(n.args) == 1 else None
    if arithmetic(n) in ("mul", "div"):  # in place too: x *= c (CTRL's embedding scale)
        # a scalar multiple: a number, or a one-element tensor that does not depend on the input (a gate such as
        # add_residual's or deepen's, a learned scale), on either side of a product
        other = n.args[1] if len(n.args) > 1 else None
        if is_scalar_factor(other):
            return x
        divide = arithmetic(n) == "div"
        return other if not divide and isinstance(other, fx.Node) and is_scalar_factor(x) else None
    # expand_as(x, y), type_as(x, y): y gives a shape or dtype only
    if base_name(n) in ("expand_as", "type_as") or pools_others(n) or zero_pad(n) or averages_trailing(gm, n):
        return x
    passes = (n.op == "call_method" and n.target in PASS_METHODS) or (
        n.op == "call_function" and n.target in PASS_FUNCTIONS
    )
    if passes or base_name(n) == "repeat_interleave" or base_name(n) in TILES:  # tokens repeated, once per expert
        rest = [a for a in list(n.args[1:]) + list(n.kwargs.values()) if isinstance(a, fx.Node)]
        return x if all(tensor_shape(a) is None for a in rest) else None  # sizes, not other tensors
    return None
