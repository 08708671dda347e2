"""Coupling rules for layers written as function calls on parameters, and for attention.

- `F.linear(x, self.weight, self.bias)` and `F.conv*d(x, self.weight, …)` whose weight (and bias) are
  parameters read by get_attr for this call alone — timm's `Linear` classifier, any layer subclass whose
  forward calls the function — are sources and consumers like the modules they stand for; the coupling
  records their parameter paths (`Functional`) so that a growth resizes the tensors themselves.
- A conv whose weight is *standardised* from a parameter (timm's StdConv2d, BiT) grows its outputs (each new
  filter is standardised alone) but not its inputs: each filter's statistics include every input weight, so zero
  new input weights would change them.
- `F.group_norm(x, G, self.weight, self.bias)` (timm's GroupNormAct): each group of C/G channels is normalised
  alone, so new channels grow as whole new groups (the group's `unit`), G rewritten (an edit), the affine resized.
- `scaled_dot_product_attention(q, k, v)`: q and k share their last axis (the query/key head size), v and the
  output theirs (the value head size). Those channels grow only as head sizes, through the attention
  rewrite (graphgrow.rewrite.heads), so the groups are marked with the attention; an attention that rewrite
  cannot follow freezes them with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from ..core.errors import NotApplicable
from ..graph import ops
from ..graph.fx_edit import tensor_shape
from .axes import node_axis
from .coupling_build import Build, Site
from .coupling_splits import ChannelEdit
from .heads import attention_of
from .stacked import StackedProduct, stacked_product

LINEARS = {F.linear}
CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
SDPA = F.scaled_dot_product_attention
# ops a weight standardisation is made of: views of the weight and statistics over its input dims
_STATISTICS = ops.MOMENTS | {"batch_norm"}  # F.batch_norm(w, None, None, training=True): a moment over the weight
_STANDARDISE = (
    ops.RESHAPES
    | ops.RESHAPES_AS
    | _STATISTICS
    | ops.BINARY_NAMES
    | {"flatten", "rsqrt", "sqrt", "pow", "sub_", "add_"}
)


@dataclass
class Functional:
    """A function call standing for a layer: its weight's (and bias's) attribute path; `kind` linear | conv."""

    weight: str
    bias: str | None
    kind: str  # linear | conv | stacked (one weight matrix per expert: analysis.stacked)
    standardised: bool = False  # the weight is standardised in the graph: outputs grow, inputs cannot
    out_axis: int = 0  # the weight's axis of output channels (rows)
    in_axis: int = 1  # its axis of input channels (columns); a stacked weight's other axes are its experts


def layer_rule(b: Build, s: Site) -> bool:
    """Apply the rule for the site's node when it is a functional layer, a group norm or an attention; False when it
    is none."""
    n, out, gm = s.node, s.out, b.gm
    product = stacked_product(gm, n) if n.op in ("call_function", "call_method") else None
    if product is not None:
        return _stacked(b, s, product)
    if n.op != "call_function":
        return False
    if n.target in (F.group_norm, torch.group_norm):
        return _group_norm(n, out, b.join, b.tensors, b.units, b.edits)
    if n.target in LINEARS or n.target in CONVS:
        return _functional(gm, n, out, b.freeze, b.sources, b.consumers, b.functional)
    if n.target is SDPA:
        return _attention(gm, n, out, b.join, b.freeze, b.attentions)
    return False


@dataclass
class ConvFacts:
    """What a 2-D conv computes, whether an nn.Conv2d module or a call (F.conv2d on its own or a standardised
    weight)."""

    in_channels: int
    out_channels: int
    groups: int
    kernel_size: tuple[int, ...]


def conv2d_facts(gm: fx.GraphModule, n: fx.Node) -> ConvFacts | None:
    """The facts of a 2-D conv node (a Conv2d module, or a conv2d call whose weight's shape is known), else None."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if not isinstance(m, torch.nn.Conv2d):
            return None
        return ConvFacts(m.in_channels, m.out_channels, m.groups, tuple(m.kernel_size))
    if n.op != "call_function" or CONVS.get(n.target) != 2:
        return None
    w, groups = _arg(n, 1, "weight"), _arg(n, 6, "groups", 1)
    shape = tensor_shape(w) if isinstance(w, fx.Node) else None
    if shape is None or len(shape) != 4 or not isinstance(groups, int):
        return None
    return ConvFacts(shape[1] * groups, shape[0], groups, tuple(shape[2:]))


def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _own_parameter(a) -> bool:
    return isinstance(a, fx.Node) and a.op == "get_attr" and len(a.users) == 1


def _functional(gm: fx.GraphModule, n: fx.Node, out, freeze, sources, consumers, functional) -> bool:
    x, weight, bias = _arg(n, 0, "input"), _arg(n, 1, "weight"), _arg(n, 2, "bias")
    if not isinstance(x, fx.Node) or node_axis(x) is None:
        return False
    conv = n.target in CONVS
    what = f"'{n.name}' (a functional {'conv' if conv else 'linear'})"
    standardised = conv and not _own_parameter(weight) and _standardised(weight)
    if standardised:
        freeze(
            [x],
            f"{what} standardises its weight: each filter's mean and variance include every input weight, "
            "so new input channels cannot enter with zero weights (exact growth is impossible unless the new "
            "channels are identically zero)",
        )
        if out is not None and not filters_apart(gm, weight):
            freeze([n], f"{what} computes its weight in a way that mixes filters: new filters would move the old ones")
    elif not _own_parameter(weight):
        freeze([x] + ([n] if out else []), f"{what} takes its weight from a computed tensor, not a parameter")
        return True
    if bias is not None and not _own_parameter(bias):
        freeze([x] + ([n] if out else []), f"{what} takes its bias from a computed tensor, not a parameter")
        return True
    groups = _arg(n, 6, "groups", 1) if conv else 1
    if groups != 1:
        freeze([x] + ([n] if out else []), f"{what} has groups={groups}: grouped functional convs are not grown yet")
        return True
    axis = node_axis(x)
    if (conv and axis != 1) or (not conv and axis != len(tensor_shape(x) or ()) - 1):
        freeze([x], f"{what} reads a non-channel axis")
        return True
    path = _parameter_of(weight) if standardised else str(weight.target)
    functional[n.name] = Functional(
        path, str(bias.target) if bias is not None else None, "conv" if conv else "linear", standardised
    )
    if not standardised:
        consumers.append((n.name, x.name))
    if out is not None:
        sources.append((n.name, None))
    return True


def _stacked(b: Build, s: Site, p: StackedProduct) -> bool:
    """A product with an expert-stacked weight: per expert a Linear, so a consumer of its input's channels along the
    contracted axis and a source of its output's along the weight's output axis; every expert grows alike."""
    n, x = s.node, p.x
    what = f"'{n.name}' (a product with the stacked weight '{p.weight}')"
    if node_axis(x) == p.x_axis:
        b.consumers.append((n.name, x.name))
    else:
        b.freeze([x], f"{what} contracts another axis of '{x.name}' than its channels")
    if s.out is not None and node_axis(n) == p.y_axis:
        b.sources.append((n.name, None))
    elif s.out is not None:
        b.freeze([n], f"{what} puts its output features on another axis than the channels")
    b.functional[n.name] = Functional(p.weight, None, "stacked", out_axis=p.out_axis, in_axis=p.in_axis)
    return True


def _group_norm(n: fx.Node, out, join, tensors: list, units: dict, edits: list) -> bool:
    x, groups = _arg(n, 0, "input"), _arg(n, 1, "num_groups")
    affine = [a for a in (_arg(n, 2, "weight"), _arg(n, 3, "bias")) if a is not None]
    shape = tensor_shape(x) if isinstance(x, fx.Node) else None
    if (
        shape is None
        or node_axis(x) != 1
        or not isinstance(groups, int)
        or out is None
        or shape[1] % groups
        or not all(_own_parameter(a) and tensor_shape(a) == (shape[1],) for a in affine)
    ):
        return False
    join(x, n)
    units[n.name] = shape[1] // groups
    tensors += [(str(a.target), n.name) for a in affine]
    edits.append(ChannelEdit("groups", n.name, x.name, ("a", 1) if len(n.args) > 1 else ("k", "num_groups")))
    return True


def filters_apart(gm: fx.GraphModule, w: fx.Node) -> bool:
    """Run the weight's computation on its parameter with two extra random filters (rows), the literals naming the
    filter count adjusted as the rewrite will: the old filters must come out unchanged."""
    chain = _chain(w)
    try:
        param = gm.get_parameter(_parameter_of(w))
    except AttributeError:  # no such parameter (a buffer, a plain tensor attribute)
        return False
    if param.is_meta:
        return True  # sizing a pass on the meta device (analysis.budget): the real run decides
    old = param.shape[0]
    with torch.no_grad():
        grown = torch.cat([param, torch.randn((2,) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)])
        try:
            before, after = _run(chain, param, old, old), _run(chain, grown, old, old + 2)
        except (RuntimeError, TypeError, ValueError):
            return False
    return after.shape[0] == old + 2 and torch.allclose(after[:old], before, rtol=1e-5, atol=1e-6)


def _chain(w: fx.Node) -> list[fx.Node]:
    seen, todo = {}, [w]
    while todo:
        a = todo.pop()
        if a.name not in seen:
            seen[a.name] = a
            todo += a.all_input_nodes
    return [n for n in w.graph.nodes if n.name in seen]


def _run(chain: list[fx.Node], param: torch.Tensor, old: int, new: int) -> torch.Tensor:
    env: dict[str, Any] = {}
    for n in chain:
        if n.op == "get_attr":
            env[n.name] = param
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a.name])
        if n.op == "call_method" and n.target in ("reshape", "view"):
            args = (args[0],) + tuple(new if a == old and isinstance(a, int) else a for a in args[1:])
        env[n.name] = (
            getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
        )
    out = env[chain[-1].name]
    assert isinstance(out, torch.Tensor)
    return out


def _parameter_of(w: fx.Node) -> str:
    """The one parameter a standardised weight is computed from."""
    todo = [w]
    while todo:
        a = todo.pop()
        if a.op == "get_attr":
            return str(a.target)
        todo += a.all_input_nodes
    raise AssertionError("a standardised weight without a parameter")


def _standardised(w) -> bool:
    """`w` is computed from one parameter through views and statistics over it (weight standardisation)."""
    seen, todo, params, stats = set(), [w], [], False
    while todo:
        a = todo.pop()
        if not isinstance(a, fx.Node) or a.name in seen:
            continue
        seen.add(a.name)
        if a.op == "get_attr":
            params.append(a.target)
            continue
        name = a.target if isinstance(a.target, str) else getattr(a.target, "__name__", "")
        if a.op not in ("call_function", "call_method") or name not in _STANDARDISE or len(seen) > 32:
            return False
        stats |= name in _STATISTICS
        todo += a.all_input_nodes
    return stats and len(set(params)) == 1


def _attention(gm: fx.GraphModule, n: fx.Node, out, join, freeze, attentions) -> bool:
    q, k, v = _arg(n, 0, "query"), _arg(n, 1, "key"), _arg(n, 2, "value")
    if (
        not all(isinstance(t, fx.Node) and node_axis(t) == len(tensor_shape(t) or ()) - 1 for t in (q, k, v))
        or out is None
    ):
        return False
    join(q, k)  # q·kᵀ sums over the query/key head size
    join(v, n)  # each output channel is a mix of the same value channel
    for role, t, growing in (("q", q, {"d", "e"}), ("v", v, {"e"})):
        try:
            attention_of(gm, n, growing)
        except NotApplicable as e:
            freeze([t] + ([k] if role == "q" else [n]), f"attention '{n.name}': {e.message}")
            continue
        attentions.append((n.name, t.name))
    return True
