"""Per-channel ops on the residual stream (stream.py): each hidden coordinate c scaled by a factor of its own (a
learned layer scale γ ⊙ x, a residual weight, a norm's γ written by hand) or filtered by a kernel of its own (a
depthwise convolution). Output coordinate c depends on input coordinate c alone, through parameters indexed by c.

Such an op keeps a zero new coordinate zero (γ_new · 0 = 0, a depthwise filter of a zero channel is zero, its new
bias 0) and replicates with its parameters copied, but no new factor turns the mean of the old inputs into the mean
of the old outputs: both sides need the zero fill (or replication, where a norm's input needs the mean).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..graph import ops
from ..graph.fx_edit import from_input, tensor_shape
from .stream_ops import arg, arithmetic, base_name, extremum
from .stream_regions import one_op, region


@dataclass
class ChannelOp:
    x: fx.Node  # the stream input
    x_axis: int  # its hidden axis
    params: list[tuple[str, int, str]]  # (parameter path, its dim along the stream, "scale" | "shift")
    groups: bool = False  # a functional depthwise conv: its `groups` argument is the width (rewritten with it)
    views: list[tuple[str, int]] = field(default_factory=list)  # (a factor's reshape, the width's place in its sizes)
    why: str = "scales each hidden coordinate by a factor of its own: 0·γ = 0, but not mean(γ·x) = γ·mean(x)"
    # the fills it needs on both sides: zero (a factor: 0·γ = 0); none (a linear map alike for every channel: any fill
    # passes, both sides share it); zero and mean (only replication is exact: a GroupNorm of one group)
    fills: tuple[str, ...] = ("zero",)
    via: tuple[str, ...] | None = None  # a factor's reads between its parameter and the product (shared_factors)


GATE_MODULES = (nn.Sigmoid, nn.Tanh, nn.Softplus, nn.SiLU, nn.GELU, nn.ReLU)  # elementwise, finite: a gate's σ
CONV_FUNCTIONS = ("conv1d", "conv2d", "conv3d")  # F.convNd(x, weight, bias, stride, padding, dilation, groups)


def channel_op(gm: fx.GraphModule, n: fx.Node, axis: int, width: int) -> ChannelOp | None:
    """`n` as a per-channel op whose output has the hidden axis `axis`, else None."""
    across = across_others(gm, n, axis, width)
    if across is not None:
        return across
    if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.modules.batchnorm._BatchNorm):
        # per channel: (x - μ) / sqrt(σ² + eps) · γ + β, μ and σ² the running or the batch statistics; a channel of
        # zeros gives β = 0 with running μ = 0 (and σ² of the old ones', positive)
        m, path = gm.get_submodule(n.target), str(n.target)
        if axis != 1 or m.num_features != width or len(n.args) != 1 or not isinstance(n.args[0], fx.Node):
            return None
        kinds = {"weight": "scale", "bias": "shift", "running_mean": "shift", "running_var": "scale"}
        return ChannelOp(n.args[0], 1, [(f"{path}.{k}", 0, v) for k, v in kinds.items() if getattr(m, k) is not None])
    norm = one_group_norm(gm, n, axis, width)
    if norm is not None:
        return norm
    pooled = avg_pooled(gm, n)
    if pooled is not None:  # each channel's average over a window of its own map: linear, the same for every channel
        if axis != 1 or (tensor_shape(pooled) or ())[1:2] != (width,):
            return None
        return ChannelOp(pooled, 1, [], why="averages or resizes each channel's own map", fills=())
    pooled = max_pooled(gm, n)
    if pooled is not None:  # each channel's largest value over a window of the map: 0 for zeros, copies for copies
        if axis != 1 or (tensor_shape(pooled) or ())[1:2] != (width,):
            return None
        return ChannelOp(pooled, 1, [], why="takes each coordinate's maximum over a window of the map: not the mean's")
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        depthwise = isinstance(m, nn.modules.conv._ConvNd) and m.groups == m.in_channels == m.out_channels == width > 1
        if not depthwise or axis != 1 or len(n.args) != 1 or not isinstance(n.args[0], fx.Node):
            return None
        params = [(f"{n.target}.weight", 0, "scale")]
        params += [(f"{n.target}.bias", 0, "shift")] if m.bias is not None else []
        return ChannelOp(n.args[0], 1, params)
    ext = extremum(n)
    if ext is not None:  # each coordinate's largest value over other axes: 0 for zeros, a copy for copies
        source, dims, keep = ext
        back = [a for a in range(len(tensor_shape(source) or ())) if a not in dims]  # the axes kept, in order
        at = axis if keep else back[axis] if axis < len(back) else -1
        if at in dims or at < 0 or (tensor_shape(source) or ())[at] != width:
            return None
        return ChannelOp(source, at, [], why="takes each coordinate's extremum over other axes: not the mean's")
    if base_name(n) in CONV_FUNCTIONS:
        return _functional_depthwise(n, axis, width)
    if arithmetic(n) != "mul" or len(n.args) != 2 or not all(isinstance(a, fx.Node) for a in n.args):
        return None
    out = tensor_shape(n)
    for gate, i in ((False, 0), (False, 1), (True, 0), (True, 1)):  # a factor on either side before a gate
        x, p = n.args[i], n.args[1 - i]
        assert isinstance(x, fx.Node) and isinstance(p, fx.Node)  # checked above
        xs = tensor_shape(x)
        if out is None or xs is None or len(xs) != len(out) or xs[axis] != width:
            continue
        found = None if gate else channel_factor(gm, p, len(out), axis, width)
        if found is not None:
            return ChannelOp(x, axis, [(found[0], found[1], "scale")], views=_sized_views(p, width), via=found[2])
        gated = gate_factor(gm, p, out, axis, width) if gate else None
        if gated is not None:
            return ChannelOp(x, axis, gated)
    return None


def across_others(gm: fx.GraphModule, n: fx.Node, axis: int, width: int) -> ChannelOp | None:
    """`n` as a learned linear map along another axis than the hidden one, the same for every hidden coordinate, else
    None: an nn.Linear or F.linear over its input's last axis while the hidden axis is another (MLP-Mixer's token MLP
    on (B, C, T)), a Conv1d of kernel 1 whose positions are the hidden coordinates (CoaT's aggregate of its stacked
    class tokens, (B, 3, C)). Its weights do not grow. Without a bias it is linear: any fill passes; with one it is
    affine: W·mean + b is the mean of W·x + b, but W·0 + b is no zero (the mean fill, or replication)."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    xs, out = tensor_shape(x) if x is not None else None, tensor_shape(n)
    if xs is None or out is None or len(xs) != len(out) or not 0 <= axis < len(out):
        return None
    if xs[axis] != width or out[axis] != width or any(isinstance(a, fx.Node) for a in n.kwargs.values()):
        return None
    if n.op == "call_module" and len(n.args) == 1:
        m = gm.get_submodule(str(n.target))
        kernel_one = isinstance(m, nn.Conv1d) and (m.kernel_size, m.stride, m.dilation, m.groups) == (
            (1,),
            (1,),
            (1,),
            1,
        )
        linear = isinstance(m, nn.Linear) and axis < len(out) - 1  # over the last axis, the hidden one another
        if not (linear or (kernel_one and m.padding in ((0,), "valid") and axis == len(out) - 1)):
            return None
        bias = m.bias is not None
    elif n.op == "call_function" and n.target is F.linear and axis < len(out) - 1:
        given = [arg(n, 1, "weight"), arg(n, 2, "bias")]
        if not isinstance(given[0], fx.Node) or any(isinstance(a, fx.Node) and from_input(a) for a in given):
            return None  # a weight computed from the input may read the stream
        bias = given[1] is not None
    else:
        return None
    why = "maps each hidden coordinate alike along another axis (a Linear over the tokens)"
    why += ", with a bias: W·0 + b is no zero" if bias else ""
    return ChannelOp(x, axis, [], why=why, fills=("mean",) if bias else ())


GROUP_NORMS = (F.group_norm, torch.group_norm, torch.ops.aten.group_norm.default)


def one_group_norm(gm: fx.GraphModule, n: fx.Node, axis: int, width: int) -> ChannelOp | None:
    """`n` as a GroupNorm of one group over the channels (axis 1) and the map (PoolFormer-v2's norm: nn.GroupNorm(1, C)
    or F.group_norm(x, 1, γ, β)), else None. Its mean and variance run over every channel and position together:
    new channels equal to 0, or to the mean of the old channels at each position, change them (that mean's spread over
    the map is not the old channels'), while copies of the old channels keep them: replication only. Then each channel
    is scaled and shifted by its own γ and β, copied with it."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if n.op == "call_module" and isinstance(m := gm.get_submodule(str(n.target)), nn.GroupNorm):
        groups, path = m.num_groups, str(n.target)
        params = [(f"{path}.{k}", 0, kind) for k, kind in (("weight", "scale"), ("bias", "shift")) if m.affine]
    elif n.op == "call_function" and n.target in GROUP_NORMS:
        groups, params = arg(n, 1, "num_groups"), []
        for i, key, kind in ((2, "weight", "scale"), (3, "bias", "shift")):
            p = arg(n, i, key)
            if p is not None and not (isinstance(p, fx.Node) and p.op == "get_attr" and len(p.users) == 1):
                return None
            params += [(str(p.target), 0, kind)] if p is not None else []
    else:
        return None
    if groups != 1 or axis != 1 or x is None or (tensor_shape(x) or ())[1:2] != (width,) or len(n.args) > 5:
        return None
    why = "normalises the channels and the map together (a GroupNorm of one group): copies keep its statistics"
    return ChannelOp(x, 1, params, why=why, fills=("zero", "mean"))


MAX_POOL_MODULES = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)


AVG_POOL_MODULES = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def avg_pooled(gm: fx.GraphModule, n: fx.Node) -> fx.Node | None:
    """The input of `n` when `n` is an average pooling or a resize of a batched (N, C, …) map (AvgPoolNd, F.avg_poolNd:
    PoolFormer's token mixer pool(x) - x; F.interpolate, nn.Upsample, ATen's upsample ops: NaFlexViT's position
    table resized to the image), else None: each output is a fixed weighted sum of its channel's values (zero
    padding, with or without counting it), the same for every channel, so any fill of new channels passes."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if x is None or any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())):
        return None
    rank = len(tensor_shape(x) or ())
    if n.op == "call_module" and isinstance(m := gm.get_submodule(str(n.target)), AVG_POOL_MODULES):
        spatial = int(type(m).__name__[-2])
    elif n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.Upsample):
        spatial = rank - 2  # a resize of the map (nearest, linear, cubic): fixed weights, the same for every channel
    elif n.op == "call_function" and base_name(n) in ("avg_pool1d", "avg_pool2d", "avg_pool3d"):
        spatial = int(base_name(n)[-2])
    elif n.op == "call_function" and base_name(n) == "interpolate":
        spatial = rank - 2
    elif n.op == "call_function" and base_name(n).lstrip("_").startswith("upsample_") and "d" in base_name(n):
        digits = [c for c in base_name(n).split("d")[0][-1:] if c.isdigit()]  # upsample_bilinear2d, …bicubic2d_aa
        spatial = int(digits[0]) if digits else -1
    else:
        return None
    return x if rank == spatial + 2 >= 3 else None


def max_pooled(gm: fx.GraphModule, n: fx.Node) -> fx.Node | None:
    """The input of `n` when `n` is a max pooling of a batched map (module or function, without indices: MViTv2's
    pooled shortcut, NesT's pooling between levels), else None. Padding is -inf, so a zero channel pools to 0."""
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if x is None or any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())):
        return None
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        if not isinstance(m, MAX_POOL_MODULES) or m.return_indices:
            return None
        spatial = int(type(m).__name__[-2])  # MaxPool2d, AdaptiveMaxPool2d: 2
    elif base_name(n) in ops.MAX_POOLS and not arg(n, 2 if "adaptive" in base_name(n) else 6, "return_indices", False):
        spatial = int(base_name(n)[-2])
    else:
        return None
    return x if len(tensor_shape(x) or ()) == spatial + 2 else None


def gate_factor(gm: fx.GraphModule, p: fx.Node, out: tuple, axis: int, width: int) -> list[tuple[str, int, str]] | None:
    """The parameters of a Linear whose output, through an elementwise function (probed: stream_regions.region),
    is `p`, a gate on the stream made for this product alone: AXK2's gated norm `norm(x) · σ(fc2(act(fc1(norm(x)))))`.
    Its new rows give the gate's new coordinates, which multiply the stream's new coordinates, 0: any value is exact
    (they start as the mean of the old rows and learn once the stream's new coordinates move)."""
    if len(p.users) != 1 or tensor_shape(p) != out or axis != len(out) - 1:
        return None
    found = region(p) if p.op in ("call_function", "call_method") else None
    root = found[0] if found is not None else p
    if root.op == "call_module" and type(gm.get_submodule(root.target)) in GATE_MODULES and len(root.args) == 1:
        root = root.args[0]  # type: ignore[assignment]  # σ as a module (checked to be a Node below)
    if not isinstance(root, fx.Node):
        return None
    if tensor_shape(root) != out or len(root.users) != 1:
        return None
    if root.op == "call_module" and isinstance(m := gm.get_submodule(root.target), nn.Linear):
        return [(f"{root.target}.{k}", 0, "scale") for k in ("weight", "bias") if getattr(m, k) is not None]
    if root.op == "call_function" and root.target is F.linear:
        given = [arg(root, 1, "weight"), arg(root, 2, "bias")]
        if all(a is None or (isinstance(a, fx.Node) and a.op == "get_attr" and len(a.users) == 1) for a in given):
            return [(str(a.target), 0, "scale") for a in given if isinstance(a, fx.Node)]
    return None


def _functional_depthwise(n: fx.Node, axis: int, width: int) -> ChannelOp | None:
    """F.conv1d(x, w, b, …, groups=width) with w a parameter of `width` filters, read directly or through unit views
    (Inkling's causal short conv: `conv1d(x, weight.squeeze(1).unsqueeze(1), None, 1, k - 1, 1, d)`): a filter per
    channel, as a depthwise conv module."""
    x, groups = n.args[0] if n.args else None, n.args[6] if len(n.args) > 6 else n.kwargs.get("groups", 1)
    if axis != 1 or width < 2 or groups != width or not isinstance(x, fx.Node):
        return None
    if (tensor_shape(x) or ())[1:2] != (width,) or (tensor_shape(n) or ())[1:2] != (width,):
        return None
    params = []
    for i, key, kind in ((1, "weight", "scale"), (2, "bias", "shift")):
        p = n.args[i] if len(n.args) > i else n.kwargs.get(key)
        if p is None and kind == "shift":
            continue
        found = _filter_parameter(p, width) if isinstance(p, fx.Node) else None
        if found is None:
            return None
        params.append((found, 0, kind))
    return ChannelOp(x, 1, params, groups=True)


def _filter_parameter(p: fx.Node, width: int) -> str | None:
    """The parameter behind `p` when `p` is it, or it through views of unit dims other than the first (whose size is
    `width`, one filter per channel), each read by the next alone."""
    node = p
    while node.op != "get_attr":
        x = node.args[0] if node.args else None
        if len(node.users) != 1 or not isinstance(x, fx.Node) or not _unit_view(node):
            return None
        if (tensor_shape(node) or (0,))[0] != width or (tensor_shape(x) or (0,))[0] != width:  # the filters stay first
            return None
        node = x
    shape = tensor_shape(node)
    return str(node.target) if len(node.users) == 1 and shape and shape[0] == width else None


def channel_factor(
    gm: fx.GraphModule, p: fx.Node, rank: int, axis: int, width: int
) -> tuple[str, int, tuple[str, ...]] | None:
    """(parameter path, its dim along the stream, the reads between) when `p`, of the hidden size on one dim and 1 on
    the others, broadcast onto the stream's axis `axis` of a rank-`rank` product, is a parameter's entries along its
    one dim of the hidden size: read directly, or through unit dims added (unsqueeze, [:, None, None]), casts,
    transposes, elementwise functions (nGPT's |λ · s|, EfficientViM's sigmoid) and integer selections along its other
    dims (EfficientViM's residual weights, sigmoid(alpha).view(4, -1, 1, 1)[i]: one row of a (4, C) parameter each).
    Entry c of `p` is then a function of the parameter's entry c alone (along that dim), so the parameter grows along
    it; shared_factors checks that every read of it scales the stream."""
    shape = tensor_shape(p)
    if shape is None or len(shape) > rank:
        return None
    k = axis - (rank - len(shape))
    if k < 0 or shape[k] != width or any(d != 1 for i, d in enumerate(shape) if i != k):
        return None
    node, via = p, []
    while node.op != "get_attr":
        step = _factor_step(node, width)
        if step is None:
            return None
        node, nodes = step
        via += nodes
    at = [i for i, d in enumerate(tensor_shape(node) or ()) if d == width]  # the one dim the entries run along
    if len(at) != 1:
        return None
    return str(node.target), at[0], tuple(v.name for v in via)


def _factor_step(n: fx.Node, width: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the tensor `n` reads, the nodes from it to `n`) when `n` keeps each entry along the one dim of size `width`
    apart: a unit view, a cast or a transpose, an elementwise function (probed: stream_regions.region), an integer
    selection along another dim (x[i], x[:, i], select, a piece of unbind, chunk or split along another dim)."""
    if n.op not in ("call_function", "call_method") or not n.args:
        return None
    x = n.args[0]
    if base_name(n) == "getitem" and isinstance(x, fx.Node) and base_name(x) in ops.SPLITS:  # a piece of x.unbind(0)
        source, dim = (
            x.args[0] if x.args else None,
            arg(x, 1, "dim", 0) if base_name(x) == "unbind" else arg(x, 2, "dim", 0),
        )
        shape = tensor_shape(source) if isinstance(source, fx.Node) else None
        if shape is None or not isinstance(dim, int) or shape[dim] == width or not isinstance(n.args[1], int):
            return None
        return source, [x, n]  # type: ignore[return-value]
    if not isinstance(x, fx.Node) or any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())):
        found = region(n)
        return (found[0], found[1]) if found is not None and found[0].op == "get_attr" else None
    shape = tensor_shape(x)
    if shape is None:
        return None
    if _unit_view(n) or base_name(n) in ops.TRANSPOSES:
        return x, [n]
    if base_name(n) == "select":
        dim = arg(n, 1, "dim")
        return (x, [n]) if isinstance(dim, int) and shape[dim] != width else None
    if base_name(n) == "getitem":
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        if Ellipsis in index or any(not (isinstance(i, int) or i is None or i == slice(None)) for i in index):
            return None
        dims = [i for i in index if i is not None]
        picked = [d for d, i in enumerate(dims) if isinstance(i, int)]
        return (x, [n]) if all(shape[d] != width for d in picked) else None
    found = region(n)
    if found is not None:
        return found[0], found[1]
    return (x, [n]) if one_op(n) is x else None


def shared_factors(gm: fx.GraphModule, factors: list[tuple[str, str, tuple[str, ...] | None]]) -> str | None:
    """A per-channel factor parameter that the graph reads other than to scale the stream: the node of such a read,
    else None. `factors`: (parameter path, the product on the stream, the reads between them or None where they are
    not known) once per product. Every read must scale the stream: growing the parameter would break one that does
    not. Where the reads are known, each of them (and each read of the parameter) is read only by them or by the
    products; else the parameter is read at most once per product."""
    reads = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    for path in {f[0] for f in factors}:
        mine = [f for f in factors if f[0] == path]
        if any(f[2] is None for f in mine):
            n = reads.get(path)
            if n is not None and len(n.users) > len(mine):
                return n.name
            continue
        inside = {v for f in mine for v in f[2]} | {f[1] for f in mine}  # type: ignore[union-attr]
        for n in gm.graph.nodes:
            if (n.op == "get_attr" and str(n.target) == path) or (
                n.name in inside and n.name not in {f[1] for f in mine}
            ):
                stray = next((u for u in n.users if u.name not in inside), None)
                if stray is not None:
                    return n.name
    return None


def _sized_views(p: fx.Node, width: int) -> list[tuple[str, int]]:
    """The reshapes between a factor parameter and `p` (its read, through unit views) that write the width as a size
    (gamma.view(1, 320, 1, 1)): (node, the width's place), for the rewrite to write the new width there."""
    found, node = [], p
    while node.op != "get_attr" and node.args and isinstance(node.args[0], fx.Node):
        if base_name(node) in ops.RESHAPES:
            sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
            found += [(node.name, i) for i, d in enumerate(sizes) if d == width][:1]
        node = node.args[0]
    return found


def _unit_view(n: fx.Node) -> bool:
    """Unit dims added or a cast, nothing else: unsqueeze, indexing by None and full slices, to(dtype), float(), a
    reshape or view that only adds or drops dims of size 1 (γ.reshape(1, -1, 1, 1): ConvNeXt's layer scale)."""
    name = base_name(n)
    if name in ops.RESHAPES and n.args and isinstance(n.args[0], fx.Node):
        sizes = n.args[1:] if not (len(n.args) == 2 and isinstance(n.args[1], (list, tuple))) else n.args[1]
        shape, source = tensor_shape(n), tensor_shape(n.args[0])
        numbers = all(isinstance(d, int) for d in sizes) and sum(d == -1 for d in sizes) <= 1
        wide = [d for d in shape or () if d != 1]
        return bool(numbers and shape is not None and source is not None and wide == [d for d in source if d != 1])
    if name in ("unsqueeze", "squeeze", "to", "float", "contiguous"):
        return not any(isinstance(a, fx.Node) and tensor_shape(a) is not None for a in list(n.args[1:]))
    if name != "getitem" or len(n.args) < 2:
        return False
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    return all(i is None or i is Ellipsis or i == slice(None) for i in index)
