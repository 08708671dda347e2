"""Channel-coupling groups over an fx graph (networkx).

Widening a layer's output changes every tensor that shares its channel dimension.
Each tensor node is a vertex; an edge joins two tensors whose channel dimensions must
stay equal (through BatchNorm, activations, pooling, elementwise ops, residual
add/mul, depthwise convs). A connected component is a *group*. Tensors derived from
a group at an offset (a `cat` along channels) or at a scale (a `flatten` of a
feature map) are *links* to other groups. Layers that create channels (conv, Linear)
are a group's *sources*; layers that read them (their in_channels) its *consumers*.
Anything the analysis does not understand *freezes* the groups it touches, with the
reason, so that passes refuse instead of guessing.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import torch
import torch.nn.functional as F
from torch import fx, nn

from ..graph.fx_edit import tensor_shape
from ..graph.graph_meta import input_spec_of
from ..graph.layers import AverageMerge
from ..graph.shapes import annotate
from ..io.mode_switch import ModeSwitch
from .axes import (  # noqa: F401 (channel_axis and BATCHNORMS are read through this module)
    across_axis, assign_channel_axes, BATCHNORMS, channel_axis, CHANNELWISE_FUNCTIONS, CHANNELWISE_METHODS, CHANNELWISE_MODULES,
    ELEMENTWISE, ELEMENTWISE_METHODS, flatten_keeps_axis, moved_axis, node_axis, reduced_axis, SHAPE_QUERIES,
)
from . import growth
from .coupling_layers import Functional, layer_rule
from .coupling_splits import Edit, literal_at, split_rule
from .opaque import slice_keeps_channels, switch_is_channelwise
from .probe import function_is_channelwise, module_is_channelwise

@dataclass
class Link:
    """Channels of `dst` that are channels of `src`: for j < repeat, src channel c is dst channels
    offset + j·stride + c·scale + q (q < scale). A cat input (offset), a flatten (scale), a slice or a split
    piece (src is the piece), a reshape that splits the channel axis into blocks (repeat, stride)."""

    src: str  # member node of the source group
    dst: str  # member node of the derived group
    offset: int
    scale: int  # features per channel (flatten of H×W maps gives H·W)
    repeat: int = 1
    stride: int = 0


@dataclass
class Group:
    id: int
    size: int
    members: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # conv/Linear nodes whose output is in the group
    consumers: list[str] = field(default_factory=list)  # conv/Linear nodes whose input is in the group
    channelwise: list[str] = field(default_factory=list)  # BatchNorm / LayerNorm / depthwise conv nodes to resize with it
    frozen: list[str] = field(default_factory=list)  # why it cannot grow
    norms: list[str] = field(default_factory=list)  # LayerNorms over these channels: only uniform replication is exact
    tensors: list[str] = field(default_factory=list)  # per-channel parameters/buffers read by get_attr (layer scale, norm affine)
    blocks: int = 1  # channels tied to this many equal blocks (grouped convs): each must gain the same number
    block_reasons: list[str] = field(default_factory=list)
    attentions: list[str] = field(default_factory=list)  # attentions whose head size these channels are (coupling_layers)
    unit: int = 1  # channels per GroupNorm group: new channels must form whole new groups (growth.step)

    @property
    def growable(self) -> bool:
        return not self.frozen and bool(self.sources)

    def to_json(self) -> dict:
        return {"id": self.id, "channels": self.size, "members": self.members, "sources": self.sources,
                "consumers": self.consumers, "channelwise": self.channelwise, "frozen": self.frozen,
                "norms": self.norms, "tensors": self.tensors, "blocks": self.blocks, "attentions": self.attentions}


@dataclass
class Coupling:
    groups: list[Group]
    group_of: dict[str, int]  # tensor node → group id
    links: list[Link]
    edits: list[Edit] = field(default_factory=list)  # ops whose constants follow the channels (slices, splits, reshapes)
    steps: dict[int, tuple[int, list[str]]] = field(default_factory=dict)  # growth.step's answers, per group
    spread: dict[int, int] = field(default_factory=dict)  # growth.step's blocks (new channels at the end of each)
    functional: dict[str, Functional] = field(default_factory=dict)  # F.linear / F.conv nodes on parameters
    tensor_axes: dict[str, int] = field(default_factory=dict)  # a tensor's channel dim, where it is not its only one

    def group(self, node: str) -> Group:
        return self.groups[self.group_of[node]]

    def why_frozen(self, gid: int) -> list[str]:
        """Reasons a growth of group `gid` cannot happen: its own, those of every group the growth reaches
        through links, and links that cannot agree on where the new channels go."""
        return growth.step(self, gid)[1]

    def step(self, gid: int) -> int:
        """Group `gid` grows by multiples of this (the blocks of grouped convs and channel splits it reaches, times
        whole GroupNorm groups)."""
        return growth.step(self, gid)[0]

    def reached(self, gid: int) -> list[int]:
        """Group `gid` and every group a growth of it changes (through links, both ways)."""
        b = self.step(gid)
        try:
            found = growth.propagate(self, gid, growth.root_insertions(self.groups[gid].size, b, self.spread.get(gid, b), None))
        except growth.Conflict:
            return [gid]
        return [gid] + [g for g in found.insertions if g != gid]

    def norms_reached(self, gid: int) -> list[str]:
        return [n for g in self.reached(gid) for n in self.groups[g].norms]


def analyze(gm: fx.GraphModule) -> Coupling:
    """Build the coupling groups of a GraphModule (annotated here first when shapes.annotate has not run:
    from the example input it was traced with; InputError when it has none)."""
    if not any("gg_shape" in n.meta for n in gm.graph.nodes):
        annotate(gm, input_spec_of(gm))
    g = nx.Graph()
    frozen: dict[str, list[str]] = {}
    sources: list[tuple[str, str | None]] = []
    consumers: list[tuple[str, str]] = []
    channelwise: list[str] = []
    norms: list[str] = []
    tensors: list[tuple[str, str]] = []  # (attribute path, group member that reads it per channel)
    attr_tensors: list[tuple[str, str]] = []
    functional: dict[str, Functional] = {}
    attentions: list[tuple[str, str]] = []  # (attention node, member of the group it marks)
    units: dict[str, int] = {}  # GroupNorm node → channels per group
    assign_channel_axes(gm)
    links: list[Link] = []
    edits: list[Edit] = []
    blocks: dict[str, list[tuple[int, str]]] = {}  # node → (block count, why)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1

    def vertex(n) -> str | None:
        if isinstance(n, fx.Node) and n.op != "output" and node_axis(n) is not None:
            g.add_node(n.name)
            return n.name
        return None

    def freeze(nodes, reason: str) -> None:
        for n in nodes:
            v = vertex(n)
            if v is not None:
                frozen.setdefault(v, []).append(reason)

    def join(*nodes) -> None:
        vs = [vertex(n) for n in nodes]
        vs = [v for v in vs if v is not None]
        for a, b in zip(vs, vs[1:]):
            g.add_edge(a, b)

    def link(src, dst, offset: int, repeat: int = 1, stride: int = 0, scale: int = 1) -> None:
        if vertex(src) is None or vertex(dst) is None:
            freeze([src, dst], f"'{dst.name}' takes channels from '{src.name}' without a channel axis on both sides")
            return
        links.append(Link(src.name, dst.name, offset, scale, repeat, stride))

    def block(node, count: int, why: str) -> None:
        if vertex(node) is not None:
            blocks.setdefault(node.name, []).append((count, why))

    for n in gm.graph.nodes:
        out = vertex(n)
        tensor_inputs = [a for a in n.all_input_nodes if vertex(a) is not None]
        if n.op == "placeholder":
            freeze([n], "it is the model's input")
        elif n.op == "output":
            freeze(tensor_inputs, "it is the model's output")
        elif n.op == "get_attr" and out is not None:  # a tensor on the stream (class token, position table) grows
            attr_tensors.append((str(n.target), n.name))  # with its group along its channel dim, once joined to one
        elif n.op == "call_module":
            if calls[n.target] > 1 and any(True for _ in modules[n.target].parameters()):
                freeze(tensor_inputs + [n], f"module '{n.target}' is called {calls[n.target]} times (shared weights)")
                continue
            _module_rule(n, modules[n.target], out, tensor_inputs, join, freeze, sources, consumers, channelwise, links, norms, block, units)
        elif n.op in ("call_function", "call_method") and not split_rule(n, out, join, freeze, link, edits) and \
                not layer_rule(n, out, join, freeze, sources, consumers, functional, attentions, gm, (tensors, units, edits)):
            _function_rule(gm, n, out, tensor_inputs, join, freeze, links, norms, tensors, edits)

    groups: list[Group] = []
    group_of: dict[str, int] = {}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for comp in sorted(nx.connected_components(g), key=lambda c: min(order[v] for v in c)):
        members = sorted(comp, key=order.__getitem__)
        first = next(n for n in gm.graph.nodes if n.name == members[0])
        size = tensor_shape(first)[node_axis(first)]
        grp = Group(len(groups), size, members)
        for v in members:
            group_of[v] = grp.id
            grp.frozen += [f"'{v}': {r}" for r in frozen.get(v, [])]
            for count, why in blocks.get(v, []):
                grp.blocks = growth.lcm(grp.blocks, count)
                grp.block_reasons.append(why)
            grp.unit = growth.lcm(grp.unit, units.get(v, 1))
        groups.append(grp)
    for name, _ in sources:
        groups[group_of[name]].sources.append(name)
    for name, inp in consumers:
        groups[group_of[inp]].consumers.append(name)
    for name in channelwise:
        groups[group_of[name]].channelwise.append(name)
    for name in norms:
        groups[group_of[name]].norms.append(name)
    by_name = {n.name: n for n in gm.graph.nodes}
    joined = [(path, member) for path, member in attr_tensors if len(groups[group_of[member]].members) > 1]
    tensors += joined
    tensor_axes = {path: node_axis(by_name[member]) for path, member in joined}
    for path, member in tensors:
        if path not in groups[group_of[member]].tensors:
            groups[group_of[member]].tensors.append(path)
    for node, member in attentions:
        groups[group_of[member]].attentions.append(node)
    _freeze_shared_tensors(gm, groups, group_of, tensors)
    return Coupling(groups, group_of, links, edits, functional=functional, tensor_axes=tensor_axes)


def _freeze_shared_tensors(gm, groups, group_of, tensors) -> None:
    """A per-channel tensor read anywhere but its per-channel uses cannot be resized for one group."""
    uses: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            uses[n.target] = uses.get(n.target, 0) + 1
    per_channel: dict[str, set[int]] = {}
    for path, member in tensors:
        per_channel.setdefault(path, set()).add(group_of[member])
    for path, gids in per_channel.items():
        if len(gids) > 1 or uses.get(path, 0) > sum(1 for p, _ in tensors if p == path):
            for gid in gids:
                groups[gid].frozen.append(f"parameter '{path}' is also read elsewhere; resizing it would change that use")


def _module_rule(n, m, out, inputs, join, freeze, sources, consumers, channelwise, links, norms, block, units) -> None:
    x = inputs[0] if inputs else None
    if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
        if m.groups > 1 and m.groups == m.in_channels == m.out_channels:  # depthwise: channel c → channel c
            join(x, n)
            channelwise.append(n.name)
            return
        sources.append((n.name, None))
        if x is not None:
            consumers.append((n.name, x.name))
        if m.groups > 1:  # each group of inputs and of outputs grows by the same number of channels
            why = f"grouped conv '{n.target}' (groups={m.groups})"
            block(n, m.groups, why)
            if x is not None:
                block(x, m.groups, why)
    elif isinstance(m, nn.Linear) and x is not None and across_axis(n) is not None:
        join(x, n)  # it maps another axis (tokens) with the same weights for every channel: channel c stays c
    elif isinstance(m, nn.Linear):
        if x is not None and node_axis(x) != len(tensor_shape(x)) - 1:  # and no tracked axis says where channels are
            freeze([x, n], f"Linear '{n.target}' reads a non-channel axis")
        if x is not None:
            consumers.append((n.name, x.name))
        sources.append((n.name, None))
    elif isinstance(m, BATCHNORMS) and _extras_are_channelwise(m, tensor_shape(n)):
        # a subclass (timm's BatchNormAct2d) = BatchNorm followed by its own channelwise extras
        join(x, n)
        channelwise.append(n.name)
    elif isinstance(m, nn.modules.instancenorm._InstanceNorm) and not m.affine and not m.track_running_stats:
        join(x, n)
    elif isinstance(m, CHANNELWISE_MODULES) or (isinstance(m, nn.Flatten) and _flatten_is_identity(x, n)):
        join(x, n)
    elif isinstance(m, nn.Flatten):
        _flatten_rule(x, n, join, freeze, links)
    elif type(m) in (nn.LayerNorm, nn.RMSNorm) and x is not None and _normalises_channels(m.normalized_shape, x):
        join(x, n)  # exact growth only by replicating every channel equally (see Group.norms)
        channelwise.append(n.name)
        norms.append(n.name)
    elif type(m) is nn.GroupNorm and x is not None and node_axis(x) == 1 and tensor_shape(x)[1] == m.num_channels:
        join(x, n)  # new channels grow as whole new groups: the old groups' statistics do not move
        channelwise.append(n.name)
        units[n.name] = m.num_channels // m.num_groups
    elif isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)):
        freeze([x, n], f"{type(m).__name__} '{n.target}' normalises across channels (growing would change its statistics)")
    elif isinstance(m, AverageMerge):  # main + mean(gate · branch): elementwise over all inputs
        join(*inputs, n)
    elif isinstance(m, ModeSwitch) and x is not None and len(inputs) == 1 and switch_is_channelwise(m, x, n):
        join(x, n)  # every path (drop-path, identity) acts on each channel alone
    elif isinstance(m, nn.Embedding):
        freeze([n], f"Embedding '{n.target}' produces these channels (growing an embedding's width is not supported yet)")
    elif isinstance(m, nn.MultiheadAttention):
        freeze(inputs + [n], f"MultiheadAttention '{n.target}' splits channels into heads (not grown yet)")
    elif x is not None and len(inputs) == 1 and out is not None and _probe_module(m, x, n):
        join(x, n)  # an opaque parameter-free op that acts on each channel alone (drop-path, custom activations)
    else:
        freeze(inputs + [n], f"module '{n.target}' ({type(m).__name__}) is not understood by the coupling analysis")


def _normalises_channels(normalized_shape, x: fx.Node) -> bool:
    """A LayerNorm over exactly the channel axis (the last one): replicas keep its mean and variance."""
    shape, axis = tensor_shape(x), node_axis(x)
    dims = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else (normalized_shape,)
    return shape is not None and axis == len(shape) - 1 and dims == (shape[axis],)


def _probe_module(m: nn.Module, x: fx.Node, n: fx.Node) -> bool:
    in_shape = tensor_shape(x)
    return in_shape is not None and in_shape == tensor_shape(n) and node_axis(x) is not None and \
        module_is_channelwise(m, tuple(in_shape), node_axis(x))


def _extras_are_channelwise(m: nn.Module, shape) -> bool:
    """A BatchNorm subclass's submodules (activation, dropout) must act per channel; a plain BatchNorm has none."""
    children = list(m.children())
    if not children:
        return True
    if shape is None:
        return False
    axis = channel_axis(tuple(shape))
    return all(isinstance(c, CHANNELWISE_MODULES) or module_is_channelwise(c, tuple(shape), axis) for c in children)


def _flatten_is_identity(x, n) -> bool:
    """A flatten of (N, C, 1, 1) keeps the channel dimension as it is."""
    s = tensor_shape(x) if x is not None else None
    return s is not None and len(s) >= 2 and all(d == 1 for d in s[2:])


def _function_rule(gm, n, out, inputs, join, freeze, links, norms, tensors, edits) -> None:
    target = n.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    if n.op == "call_method" and target in SHAPE_QUERIES:
        return
    if out is None and not inputs:
        return
    if n.op == "call_function" and target in (getattr, operator.getitem) and out is None:
        return  # x.shape, x.shape[0]: no tensor
    x = inputs[0] if inputs else None
    if x is not None and slice_keeps_channels(n, x):  # x[:, :, 1:, 1:] (factorized reduce): every channel kept
        join(x, n)
        return
    if moved_axis(n) is not None or flatten_keeps_axis(n) is not None:  # channels move or stay; they do not mix
        join(x, n)
        return
    if n.op == "call_function" and target in (F.layer_norm, torch.layer_norm) and _layer_norm_call(n, join, norms, tensors):
        return
    if (n.op == "call_function" and target in CHANNELWISE_FUNCTIONS) or (n.op == "call_method" and target in CHANNELWISE_METHODS):
        join(x, n)
        return
    if (n.op == "call_function" and target in ELEMENTWISE) or (n.op == "call_method" and target in ELEMENTWISE_METHODS):
        out_shape = tensor_shape(n)
        axis = node_axis(n)
        scales = {a: found for a in n.all_input_nodes if tensor_shape(a) != out_shape
                  for found in [_per_channel_tensor(gm, a, out_shape, axis)] if found}
        tensors += [(path, n.name) for path, _ in scales.values()]  # a layer scale: resized with the group
        edits += [Edit("view", v, n.name, where) for _, views in scales.values() for v, where in views]
        rest = [a for a in inputs if a not in scales]
        full = [a for a in rest if tensor_shape(a) is not None and len(tensor_shape(a)) == len(out_shape)
                and tensor_shape(a)[axis] == out_shape[axis]]
        broadcast = [a for a in rest if a not in full]
        if any(len(tensor_shape(a)) == len(out_shape) and tensor_shape(a)[axis] != 1 for a in broadcast) or \
                any(len(tensor_shape(a)) != len(out_shape) for a in broadcast):
            freeze(inputs + [n], f"'{n.name}' ({name}) broadcasts across channels")
            return
        join(*full, n)
        return
    if n.op == "call_function" and target is torch.cat:
        _cat_rule(n, inputs, join, freeze, links)
        return
    if _is_flatten(n):
        _flatten_rule(x, n, join, freeze, links)
        return
    if reduced_axis(n) is not None and out is not None and node_axis(n) == reduced_axis(n):
        join(x, n)  # a reduction over other dims (spatial or token mean) keeps each channel apart
        return
    if n.op == "call_function" and x is not None and len(inputs) == 1 and out is not None and _probe_function(n, x):
        join(x, n)  # e.g. torchvision's stochastic_depth: acts on whole examples, so on each channel alone
        return
    freeze(inputs + ([n] if out else []), f"'{n.name}' ({name}) is not understood by the coupling analysis")


def _layer_norm_call(n: fx.Node, join, norms, tensors) -> bool:
    """F.layer_norm(x, (C,), weight, bias, eps) over the channel axis, its affine read by get_attr."""
    args = list(n.args) + [None] * 5
    x = args[0]
    shape = n.kwargs.get("normalized_shape", args[1])
    affine = [n.kwargs.get("weight", args[2]), n.kwargs.get("bias", args[3])]
    if not isinstance(x, fx.Node) or not _normalises_channels(shape, x):
        return False
    c = tensor_shape(x)[-1]
    for a in affine:
        if a is not None and not (isinstance(a, fx.Node) and a.op == "get_attr" and tensor_shape(a) == (c,) and len(a.users) == 1):
            return False
    join(x, n)
    norms.append(n.name)
    tensors += [(a.target, n.name) for a in affine if a is not None]
    return True


VIEWS = {"reshape", "view", "unsqueeze", "expand", "expand_as", "squeeze"}


def _per_channel_tensor(gm, a: fx.Node, out_shape, axis: int) -> tuple[str, list[tuple[str, tuple]]] | None:
    """The attribute path when `a` is a parameter/buffer with one value per channel, broadcast along the
    channel axis (a layer scale γ, read as `x * self.gamma` or `x.mul(self.gamma.reshape(1, -1, 1, 1))`), with
    the views on the way whose literal arguments name the channel count (`gamma.view(64, 1, 1)`: rewritten)."""
    shape = tensor_shape(a)
    if shape is None or len(shape) > len(out_shape):
        return None
    lead = len(out_shape) - len(shape)
    if any(d != (out_shape[axis] if lead + i == axis else 1) for i, d in enumerate(shape)) or out_shape[axis] == 1:
        return None
    views: list[tuple[str, tuple]] = []
    while a.op == "call_method" and a.target in VIEWS and len(a.users) == 1 and isinstance(a.args[0], fx.Node) \
            and all(not isinstance(x, fx.Node) for x in list(a.args[1:]) + list(a.kwargs.values())):
        view_shape = tensor_shape(a) or ()
        views += [(a.name, where) for d, size in enumerate(view_shape) if size == out_shape[axis]
                  for where in [literal_at(a, d)] if where is not None]
        a = a.args[0]
    if a.op != "get_attr" or len(a.users) != 1:
        return None
    t = getattr(gm.get_submodule(a.target.rpartition(".")[0]) if "." in a.target else gm, a.target.rpartition(".")[2], None)
    return (str(a.target), views) if isinstance(t, torch.Tensor) and t.numel() == out_shape[axis] else None


def _probe_function(n: fx.Node, x: fx.Node) -> bool:
    """Run an unknown function on probe tensors; its other arguments must be constants or mode flags."""
    shape = tensor_shape(x)
    if shape is None or shape != tensor_shape(n) or not isinstance(n.target, Callable) or node_axis(x) is None:
        return False
    args, flags, index = list(n.args), {}, None
    for i, a in enumerate(args):
        if a is x and index is None:
            index = i
        elif isinstance(a, fx.Node):
            if a.op == "get_attr" and str(a.target).split(".")[-1] == "training":
                flags[i] = lambda training: training
            else:
                return False
    kwargs = dict(n.kwargs)
    for k, a in n.kwargs.items():
        if isinstance(a, fx.Node):
            if a.op == "get_attr" and str(a.target).split(".")[-1] == "training":
                flags[k] = lambda training: training
            else:
                return False
    if index is None:
        return False
    return function_is_channelwise(n.target, tuple(args), kwargs, index, tuple(shape), node_axis(x), flags)


def _flatten_rule(x, n, join, freeze, links) -> None:
    """(N, C, H, W) → (N, C·H·W): channel c becomes features [c·H·W, (c+1)·H·W)."""
    xs, os_ = tensor_shape(x), tensor_shape(n)
    if _flatten_is_identity(x, n):
        join(x, n)
    elif xs is not None and os_ is not None and len(xs) >= 3 and len(os_) == 2 and os_[1] == xs[1] * _prod(xs[2:]):
        links.append(Link(x.name, n.name, 0, _prod(xs[2:])))
    else:
        freeze([x, n], f"'{n.name}' reshapes channels")


def _cat_rule(n, inputs, join, freeze, links) -> None:
    tensors = n.args[0] if n.args else n.kwargs.get("tensors")
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
    out_shape = tensor_shape(n)
    axis = node_axis(n)
    if dim % len(out_shape) != axis:  # along batch or space: channels stay equal
        join(*tensors, n)
        return
    offset = 0
    for t in tensors:
        links.append(Link(t.name, n.name, offset, 1))
        offset += tensor_shape(t)[axis]


def _is_flatten(n) -> bool:
    if n.op == "call_function" and n.target is torch.flatten:
        return True
    if n.op == "call_method" and n.target in ("flatten", "view", "reshape"):
        out = tensor_shape(n)
        return out is not None and len(out) == 2
    return False


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p
