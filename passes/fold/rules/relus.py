"""Rule family: ReLUs. A ReLU of a tensor that is never negative goes; a scalar gate behind a ReLU moves
into the ReLU's input (c·relu(z) = relu(|c|·z), a negative c turning the add that uses it into a subtract)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from graphgrow.passes.fold.graph import ADD, MUL, SUB, bypass, is_relu, module_of, scalar_operand  # noqa: TID251 (the fold package's own module)
from torch import fx, nn

_NONNEG_FNS = (
    F.relu,
    torch.relu,
    F.relu6,
    torch.sigmoid,
    F.sigmoid,
    F.softmax,
    torch.softmax,
    torch.exp,
    torch.abs,
    F.hardsigmoid,
)
_KEEP_SIGN_FNS = (
    F.max_pool2d,
    F.avg_pool2d,
    F.adaptive_avg_pool2d,
    F.adaptive_max_pool2d,
    torch.flatten,
    torch.cat,
    operator.getitem,
)
_KEEP_SIGN_METHODS = ("view", "reshape", "flatten", "permute", "transpose", "contiguous", "mean", "amax", "max")
_KEEP_SIGN_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten)
_NONNEG_MODULES = (nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Softmax, nn.Hardsigmoid)


def _nonnegative(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose output can never be negative."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        inputs = [a for a in n.all_input_nodes if a.op != "get_attr"]
        keeps = bool(inputs) and all(a in out for a in inputs)
        if n.op == "call_module":
            m = module_of(gm, n)
            if isinstance(m, _NONNEG_MODULES) or (isinstance(m, _KEEP_SIGN_MODULES) and keeps):
                out.add(n)
        elif n.op == "call_function":
            if n.target in _NONNEG_FNS or (n.target in _KEEP_SIGN_FNS and keeps):
                out.add(n)
            elif n.target in ADD + MUL and not n.kwargs and all(_nonneg_value(a, out) for a in n.args):
                out.add(n)  # sums and products of non-negative tensors and numbers (x − 1 is not one)
        elif n.op == "call_method" and (
            n.target in ("relu", "sigmoid", "exp", "abs") or (n.target in _KEEP_SIGN_METHODS and keeps)
        ):
            out.add(n)
    return out


def _nonneg_value(a: Any, nonneg: set[fx.Node]) -> bool:
    if isinstance(a, fx.Node):
        return a in nonneg
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a >= 0


def drop_idempotent_relus(gm: fx.GraphModule) -> int:
    """relu(x) for x ≥ 0 is x (a branch's leading ReLU on an already-rectified input)."""
    count = 0
    nonneg = _nonnegative(gm)
    for n in list(gm.graph.nodes):
        if is_relu(gm, n) and n.args[0] in nonneg:
            bypass(n, n.args[0])
            count += 1
    return count


def gates_through_relus(gm: fx.GraphModule) -> int:
    """c·relu(z) = relu(|c|·z) for c > 0; for c < 0 the add that uses it becomes a subtract."""
    count = 0
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in MUL:
            continue
        s = scalar_operand(n)
        if s is None or s[0] == 0.0 or s[0] == 1.0 or not is_relu(gm, s[1]) or len(s[1].users) != 1:
            continue
        c, r = s
        z = r.args[0]
        if not isinstance(z, fx.Node):
            continue
        if c < 0:
            users = list(n.users)
            if len(users) != 1 or users[0].op != "call_function" or users[0].target not in ADD + SUB:
                continue
            user = users[0]
            if user.target in ADD:
                other = user.args[1] if user.args[0] is n else user.args[0]
                user.target, user.args = operator.sub, (other, n)
            elif user.args[1] is n:
                user.target = operator.add
            else:
                continue
        with g.inserting_before(r):
            scaled = g.call_function(operator.mul, (z, abs(c)))
            scaled.meta["gg_scope"] = r.meta.get("gg_scope")
        r.args = (scaled,)
        bypass(n, r)
        count += 1
    return count
