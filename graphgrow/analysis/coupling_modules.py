"""Coupling rules for `call_module` nodes, registered by module type (like fold's RULES).

`MODULE_RULES` lists (module types, rule) in order; `module_rule` asks each rule whose types the module is an
instance of, in that order, until one returns True (a rule returns False when the module is of its type but not its
case: a BatchNorm subclass with extras that mix channels, an affine InstanceNorm …). A module no rule takes is
probed (an opaque parameter-free op acting on each channel alone) or freezes its tensors with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx, nn

from ..graph.fx_edit import tensor_shape
from ..graph.layers import AverageMerge
from ..io.mode_switch import ModeSwitch
from .axes import BATCHNORMS, CHANNELWISE_MODULES, across_axis, channel_axis, node_axis
from .coupling_build import Build, Link, Site
from .opaque import switch_is_channelwise
from .probe import module_is_channelwise

ModuleRule = Callable[[Build, Site, nn.Module], bool]
MODULE_RULES: list[tuple[tuple[type, ...], ModuleRule]] = []


def rule_for(*types: type) -> Callable[[ModuleRule], ModuleRule]:
    """Register a rule for modules of these types (after the rules registered before it)."""

    def register(rule: ModuleRule) -> ModuleRule:
        MODULE_RULES.append((types, rule))
        return rule

    return register


def module_rule(b: Build, s: Site, m: nn.Module) -> None:
    for types, rule in MODULE_RULES:
        if isinstance(m, types) and rule(b, s, m):
            return
    n, x = s.node, s.x
    if x is not None and len(s.inputs) == 1 and s.out is not None and _probe_module(m, x, n):
        b.join(x, n)  # an opaque parameter-free op that acts on each channel alone (drop-path, custom activations)
    else:
        b.freeze(s.inputs + [n], f"module '{n.target}' ({type(m).__name__}) is not understood by the coupling analysis")


def join_calls(b: Build, s: Site, first: Site) -> None:
    """A module with parameters called several times (ALBERT's one layer run at every depth, a recurrent block run
    for several cycles) holds one weight for all its calls: its outputs share their channels at every call, and its
    inputs too, so each call's groups are one group and grow with the same new channels. Calls whose channel counts
    differ cannot share a new size: they stay frozen, with the reason."""
    if s is first:
        return
    n = s.node
    pairs = [(n, first.node)] if s.out is not None and first.out is not None else []
    pairs += list(zip(s.inputs, first.inputs))
    if (
        len(s.inputs) != len(first.inputs)
        or (s.out is None) != (first.out is None)
        or any(_channels(a) != _channels(c) for a, c in pairs)
    ):
        b.freeze(s.inputs + [n], f"module '{n.target}' is called several times with different channel counts")
        return
    for a, c in pairs:
        b.join(a, c)


def _channels(n: fx.Node) -> int | None:
    shape, axis = tensor_shape(n), node_axis(n)
    return None if shape is None or axis is None else int(shape[axis])


@rule_for(nn.modules.conv._ConvNd)
def _conv(b: Build, s: Site, m) -> bool:
    n, x = s.node, s.x
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        return False
    if m.groups > 1 and m.groups == m.in_channels == m.out_channels:  # depthwise: channel c → channel c
        b.join(x, n)
        b.channelwise.append(n.name)
        return True
    b.sources.append((n.name, None))
    if x is not None:
        b.consumers.append((n.name, x.name))
    if m.groups > 1:  # each group of inputs and of outputs grows by the same number of channels
        why = f"grouped conv '{n.target}' (groups={m.groups})"
        b.block(n, m.groups, why)
        if x is not None:
            b.block(x, m.groups, why)
    return True


@rule_for(nn.Linear)
def _linear(b: Build, s: Site, m) -> bool:
    n, x = s.node, s.x
    if x is not None and across_axis(n) is not None:
        b.join(x, n)  # it maps another axis (tokens) with the same weights for every channel: channel c stays c
        return True
    if x is not None and node_axis(x) != len(tensor_shape(x)) - 1:  # and no tracked axis says where channels are
        b.freeze([x, n], f"Linear '{n.target}' reads a non-channel axis")
    if x is not None:
        b.consumers.append((n.name, x.name))
    b.sources.append((n.name, None))
    return True


@rule_for(*BATCHNORMS)
def _batch_norm(b: Build, s: Site, m) -> bool:
    if not _extras_are_channelwise(m, tensor_shape(s.node)):
        return False
    # a subclass (timm's BatchNormAct2d) = BatchNorm followed by its own channelwise extras
    b.join(s.x, s.node)
    b.channelwise.append(s.node.name)
    return True


@rule_for(nn.modules.instancenorm._InstanceNorm)
def _instance_norm(b: Build, s: Site, m) -> bool:
    if m.affine or m.track_running_stats:
        return False
    b.join(s.x, s.node)
    return True


@rule_for(*CHANNELWISE_MODULES)
def _channelwise(b: Build, s: Site, m) -> bool:
    b.join(s.x, s.node)
    return True


@rule_for(nn.Flatten)
def _flatten(b: Build, s: Site, m) -> bool:
    if flatten_is_identity(s.x, s.node):
        b.join(s.x, s.node)
    else:
        flatten_rule(b, s.x, s.node)
    return True


@rule_for(nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
def _norm(b: Build, s: Site, m) -> bool:
    n, x = s.node, s.x
    if type(m) in (nn.LayerNorm, nn.RMSNorm) and x is not None and normalises_channels(m.normalized_shape, x):
        b.join(x, n)  # exact growth only by replicating every channel equally (see Group.norms)
        b.channelwise.append(n.name)
        b.norms.append(n.name)
    elif type(m) is nn.GroupNorm and x is not None and node_axis(x) == 1 and tensor_shape(x)[1] == m.num_channels:
        b.join(x, n)  # new channels grow as whole new groups: the old groups' statistics do not move
        b.channelwise.append(n.name)
        b.units[n.name] = m.num_channels // m.num_groups
    else:
        b.freeze(
            [x, n], f"{type(m).__name__} '{n.target}' normalises across channels (growing would change its statistics)"
        )
    return True


@rule_for(AverageMerge)
def _average_merge(b: Build, s: Site, m) -> bool:
    b.join(*s.inputs, s.node)  # main + mean(gate · branch): elementwise over all inputs
    return True


@rule_for(ModeSwitch)
def _mode_switch(b: Build, s: Site, m) -> bool:
    if s.x is None or len(s.inputs) != 1 or not switch_is_channelwise(m, s.x, s.node):
        return False
    b.join(s.x, s.node)  # every path (drop-path, identity) acts on each channel alone
    return True


@rule_for(nn.Embedding)
def _embedding(b: Build, s: Site, m) -> bool:
    b.freeze(
        [s.node],
        f"Embedding '{s.node.target}' produces these channels (growing an embedding's width is not supported yet)",
    )
    return True


@rule_for(nn.MultiheadAttention)
def _multihead_attention(b: Build, s: Site, m) -> bool:
    b.freeze(s.inputs + [s.node], f"MultiheadAttention '{s.node.target}' splits channels into heads (not grown yet)")
    return True


def normalises_channels(normalized_shape, x: fx.Node) -> bool:
    """A LayerNorm over exactly the channel axis (the last one): replicas keep its mean and variance."""
    shape, axis = tensor_shape(x), node_axis(x)
    dims = tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else (normalized_shape,)
    return shape is not None and axis == len(shape) - 1 and dims == (shape[axis],)


def _probe_module(m: nn.Module, x: fx.Node, n: fx.Node) -> bool:
    in_shape = tensor_shape(x)
    return (
        in_shape is not None
        and in_shape == tensor_shape(n)
        and node_axis(x) is not None
        and module_is_channelwise(m, tuple(in_shape), node_axis(x))
    )


def _extras_are_channelwise(m: nn.Module, shape) -> bool:
    """A BatchNorm subclass's submodules (activation, dropout) must act per channel; a plain BatchNorm has none."""
    children = list(m.children())
    if not children:
        return True
    if shape is None:
        return False
    axis = channel_axis(tuple(shape))
    return all(isinstance(c, CHANNELWISE_MODULES) or module_is_channelwise(c, tuple(shape), axis) for c in children)


def flatten_is_identity(x, n) -> bool:
    """A flatten of (N, C, 1, 1) keeps the channel dimension as it is."""
    s = tensor_shape(x) if x is not None else None
    return s is not None and len(s) >= 2 and all(d == 1 for d in s[2:])


def flatten_rule(b: Build, x, n) -> None:
    """(N, C, H, W) → (N, C·H·W): channel c becomes features [c·H·W, (c+1)·H·W)."""
    xs, os_ = tensor_shape(x), tensor_shape(n)
    if flatten_is_identity(x, n):
        b.join(x, n)
    elif xs is not None and os_ is not None and len(xs) >= 3 and len(os_) == 2 and os_[1] == xs[1] * _prod(xs[2:]):
        b.links.append(Link(x.name, n.name, 0, _prod(xs[2:])))
    else:
        b.freeze([x, n], f"'{n.name}' reshapes channels")


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def freeze_shared_head_sizes(gm: fx.GraphModule, groups, group_of: dict[str, int], links: list[Link]) -> None:
    """Channels that are an attention's head size grow through the attention rewrite, which rebuilds each call's
    projections on its own: a shared module there (one weight, several calls) would be rebuilt once per call. A group
    of a shared module's call that reaches an attention through links (the heads view of a projection) stays frozen,
    with the reason; a shared layer's other groups (its MLP) grow."""
    near: dict[int, set[int]] = {}
    for link in links:
        a, c = group_of[link.src], group_of[link.dst]
        near.setdefault(a, set()).add(c)
        near.setdefault(c, set()).add(a)
    calls: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and any(True for _ in gm.get_submodule(n.target).parameters()):
            calls.setdefault(str(n.target), []).append(n.name)
    for target, names in calls.items():
        if len(names) < 2:
            continue
        for gid in {group_of[v] for v in names if v in group_of}:
            seen, todo = {gid}, [gid]
            while todo:
                for g in near.get(todo.pop(), ()):
                    if g not in seen:
                        seen.add(g)
                        todo.append(g)
            if any(groups[g].attentions for g in seen):
                groups[gid].frozen.append(
                    f"module '{target}' is called {len(names)} times (shared weights) and these channels are the head "
                    "size of an attention, whose rewrite rebuilds each call's projections on their own"
                )
