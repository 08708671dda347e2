"""ModeSwitch: the part of a block's forward that differs between paths through its mode branches.

A DARTS cell applies drop-path only `if self.training and drop_prob > 0`. Tracing every path
through such branches and merging them (mode_merge.py) leaves one graph in which the difference
is a single call:

    h = cells.0.mode_switch_0(cells_0_training, gt, h, sub)      # conditions first, then inputs

Each row of `table` is one path: the answers it needs, as (condition index, answer) pairs; the
switch runs the body of the row whose answers all hold (the rows are the leaves of the branches'
decision tree, so exactly one does). Bodies are small graphs of tensor functions and methods — no
modules, no parameters — stored as plain node records, so a graphgrow file keeps them as data
and they are checked like the main graph when a file is read (serialize.graph_from_records).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import fx, nn

from ..core.errors import LoadError

MAX_PATHS = 64


class ModeSwitch(nn.Module):
    """out = bodies[i](*inputs) for the row i of `table` whose answers the `conditions` leading arguments give."""

    _is_impure = True  # a body may draw random numbers or mutate: fx must not drop an unused call

    def __init__(self, conditions: int, table: list[list[tuple[int, bool]]], bodies: list[list[dict[str, Any]]]):
        super().__init__()
        self.conditions = conditions
        self.table = [[[int(i), bool(a)] for i, a in row] for row in table]
        self.body_records = bodies

    def bodies(self) -> list[fx.GraphModule]:
        """Every path's body, built (through the file checks) on first use."""
        return self._bodies()

    def _bodies(self) -> list[fx.GraphModule]:
        compiled: list[fx.GraphModule] | None = self.__dict__.get("_compiled")
        if compiled is None:
            self.load_bodies(trusted=False)
            compiled = self.__dict__["_compiled"]
        assert compiled is not None
        return compiled

    def load_bodies(self, trusted: bool) -> None:
        """Check the table and build every body from its records through the same checks as a stored graph."""
        from .serialize import graph_from_records  # the checked path for graphs read from data

        self._check_table()
        empty = nn.Module()
        self.__dict__["_compiled"] = [
            fx.GraphModule(empty, graph_from_records(records, empty, trusted), "ModeBody")
            for records in self.body_records
        ]

    def record_count(self) -> int:
        """How many node records building every body means (a list several bodies share counts for each)."""
        bodies = self.body_records
        if not (isinstance(bodies, list) and len(bodies) <= MAX_PATHS and all(isinstance(b, list) for b in bodies)):
            raise LoadError(
                "a mode switch in the saved model has a malformed table of paths", "the file is corrupted or hostile"
            )
        return sum(len(b) for b in bodies)

    def _check_table(self) -> None:
        table, bodies, count = self.table, self.body_records, self.conditions
        ok = (
            type(count) is int
            and 0 <= count <= MAX_PATHS
            and isinstance(table, list)
            and isinstance(bodies, list)
            and 0 < len(table) == len(bodies) <= MAX_PATHS
            and all(
                isinstance(row, list)
                and all(
                    isinstance(e, list)
                    and len(e) == 2
                    and type(e[0]) is int
                    and 0 <= e[0] < count
                    and type(e[1]) is bool
                    for e in row
                )
                for row in table
            )
        )
        if not ok:
            raise LoadError(
                "a mode switch in the saved model has a malformed table of paths", "the file is corrupted or hostile"
            )

    def forward(self, *args: Any) -> Any:
        answers = [bool(c) for c in args[: self.conditions]]
        for row, body in zip(self.table, self._bodies()):
            if all(answers[i] == a for i, a in row):
                return body(*args[self.conditions :])
        raise RuntimeError(f"no path of the mode switch matches the conditions {answers}")

    def passthrough(self, answers: list[bool]) -> int | None:
        """For these condition values: the index of the input the chosen body hands back unchanged, if it does."""
        for row, body in zip(self.table, self._bodies()):
            if all(answers[i] == a for i, a in row):
                out = next(n for n in body.graph.nodes if n.op == "output").args[0]
                inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
                return inputs.index(out) if out in inputs else None
        return None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_compiled", None)  # rebuilt from the records: a file never holds generated code
        return state

    def __deepcopy__(self, memo: dict[str, Any]) -> ModeSwitch:
        """A copy in memory shares the built bodies (graphs of tensor functions, no state): a pass copies the
        model twice, and rebuilding every body through the file checks each time cost more than the pass."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key == "_compiled" else copy.deepcopy(value, memo)
        return new

    def extra_repr(self) -> str:
        return f"conditions={self.conditions}, paths={len(self.table)}"


def check_node_total(root: nn.Module, graph_nodes: int, limit: int) -> None:
    """The node limit is for the whole file: the main graph's `graph_nodes` plus every body of every switch in
    `root`, counted before any of them is built (a pickle stores a list once however often it is used, so many
    bodies sharing one long list cost the file nothing and the loader each time)."""
    total = graph_nodes
    for m in root.modules():
        if isinstance(m, ModeSwitch):
            total += m.record_count()
            if total > limit:
                raise LoadError(
                    f"the saved model has more than {limit:,} graph nodes, counting its mode switches' bodies",
                    "the file is corrupted or hostile",
                )
