"""search: population-based growth on Ray Tune (Ray is imported only when a search runs).

`MutationSpace` (the moves and the budget) needs no Ray; `search` runs PBT on Ray Tune.
May import: core, graph, io, analysis, capture, verify, rewrite, jobs.
Nothing in graphgrow but the cli imports this package.
"""

from __future__ import annotations

from .space import NOOP, POLICIES, Move, MutationSpace, Outcome, applied_moves

__all__ = [
    "NOOP",
    "POLICIES",
    "Move",
    "MutationSpace",
    "Outcome",
    "applied_moves",
    "SearchOptions",
    "SearchResult",
    "search",
]


def __getattr__(name: str):
    if name in ("SearchOptions", "SearchResult", "search"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'graphgrow.search' has no attribute {name!r}")
