"""Where a tensor's channels are, and the operations that keep them: the vocabulary of the coupling analysis.

Convolutional layouts keep channels at dim 1, token and feature layouts at the last dim; a
permute or transpose moves them, a flatten of (N, C, 1, 1) keeps them, a reduction over other
axes keeps them. coupling.py builds its groups with these; passes read `channel_axis`.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .reshapes import piece_axis, reshape_regroup, stack_axis, unit_dims_regroup
from .stacked import stacked_product

# Modules whose output channel c depends only on input channel c.
CHANNELWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Identity,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Upsample,
    nn.ZeroPad2d,
    nn.ConstantPad2d,
    nn.ReflectionPad2d,
    nn.ReplicationPad2d,
    nn.modules.dropout._DropoutNd,
)
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
CHANNELWISE_FUNCTIONS = {
    F.relu,
    F.relu6,
    F.gelu,
    F.silu,
    F.hardswish,
    F.hardsigmoid,
    F.leaky_relu,
    F.elu,
    F.sigmoid,
    F.tanh,
    F.dropout,
    F.adaptive_avg_pool2d,
    F.adaptive_max_pool2d,
    F.avg_pool2d,
    F.max_pool2d,
    F.interpolate,
    F.pad,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    torch.exp,
    torch.abs,
    torch.neg,
    operator.neg,
}
# unary elementwise ops and the value-keeping casts/copies, plus the two in-place activations models use
CHANNELWISE_METHODS = ops.UNARY_METHODS | ops.SAME_VALUES | {"relu_", "sigmoid_"}
ELEMENTWISE = ops.BINARY_FUNCTIONS
# the methods' names: x.add(y) …; "truediv" is an operator, never a method, and of the in-place ones only
# add_ and mul_ are followed (x.sub_(y), x.div_(y) freeze: not seen in a model yet)
ELEMENTWISE_METHODS = (ops.BINARY_NAMES - {"truediv"}) | {"add_", "mul_"}
# only the called ones: the coupling checks call_method nodes, and shape/dtype/device are attributes, never called
SHAPE_QUERIES = ops.SHAPE_METHODS


def channel_axis(shape) -> int | None:
    """Convolutional layouts keep channels at dim 1; token/feature layouts (N, …, F) at the last dim."""
    if not isinstance(shape, tuple) or len(shape) < 2:
        return None
    return 1 if len(shape) in (2, 4, 5) else len(shape) - 1


def node_axis(n: fx.Node) -> int | None:
    """The channel axis of a node's tensor: where its channels actually are (a permute moves them), set by
    `assign_channel_axes`, else the layout default."""
    axis = n.meta.get("gg_channel_axis")
    return axis if axis is not None else channel_axis(tensor_shape(n))


def conv_dims(n: fx.Node) -> int | None:
    """How many spatial dimensions `n`'s tensor has in a conv layout, channels at dim 1: 2 for (N, C, H, W),
    1 for a Conv1d's (N, C, L), 3 for (N, C, D, H, W); None for features last ((N, F), (N, T, F) tokens).
    Reads the axes `assign_channel_axes` found (stages() and analyze() run it)."""
    shape = tensor_shape(n)
    if shape is None or len(shape) < 3:
        return None
    if len(shape) == 4:
        return 2
    return len(shape) - 2 if node_axis(n) == 1 else None


PERMUTES = {torch.permute, torch.transpose, torch.swapaxes, torch.movedim}


def assign_channel_axes(gm: fx.GraphModule) -> None:
    """Follow the channel axis through the graph: a permute/transpose moves it, a Linear produces its
    features last, a conv at dim 1, and an op whose output has an input's shape keeps that input's axis
    (so (N, H, W, C) tensors inside ConvNeXt/Swin blocks are known as channels-last), and a pooling or a
    BatchNorm keeps its input's (so a Conv1d stack's (N, C, L) tensors are known as channels-first)."""
    for n in gm.graph.nodes:
        n.meta.pop("gg_channel_axis", None)
        shape = tensor_shape(n)
        if shape is None or len(shape) < 2:
            continue
        axis = moved_axis(n)
        if axis is None:
            axis = flatten_keeps_axis(n)
        if axis is None:
            axis = reduced_axis(n)
        if axis is None:
            axis = _regrouped_axis(n)
        if axis is None:
            product = stacked_product(gm, n) if n.op in ("call_function", "call_method") else None
            axis = product.y_axis if product is not None else None  # per expert a Linear: its output's features
        if axis is None and n.op == "call_module":
            m = gm.get_submodule(n.target)
            if isinstance(m, nn.Linear):
                axis = across_axis(n) if across_axis(n) is not None else len(shape) - 1
            elif isinstance(m, nn.modules.conv._ConvNd):
                axis = 1
            elif isinstance(m, CHANNELWISE_MODULES + BATCHNORMS):  # pooling changes the size, not the layout
                axis = _same_rank_axis(n, shape)
        if axis is None and n.op == "call_function" and n.target in CHANNELWISE_FUNCTIONS:
            axis = _same_rank_axis(n, shape)
        if axis is None:
            axis = product_axis(n) if product_axis(n) is not None else cat_axis(n)
        if axis is None and n.op in ("call_module", "call_function", "call_method"):
            same = [a for a in n.all_input_nodes if tensor_shape(a) == shape and node_axis(a) is not None]
            if same:
                axis = node_axis(same[0])
        if axis is not None:
            n.meta["gg_channel_axis"] = axis


def product_axis(n: fx.Node) -> int | None:
    """Where a matrix product `a @ b` (matmul, bmm) puts the channels an operand's found axis says it carries: b's
    columns are the output's columns (attention's probabilities @ values: the head size last), a's rows its rows.
    Only axes found by following the graph count, never a layout's guess; None when neither or both say so (or for
    any other op), so that an output of an operand's shape is not taken for that operand (probabilities T × T of a
    head size T)."""
    if n.op not in ("call_function", "call_method") or ops.op_name(n.target).split(".")[0] not in ("matmul", "bmm"):
        return None
    if len(n.args) < 2 or not all(isinstance(a, fx.Node) for a in n.args[:2]):
        return None
    a, b = n.args[0], n.args[1]
    out, sa, sb = tensor_shape(n), tensor_shape(a), tensor_shape(b)
    if out is None or sa is None or sb is None or min(len(out), len(sa), len(sb)) < 2:
        return None
    columns = b.meta.get("gg_channel_axis") == len(sb) - 1
    rows = a.meta.get("gg_channel_axis") == len(sa) - 2
    if columns == rows:
        return None
    return len(out) - 1 if columns else len(out) - 2


def cat_axis(n: fx.Node) -> int | None:
    """torch.cat's output has its inputs' channel axis when every input's axis was found (not guessed) and they
    agree (ConvBERT's attention heads beside its conv heads along the heads dim); else None."""
    if n.op != "call_function" or ops.op_name(n.target) not in ("cat", "concat", "concatenate"):
        return None
    tensors = n.args[0] if n.args else n.kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, fx.Node) for t in tensors):
        return None
    found = {t.meta.get("gg_channel_axis") for t in tensors}
    ranks = {len(tensor_shape(t) or ()) for t in tensors} | {len(tensor_shape(n) or ())}
    return found.pop() if len(found) == 1 and None not in found and len(ranks) == 1 else None


def across_axis(n: fx.Node) -> int | None:
    """The channel axis a Linear call keeps when it maps another axis: its input's channels were found elsewhere
    than the last axis (a transpose moved them there, as a gMLP spatial gating unit or an MLP-Mixer token MLP
    does), so the Linear mixes tokens with the same weights for every channel, and its output has them at the
    same place. None when the input's channels are last, or only guessed from the layout."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if x is None or x.meta.get("gg_channel_axis") is None:
        return None
    shape, axis = tensor_shape(x), x.meta["gg_channel_axis"]
    out = tensor_shape(n)
    if shape is None or out is None or len(shape) != len(out) or axis == len(shape) - 1 or shape[:-1] != out[:-1]:
        return None
    return axis


def _regrouped_axis(n: fx.Node) -> int | None:
    """Where a reshape, a stack, a split piece or a slice puts its input's channel axis."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if (
        n.op == "call_function"
        and n.target is torch.stack
        and n.args
        and isinstance(n.args[0], (list, tuple))
        and n.args[0]
    ):
        first = n.args[0][0]
        return stack_axis(n, node_axis(first)) if isinstance(first, fx.Node) else None
    if x is None:
        return None
    found = reshape_regroup(n, node_axis(x)) or unit_dims_regroup(n, node_axis(x))
    if found is not None:
        return found.out_axis
    piece = piece_axis(n, node_axis)
    if piece is not None:
        return piece
    same_rank = len(tensor_shape(x) or ()) == len(tensor_shape(n) or (0,))
    sliced = (
        n.op == "call_function"
        and n.target is operator.getitem
        and isinstance(n.args[1], (tuple, slice))
        and all(
            isinstance(i, slice) or i is Ellipsis for i in (n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],))
        )
    )
    narrowed = (n.op == "call_method" and n.target == "narrow") or (
        n.op == "call_function" and n.target is torch.narrow
    )
    if same_rank and (sliced or narrowed):
        return node_axis(x)
    return indexed_axis(n)


def index_of(n: fx.Node) -> tuple[fx.Node, object] | None:
    """(x, the index) when `n` indexes x: `x[i0, i1, ...]`, or `x.select(d, i)` / `torch.select(x, d, i)` written
    as the index `x[:, ..., :, i]` (slices on the d dims before d); None for any other op."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.op == "call_function" and n.target is operator.getitem and len(n.args) > 1:
        return n.args[0], n.args[1]
    if (n.op, n.target) in (("call_function", torch.select), ("call_method", "select")):
        shape = tensor_shape(n.args[0])
        dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
        i = n.kwargs.get("index", n.args[2] if len(n.args) > 2 else None)
        if shape is None or not isinstance(dim, int) or not isinstance(i, int) or isinstance(i, bool):
            return None
        return n.args[0], (slice(None),) * (dim % len(shape)) + (i,)
    return None


def indexed_axis(n: fx.Node) -> int | None:
    """Where `x[:, 0]`-style indexing (or `x.select(1, 0)`) puts x's channel axis: plain slices (at most one `...`)
    and integers on other axes (each removes its axis; a ViT's class-token pooling, one time step of a scan, one
    half of a gated MLP's `view(..., 2, C)`), the channel axis not indexed by an integer. None for any other op
    or index."""
    found = index_of(n)
    if found is None:
        return None
    x, index = found
    shape, axis = tensor_shape(x), node_axis(x)
    index = index if isinstance(index, tuple) else (index,)
    if (
        shape is None
        or axis is None
        or not isinstance(shape, tuple)
        or sum(i is Ellipsis for i in index) > 1
        or not all(isinstance(i, (slice, int)) or i is Ellipsis for i in index)
        or isinstance(index[0], bool)
    ):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    if len(index) > len(shape) or (axis < len(index) and not isinstance(index[axis], slice)):
        return None
    return axis - sum(1 for i in index[:axis] if isinstance(i, int) and not isinstance(i, bool))


def _same_rank_axis(n: fx.Node, shape: tuple) -> int | None:
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    return node_axis(x) if x is not None and len(tensor_shape(x) or ()) == len(shape) else None


def flatten_keeps_axis(n: fx.Node) -> int | None:
    """A flatten that leaves the channel axis out of the dims it merges keeps each channel apart: past it
    ((N, C, H, W) → (N, C, H·W), a ViT patch embedding) the axis stays where it was; before it ((B, 2, 2, h, w, C)
    → (4B, h, w, C), Hiera's windows folded into the batch) it moves down by the dims merged. Else None."""
    is_flatten = (n.op == "call_function" and n.target is torch.flatten) or (
        n.op == "call_method" and n.target == "flatten"
    )
    if not is_flatten or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    x = n.args[0]
    axis, shape = node_axis(x), tensor_shape(x)
    start = n.kwargs.get("start_dim", n.args[1] if len(n.args) > 1 else 0)
    end = n.kwargs.get("end_dim", n.args[2] if len(n.args) > 2 else -1)
    if axis is None or not shape or not isinstance(start, int) or not isinstance(end, int):
        return None
    start, end = start % len(shape), end % len(shape)
    if axis < start:
        return axis
    return axis - (end - start) if axis > end else None


REDUCTIONS = ops.LINEAR_REDUCTIONS | (ops.EXTREMA - {"max", "min"})  # max/min over a dim also return indices


def reduced_axis(n: fx.Node) -> int | None:
    """The channel axis after a mean/sum/amax/amin over other dims (keepdim or not), else None."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if (
        n.op not in ("call_function", "call_method")
        or name not in REDUCTIONS
        or not n.args
        or not isinstance(n.args[0], fx.Node)
    ):
        return None
    x = n.args[0]
    axis, shape = node_axis(x), tensor_shape(x)
    dims = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    dims = (dims,) if isinstance(dims, int) else dims
    if (
        axis is None
        or shape is None
        or not isinstance(dims, (tuple, list))
        or not dims
        or not all(isinstance(d, int) for d in dims)
    ):
        return None
    reduced = {d % len(shape) for d in dims}
    if axis in reduced:
        return None
    keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
    return axis if keepdim else axis - sum(1 for d in reduced if d < axis)


def moved_axis(n: fx.Node) -> int | None:
    """Where a permute/transpose/movedim puts its input's channel axis (None: not such an op)."""
    is_fn = n.op == "call_function" and n.target in PERMUTES
    is_method = n.op == "call_method" and n.target in ("permute", "transpose", "swapaxes", "movedim")
    if not (is_fn or is_method) or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    x, rest = n.args[0], list(n.args[1:])
    axis, shape = node_axis(x), tensor_shape(x)
    if axis is None or shape is None:
        return None
    rank = len(shape)
    name = n.target if isinstance(n.target, str) else n.target.__name__
    try:
        if name == "permute":
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            dims = list(n.kwargs.get("dims", dims))
            return [int(d) % rank for d in dims].index(axis)
        if name in ("transpose", "swapaxes"):
            a, b = (int(d) % rank for d in rest[:2])
            return b if axis == a else a if axis == b else axis
        if name == "movedim":
            src, dst = rest[:2]
            order = [d for d in range(rank) if d != src % rank]
            order.insert(dst % rank, src % rank)
            return order.index(axis)
    except (ValueError, TypeError, IndexError):
        return None
    return None
