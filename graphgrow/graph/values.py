"""Run-time values flowing between graph nodes, mapped leaf by leaf without losing their type.

torch.fx.node.map_aggregate rebuilds a tuple that is not a namedtuple as a plain tuple, and the results of
torch.topk, torch.max(dim=…), torch.sort (torch.return_types, structseqs) are such tuples: a later
`getattr(out, "indices")` node then fails. map_values keeps every tuple's own type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def map_values(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` with `fn` applied to every leaf inside lists, dicts and tuples of any kind (structseqs and
    namedtuples rebuilt as their own type)."""
    if isinstance(value, list):
        return [map_values(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_values(v, fn) for k, v in value.items()}
    if isinstance(value, tuple):
        items = [map_values(v, fn) for v in value]
        if type(value) is tuple:
            return tuple(items)
        if hasattr(value, "_fields"):  # a namedtuple: positional fields
            return type(value)(*items)
        return type(value)(items)  # a structseq (torch.return_types): built from one sequence
    return fn(value)
