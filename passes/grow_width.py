"""grow_width: widen a conv or Linear layer's output, exactly, with every coupled tensor.

mode=group  widens the whole coupled channel group (residual adds, BatchNorms,
            depthwise convs, squeeze-excitation, concatenations, flatten → Linear)
            and every consumer.
mode=adapter widens only the target and projects back with a 1×1 adapter [I | 0].
init=zero   (default) new units get random incoming and zero outgoing weights.
init=net2net new units replicate existing ones; the replicated unit and its copies
            split its outgoing weights in random shares (exact, not symmetric).
init=gradmax zero outgoing weights; incoming weights aimed from a batch (`data`) so the
            gradient on the outgoing weights is largest (graphgrow.rewrite.gradmax).
A group normalised by a LayerNorm (ConvNeXt/transformer streams) grows exactly only
by replicating every channel the same number of times: init=net2net with an integer
factor; layer scales and norm affines are replicated with it. Anything else is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    Coupling,
    Init,
    Insertion,
    adapter_layouts,
    add_module,
    analyze,
    begin,
    columns,
    deployed_nodes,
    finish,
    gradmax_init,
    graphgrow_modules,
    group_layouts,
    grow_group,
    identity_adapter,
    inserting_after,
    is_graphgrow_node,
    keep_heard,
    load_data,
    make_layout,
    param_count,
    pass_function,
    pick_within_budget,
    place,
    replace_uses,
    resize,
    resolve_tensor,
    set_module,
    set_scope,
    tensor_shape,
    train_only_note,
)


def find_layer(gm: fx.GraphModule, target: str, coupling: Coupling | None = None) -> fx.Node:
    """A call_module node by node name or module path; or a layer written as a call on its parameters
    (F.linear / F.conv) by its node name or the path of the module holding its weight."""
    for n in gm.graph.nodes:
        if n.op == "call_module" and (n.name == target or n.target == target):
            return n
    for n in gm.graph.nodes:
        f = coupling.functional.get(n.name) if coupling is not None else None
        if f is not None and (n.name == target or f.weight.rpartition(".")[0] == target):
            return n
    node = resolve_tensor(gm, target, "out")  # raises NotApplicable with suggestions
    what = "a container of several layers" if target in dict(gm.named_modules()) else f"a {node.op} node"
    raise NotApplicable(
        f"'{target}' is {what}, not one conv or Linear layer",
        "name one conv or Linear layer (graphgrow inspect lists them)",
    )


def layer_path(node: fx.Node, coupling: Coupling) -> str:
    """The module path a user names a layer by (a called layer: the module holding its weight)."""
    f = coupling.functional.get(node.name)
    return f.weight.rpartition(".")[0] if f is not None else str(node.target)


def width_of(gm: fx.GraphModule, node: fx.Node, coupling: Coupling) -> tuple[int, str]:
    """(output width, kind in words) of a conv/Linear module or of a layer written as a call on its parameters."""
    f = coupling.functional.get(node.name)
    if f is not None:
        if (
            f.kind == "conv"
            and not f.standardised
            and (tensor_shape(node.args[0]) or (0, 0))[1] != gm.get_parameter(f.weight).shape[1]
        ):
            raise NotApplicable(
                f"'{layer_path(node, coupling)}' is a grouped conv written as a call",
                "grow the layer that produces its input",
            )
        kind = "weight-standardised conv" if f.standardised else f"F.{f.kind}"
        if f.kind == "stacked":
            kind = "experts stacked in one weight"
        return int(gm.get_parameter(f.weight).shape[f.out_axis]), kind
    layer = check_growable_layer(gm, node)
    return out_width(layer), type(layer).__name__


def check_growable_layer(gm: fx.GraphModule, node: fx.Node) -> nn.Module:
    m = gm.get_submodule(node.target)
    if isinstance(m, nn.Linear):
        return m
    if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
        if m.groups > 1 and m.groups == m.in_channels == m.out_channels:
            raise NotApplicable(
                f"'{node.target}' is a depthwise conv: its width follows its input",
                "grow the layer that produces its input",
            )
        return m  # a grouped conv grows each of its groups by the same number of channels
    raise NotApplicable(
        f"'{node.target}' is {type(m).__name__}; grow_width widens a conv or Linear layer",
        "name a conv or Linear layer (graphgrow inspect --groups lists them)",
    )


def growable_layers(
    gm: fx.GraphModule, coupling: Coupling, replicates: bool = False, factor: float = 2.0
) -> tuple[list[tuple[fx.Node, int]], str | None]:
    """Main-path conv/Linear layers (graph order) whose whole channel group can grow, with the parameters
    growing by `factor` adds; not ones working on pooled 1×1 maps (squeeze-excitation, a head conv) when
    the model has larger maps, nor ones graphgrow added, nor ones the deployed function does not run (a
    train-only auxiliary head). Groups under a LayerNorm only when the growth `replicates` every channel
    equally (net2net, integer factor). Also: the first such group skipped, in words (None when none was)."""
    skipped_norm: str | None = None
    added = graphgrow_modules(gm)
    deployed = deployed_nodes(gm)
    has_maps = any(
        len(tensor_shape(n) or ()) == 4 and (tensor_shape(n) or (0, 0, 1, 1))[2:] != (1, 1) for n in gm.graph.nodes
    )
    found = []
    for n in gm.graph.nodes:
        called = n.name in coupling.functional
        if (
            (n.op != "call_module" and not called)
            or n.name not in coupling.group_of
            or n not in deployed
            or is_graphgrow_node(gm, n, added)
        ):
            continue
        grp = coupling.group(n.name)
        if (
            n.name not in grp.sources
            or coupling.why_frozen(grp.id)
            or not (called or isinstance(gm.get_submodule(n.target), (nn.Linear, nn.modules.conv._ConvNd)))
        ):
            continue
        norms = coupling.norms_reached(grp.id)
        if norms and not replicates:
            where = f"'{norms[0]}' normalises the {grp.size} channels of '{layer_path(n, coupling)}'"
            skipped_norm = skipped_norm or where
            continue
        shape = tensor_shape(n) or ()
        if has_maps and len(shape) == 4 and shape[2:] == (1, 1):
            continue  # a squeeze-excitation bottleneck or a conv on the pooled head: not a main-path layer
        found.append((n, growth_params(gm, coupling, grp.id, factor)))
    return found, skipped_norm


def default_target(
    gm: fx.GraphModule, coupling: Coupling, replicates: bool = False, factor: float = 2.0
) -> tuple[fx.Node, str]:
    """The first of `growable_layers` within the parameter budget (else the one that adds the fewest
    parameters: a small model has no growth that small), with why in words."""
    found, skipped_norm = growable_layers(gm, coupling, replicates, factor)
    total = max(param_count(gm), 1)
    if found:
        heard = keep_heard(gm, found, lambda c: c[0], fed=True)  # no gradient, or zeros in: new units never learn
        (node, cost), over = pick_within_budget(heard, lambda c: c[1], total)
        what = (
            "main-path layer whose channel group grows the least"
            if over
            else "first main-path layer whose channel group can grow"
        )
        deaf = (
            f"; {len(found) - len(heard)} other layers get a vanishing gradient from the output (an untrained stack "
            "too deep to pass its signal on) or only zeros as input (a LayerNorm over one channel, a dead ReLU): units "
            "grown there could not learn"
            if len(heard) < len(found)
            else ""
        )
        return node, (
            f"{what}: {place(gm, node)}; adds about {cost:,} parameters ({100 * cost / total:.0f}% of the model)"
            f"{over}{deaf}"
        )
    hint = "graphgrow inspect --groups shows why each group is frozen; mode=adapter widens one layer"
    if skipped_norm:  # a stated impossibility for this init, not a missing place
        raise NotApplicable(
            f"every channel group that can grow is normalised across its channels ({skipped_norm}): its mean and "
            "variance stay exact only when each channel is copied the same number of times, so this growth would "
            "not be exact",
            "use init=net2net with an integer factor; " + hint + train_only_note(gm, "name a layer with target="),
        )
    frozen = _first_frozen(gm, coupling)
    if frozen is not None:  # say which op stops the main path's groups, not only that none grows
        raise NotApplicable(
            f"every channel group of this model is frozen; the first main-path one, {frozen}",
            hint + train_only_note(gm, "name a layer with target="),
        )
    leaf = _kept_whole(gm)
    raise NotApplicable(
        "no layer in this model has a channel group that can grow"
        + (
            f": the layers of '{leaf.target}' ({type(gm.get_submodule(str(leaf.target))).__name__}) are inside a "
            "module the capture kept whole (a leaf), not in the graph"
            if leaf is not None
            else ""
        ),
        (
            "capture the model so that the module is traced through (torch.export, or without --leaf for it); "
            if leaf is not None
            else ""
        )
        + hint
        + train_only_note(gm, "name a layer with target="),
    )


def _kept_whole(gm: fx.GraphModule) -> fx.Node | None:
    """The first module the capture kept whole (a leaf, not a conv or Linear itself) that holds conv or Linear
    layers: what it computes is not in the graph, so no group reaches its layers."""
    layers = (nn.Linear, nn.modules.conv._ConvNd)
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        m = gm.get_submodule(str(n.target))
        if not isinstance(m, layers) and any(isinstance(sub, layers) for sub in m.modules()):
            return n
    return None


def _first_frozen(gm: fx.GraphModule, coupling: Coupling) -> str | None:
    """The first group (graph order) that a layer makes, with its first reason in words: one whose reason is a stated
    one, and then the first the analysis does not understand (the op it stops at: a selective scan's matmul). The
    head's group (no layer reads it, the model returns it) is left out. None when no such group is frozen."""
    seen: set[int] = set()
    stated, unknown = None, None
    deployed = deployed_nodes(gm)
    returned = {a.name for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}
    for n in gm.graph.nodes:
        gid = coupling.group_of.get(n.name)
        if gid is None or gid in seen or n not in deployed:
            continue
        grp = coupling.groups[gid]
        if n.name not in grp.sources:  # a group is met first where an embedding or a norm makes it: wait for a layer
            continue
        seen.add(gid)
        if not grp.consumers and returned & set(grp.members):
            continue  # the head's: its width is the model's output
        why = coupling.why_frozen(gid)
        if not why:
            continue
        words = f"of '{layer_path(n, coupling)}' ({grp.size} channels): {why[0]}"
        if "not understood" in why[0]:
            unknown = unknown or words
        else:
            stated = stated or words
    if stated and unknown:  # the op the analysis does not follow may be what blocks the layers that matter
        return f"{stated}; the first the analysis does not follow, {unknown}"
    return stated or unknown


def growth_params(gm: fx.GraphModule, coupling: Coupling, gid: int, factor: float) -> int:
    """About how many parameters growing group `gid` by `factor` adds: per output channel of its
    sources, per input channel of its consumers, per channel of its channelwise layers (and the same
    for the groups derived from it)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    total = 0
    for g in (coupling.groups[i] for i in coupling.reached(gid)):
        delta = max(int(round(g.size * (factor - 1))), 0)
        for role, names in (("out", g.sources), ("in", g.consumers), ("both", g.channelwise)):
            for name in names:
                node, f = nodes.get(name), coupling.functional.get(name)
                if f is not None:  # a called layer: its weight's rows (outputs) or columns (inputs)
                    w = gm.get_parameter(f.weight)
                    total += (
                        (w.numel() // w.shape[f.out_axis] + (role == "out" and f.bias is not None)) * delta
                        if role == "out"
                        else w.numel() // w.shape[f.in_axis] * delta
                    )
                    continue
                if node is None or node.op != "call_module":
                    continue
                m = gm.get_submodule(node.target)
                own = sum(p.numel() for p in m.parameters(recurse=False))
                channels = {
                    "out": getattr(m, "out_channels", getattr(m, "out_features", 0)),
                    "in": getattr(m, "in_channels", getattr(m, "in_features", 0)),
                    "both": getattr(m, "num_features", getattr(m, "out_channels", g.size)),
                }[role]
                if channels:
                    total += own * delta // channels
    return total


def out_width(m: nn.Module) -> int:
    return int(m.out_features if isinstance(m, nn.Linear) else m.out_channels)  # type: ignore[arg-type]


MAX_FACTOR = 16  # one growth step; larger steps are almost always a typo (factor=1e9 would allocate for minutes)


def new_width(target: str, old: int, factor: float, to: int | None) -> int:
    width = to if to is not None else int(round(old * factor))
    if width > max(old * MAX_FACTOR, 1):
        raise NotApplicable(
            f"'{target}' would grow from {old} to {width} channels, more than {MAX_FACTOR}× at once",
            "grow in smaller steps",
        )
    if width < old:
        raise NotApplicable(
            f"'{target}' has {old} channels; {width} would narrow it and grow_width only grows",
            "use insert_adapter(out_channels=..., allow_narrowing=true) to narrow on purpose",
        )
    if width == old:
        raise NotApplicable(f"'{target}' already has {old} channels", "give factor > 1 or to > the current width")
    return width


@pass_function  # the arguments' defaults and allowed values: GrowWidth's declaration
def grow_width(
    gm: fx.GraphModule,
    target: str | None,
    factor: float,
    to: int | None,
    mode: Literal["group", "adapter"],
    init: Init | Literal["gradmax"],
    data,
    generator: torch.Generator | None = None,
) -> Rewrite:
    """Widen `target` (default: the first growable layer) to `to` channels or `factor`× its width.
    init=gradmax: `data` is a callable (or `package.module:function`) returning (inputs, loss_fn)."""
    gm, generator = begin(gm, generator)
    aim, init = init == "gradmax", ("zero" if init == "gradmax" else init)
    if aim and data is None:
        load_data(None)  # refused before any work: gradmax needs a batch
    coupling = analyze(gm)
    replicates = init == "net2net" and to is None and float(factor).is_integer()
    node, why = (
        (find_layer(gm, target, coupling), "given")
        if target is not None
        else default_target(gm, coupling, replicates, factor)
    )
    old, kind = width_of(gm, node, coupling)
    width = new_width(layer_path(node, coupling), old, factor, to)
    count = width - old
    targets: dict[str, object] = {"target": f"{layer_path(node, coupling)} ({kind}, {old} → {width})", "chosen": why}
    if mode == "group":
        gid = coupling.group_of[node.name]
        group = coupling.groups[gid]
        if node.name not in group.sources:  # a Linear that maps tokens: the channels pass through it unchanged
            raise NotApplicable(
                f"'{layer_path(node, coupling)}' maps another axis of its input than the channels (a "
                "token-mixing Linear): its features are that axis, which no channel group holds",
                "widen a layer that makes channels, or use mode=adapter",
            )
        rebuilt = grow_group(gm, coupling, gid, count, init, generator)
        targets["group"] = (
            f"#{gid}: {group.size} channels, {len(group.members)} tensors, sources {', '.join(group.sources)}"
        )
        norms = coupling.norms_reached(gid)
        if norms:
            targets["layernorm"] = f"{len(norms)} LayerNorm(s) over the group; every channel replicated ×{width // old}"
    elif node.name in coupling.functional:
        raise NotApplicable(
            f"'{layer_path(node, coupling)}' is a layer written as a call (F.{coupling.functional[node.name].kind}): "
            "mode=adapter rebuilds a module layer",
            "use mode=group",
        )
    else:
        rebuilt = _grow_with_adapter(gm, node, check_growable_layer(gm, node), count, init, generator)
    targets["rebuilt"] = ", ".join(rebuilt)
    gm, notes = finish(gm), []
    if aim:  # after finish: the adapter's node is in the recompiled forward
        outs, ins = (
            group_layouts(coupling, gid, count)
            if mode == "group"
            else adapter_layouts(gm, rebuilt[0], rebuilt[1], old, count)
        )
        aimed = gradmax_init(gm, outs, ins, data)
        if aimed is not None:
            targets["gradmax"] = aimed.describe()
            targets["gain"] = float(f"{aimed.gain:.4g}")
            notes += aimed.notes
    return Rewrite(gm, targets, notes)


def _grow_with_adapter(gm, node, layer, count, init, generator) -> list[str]:
    """Target out C → C+k, then an adapter C+k → C initialised to [I | 0] (or net2net shares)."""
    old = out_width(layer)
    src = [None] * count
    if init == "net2net":
        perm = torch.randperm(old, generator=generator).tolist()
        src = [perm[i % old] for i in range(count)]
    layout = make_layout(old, [Insertion(old, count, src)])
    set_module(gm, node.target, resize(layer, None, layout, init, generator))
    dims = layer.weight.dim() - 2 if isinstance(layer, nn.modules.conv._ConvNd) else None
    adapter = identity_adapter(layout.new, old, dims, layer.weight)
    with torch.no_grad():
        adapter.weight.copy_(columns(identity_adapter(old, old, dims, layer.weight).weight, layout, init, generator))
    name = add_module(gm, f"{str(node.target).replace('.', '_')}_adapter", adapter)
    with inserting_after(node):
        a = gm.graph.call_module(name, (node,))
    replace_uses(node, a, keep=[a])
    set_scope([a], node)
    return [str(node.target), name]


@dataclass(frozen=True)
class GrowWidth(Pass):
    """Widen a conv/Linear layer exactly: its whole channel group (mode=group) or only it, with a 1×1 adapter back."""

    name: ClassVar[str] = "grow_width"
    function = grow_width
    ensures = (ADDS_PARAMETERS,)
    target: str | None = arg(
        None, "node name or module path of a conv or Linear; default: the first main-path layer whose group can grow"
    )
    factor: float = arg(
        2.0,
        "new width = round(factor × old width), unless `to` is given; one step grows at most 16×",
        above=0,
        high=MAX_FACTOR,
    )
    to: int | None = arg(None, "the new width", low=1)
    mode: Literal["group", "adapter"] = arg(
        "group", "group: widen the whole channel group; adapter: the target only, projected back by [I | 0]"
    )
    init: Literal["zero", "net2net", "gradmax"] = arg(
        "zero",
        "zero: random in, zero out; net2net: copies sharing their outgoing weights; "
        "gradmax: zero out, in aimed from `data`",
    )
    data: str | None = arg(
        None, "with init=gradmax: package.module:function returning (inputs, loss_fn); CLI: --data", names_code=True
    )

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """Every layer whose channel group can grow (mode=group), in graph order."""
        coupling = analyze(gm)
        replicates = self.init == "net2net" and self.to is None and float(self.factor).is_integer()
        found, _ = growable_layers(gm, coupling, replicates, self.factor)
        try:
            default = default_target(gm, coupling, replicates, self.factor)[0]
        except NotApplicable:
            default = None
        return [Candidate({"target": layer_path(n, coupling)}, place(gm, n), cost, n is default) for n, cost in found]
