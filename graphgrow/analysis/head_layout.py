"""Factor layouts for attention growth (analysis.heads): how the head count and head size sit in each tensor's
axes between an attention's projections and the attention, and which reshape constants name them.

Each axis is a list of factors, outermost first: `s` (q/k/v sections of a fused projection), `h` (key/value heads),
`r` (query heads per key/value head), `d` (query/key head size), `e` (value head size), or "" (anything else: batch,
tokens, a factor that does not grow). Growing factors must stay whole through every op; fixed ones may split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph import ops
from ..graph.fx_edit import tensor_shape

Factor = tuple[str, int]  # (name, size); name "" is an anonymous factor (batch, tokens, a factor that does not grow)
Axis = tuple[Factor, ...]
Layout = tuple[Axis, ...]
HEAD_FACTORS = ("h", "r")
SDPA = F.scaled_dot_product_attention
SAME = ops.SAME_VALUES | {"dropout", "neg", "detach"}  # one data operand, same layout
ELEMENTWISE = ops.BINARY_NAMES | ops.IN_PLACE_OPERATORS | ops.SELECTS | {"pow"}
# one data operand, each output element from its input element: a norm written out (x · (mean(x²) + eps)^-½)
POINTWISE = ops.UNARY_METHODS | {"rsqrt", "sqrt", "reciprocal", "square", "silu", "gelu", "softplus"}
# statistics over axes (a norm written out): exact under growth when no reduced axis grows
REDUCE = ops.AXIS_STATISTICS
# ops whose factor layout rules Flow knows: expand_as, the *_as reshapes and the other reorderings are not among them
LAYOUT = (
    ops.RESHAPES
    | ops.FLATTENS
    | ops.TRANSPOSES
    | ops.UNIT_DIMS
    | ops.SPLITS
    | ops.INDEXING
    | ops.RESHAPES_AS
    | ops.TILES
    | {"expand", "cat", "stack", "view_as_complex", "view_as_real"}
)
# a tensor allocated and then filled by copies into slices of one axis (multi-head latent attention's key:
# `k = x.new_empty(…); k[..., :n] = k_nope; k[..., n:] = k_rope`): the same values as a concatenation of the copies
ALLOCATIONS = frozenset({"new_empty", "new_zeros", "empty", "zeros"})
WRITES = frozenset({"copy_", "setitem"})
NORMS = ops.NORMS
SHAPE_QUERIES = ops.SHAPE_QUERIES
HINT = (
    "grow_heads grows attentions it fully understands (scaled_dot_product_attention or softmax(q @ kᵀ) @ v fed by "
    "projections: Linear layers or convolutions of one group)"
)


@dataclass
class FactorEdit:
    """A literal size in a reshape/view/split that is a product of head-layout factors (heads × head size …): the
    attention growth rewrites it to the product of the grown factors. (Not coupling's ChannelEdit, which marks an op
    whose constants follow a channel group.)"""

    node: str
    where: tuple  # ("args", i[, j]): the constant's place in the node's arguments
    old: int
    factors: Axis  # the constant is the product of these factors' sizes
    via: int | None = None  # the value at `where` is mul(size, c): c (at this position of the mul) is the constant
    infer: bool = False  # the value is computed (C read from an input's shape): it becomes -1, the one size inferred


def _name(n: fx.Node) -> str:
    if n.op == "call_module":
        return f"module {n.target}"
    if isinstance(n.target, torch._ops.OpOverload):  # an ATen op a capture left in the graph: its packet's name
        return n.target.overloadpacket.__name__
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def refuse(n: fx.Node, why: str, hint: str = HINT) -> NotApplicable:
    return NotApplicable(f"attention growth reaches '{n.name}' ({_name(n)}), which {why}", hint)


def op_kind(gm: fx.GraphModule, n: fx.Node) -> str | None:
    """The op's kind by name (module type for call_module), or None for an op no layout rule covers. "linear": a
    projection, a learned linear map over the channel axis (conv_channels says which axis)."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if isinstance(m, (nn.Identity, nn.Dropout)) or type(m).__name__ in ("DropPath", "StochasticDepth"):
            return "same"
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            return "norm"
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return "channelnorm"
        return "linear" if isinstance(m, nn.Linear) or conv_channels(gm, n) is not None else None
    if n.op not in ("call_method", "call_function"):
        return None
    name = _name(n)
    if n.op == "call_function" and (n.target is F.linear or conv_channels(gm, n) is not None):
        return "linear"
    if n.op == "call_function" and n.target is F.normalize:
        return "channelnorm"
    if name in ALLOCATIONS:
        return "alloc"
    if name in POINTWISE - SAME:
        return "pointwise"
    if name in ops.BOUNDS and all(not isinstance(a, fx.Node) for a in [*n.args[1:], *n.kwargs.values()]):
        return "pointwise"  # bounded by numbers
    if name in REDUCE:
        return "reduce"
    if name in WRITES:
        return "write"
    for kind, names in (("same", SAME), ("elementwise", ELEMENTWISE), ("layout", LAYOUT), ("norm", NORMS)):
        if name in names:
            return kind
    return None


_LINEAR_ARGS = ("input", "weight", "bias")
CONVS = (F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d)


def conv_facts(gm: fx.GraphModule, n: fx.Node) -> tuple[int, int] | None:
    """(spatial dims, groups) of a convolution node (an nn.ConvNd module, not transposed, or F.convNd on a
    weight of known shape), else None."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if not isinstance(m, nn.modules.conv._ConvNd) or m.transposed:
            return None
        return m.weight.dim() - 2, int(m.groups)
    if n.op != "call_function" or n.target not in CONVS:
        return None
    w = tensor_shape(linear_arg(n, 1)) if isinstance(linear_arg(n, 1), fx.Node) else None
    groups = n.args[6] if len(n.args) > 6 else n.kwargs.get("groups", 1)
    if w is None or not isinstance(groups, int):
        return None
    return len(w) - 2, groups


def conv_channels(gm: fx.GraphModule, n: fx.Node) -> int | None:
    """The channel axis (negative, from the end) of a convolution that is a projection: each output channel a learned
    linear map of every input channel (groups 1: new output channels leave the old ones as they are, new input
    channels are columns of their own); None for anything else, a grouped or depthwise conv among them
    (conv_blocks says why)."""
    facts = conv_facts(gm, n)
    return -(facts[0] + 1) if facts is not None and facts[1] == 1 else None


def transposed_reader(gm: fx.GraphModule, n: fx.Node) -> int | None:
    """The channel axis (negative) of a transposed convolution module of one group: each output channel a learned
    linear map of every input channel, so it reads heads as an output projection does (LowFormer's upsampling with the
    output projection folded in), its input channels its weight's first axis; None for anything else."""
    m = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
    if not isinstance(m, nn.modules.conv._ConvTransposeNd) or m.groups != 1:
        return None
    return -(m.weight.dim() - 1)


def channel_axis(gm: fx.GraphModule, n: fx.Node) -> int:
    """The axis of a projection's input and output features: the last for a Linear, the channels (dim 1, counted from
    the end) for a convolution."""
    return conv_channels(gm, n) or -1


def channels_laid(gm: fx.GraphModule, n: fx.Node, factors: Axis) -> Layout:
    """The layout of projection `n`'s output: `factors` on its channel axis, every other axis plain."""
    shape = tensor_shape(n)
    lay = list(plain(shape))
    lay[channel_axis(gm, n)] = factors
    return tuple(lay)


def channel_norm(flow, n: fx.Node) -> Layout:
    """A BatchNorm module on the way (a projection's conv + BN, timm's ConvNorm): each channel (dim 1) is normalised
    alone, with statistics over the other axes, so heads on its channels grow with entries of their own (new heads'
    weight 1, bias 0, running mean 0, running variance 1: their outputs enter the output projection through zero
    columns). Refused where a growing factor sits on an axis it takes statistics over, or where the head size grows
    (the query's old rows are rescaled then, which the norm would undo). F.normalize (an Lp norm over one axis, each
    row apart: XCiT's and EdgeNeXt's query and key over the positions): exact where that axis does not grow."""
    lay = flow.of(n.args[0])
    if n.op == "call_function":
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 1)
        if not isinstance(dim, int) or flow.grows(lay[dim % len(lay)]):
            raise refuse(n, "normalises over an axis that grows (its heads or head size)")
        return lay
    if any(flow.grows(ax) for i, ax in enumerate(lay) if i != 1):
        raise refuse(n, "normalises with statistics over an axis that holds heads or head size (not its channels)")
    if not flow.grows(lay[1]):
        return lay
    if any(f in flow.growing and f not in HEAD_FACTORS for f, _ in lay[1]):
        raise refuse(
            n,
            f"normalises each channel of a growing head size ({words(lay[1])}): the query's rescaled rows would be "
            "normalised back, so the head size cannot grow exactly",
            "grow heads instead (heads=…)",
        )
    m = flow.gm.get_submodule(str(n.target))
    for part, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
        if getattr(m, part, None) is not None:
            flow.params.append((f"{n.target}.{part}", 0, lay[1], fill))
    return lay


def conv_blocks(gm: fx.GraphModule, n: fx.Node) -> str | None:
    """Why a convolution is not a projection whose output channels can grow by heads (a grouped or depthwise conv:
    each output channel reads only its group's inputs, so new ones would change which group the old ones are in);
    None for any other op."""
    m = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        return (
            f"is a transposed convolution ({type(m).__name__}, its weight's input channels first): the analysis does "
            "not grow it as a projection (new heads would be rows of its weight's first axis)"
        )
    facts = conv_facts(gm, n)
    if facts is None or facts[1] == 1:
        return None
    return (
        f"is a grouped convolution ({facts[1]} groups): each output channel reads only its group's input channels, so "
        "new heads' channels would move old channels into other groups (or need groups of their own)"
    )


def linear_arg(n: fx.Node, i: int):
    """Argument `i` (0 input, 1 weight, 2 bias) of an nn.Linear call or F.linear call, given by position or by
    name: timm's BEiT calls F.linear(x, weight=…, bias=…)."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(_LINEAR_ARGS[i])


def data_args(n: fx.Node) -> list[fx.Node]:
    """The operands that carry data into op `n` (not dtype donors, not sizes; an allocation's: what is copied
    into it)."""
    if _name(n) in ALLOCATIONS and n.op != "call_module":
        filled = writes(n)
        return [w.source for w in filled[1]] if filled else []
    if _name(n) in ("to", "type_as", "expand", "reshape", "view") or n.op == "call_module":
        return [n.args[0]] if n.args and isinstance(n.args[0], fx.Node) else []
    if _name(n) in ("cat", "stack"):
        return [a for a in n.args[0] if isinstance(a, fx.Node)]
    if _name(n) in ELEMENTWISE:
        return [
            a
            for a in n.args[: 3 if _name(n) in ops.SELECTS else 2]
            if isinstance(a, fx.Node) and tensor_shape(a) is not None
        ]
    return [n.args[0]] if n.args and isinstance(n.args[0], fx.Node) else []


@dataclass
class Write:
    """One copy into an allocated tensor: `source` copied into its slice `start:stop` (by `node`, a copy_ into the
    slice `views[-1]`, or a setitem on the allocation itself: then `views` is empty)."""

    start: int
    stop: int
    views: tuple[fx.Node, ...]  # the slice copied into: a chain of slices, one axis each, as torch.export writes
    node: fx.Node
    source: fx.Node


def one_axis_slice(index, shape: tuple) -> tuple[int, int, int] | None:
    """(axis, start, stop) when `index` keeps every axis of `shape` whole but one, cut by a slice of step 1."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        return None
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(shape) - len(index) + 1) + index[k + 1 :]
    if len(index) > len(shape) or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
        return None
    index = index + (slice(None),) * (len(shape) - len(index))
    cut = [(d, *i.indices(shape[d])[:2]) for d, i in enumerate(index) if i.indices(shape[d])[:2] != (0, shape[d])]
    return cut[0] if len(cut) == 1 else (len(shape) - 1, 0, shape[-1]) if not cut else None


def _slice_chain(u: fx.Node, shape: tuple) -> tuple[tuple[int, int, int] | None, tuple[fx.Node, ...]] | None:
    """(the cut, the slices) when `u` starts a chain of slices (each read only by the next) ending in a copy_ into
    the last; the cut: (axis, start, stop) of the one axis they cut (None: more than one)."""
    views, cut = [u], (len(shape) - 1, 0, shape[-1])
    while True:
        v = views[-1]
        if _name(v) != "getitem" or len(v.users) != 1 or v.args[0] is not (views[-2] if len(views) > 1 else v.args[0]):
            return None
        step = one_axis_slice(v.args[1], shape)
        if step is None:
            return None
        if step[1:] != (0, shape[step[0]]):  # a cut: of one axis, once
            if cut[1:] != (0, shape[cut[0]]):
                return None, tuple(views)
            cut = step
            shape = shape[: step[0]] + (step[2] - step[1],) + shape[step[0] + 1 :]
        (user,) = v.users
        if _name(user) == "copy_" and user.args[0] is v:
            return cut, tuple(views)
        views.append(user)


def writes(alloc: fx.Node) -> tuple[int, list[Write]] | None:
    """(the axis, the writes in its order) when allocated tensor `alloc` is filled by copies into slices of one axis
    (`k[..., :n].copy_(a)`, `k[..., :n] = a`) that tile it, before anything else reads it; else None."""
    shape = tensor_shape(alloc)
    if shape is None:
        return None
    order = {m: i for i, m in enumerate(alloc.graph.nodes)}
    found, readers = [], []
    views: tuple[fx.Node, ...]
    for u in alloc.users:
        if _name(u) == "setitem" and u.args[0] is alloc and len(u.args) == 3:
            cut, views, node, source = one_axis_slice(u.args[1], shape), (), u, u.args[2]
        elif _name(u) == "getitem" and (chain := _slice_chain(u, shape)) is not None:
            cut, views = chain
            node = next(iter(views[-1].users))
            source = node.args[1]
        else:
            readers.append(u)
            continue
        if cut is None or not isinstance(source, fx.Node):
            return None
        found.append((cut, Write(cut[1], cut[2], views, node, source)))
    if not found or len({cut[0] for cut, _ in found}) != 1:
        return None
    ws = sorted((w for _, w in found), key=lambda w: w.start)
    dim, at = found[0][0][0], 0
    for w in ws:
        if w.start != at:
            return None
        at = w.stop
    last = max(order[w.node] for w in ws)
    if at != shape[dim] or any(order[r] < last for r in readers):
        return None
    return dim, ws


def broadcasts(n: fx.Node) -> bool:
    """`n` is an expand that repeats a size-1 axis: its values are the same along that axis (a part shared by every
    head, as multi-head latent attention's rotary key)."""
    if _name(n) not in ("expand", "expand_as") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    src, out = tensor_shape(n.args[0]), tensor_shape(n)
    if src is None or out is None:
        return False
    lead = len(out) - len(src)
    return any(j < lead and s > 1 or j >= lead and src[j - lead] == 1 and s > 1 for j, s in enumerate(out))


def canon(axis: Axis, growing: set[str]) -> tuple:
    """An axis with its fixed factors merged (what must agree where two tensors meet)."""
    out: list = []
    for name, size in axis:
        if name in growing:
            out.append((name, size))
        elif size > 1:
            out.append(("", out.pop()[1] * size) if out and out[-1][0] == "" else ("", size))
    return tuple(out)


def size_of(axis: Axis) -> int:
    return math.prod(s for _, s in axis)


def plain(shape: tuple) -> Layout:
    return tuple(((("", s),) if s != 1 else ()) for s in shape)


_FACTOR_WORDS = {
    "h": "heads",
    "r": "query heads per key/value head",
    "d": "head size",
    "e": "value head size",
    "s": "q/k/v sections",
}


def words(axis: Axis) -> str:
    return " × ".join(f"{_FACTOR_WORDS.get(f, 'other')} {s}" for f, s in axis) or "size 1"
