"""grow_width: widen a conv or Linear layer's output, exactly, with every coupled tensor.

mode=group  widens the whole coupled channel group (residual adds, BatchNorms,
            depthwise convs, squeeze-excitation, concatenations, flatten → Linear)
            and every consumer.
mode=adapter widens only the target and projects back with a 1×1 adapter [I | 0].
init=zero   (default) new units get random incoming and zero outgoing weights.
init=net2net new units replicate existing ones; the replicated unit and its copies
            split its outgoing weights in random shares (exact, not symmetric).
A group normalised by a LayerNorm (ConvNeXt/transformer streams) grows exactly only
by replicating every channel the same number of times: init=net2net with an integer
factor; layer scales and norm affines are replicated with it. Anything else is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import fx, nn

from graphgrow import NotApplicable, Pass, Rewrite
from graphgrow.coupling import Coupling, Insertion, analyze, make_layout
from graphgrow.rewrite import add_module, copy_graph_module, finish, inserting_after, replace_uses, resolve_tensor, set_scope

from ._resize import Init, _cols, grow_group, resize, set_module


def find_layer(gm: fx.GraphModule, target: str) -> fx.Node:
    """A call_module node by node name or module path."""
    for n in gm.graph.nodes:
        if n.op == "call_module" and (n.name == target or n.target == target):
            return n
    node = resolve_tensor(gm, target, "out")  # raises NotApplicable with suggestions
    what = "a container of several layers" if target in dict(gm.named_modules()) else f"a {node.op} node"
    raise NotApplicable(f"'{target}' is {what}, not one conv or Linear layer",
                        "name one conv or Linear layer (graphgrow inspect lists them)")


def check_growable_layer(gm: fx.GraphModule, node: fx.Node) -> nn.Module:
    m = gm.get_submodule(node.target)
    if isinstance(m, nn.Linear):
        return m
    if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
        if m.groups == 1:
            return m
        if m.groups == m.in_channels == m.out_channels:
            raise NotApplicable(f"'{node.target}' is a depthwise conv: its width follows its input",
                                "grow the layer that produces its input")
        raise NotApplicable(f"'{node.target}' is a grouped conv (groups={m.groups})", "grow a conv with groups=1 or a Linear")
    raise NotApplicable(f"'{node.target}' is {type(m).__name__}; grow_width widens a conv or Linear layer",
                        "name a conv or Linear layer (graphgrow inspect --groups lists them)")


def default_target(gm: fx.GraphModule, coupling: Coupling, replicates: bool = False) -> fx.Node:
    """The first conv/Linear (in graph order) whose whole channel group can grow; groups under a LayerNorm
    only when the growth `replicates` every channel equally (net2net, integer factor)."""
    skipped_norm = False
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.name in coupling.group_of:
            m = gm.get_submodule(n.target)
            grp = coupling.group(n.name)
            if n.name in grp.sources and not coupling.why_frozen(grp.id) and \
                    (isinstance(m, nn.Linear) or getattr(m, "groups", 0) == 1):
                if coupling.norms_reached(grp.id) and not replicates:
                    skipped_norm = True
                    continue
                return n
    hint = "graphgrow inspect --groups shows why each group is frozen; mode=adapter widens one layer"
    if skipped_norm:
        hint = "groups under a LayerNorm grow with init=net2net and an integer factor; " + hint
    raise NotApplicable("no layer in this model has a channel group that can grow", hint)


def out_width(m: nn.Module) -> int:
    return int(m.out_features if isinstance(m, nn.Linear) else m.out_channels)  # type: ignore[arg-type]


MAX_FACTOR = 16  # one growth step; larger steps are almost always a typo (factor=1e9 would allocate for minutes)


def new_width(target: str, old: int, factor: float, to: int | None) -> int:
    if to is None and not (0 < factor <= MAX_FACTOR):
        raise NotApplicable(f"factor must be in (0, {MAX_FACTOR}], got {factor}", "grow in steps of at most 16×")
    width = to if to is not None else int(round(old * factor))
    if width > max(old * MAX_FACTOR, 1):
        raise NotApplicable(f"'{target}' would grow from {old} to {width} channels, more than {MAX_FACTOR}× at once",
                            "grow in smaller steps")
    if width < old:
        raise NotApplicable(f"'{target}' has {old} channels; {width} would narrow it and grow_width only grows",
                            "use insert_adapter(out_channels=..., allow_narrowing=true) to narrow on purpose")
    if width == old:
        raise NotApplicable(f"'{target}' already has {old} channels", "give factor > 1 or to > the current width")
    return width


def grow_width(gm: fx.GraphModule, target: str | None = None, factor: float = 2.0, to: int | None = None,
               mode: Literal["group", "adapter"] = "group", init: Init = "zero",
               generator: torch.Generator | None = None) -> Rewrite:
    """Widen `target` (default: the first growable layer) to `to` channels or `factor`× its width."""
    gm = copy_graph_module(gm)
    generator = generator or torch.Generator().manual_seed(0)
    coupling = analyze(gm)
    replicates = init == "net2net" and to is None and float(factor).is_integer()
    node = find_layer(gm, target) if target is not None else default_target(gm, coupling, replicates)
    layer = check_growable_layer(gm, node)
    old = out_width(layer)
    width = new_width(str(node.target), old, factor, to)
    count = width - old
    targets = {"target": f"{node.target} ({type(layer).__name__}, {old} → {width})",
               "chosen": "given" if target is not None else "first layer whose channel group can grow"}
    if mode == "group":
        gid = coupling.group_of[node.name]
        group = coupling.groups[gid]
        rebuilt = grow_group(gm, coupling, gid, count, init, generator)
        targets["group"] = (f"#{gid}: {group.size} channels, {len(group.members)} tensors, "
                            f"sources {', '.join(group.sources)}")
        norms = coupling.norms_reached(gid)
        if norms:
            targets["layernorm"] = f"{len(norms)} LayerNorm(s) over the group; every channel replicated ×{width // old}"
    else:
        rebuilt = _grow_with_adapter(gm, node, layer, count, init, generator)
    targets["rebuilt"] = ", ".join(rebuilt)
    return Rewrite(finish(gm), targets)


def _grow_with_adapter(gm, node, layer, count, init, generator) -> list[str]:
    """Target out C → C+k, then an adapter C+k → C initialised to [I | 0] (or net2net shares)."""
    old = out_width(layer)
    src = [None] * count
    if init == "net2net":
        perm = torch.randperm(old, generator=generator).tolist()
        src = [perm[i % old] for i in range(count)]
    layout = make_layout(old, [Insertion(old, count, src)])
    set_module(gm, node.target, resize(layer, None, layout, init, generator))
    adapter = identity_adapter(layer, layout.new, old)
    with torch.no_grad():
        adapter.weight.copy_(_cols(identity_adapter(layer, old, old).weight, layout, init, generator))
    name = add_module(gm, f"{str(node.target).replace('.', '_')}_adapter", adapter)
    with inserting_after(node):
        a = gm.graph.call_module(name, (node,))
    replace_uses(node, a, keep=[a])
    set_scope([a], node)
    return [str(node.target), name]


def identity_adapter(like: nn.Module, cin: int, cout: int) -> nn.Module:
    """A 1×1 conv (same dimensionality as `like`) or a Linear, weights [I | 0] / [I ; 0], no bias."""
    w = like.weight
    m: nn.Module
    if isinstance(like, nn.modules.conv._ConvNd):
        conv_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[w.dim() - 2]
        m = conv_cls(cin, cout, 1, bias=False, device=w.device, dtype=w.dtype)
    else:
        m = nn.Linear(cin, cout, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        m.weight.zero_()
        eye = torch.eye(min(cin, cout), dtype=w.dtype, device=w.device)
        m.weight.view(cout, cin)[: eye.shape[0], : eye.shape[1]] = eye
    return m


@dataclass(frozen=True)
class GrowWidth(Pass):
    """Widen a conv/Linear layer exactly: its whole channel group (mode=group) or only it, with a 1×1 adapter back."""

    name: ClassVar[str] = "grow_width"
    target: str | None = None  # node name or module path of a conv/Linear; default: first layer whose group can grow
    factor: float = 2.0  # new width = round(factor × old) unless `to` is given
    to: int | None = None  # new width
    mode: Literal["group", "adapter"] = "group"
    init: Literal["zero", "net2net"] = "zero"

    def apply(self, gm: fx.GraphModule, generator: torch.Generator) -> Rewrite:
        return grow_width(gm, self.target, self.factor, self.to, self.mode, self.init, generator)
