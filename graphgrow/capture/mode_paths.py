"""Which paths through a block's mode branches to trace (mode_merge.py merges them).

While a block is traced for merging, every Python branch on a flag or a live number is answered by a policy
(`follow`) and recorded as a Condition with its site and code location; `unexplored` lists the answer patterns a
trace showed but did not try, so each site's whole decision tree is traced. MergeError: what cannot be merged,
naming the block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import fx

Path = tuple[bool, ...]
MAX_PATHS = 16  # traces per merge; every one re-runs the model's forward symbolically
MAX_CONDITIONS = 4096  # branches answered in one trace; a loop on a live number would never stop


@dataclass
class Condition:
    node: fx.Node  # the value Python branched on
    site: int
    position: int  # in its site's chain of conditions
    reader: str  # path of the module whose forward branched
    after: fx.Node | None  # the last tensor-work node created before it
    answer: bool
    location: Any = None  # (file, line) of the `if` that asked it
    forced: bool = False  # a value asked before in this trace: its earlier answer, never explored the other way


class MergeError(Exception):
    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


Policy = tuple[tuple[Any, Path], ...]  # (code location of a site's `if`, the answers it is given first), sorted


def follow(policy: Policy) -> Callable[[Any, Path], bool]:
    """Answer a site's conditions with the prefix its code location is given, then True."""
    prefixes = dict(policy)

    def answer(location: Any, history: Path) -> bool:
        prefix = prefixes.get(location, ())
        return prefix[len(history)] if len(history) < len(prefix) else True

    return answer


def unexplored(conditions: list[Condition], policy: Policy) -> list[Policy]:
    """Answer patterns a trace under `policy` showed but did not try: each True it gave by default, as False,
    at that site's code location (sites at the same `if` — a cell's loop, every cell — are explored together;
    a nested `if` has its own location, so its answers combine with the outer one's)."""
    prefixes = dict(policy)
    out: list[Policy] = []
    seen_sites: dict[int, list[Condition]] = {}
    for c in conditions:
        seen_sites.setdefault(c.site, []).append(c)
    for conds in seen_sites.values():
        location, answers = conds[0].location, tuple(c.answer for c in conds)
        for j in range(len(prefixes.get(location, ())), len(answers)):
            if conds[j].forced:
                continue
            new = tuple(sorted({**prefixes, location: answers[:j] + (not answers[j],)}.items(), key=repr))
            if new not in out:
                out.append(new)
    return out
