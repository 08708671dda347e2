"""The ops the residual-stream analysis (stream.py) follows the hidden axis through: scalar factors, elementwise
activations with f(0) = 0, and the views, transposes, selections and reductions that move or keep the axis."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..graph import ops
from ..graph.fx_edit import from_input, tensor_shape


def arg(n: fx.Node, i: int, key: str, default=None):
    """Argument `i` of `n`, or its keyword `key`."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


# methods the hidden axis passes through (moved or kept); unflatten, the *_as forms, expand_as, split and the moments
# past the mean are not followed (the axis's place after them is not worked out here). ("getitem" is never a method:
# x[i] is operator.getitem, in PASS_FUNCTIONS.)
PASS_METHODS = (
    ops.SAME_VALUES
    | ops.TRANSPOSES
    | ops.RESHAPES
    | ops.UNIT_DIMS
    | ops.LINEAR_REDUCTIONS
    | ops.INDEXING
    | {"flatten", "expand"}
    | {"detach"}  # the same values, no gradient back through it
)
TILES = frozenset({"repeat", "tile"})  # whole copies of a tensor along dims (x.repeat(4, 1): the tokens, 4 times)
PASS_FUNCTIONS = {
    F.dropout,
    torch.transpose,
    torch.permute,
    torch.flatten,
    torch.reshape,
    torch.select,
    operator.getitem,
    torch.mean,
    torch.sum,
    torch.squeeze,
    torch.unsqueeze,
}


def base_name(n: fx.Node) -> str:
    """A call's op name without ATen's overload (aten.add_.Tensor → "add_"); "" for other nodes."""
    return ops.op_name(n.target).split(".")[0] if n.op in ("call_function", "call_method") else ""


def arithmetic(n: fx.Node) -> str | None:
    """ "add", "sub", "mul" or "div" for x ± y, x · y, x / y in any spelling: an operator or torch function, a
    method, in place (x += y, x.add_(y)) or an ATen overload (aten.add_.Tensor); else None. In place or not, the
    value computed is the same, and the stream analysis joins both operands with the result anyway."""
    name = base_name(n).removesuffix("_")
    name = name[1:] if name in ops.IN_PLACE_OPERATORS else name  # iadd → add
    name = "div" if name == "truediv" else name
    return name if name in ops.BINARY_NAMES else None


def value_free_read(u: fx.Node, x: fx.Node) -> bool:
    """Whether `u` reads only `x`'s dtype or device, never its values or its shape: y.type_as(x), y.to(x),
    x.new_ones(3, 4) with sizes given as numbers or read from shapes (a growth of x changes nothing in `u`)."""
    name = base_name(u)
    rest = list(u.args[1:]) + list(u.kwargs.values())
    if name in ("type_as", "to") and u.args and u.args[0] is not x:
        return True
    sizes = not any(isinstance(a, fx.Node) and tensor_shape(a) is not None for a in rest)  # numbers or sizes read
    return name.startswith("new_") and bool(u.args) and u.args[0] is x and sizes


def constant_like(u: fx.Node, x: fx.Node) -> bool:
    """Whether `u` is zeros_like(x), ones_like(x), full_like(x, c), empty_like(x): x's shape, no value of it."""
    rest = list(u.args[1:]) + list(u.kwargs.values())
    return (
        base_name(u).endswith("_like")
        and bool(u.args)
        and u.args[0] is x
        and not any(isinstance(a, fx.Node) for a in rest)
    )


def zero_pad(n: fx.Node) -> bool:
    """Whether `n` is F.pad (aten pad, constant_pad_nd) adding zeros, its pads written as numbers or computed from
    sizes (DaViT's windows: (7 - W % 7) % 7)."""
    pads = arg(n, 1, "pad")
    value = arg(n, 3, "value", 0) if base_name(n) == "pad" else arg(n, 2, "value", 0)
    return (
        base_name(n) in ("pad", "constant_pad_nd")
        and isinstance(pads, (list, tuple))
        and all(isinstance(p, int) or (isinstance(p, fx.Node) and tensor_shape(p) is None) for p in pads)
        and (base_name(n) != "pad" or arg(n, 2, "mode", "constant") == "constant")
        and value in (0, None)
    )


def pools_others(n: fx.Node) -> bool:
    """Whether `n` is avg_pool1d/2d/3d whose window along the last axis is 1 (size, stride 1, no padding): an average
    over tokens taken for every coordinate alike (Funnel's pooling of (B, 1, T, D) by (2, 1))."""
    if not base_name(n).startswith("avg_pool") or any(isinstance(a, fx.Node) for a in n.args[1:]):
        return False

    def last(v, default):
        v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v  # aten's stride [] = the size
        return v[-1] if isinstance(v, (list, tuple)) else v

    size = last(arg(n, 1, "kernel_size"), None)
    return size == 1 and last(arg(n, 2, "stride"), size) in (1, None) and last(arg(n, 3, "padding"), 0) == 0


ADAPTIVE_AVERAGES = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)


def averages_trailing(gm: fx.GraphModule, n: fx.Node) -> int:
    """k when `n` is an adaptive average pool over its input's last k axes (module or function: Hiera's pooler,
    AdaptiveAvgPool1d(1) over the tokens of (N, C, T)), else 0: each coordinate of the axes before them alone."""
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        return ADAPTIVE_AVERAGES.index(type(m)) + 1 if type(m) in ADAPTIVE_AVERAGES else 0
    name = base_name(n)
    return int(name[-2]) if name.startswith("adaptive_avg_pool") and name[-2:-1] in ("1", "2", "3") else 0


def fourier_along(n: fx.Node, axis: int) -> bool:
    """Whether `n` or one of its inputs is a Fourier transform along the hidden axis (FNet's 2-D DFT of tokens and
    hidden coordinates)."""
    for f in [n, *n.all_input_nodes]:
        dims = arg(f, 2, "dim", -1) if base_name(f).startswith("fft") else None
        rank = len(tensor_shape(f) or (0,))
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        if dims != [None] and axis % rank in {d % rank for d in dims}:
            return True
    return False


EXTREMA_WITH_INDICES = ("max", "min")  # over a dim: a (values, indices) pair


def extremum(n: fx.Node) -> tuple[fx.Node, list[int], bool] | None:
    """(x, the reduced dims, keepdim) when `n` is the largest or smallest values of x over some dims: amax/amin, or
    the values of max/min over a dim (`.values`, `[0]`: Hiera's max over the query-stride tokens)."""
    t = n
    if base_name(n) == "getitem" and n.args[1] == 0 or base_name(n) == "getattr" and n.args[1] == "values":
        t = n.args[0]  # type: ignore[assignment]
        if not isinstance(t, fx.Node) or base_name(t) not in EXTREMA_WITH_INDICES:
            return None
    elif base_name(n) not in ("amax", "amin"):
        return None
    x, dim, keepdim = t.args[0] if t.args else None, arg(t, 1, "dim"), arg(t, 2, "keepdim", False)
    rank = len(tensor_shape(x) or ()) if isinstance(x, fx.Node) else 0
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else []
    if not rank or not dims or not all(isinstance(d, int) for d in dims) or not isinstance(keepdim, bool):
        return None
    return x, sorted({d % rank for d in dims}), keepdim  # type: ignore[return-value]


def averages_over(u: fx.Node, x: fx.Node, axis: int) -> bool:
    """Whether `u` is the mean of `x` over dims that include `axis` (x.mean(1), torch.mean(x, (1, 2)), x.mean()):
    new coordinates equal to the mean of the old ones keep it, as copies of them do."""
    if base_name(u) != "mean" or not u.args or u.args[0] is not x:
        return False
    rank, dim = len(tensor_shape(x) or ()), arg(u, 1, "dim")
    if isinstance(dim, fx.Node) or not rank:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) and dim else range(rank)
    return all(isinstance(d, int) for d in dims) and axis in {d % rank for d in dims}


def drops_axis_by_index(v: fx.Node, a: int) -> bool:
    """Whether `v` indexes its input's axis `a` with one integer (x.select(a, i), x[..., i]): the axis disappears."""
    shape = tensor_shape(v.args[0]) if v.args and isinstance(v.args[0], fx.Node) else None
    if shape is None:
        return False
    name = base_name(v)
    if name == "select":
        dim = arg(v, 1, "dim")
        return isinstance(dim, int) and dim % len(shape) == a and isinstance(arg(v, 2, "index"), int)
    if name != "getitem" or len(v.args) < 2:
        return False
    index = v.args[1] if isinstance(v.args[1], tuple) else (v.args[1],)
    if any(i is None for i in index) or sum(i is Ellipsis for i in index) > 1:
        return False
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1 :]
    return a < len(index) and isinstance(index[a], int) and not isinstance(index[a], bool)


# elementwise activations with f(0) = 0: a stream tensor may pass through one when its new coordinates are zero (or
# every coordinate is replicated), as in a gated block deepen inserts on a token stream
ZERO_ACTIVATION_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.LeakyReLU, nn.Hardswish, nn.Mish, nn.ELU)
ZERO_ACTIVATION_FUNCTIONS = {
    F.relu,
    F.relu6,
    F.gelu,
    F.silu,
    F.leaky_relu,
    F.hardswish,
    F.mish,
    F.elu,
    torch.relu,
    torch.tanh,
}
ZERO_ACTIVATION_METHODS = {"relu", "tanh"}
FLAT_AT_ZERO = (nn.ReLU, nn.ReLU6, F.relu, F.relu6, torch.relu, "relu")  # f'(0) = 0: a new unit at 0 would never learn


def zero_activation_input(gm: fx.GraphModule, n: fx.Node) -> fx.Node | None:
    """x when `n` is an elementwise activation f(x) with f(0) = 0 and nothing else tensor-valued in its arguments."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if x is None or any(isinstance(a, fx.Node) for a in list(n.args[1:]) + list(n.kwargs.values())):
        return None
    if n.op == "call_module":
        return x if type(gm.get_submodule(n.target)) in ZERO_ACTIVATION_MODULES else None
    if n.op == "call_function":
        return x if n.target in ZERO_ACTIVATION_FUNCTIONS else None
    return x if n.op == "call_method" and n.target in ZERO_ACTIVATION_METHODS else None


def is_scalar_factor(v) -> bool:
    """A number, or a one-element tensor computed from parameters and constants only (never from the input: a
    factor read from the stream would change when the stream grows)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True
    if not isinstance(v, fx.Node):
        return False
    shape = tensor_shape(v)
    if shape is None or any(d != 1 for d in shape):
        return False
    return not from_input(v)


def forward_axis(n: fx.Node, x: fx.Node, a: int) -> int | None:
    """Where op `n` puts input `x`'s hidden axis `a` (None: it does not keep it whole)."""
    xs, out = tensor_shape(x), tensor_shape(n)
    if xs is None or out is None:
        return None
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "").split(".")[0]
    rest = list(n.args[1:])
    try:
        if name in ("pad", "constant_pad_nd"):  # zeros added along other axes: a zero token is its own mean
            pads, k = list(arg(n, 1, "pad")), len(xs) - 1 - a
            kept = all(isinstance(p, int) and p == 0 for p in pads[2 * k : 2 * k + 2])
            return a if kept and zero_pad(n) else None
        if name.startswith("adaptive_avg_pool"):  # the last 1-3 axes averaged: the axes before them kept
            return a if a < len(xs) - int(name[-2]) and out[: a + 1] == xs[: a + 1] else None
        if name.startswith("avg_pool"):  # an average over the other axes, each coordinate alone: the last axis
            return a if a == len(xs) - 1 == len(out) - 1 and pools_others(n) else None
        if name == "repeat_interleave":  # whole slices repeated along another dim keep the axis; dim=None flattens
            dim = arg(n, 2, "dim")
            return None if dim is None or int(dim) % len(xs) == a else a
        if name in TILES:  # copies along other dims keep the axis (counts aligned from the right, missing ones 1)
            reps = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            reps = [1] * (len(xs) - len(reps)) + list(reps)
            return a + len(out) - len(xs) if reps[len(reps) - len(xs) + a] == 1 else None
        if name in ("transpose",):
            i, j = (int(d) % len(xs) for d in rest[:2])
            return j if a == i else i if a == j else a
        if name == "permute":
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            return [int(d) % len(xs) for d in dims].index(a)
        if name == "getitem":
            return _index_axis(rest[0], xs, a)
        if name == "select":
            dim = int(arg(n, 1, "dim")) % len(xs)
            return None if dim == a else a - (dim < a)
        if name in ("mean", "sum"):
            dims = arg(n, 1, "dim")
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            dims = [d % len(xs) for d in dims]
            if not dims or a in dims:
                return None
            return a if arg(n, 2, "keepdim", False) else a - len([d for d in dims if d < a])
    except (TypeError, ValueError, IndexError):
        return None
    if xs == out or name in (
        "dropout",
        "expand",
        "expand_as",
        "contiguous",
        "clone",
        "float",
        "to",
        "type_as",
        "mul",
        "div",
        "truediv",
    ):
        return a + len(out) - len(xs) if out[a + len(out) - len(xs)] == xs[a] else None
    if a == len(xs) - 1 and out[-1] == xs[-1]:  # a view that regroups the leading dimensions only
        return len(out) - 1
    if out[: a + 1] == xs[: a + 1]:  # flatten(2) of (N, C, H, W): the axis and those before it kept
        return a
    return None


def _index_axis(index, shape: tuple, a: int) -> int | None:
    """The hidden axis after x[index]: it must be indexed by a full slice (or not at all)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1 :]
    out, dim = 0, 0
    for i in index:
        if i is None:
            out += 1
            continue
        if dim == a:
            full = (
                isinstance(i, slice)
                and i.step in (None, 1)
                and (i.start or 0) == 0
                and (i.stop is None or i.stop >= shape[a])
            )
            return out if full else None
        out += 0 if isinstance(i, int) else 1
        if not isinstance(i, (int, slice)):
            return None
        dim += 1
    return out + (a - dim)


def token_scale(n: fx.Node, axis: int, width: int) -> tuple[fx.Node, int] | None:
    """`n` = x · w, w of size 1 along the hidden axis (a per-token weight: a mixture-of-experts router's weight on
    an expert's output): every hidden coordinate of a token scaled alike, so new coordinates keep their fill
    (0 · w = 0, mean(x) · w = mean(x · w)). w itself reads the stream, if at all, only through what the walk
    understands (a router Linear: new columns zero). Returns (x, its hidden axis)."""
    if not (arithmetic(n) in ("mul", "div") and len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args)):
        return None
    out = tensor_shape(n)
    shapes = [tensor_shape(a) for a in n.args]
    if out is None or any(sh is None for sh in shapes):
        return None
    ks = [axis - (len(out) - len(sh)) for sh in shapes]  # type: ignore[arg-type]
    wide = [i for i in (0, 1) if 0 <= ks[i] < len(shapes[i]) and shapes[i][ks[i]] == width]  # type: ignore[index]
    if len(wide) != 1:
        return None
    j = 1 - wide[0]
    if arithmetic(n) == "div" and j == 0:  # w / x is not linear in x
        return None
    if 0 <= ks[j] < len(shapes[j]) and shapes[j][ks[j]] != 1:  # type: ignore[index]
        return None
    return n.args[wide[0]], ks[wide[0]]  # type: ignore[return-value]


def input_axis(n: fx.Node, x: fx.Node, axis: int, width: int) -> int | None:
    """The axis of `n`'s input x (of size `width`) that `n` moves to its output's `axis`, else None."""
    shape = tensor_shape(x) or ()
    fits = [a for a in range(len(shape)) if shape[a] == width and forward_axis(n, x, a) == axis]
    return fits[-1] if fits else None
