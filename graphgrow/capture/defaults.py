"""Optional forward arguments are not model inputs: fixed to their defaults while tracing, their
placeholders (and the asserts fx hangs on them) dropped from the graph afterwards."""

from __future__ import annotations

import inspect
from typing import Any

from torch import fx, nn


def concrete_defaults(model: nn.Module) -> dict[str, Any]:
    """Forward parameters that have defaults (and *args/**kwargs): fixed, not model inputs."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    fixed = {}
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is not p.empty and i > 0:
            fixed[p.name] = p.default
    return fixed


def drop_fixed_placeholders(graph: fx.Graph) -> None:
    """Remove placeholders of arguments fixed to their defaults, with the asserts fx hangs on them.

    fx gives such a placeholder its default as `args`; the first placeholder (the model input) stays, and so
    does a `*args`/`**kwargs` placeholder the forward reads.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders[1:]:
        if str(ph.target).startswith("*") and not ph.users:
            graph.erase_node(ph)  # an unused *args / **kwargs (transformers' forwards take **kwargs): not an input
            continue
        if not ph.args:
            continue
        dependents: list[fx.Node] = []
        todo = [ph]
        while todo:
            n = todo.pop()
            for u in n.users:
                if u not in dependents:
                    dependents.append(u)
                    todo.append(u)
        if any(d.op == "output" for d in dependents):
            continue  # the argument's value flows to the output: keep it as it is
        order = {n: i for i, n in enumerate(graph.nodes)}
        for d in sorted(dependents, key=lambda n: -order[n]):
            graph.erase_node(d)
        graph.erase_node(ph)
