"""The vocabulary every part of fold shares: which ops count as add, subtract, multiply and ReLU, and the
small graph edits (bypass a node, substitute a constant) the rules are written with."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

SITE = "gg_fold_site"  # node meta: the growth structure an add came from (for the report)
MUL = (operator.mul, torch.mul)
ADD = (operator.add, torch.add)
SUB = (operator.sub, torch.sub)
RELU_FN = (F.relu, torch.relu)


def module_of(gm: fx.GraphModule, n: fx.Node) -> nn.Module | None:
    """The module a call_module node calls; None for any other node."""
    return gm.get_submodule(n.target) if n.op == "call_module" else None


def substitute(node: fx.Node, value: Any) -> None:
    """Replace every use of `node` with a Python constant."""
    for user in list(node.users):
        user.args = fx.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = fx.map_arg(user.kwargs, lambda a: value if a is node else a)


def bypass(node: fx.Node, by: fx.Node) -> None:
    """Every use of `node` reads `by` instead, and `node` goes."""
    node.replace_all_uses_with(by)
    node.graph.erase_node(node)


def scalar_operand(n: fx.Node) -> tuple[float, fx.Node] | None:
    """(c, x) for x·c or c·x with a Python number c."""
    a, b = (list(n.args) + [None, None])[:2]
    if isinstance(a, fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return float(b), a
    if isinstance(b, fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a), b
    return None


def is_relu(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return type(module_of(gm, n)) is nn.ReLU
    if n.op == "call_function":
        return n.target in RELU_FN and len(n.args) == 1
    return n.op == "call_method" and n.target == "relu" and len(n.args) == 1
