"""Widening: plan where new channels go (over coupling's groups) and rebuild conv / Linear /
BatchNorm / LayerNorm layers at the new widths, keeping every constructor setting.

`plan_growth` carries an insertion through the links between groups; `make_layout` says
where old and new channels sit; old weights go to their new positions; new output units get
random incoming weights (`zero` init) or copies of the unit they replicate
(`net2net`); new input columns are zero (`zero`) or share the replicated unit's
outgoing weight with it (`net2net`, random shares that sum to one, so replicas are
exact but not symmetric).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import fx, nn

from ..analysis import growth
from ..analysis.axes import node_axis
from ..analysis.coupling import BATCHNORMS, Coupling
from ..analysis.growth import Insertion, Layout, make_layout  # noqa: F401 (part of this module's API)
from ..core.errors import NotApplicable
from .channel_fill import Init, columns, rows  # noqa: F401 (part of this module's API)
from .functional_layers import resize_functional
from .head_sizes import grow_head_sizes
from .initializers import kaiming_
from .size_reads import hold_size_reads
from .tensor_paths import owners, put_tensor
from .widen_args import apply_edits, block_sources


def plan_growth(c: Coupling, gid: int, count: int, src: list[int | None] | None = None) -> dict[int, list[Insertion]]:
    """Every group's insertions when group `gid` gains `count` channels: at its end, or at the end of each of
    its blocks (grouped convs, channel splits: see analysis.growth).

    Links carry the insertion to tied groups, both ways: a `cat` shifts it by the input's offset, a
    `flatten` scales it by the spatial size, a slice or split piece takes the part in its span, a reshape
    that splits channels into blocks repeats it per block. Raises ValueError with the reasons when a
    reached group is frozen or the links cannot agree.
    """
    try:
        found = growth.plan(c, gid, count, src)
    except growth.Conflict as e:
        raise ValueError(str(e)) from e
    if found.reasons:
        raise ValueError("; ".join(found.reasons))
    return found.insertions


def set_module(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, name, module)


def _rebuilt(m: nn.Module, **sizes) -> nn.Module:
    """A copy of `m` (same class — subclasses such as TF-'same' convs or BatchNorm with a fused activation
    keep their extras —, stride, padding, dilation, bias, padding_mode, dtype, device, training flag) with
    its size attributes changed; the caller gives it new parameters and buffers."""
    memo = {
        id(t): t for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
    }  # not copied: replaced
    new = copy.deepcopy(m, memo)
    for key, value in sizes.items():
        setattr(new, key, value)
    return new


def resize_conv(
    m: nn.modules.conv._ConvNd,
    in_layout: Layout | None,
    out_layout: Layout | None,
    init: Init,
    generator: torch.Generator,
) -> nn.Module:
    """A conv with more input and/or output channels; stride, padding, dilation, groups, bias,
    padding_mode, dtype, device and the class are kept. Depthwise convs grow in, out and groups together."""
    depthwise = m.groups > 1 and m.groups == m.in_channels == m.out_channels
    if m.groups > 1 and not depthwise:
        return resize_grouped_conv(m, in_layout, out_layout, init, generator)
    if depthwise:
        out_layout = out_layout or in_layout
        in_layout = None
    cin = out_layout.new if depthwise else (in_layout.new if in_layout else m.in_channels)
    cout = out_layout.new if out_layout else m.out_channels
    new = _rebuilt(m, in_channels=cin, out_channels=cout, groups=cout if depthwise else 1)
    return _fill_weights(m, new, in_layout, out_layout, init, generator)


def resize_grouped_conv(
    m: nn.modules.conv._ConvNd,
    in_layout: Layout | None,
    out_layout: Layout | None,
    init: Init,
    generator: torch.Generator,
) -> nn.Module:
    """A grouped conv whose groups each gain the same number of input and/or output channels (groups kept):
    the weight is laid out block-diagonally, widened like a dense conv, and its diagonal blocks taken back;
    new rows are drawn at the grouped fan-in."""
    g = m.groups
    for layout in (in_layout, out_layout):
        if layout is not None and not growth.keeps_blocks(layout, g):
            raise NotApplicable(
                f"the {g} groups of this grouped conv would not each gain the same number of channels "
                f"({layout.old} → {layout.new})",
                f"grow by a multiple of {g}",
            )
    cin = in_layout.new if in_layout else m.in_channels
    cout = out_layout.new if out_layout else m.out_channels
    new = _rebuilt(m, in_channels=cin, out_channels=cout)
    with torch.no_grad():
        dense = _block_diagonal(m.weight, g)
        w = rows(columns(dense, in_layout, init, generator), out_layout, init, generator, "zero")
        weight = _diagonal_blocks(w, g)
        for slot, src in zip(out_layout.new_slots if out_layout else [], out_layout.src if out_layout else []):
            if init == "net2net" and src is not None:
                if slot // (cout // g) != src // (m.out_channels // g):
                    raise NotApplicable(
                        "a net2net replica would sit in another group of the grouped conv than its source",
                        "use init=zero",
                    )
            else:
                weight[slot] = kaiming_(torch.empty_like(weight[slot : slot + 1]), generator)[0]
        put_tensor(new, "weight", weight)
        if m.bias is not None:
            put_tensor(
                new, "bias", rows(m.bias.detach(), out_layout, init, generator, "zero")
            )  # detached: see _fill_weights
    return new


def _block_diagonal(w: torch.Tensor, g: int) -> torch.Tensor:
    """(out, in/g, k…) grouped weight → (out, in, k…) with zeros outside each group's block."""
    out, per = w.shape[0], w.shape[1]
    dense = torch.zeros((out, per * g) + tuple(w.shape[2:]), dtype=w.dtype, device=w.device)
    rows_per = out // g
    for j in range(g):
        dense[j * rows_per : (j + 1) * rows_per, j * per : (j + 1) * per] = w[j * rows_per : (j + 1) * rows_per]
    return dense


def _diagonal_blocks(dense: torch.Tensor, g: int) -> torch.Tensor:
    out, cin = dense.shape[0], dense.shape[1]
    rows_per, per = out // g, cin // g
    return torch.cat(
        [dense[j * rows_per : (j + 1) * rows_per, j * per : (j + 1) * per] for j in range(g)], 0
    ).contiguous()


def _fill_weights(old: nn.Module, new: nn.Module, in_layout, out_layout, init: Init, generator) -> nn.Module:
    """Put a conv's or Linear's weight and bias into `new` at the layouts' positions."""
    with torch.no_grad():  # detached: a side that keeps its size still gets a fresh Parameter, not the old object
        w = columns(old.weight.detach(), in_layout, init, generator)
        put_tensor(new, "weight", rows(w, out_layout, init, generator, "kaiming"))
        if old.bias is not None:
            put_tensor(new, "bias", rows(old.bias.detach(), out_layout, init, generator, "zero"))
    return new


def resize_linear(
    m: nn.Linear, in_layout: Layout | None, out_layout: Layout | None, init: Init, generator: torch.Generator
) -> nn.Module:
    new = _rebuilt(
        m,
        in_features=in_layout.new if in_layout else m.in_features,
        out_features=out_layout.new if out_layout else m.out_features,
    )
    return _fill_weights(m, new, in_layout, out_layout, init, generator)


def resize_batchnorm(m: nn.modules.batchnorm._BatchNorm, layout: Layout, init: Init, generator) -> nn.Module:
    """New channels: γ=1, β=0, mean 0, var 1 (or the replicated channel's values for net2net)."""
    new = _rebuilt(m, num_features=layout.new)
    with torch.no_grad():
        if m.affine:
            put_tensor(new, "weight", rows(m.weight, layout, init, generator, "one"))
            put_tensor(new, "bias", rows(m.bias, layout, init, generator, "zero"))
        if m.track_running_stats and m.running_mean is not None:
            put_tensor(new, "running_mean", rows(m.running_mean, layout, init, generator, "zero"))
            put_tensor(new, "running_var", rows(m.running_var, layout, init, generator, "one"))
            put_tensor(new, "num_batches_tracked", m.num_batches_tracked.clone())
    return new


def resize_layernorm(m: nn.LayerNorm, layout: Layout, init: Init, generator) -> nn.Module:
    """normalized_shape = (new,); affine rows replicated (net2net) — the only exact way, checked by grow_group."""
    new = _rebuilt(m, normalized_shape=(layout.new,))
    with torch.no_grad():
        if m.weight is not None:
            put_tensor(new, "weight", rows(m.weight, layout, init, generator, "one"))
        if getattr(m, "bias", None) is not None:
            put_tensor(new, "bias", rows(m.bias, layout, init, generator, "zero"))
    return new


def resize_groupnorm(m: nn.GroupNorm, layout: Layout, generator) -> nn.Module:
    """New channels as whole new groups (the coupling placed them so): γ=1, β=0 for them."""
    unit = m.num_channels // m.num_groups
    new = _rebuilt(m, num_channels=layout.new, num_groups=layout.new // unit)
    with torch.no_grad():
        if m.affine:
            put_tensor(new, "weight", rows(m.weight, layout, "zero", generator, "one"))
            put_tensor(new, "bias", rows(m.bias, layout, "zero", generator, "zero"))
    return new


def resize_tensor_attr(
    gm: fx.GraphModule, path: str, layout: Layout, init: Init, generator, dim: int | None = None
) -> None:
    """A parameter or buffer read by get_attr whose dim `dim` holds the channels (a layer scale, a traced
    LayerNorm's affine, a class token, a position table): that dim takes the layout; new channels copy their
    source (net2net) or the mean over the old ones."""
    owner_path, _, name = path.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    old = getattr(owner, name)
    if dim is None:
        dim = max(i for i, d in enumerate(old.shape) if d == layout.old)
    with torch.no_grad():
        moved = old.detach().movedim(dim, 0)
        value = rows(moved, layout, init, generator, "mean").movedim(0, dim).contiguous()
    if name in owner._parameters:
        owner._parameters[name] = nn.Parameter(value, requires_grad=old.requires_grad)
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


_KNOWN_TENSORS = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}


def resize(m: nn.Module, in_layout: Layout | None, out_layout: Layout | None, init: Init, generator) -> nn.Module:
    own = {n for n, _ in m.named_parameters(recurse=False)} | {n for n, _ in m.named_buffers(recurse=False)}
    unknown = sorted(own - _KNOWN_TENSORS)
    if unknown or any(True for _ in m.children() for _ in _.parameters()):
        raise NotApplicable(
            f"cannot resize {type(m).__name__}: it holds tensors graphgrow does not know how to widen "
            f"({', '.join(unknown) or 'in its submodules'})",
            "grow a layer in another channel group",
        )
    if isinstance(m, nn.modules.conv._ConvNd):
        return resize_conv(m, in_layout, out_layout, init, generator)
    if isinstance(m, nn.Linear):
        return resize_linear(m, in_layout, out_layout, init, generator)
    if isinstance(m, BATCHNORMS):
        return resize_batchnorm(m, out_layout or in_layout, init, generator)
    if type(m) in (nn.LayerNorm, nn.RMSNorm):  # an RMSNorm keeps its mean square under the same replication
        return resize_layernorm(m, out_layout or in_layout, init, generator)
    if type(m) is nn.GroupNorm:
        return resize_groupnorm(m, out_layout or in_layout, generator)
    raise NotApplicable(f"cannot resize {type(m).__name__}", "this layer type is not supported by grow_width")


def grow_group(
    gm: fx.GraphModule, coupling: Coupling, gid: int, count: int, init: Init, generator: torch.Generator
) -> list[str]:
    """Widen group `gid` (and every group it reaches) by `count` channels in place; returns the rebuilt layers.
    Channels that are attention head sizes grow through the attention rewrite (rewrite.heads.grow_head_sizes)."""
    group = coupling.groups[gid]
    src = block_sources(group.size, count, coupling.step(gid), generator) if init == "net2net" else None
    try:
        plan = plan_growth(coupling, gid, count, src)
    except ValueError as e:
        raise NotApplicable(
            f"cannot grow the {group.size}-channel group of {', '.join(group.sources[:3]) or group.members[0]}: {e}",
            "widen a layer whose group can grow (graphgrow inspect --groups), or use grow_width(mode=adapter)",
        ) from e
    if any(coupling.groups[g].attentions for g in plan):
        return grow_head_sizes(gm, coupling, plan, init, generator)
    layouts = {g: make_layout(coupling.groups[g].size, ins) for g, ins in plan.items()}
    for g, layout in layouts.items():
        _check_norms(coupling.groups[g], layout, init)
        if coupling.groups[g].unit > 1 and init == "net2net":
            raise NotApplicable(
                f"a GroupNorm normalises '{coupling.groups[g].members[0]}' in groups of {coupling.groups[g].unit} "
                "channels: new channels form new groups, whose statistics replicas would not keep",
                "use init=zero",
            )
    in_layouts: dict[str, Layout] = {}
    out_layouts: dict[str, Layout] = {}
    for g, layout in layouts.items():
        grp = coupling.groups[g]
        for n in grp.sources + grp.channelwise:
            out_layouts[n] = layout
        for n in grp.consumers:
            in_layouts[n] = layout
    nodes = {n.name: n for n in gm.graph.nodes}
    tensor_layouts = {path: layout for g, layout in layouts.items() for path in coupling.groups[g].tensors}
    layers = set(in_layouts) | set(out_layouts)
    functional = [
        p for n in layers if n in coupling.functional for f in [coupling.functional[n]] for p in (f.weight, f.bias) if p
    ]
    _refuse_tied(
        gm, [nodes[n].target for n in layers if n not in coupling.functional], list(tensor_layouts) + functional
    )
    rebuilt = []
    for name in sorted(set(in_layouts) | set(out_layouts), key=list(nodes).index):
        if name in coupling.functional:
            rebuilt += resize_functional(
                gm, coupling.functional[name], nodes[name], in_layouts.get(name), out_layouts.get(name), init, generator
            )
            continue
        path = nodes[name].target
        if path in rebuilt:  # a module called several times (shared weights): its calls share one layout
            continue
        old = gm.get_submodule(path)
        set_module(gm, path, resize(old, in_layouts.get(name), out_layouts.get(name), init, generator))
        rebuilt.append(path)
    for path, layout in tensor_layouts.items():
        resize_tensor_attr(gm, path, layout, init, generator, coupling.tensor_axes.get(path))
        rebuilt.append(path)
    apply_edits(gm, coupling, layouts)  # slices, splits and reshapes whose constants name channels
    hold_size_reads(
        gm,
        {
            m: (axis, coupling.groups[g].size)
            for g in layouts
            for m in coupling.groups[g].members
            if m in nodes
            for axis in [node_axis(nodes[m])]
            if axis is not None
        },
    )
    for g, layout in layouts.items():  # a traced F.layer_norm carries its normalized_shape as a constant
        for name in coupling.groups[g].norms:
            n = nodes[name]
            if n.op == "call_function":
                if "normalized_shape" in n.kwargs:
                    n.kwargs = {**n.kwargs, "normalized_shape": (layout.new,)}
                else:
                    n.args = (n.args[0], (layout.new,), *n.args[2:])
    return rebuilt


def _check_norms(group, layout: Layout, init: Init) -> None:
    """A LayerNorm over the group keeps its mean and variance only when every channel is replicated the
    same number of times: net2net with an integer factor."""
    if not group.norms:
        return
    counts = [layout.src.count(c) for c in range(layout.old)]
    if init == "net2net" and None not in layout.src and len(set(counts)) == 1:
        return
    factor = layout.new / layout.old
    why = (
        "init=zero adds channels that are not copies"
        if init != "net2net"
        else f"growing {layout.old} → {layout.new} channels (×{factor:g}) cannot replicate every channel equally"
    )
    raise NotApplicable(
        f"LayerNorm '{group.norms[0]}' normalises over these {layout.old} channels and {why}; "
        "its mean and variance stay exact only when each channel is copied the same number of times",
        f"use grow_width(init=net2net) with an integer factor (2, 3, …), e.g. to={layout.old * 2}",
    )


def _refuse_tied(gm: fx.GraphModule, paths: list[str], tensor_paths: Sequence[str] = ()) -> None:
    """Rebuilding a layer whose parameter another module shares (tied weights) would silently untie them."""
    by_id = owners(gm)
    mine = [
        (f"{path}.{name}", p) for path in paths for name, p in gm.get_submodule(path).named_parameters(recurse=False)
    ]
    mine += [(path, gm.get_parameter(path)) for path in tensor_paths if _is_parameter(gm, path)]
    for full, p in mine:
        shared = [o for o in by_id.get(id(p), []) if o != full]
        if shared:
            raise NotApplicable(
                f"'{full}' is the same parameter as '{shared[0]}' (tied weights); growing one would untie them",
                "grow a layer whose weights are not shared, or untie them yourself first",
            )


def _is_parameter(gm: fx.GraphModule, path: str) -> bool:
    try:
        gm.get_parameter(path)
        return True
    except AttributeError:
        return False


def identity_adapter(cin: int, cout: int, spatial_dims: int | None, like: torch.Tensor) -> nn.Module:
    """The one [I | 0] (cout ≤ cin) / [I ; 0] (cout > cin) adapter: a 1×1 conv over `spatial_dims`
    (1, 2 or 3) or a Linear (None), no bias, on `like`'s device and dtype."""
    m: nn.Module
    if spatial_dims is not None:
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[spatial_dims]
        m = conv(cin, cout, 1, bias=False, device=like.device, dtype=like.dtype)
    else:
        m = nn.Linear(cin, cout, bias=False, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        m.weight.zero_()
        k = min(cin, cout)
        m.weight.view(cout, cin)[:k, :k] = torch.eye(k, device=like.device, dtype=like.dtype)
    return m
