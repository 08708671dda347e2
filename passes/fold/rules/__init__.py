"""fold's local rewrite rules, one family per module, registered in the two lists the driver runs each round.

RULES: `rule(gm) -> int`, a local simplification that edits the graph in place and returns how many
rewrites it made (0: nothing to do; the driver stops when a whole round changes nothing). They run in
list order, every one each round, and shapes are recorded again after them if any changed something.
MOVES: `move(gm) -> list[str]`, a rewrite that moves a layer into another; it returns one line per move
for the report's `folded:`.
"""

from __future__ import annotations

from collections.abc import Callable

from graphgrow.passes.fold.rules.heads import fold_gap_adapters, fold_select_adapters  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.rules.identities import remove_identities  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.rules.relus import drop_idempotent_relus, gates_through_relus  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.rules.terms import drop_zero_terms  # noqa: TID251 (the fold package's own module)
from torch import fx

RULES: list[Callable[[fx.GraphModule], int]] = [
    remove_identities,  # nn.Identity, dropout, drop-path: the identity in eval mode
    drop_idempotent_relus,  # relu(x) for x ≥ 0 is x
    gates_through_relus,  # c·relu(z) = relu(|c|·z)
    drop_zero_terms,  # a + 0·b → a, 1·x → x
]

MOVES: list[Callable[[fx.GraphModule], list[str]]] = [
    fold_gap_adapters,  # 1×1 conv → global pool → flatten → Linear
    fold_select_adapters,  # per-token Linear → x[:, 0] → Linear
]
