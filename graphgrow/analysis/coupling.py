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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.nn.functional as F
from torch import fx

from ..graph import ops
from ..graph.fx_edit import from_input, tensor_shape
from ..graph.graph_meta import input_spec_of
from ..graph.shapes import annotate
from . import growth
from .axes import (  # noqa: F401 (channel_axis and BATCHNORMS are read through this module)
    BATCHNORMS,
    CHANNELWISE_FUNCTIONS,
    CHANNELWISE_METHODS,
    ELEMENTWISE,
    ELEMENTWISE_METHODS,
    SHAPE_QUERIES,
    assign_channel_axes,
    channel_axis,
    flatten_keeps_axis,
    moved_axis,
    node_axis,
    reduced_axis,
)
from .coupling_build import Build, Link, Site  # noqa: F401 (Link is read through this module)
from .coupling_layers import Functional, layer_rule
from .coupling_modules import (
    flatten_rule,
    freeze_shared_head_sizes,
    join_calls,
    module_rule,
    normalises_channels,
)
from .coupling_reductions import across_channels, keeps_channels
from .coupling_scales import one_value, per_channel_tensor, unresized_operand
from .coupling_splits import ChannelEdit, pad_rule, split_rule
from .opaque import slice_keeps_channels
from .probe import elementwise_is_channelwise, function_is_channelwise
from .stacked import feeds_stacked_weight


@dataclass
class Group:
    id: int
    size: int
    members: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # conv/Linear nodes whose output is in the group
    consumers: list[str] = field(default_factory=list)  # conv/Linear nodes whose input is in the group
    channelwise: list[str] = field(
        default_factory=list
    )  # BatchNorm / LayerNorm / depthwise conv nodes to resize with it
    frozen: list[str] = field(default_factory=list)  # why it cannot grow
    norms: list[str] = field(default_factory=list)  # LayerNorms over these channels: only uniform replication is exact
    tensors: list[str] = field(
        default_factory=list
    )  # per-channel parameters/buffers read by get_attr (layer scale, norm affine)
    blocks: int = 1  # channels tied to this many equal blocks (grouped convs): each must gain the same number
    block_reasons: list[str] = field(default_factory=list)
    attentions: list[str] = field(
        default_factory=list
    )  # attentions whose head size these channels are (coupling_layers)
    unit: int = 1  # channels per GroupNorm group: new channels must form whole new groups (growth.step)

    @property
    def growable(self) -> bool:
        return not self.frozen and bool(self.sources)

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "channels": self.size,
            "members": self.members,
            "sources": self.sources,
            "consumers": self.consumers,
            "channelwise": self.channelwise,
            "frozen": self.frozen,
            "norms": self.norms,
            "tensors": self.tensors,
            "blocks": self.blocks,
            "attentions": self.attentions,
        }


@dataclass
class Coupling:
    groups: list[Group]
    group_of: dict[str, int]  # tensor node → group id
    links: list[Link]
    edits: list[ChannelEdit] = field(
        default_factory=list
    )  # ops whose constants follow the channels (slices, splits, reshapes)
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
            found = growth.propagate(
                self, gid, growth.root_insertions(self.groups[gid].size, b, self.spread.get(gid, b), None)
            )
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
    b = Build(gm)
    assign_channel_axes(gm)
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    first_calls: dict[str, Site] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1

    for n in gm.graph.nodes:
        out = b.vertex(n)
        tensor_inputs = [a for a in n.all_input_nodes if b.vertex(a) is not None]
        site = Site(n, out, tensor_inputs)
        if n.op == "placeholder":
            b.freeze([n], "it is the model's input")
        elif n.op == "output":
            b.freeze(tensor_inputs, "it is the model's output")
        elif n.op == "get_attr" and out is not None:  # a tensor on the stream (class token, position table) grows
            b.attr_tensors.append((str(n.target), n.name))  # with its group along its channel dim, once joined to one
        elif n.op == "call_module":
            module_rule(b, site, modules[n.target])
            if calls[n.target] > 1 and any(True for _ in modules[n.target].parameters()):
                join_calls(b, site, first_calls.setdefault(n.target, site))  # one weight: every call grows alike
        elif n.op in ("call_function", "call_method") and feeds_stacked_weight(gm, n):
            continue  # a gather or view of an expert-stacked weight: read by the product's own rule
        elif n.op in ("call_function", "call_method") and not split_rule(b, site) and not layer_rule(b, site):
            function_rule(b, site)

    groups: list[Group] = []
    group_of: dict[str, int] = {}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for comp in sorted(nx.connected_components(b.g), key=lambda c: min(order[v] for v in c)):
        members = sorted(comp, key=order.__getitem__)
        first = next(n for n in gm.graph.nodes if n.name == members[0])
        size = tensor_shape(first)[node_axis(first)]
        grp = Group(len(groups), size, members)
        for v in members:
            group_of[v] = grp.id
            grp.frozen += [f"'{v}': {r}" for r in b.frozen.get(v, [])]
            for count, why in b.blocks.get(v, []):
                grp.blocks = growth.lcm(grp.blocks, count)
                grp.block_reasons.append(why)
            grp.unit = growth.lcm(grp.unit, b.units.get(v, 1))
        groups.append(grp)
    for name, _ in b.sources:
        groups[group_of[name]].sources.append(name)
    for name, inp in b.consumers:
        groups[group_of[inp]].consumers.append(name)
    for name in b.channelwise:
        groups[group_of[name]].channelwise.append(name)
    for name in b.norms:
        groups[group_of[name]].norms.append(name)
    by_name = {n.name: n for n in gm.graph.nodes}
    joined = [(path, member) for path, member in b.attr_tensors if len(groups[group_of[member]].members) > 1]
    tensors = b.tensors + joined
    tensor_axes = {path: node_axis(by_name[member]) for path, member in joined}
    for path, member in tensors:
        if path not in groups[group_of[member]].tensors:
            groups[group_of[member]].tensors.append(path)
    for node, member in b.attentions:
        groups[group_of[member]].attentions.append(node)
    _freeze_shared_tensors(gm, groups, group_of, tensors)
    freeze_shared_head_sizes(gm, groups, group_of, b.links)
    return Coupling(groups, group_of, b.links, b.edits, functional=b.functional, tensor_axes=tensor_axes)


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
                groups[gid].frozen.append(
                    f"parameter '{path}' is also read elsewhere; resizing it would change that use"
                )


# Rules for call_function / call_method nodes the split and layer rules did not take, by (op, target): a function
# object for call_function, a method name for call_method. A rule returns False when the node is not its case after
# all; `function_rule` then tries the rules that look at the node's shape instead of its target.
FunctionRule = Callable[[Build, Site], bool]
FUNCTION_RULES: dict[tuple[str, object], FunctionRule] = {}


def rule_for(functions=(), methods=()) -> Callable[[FunctionRule], FunctionRule]:
    """Register a rule for these functions (call_function targets) and method names (call_method targets)."""

    def register(rule: FunctionRule) -> FunctionRule:
        for key in [("call_function", f) for f in functions] + [("call_method", m) for m in methods]:
            assert key not in FUNCTION_RULES, f"two coupling rules for {key}"
            FUNCTION_RULES[key] = rule
        return rule

    return register


def function_rule(b: Build, s: Site) -> None:
    n, x, target = s.node, s.x, s.node.target
    if n.op == "call_method" and target in SHAPE_QUERIES:
        return
    if s.out is None and not s.inputs:
        return
    if n.op == "call_function" and target in (getattr, operator.getitem) and s.out is None:
        return  # x.shape, x.shape[0]: no tensor
    if x is not None and slice_keeps_channels(n, x):  # x[:, :, 1:, 1:] (factorized reduce): every channel kept
        b.join(x, n)
        return
    if moved_axis(n) is not None or flatten_keeps_axis(n) is not None:  # channels move or stay; they do not mix
        b.join(x, n)
        return
    rule = FUNCTION_RULES.get((n.op, target))
    if rule is not None and rule(b, s):
        return
    if reduced_axis(n) is not None and s.out is not None and node_axis(n) == reduced_axis(n):
        b.join(x, n)  # a reduction over other dims (spatial or token mean) keeps each channel apart
        return
    if n.op == "call_function" and x is not None and len(s.inputs) == 1 and s.out is not None and _probe_function(n, x):
        b.join(x, n)  # e.g. torchvision's stochastic_depth: acts on whole examples, so on each channel alone
        return
    full = _probe_elementwise(n)
    if full:
        b.join(*full, n)  # e.g. xIELU: where(x > 0, α·x² + β·x, (expm1(min(x, ε)) − x)·α' + β·x), α, β, ε scalars
        return
    if keeps_channels(n, x):
        b.join(x, n)  # ‖x‖₂ over space (ConvNeXt-V2's GRN): one value per channel
        return
    across = across_channels(n, x)  # an L2 norm across the channels: stated, not "not understood"
    b.freeze(
        s.inputs + ([n] if s.out else []),
        across or f"'{n.name}' ({_name(target)}) is not understood by the coupling analysis",
    )


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


@rule_for(functions=CHANNELWISE_FUNCTIONS - {F.pad}, methods=CHANNELWISE_METHODS)
def _channelwise(b: Build, s: Site) -> bool:
    b.join(s.x, s.node)
    return True


@rule_for(functions=(torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max), methods=ops.BOUNDS)
def _bounded(b: Build, s: Site) -> bool:
    """x.clamp(min=a, max=b) with number bounds (GPT-OSS's clamped SwiGLU): each value alone, so each channel."""
    bounds = list(s.node.args[1:]) + list(s.node.kwargs.values())
    if s.x is None or s.out is None or s.node.args[0] is not s.x or any(isinstance(a, fx.Node) for a in bounds):
        return False
    b.join(s.x, s.node)
    return True


@rule_for(functions=(F.pad,))
def _pad(b: Build, s: Site) -> bool:
    return pad_rule(b, s)


@rule_for(functions=ELEMENTWISE, methods=ELEMENTWISE_METHODS)
def _elementwise(b: Build, s: Site) -> bool:
    n, inputs = s.node, s.inputs
    out_shape = tensor_shape(n)
    if out_shape is None:  # no known tensor shape (a value the export left unshaped): not read as elementwise
        return False
    axis = node_axis(n)
    scales = {
        a: found
        for a in n.all_input_nodes
        if tensor_shape(a) != out_shape
        for found in [per_channel_tensor(b.gm, a, out_shape, axis)]
        if found
    }
    b.tensors += [(path, n.name) for path, _ in scales.values()]  # a layer scale: resized with the group
    b.edits += [ChannelEdit("view", v, n.name, where) for _, views in scales.values() for v, where in views]
    rest = [a for a in inputs if a not in scales]
    full = [
        a
        for a in rest
        if tensor_shape(a) is not None
        and len(tensor_shape(a)) == len(out_shape)
        and tensor_shape(a)[axis] == out_shape[axis]
    ]
    broadcast = [a for a in rest if a not in full and not one_value(a)]  # a scalar is the same for every channel
    loose = unresized_operand(n, inputs + list(scales))  # a value per channel no rule resizes: never left as it is
    if loose is not None:
        b.freeze(
            inputs + [n],
            f"'{n.name}' ({_name(n.target)}) reads '{loose.name}', a value per channel the growth would not resize",
        )
        return True
    if any(len(tensor_shape(a)) == len(out_shape) and tensor_shape(a)[axis] != 1 for a in broadcast) or any(
        len(tensor_shape(a)) != len(out_shape) for a in broadcast
    ):
        b.freeze(inputs + [n], f"'{n.name}' ({_name(n.target)}) broadcasts across channels")
        return True
    # what is left broadcasts along the output's channel axis: a one-channel operand read by every output channel
    # (FocalNet's gates[:, l:l+1], a spatial attention map), or one whose own channels sit on another dim of the
    # output (a per-head gate [B, T, H, 1] on [B, T, H, D] whose channels are D). Its channel count must stay as it
    # is: another size would not broadcast. The output's channels stay free.
    b.freeze(
        broadcast,
        f"'{n.name}' ({_name(n.target)}) broadcasts it over its {out_shape[axis]} output channels: "
        "its own channel count cannot change",
    )
    # an operand of the output's shape whose channels are another of its dims (heads [B, T, H, D] times a Linear's
    # output viewed [B, T, -1, D]): joined, one's growth would resize the other along a dim nothing follows
    crossed = [a for a in full if node_axis(a) not in (None, axis)]
    if crossed:
        names, at = ", ".join(repr(a.name) for a in crossed), node_axis(crossed[0])
        why = f"has its channels on dim {axis}, those of {names} on its dim {at}: they cannot grow together"
        b.freeze(crossed + [n], f"'{n.name}' ({_name(n.target)}) {why}")
    b.join(*[a for a in full if a not in crossed], n)
    return True


@rule_for(functions=(torch.cat,))
def _cat(b: Build, s: Site) -> bool:
    n = s.node
    tensors: Any = n.args[0] if n.args else n.kwargs.get("tensors")
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
    out_shape = tensor_shape(n)
    axis = node_axis(n)
    if dim % len(out_shape) != axis:  # along batch or space: channels stay equal
        b.join(*tensors, n)
        return True
    offset = 0
    for t in tensors:
        b.links.append(Link(t.name, n.name, offset, 1))
        offset += tensor_shape(t)[axis]
    return True


@rule_for(functions=(torch.flatten,), methods=("flatten", "view", "reshape"))
def _flatten(b: Build, s: Site) -> bool:
    """torch.flatten, or a flatten/view/reshape method to two dims: the (N, C·H·W) of a classifier's input."""
    n = s.node
    if s.x is None:  # its input has no channel axis (a routing index, a scalar): nothing to link
        return False
    if n.op == "call_method":
        out = tensor_shape(n)
        if out is None or len(out) != 2:
            return False
    flatten_rule(b, s.x, n)
    return True


@rule_for(functions=(F.layer_norm, torch.layer_norm))
def _layer_norm_call(b: Build, s: Site) -> bool:
    """F.layer_norm(x, (C,), weight, bias, eps) over the channel axis, its affine read by get_attr."""
    n = s.node
    args = list(n.args) + [None] * 5
    x = args[0]
    shape = n.kwargs.get("normalized_shape", args[1])
    affine = [n.kwargs.get("weight", args[2]), n.kwargs.get("bias", args[3])]
    if not isinstance(x, fx.Node) or not normalises_channels(shape, x):
        return False
    c = tensor_shape(x)[-1]
    for a in affine:
        if a is not None and not (
            isinstance(a, fx.Node) and a.op == "get_attr" and tensor_shape(a) == (c,) and len(a.users) == 1
        ):
            return False
    b.join(x, n)
    b.norms.append(n.name)
    b.tensors += [(str(a.target), n.name) for a in affine if a is not None]
    return True


def _probe_elementwise(n: fx.Node) -> list[fx.Node]:
    """The tensor arguments of an op with several of the output's shape and otherwise one-element tensors (learned
    scalars), when probing shows it channelwise in all of them at once; else []."""
    out = tensor_shape(n)
    if n.op != "call_function" or not callable(n.target) or out is None or node_axis(n) is None:
        return []
    if any(isinstance(v, fx.Node) for v in n.kwargs.values()):
        return []
    args, full, slots = list(n.args), [], []
    for i, a in enumerate(args):
        if not isinstance(a, fx.Node):
            continue
        shape, dtype = tensor_shape(a), a.meta.get("gg_dtype")
        # only tensors computed from the input: one from parameters alone (Mamba's D.unsqueeze(0)) holds per-channel
        # values a growth must resize, and joined by shape it would keep its old size
        if shape == out and node_axis(a) == node_axis(n) and isinstance(dtype, torch.dtype) and from_input(a):
            full.append(a)
            slots.append((i, dtype))
        elif one_value(a) and isinstance(dtype, torch.dtype):
            args[i] = torch.full(shape, 0.37 + 0.1 * i, dtype=dtype)  # a value of its own, not 0 or 1
        else:
            return []
    if not full or not elementwise_is_channelwise(n.target, tuple(args), dict(n.kwargs), slots, out, node_axis(n)):
        return []
    return full


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
