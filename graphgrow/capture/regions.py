"""Regions of a traced graph, as mode merging cuts one path's work out of a trace (mode_merge.py): what a value is
computed from inside a region, what the region reads from outside, and which nodes are safe to compute twice."""

from __future__ import annotations

from torch import fx


def pure(n: fx.Node) -> bool:
    """Safe to compute twice: reading a size, dtype or device, or arithmetic on such values."""
    return (n.op == "call_method" and n.target in ("size", "dim")) or (
        n.op == "call_function"
        and (n.target is getattr or getattr(n.target, "__module__", "") in ("_operator", "operator"))
    )


def ancestors_in(value: fx.Node, nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes among `nodes` that `value` is computed from (itself included)."""
    inside, found, todo = set(nodes), set(), [value]
    while todo:
        n = todo.pop()
        if n in inside and n not in found:
            found.add(n)
            todo.extend(n.all_input_nodes)
    return found


def outside_inputs(nodes: list[fx.Node], value: fx.Node) -> list[fx.Node]:
    """What a body reads from outside: its nodes' inputs, or the value itself when the body is the identity."""
    inside = set(nodes)
    if value not in inside:
        return [value]
    out: list[fx.Node] = []
    for n in nodes:
        out += [a for a in n.all_input_nodes if a not in inside and a not in out]
    return out
