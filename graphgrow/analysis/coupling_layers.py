"""Coupling rules for layers written as function calls on parameters, and for attention.

- `F.linear(x, self.weight, self.bias)` and `F.conv*d(x, self.weight, …)` whose weight (and bias) are
  parameters read by get_attr for this call alone — timm's `Linear` classifier, any layer subclass whose
  forward calls the function — are sources and consumers like the modules they stand for; the coupling
  records their parameter paths (`Functional`) so that a growth resizes the tensors themselves.
- A conv whose weight is *computed* from a parameter (weight standardisation: timm's StdConv2d, BiT) reads
  new input channels through statistics over every input weight: zero new input weights would change them.
- `F.group_norm(x, G, self.weight, self.bias)` (timm's GroupNormAct): each group of C/G channels is normalised
  alone, so new channels grow as whole new groups (the group's `unit`), G rewritten (an edit), the affine resized.
- `scaled_dot_product_attention(q, k, v)`: q and k share their last axis (the query/key head size), v and the
  output theirs (the value head size). Those channels grow only as head sizes, through the attention
  rewrite (graphgrow.rewrite.heads), so the groups are marked with the attention; an attention that rewrite
  cannot follow freezes them with its reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from ..core.errors import NotApplicable
from ..graph.fx_edit import tensor_shape
from .axes import node_axis
from .coupling_splits import Edit
from .heads import attention_of

LINEARS = {F.linear}
CONVS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
SDPA = F.scaled_dot_product_attention
# ops a weight standardisation is made of: views of the weight and statistics over its input dims
_STANDARDISE = {"reshape", "view", "reshape_as", "view_as", "flatten", "batch_norm", "mean", "var", "std", "var_mean",
                "std_mean", "sub", "div", "mul", "add", "rsqrt", "sqrt", "pow", "truediv", "sub_", "add_"}
_STATISTICS = {"batch_norm", "mean", "var", "std", "var_mean", "std_mean"}


@dataclass
class Functional:
    """A function call standing for a layer: its weight's (and bias's) attribute path; `kind` linear | conv."""

    weight: str
    bias: str | None
    kind: str


def layer_rule(n: fx.Node, out: str | None, join, freeze, sources: list, consumers: list,
               functional: dict[str, Functional], attentions: list[tuple[str, str]], gm: fx.GraphModule,
               more: tuple[list, dict, list]) -> bool:
    """Apply the rule for `n` when it is a functional layer, a group norm or an attention; False when it is none.
    `more`: (per-channel tensors, GroupNorm units, edits) of the analysis, appended to."""
    if n.op != "call_function":
        return False
    if n.target in (F.group_norm, torch.group_norm):
        return _group_norm(n, out, join, *more)
    if n.target in LINEARS or n.target in CONVS:
        return _functional(n, out, freeze, sources, consumers, functional)
    if n.target is SDPA:
        return _attention(gm, n, out, join, freeze, attentions)
    return False


def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _own_parameter(a) -> bool:
    return isinstance(a, fx.Node) and a.op == "get_attr" and len(a.users) == 1


def _functional(n: fx.Node, out, freeze, sources, consumers, functional) -> bool:
    x, weight, bias = _arg(n, 0, "input"), _arg(n, 1, "weight"), _arg(n, 2, "bias")
    if not isinstance(x, fx.Node) or node_axis(x) is None:
        return False
    conv = n.target in CONVS
    what = f"'{n.name}' (a functional {'conv' if conv else 'linear'})"
    if not _own_parameter(weight):
        if conv and _standardised(weight):
            freeze([x], f"{what} standardises its weight: each filter's mean and variance include every input weight, "
                   "so new input channels cannot enter with zero weights (exact growth is impossible unless the new "
                   "channels are identically zero)")
            freeze([n] if out else [], f"{what} standardises its weight (a weight-standardised conv such as timm's "
                   "StdConv2d): growing its outputs is not supported yet")
        else:
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
    functional[n.name] = Functional(str(weight.target), str(bias.target) if bias is not None else None,
                                    "conv" if conv else "linear")
    consumers.append((n.name, x.name))
    if out is not None:
        sources.append((n.name, None))
    return True


def _group_norm(n: fx.Node, out, join, tensors: list, units: dict, edits: list) -> bool:
    x, groups = _arg(n, 0, "input"), _arg(n, 1, "num_groups")
    affine = [a for a in (_arg(n, 2, "weight"), _arg(n, 3, "bias")) if a is not None]
    shape = tensor_shape(x) if isinstance(x, fx.Node) else None
    if shape is None or node_axis(x) != 1 or not isinstance(groups, int) or out is None or shape[1] % groups or \
            not all(_own_parameter(a) and tensor_shape(a) == (shape[1],) for a in affine):
        return False
    join(x, n)
    units[n.name] = shape[1] // groups
    tensors += [(str(a.target), n.name) for a in affine]
    edits.append(Edit("groups", n.name, x.name, ("a", 1) if len(n.args) > 1 else ("k", "num_groups")))
    return True


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
    if not all(isinstance(t, fx.Node) and node_axis(t) == len(tensor_shape(t) or ()) - 1 for t in (q, k, v)) or out is None:
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
