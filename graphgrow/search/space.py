"""The architecture moves of a growth search, and how one is applied. No Ray here.

A search explores on the driver, which sees only a trial's config, and grows on a worker,
which holds the model. So a move is chosen in two halves: `MutationSpace.choose` (driver)
picks a pass spec, a seed and a fresh id; `MutationSpace.apply` (worker) resolves where the
pass goes from that seed — one of the pass's own candidate places that fits the budget —
and runs it, verified, like any pass. The same (model, move) always gives the same result,
and the id goes into the grown model's mutation log, so a trial that restarts from its own
checkpoint can tell a move it already made from a new one.
"""
from __future__ import annotations

import random
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from torch import fx

from ..analysis.budget import Limits
from ..core.errors import GraphgrowError, SpecError
from ..rewrite.pass_base import Pass
from ..jobs.pipeline import Pipeline, _split_top, build_pipeline, make_pass, parse_spec, spec_of
from ..graph.shapes import annotate, param_count
from ..capture.trace import graph_info
from ..graph.graph_meta import input_spec_of

NOOP = "noop"
MOVE_KEY = "search_move"  # the key under which a log entry records the id of the move that made it


@dataclass(frozen=True)
class Move:
    """One architecture move as the driver chose it: a spec (or "noop"), a seed, a unique id."""

    id: str
    spec: str
    seed: int

    def to_config(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, value: object) -> "Move | None":
        if not isinstance(value, dict):
            return None
        return cls(str(value["id"]), str(value["spec"]), int(value["seed"]))


@dataclass
class Outcome:
    """What applying a move did. `spec` is the resolved spec (with the place chosen); `grew` is
    False for a no-op and for a move that was skipped (`reason` says why)."""

    move: Move
    grew: bool
    spec: str
    reason: str
    params_before: int
    params_after: int

    def to_json(self) -> dict:
        return {"id": self.move.id, "chosen": self.move.spec, "seed": self.move.seed, "grew": self.grew,
                "spec": self.spec, "reason": self.reason, "params_before": self.params_before,
                "params_after": self.params_after}


class MutationSpace:
    """Weighted pass specs, one of which may be "noop", and a size budget.

    `MutationSpace.parse("grow_width(factor=2)*2; deepen; add_residual; noop", max_params=1e6)`:
    moves separated by ';', an optional `*W` weight (default 1). Every spec is checked
    against the installed passes when the space is built, not mid-search.
    """

    def __init__(self, moves: Sequence[tuple[str, float]], max_params: int | None = None):
        if not moves:
            raise SpecError("the mutation space is empty", "give at least one pass spec, e.g. 'deepen;noop'")
        checked: list[tuple[str, float]] = []
        for spec, weight in moves:
            spec = spec.strip()
            if not (isinstance(weight, (int, float)) and weight > 0 and weight < float("inf")):
                raise SpecError(f"move {spec!r} has weight {weight!r}", "weights are positive numbers, e.g. deepen*2")
            if spec != NOOP:
                passes = build_pipeline(spec)
                if len(passes) != 1:
                    raise SpecError(f"move {spec!r} is {len(passes)} passes", "one pass per move; separate moves with ';'")
            checked.append((spec, float(weight)))
        if max_params is not None and max_params <= 0:
            raise SpecError(f"max_params must be positive, got {max_params}")
        self.moves = checked
        self.max_params = int(max_params) if max_params is not None else None

    @classmethod
    def parse(cls, text: str, max_params: int | None = None) -> "MutationSpace":
        moves = []
        for item in _split_top(text, ";"):
            if not item:
                raise SpecError(f"empty move in {text!r}", "separate moves with single ';'")
            spec, weight = item, 1.0
            head, star, tail = item.rpartition("*")
            if star and ")" not in tail:
                try:
                    spec, weight = head.strip(), float(tail)
                except ValueError:
                    raise SpecError(f"move {item!r}: weight {tail.strip()!r} is not a number", "write e.g. deepen*2") from None
            moves.append((spec, weight))
        return cls(moves, max_params)

    def __repr__(self) -> str:
        budget = f", max_params={self.max_params:,}" if self.max_params is not None else ""
        return f"MutationSpace({'; '.join(f'{s}*{w:g}' for s, w in self.moves)}{budget})"

    def choose(self, rng: random.Random) -> Move:
        """Driver side: a spec by weight, a seed and a fresh id (all from `rng`)."""
        specs, weights = zip(*self.moves)
        spec = rng.choices(specs, weights=weights)[0]
        return Move(id=uuid.UUID(int=rng.getrandbits(128)).hex[:12], spec=spec, seed=rng.randrange(2**31))

    def apply(self, gm: fx.GraphModule, move: Move, limits: Limits | None = None) -> tuple[fx.GraphModule, Outcome]:
        """Worker side: the model after `move` (or `gm` itself when the move is a no-op or cannot
        apply within the budget) and what happened. Deterministic in (gm's structure, move)."""
        before = param_count(gm)

        def skipped(reason: str, spec: str = move.spec) -> tuple[fx.GraphModule, Outcome]:
            return gm, Outcome(move, False, spec, reason, before, before)

        if move.spec == NOOP:
            return skipped("no-op")
        if self.max_params is not None and before >= self.max_params:
            return skipped(f"the model has {before:,} parameters, the budget is {self.max_params:,}")
        try:
            p = self._place(gm, move, before)
            if p is None:
                return skipped(f"no place for {move.spec} fits the budget of {self.max_params:,} parameters")
            room = limits or Limits()
            if self.max_params is not None:
                room = replace(room, max_new_params=min(room.max_new_params, self.max_params - before))
            result = Pipeline([p], seeds=[move.seed], limits=room).run(gm).results[0]
        except GraphgrowError as e:
            return skipped(f"{type(e).__name__}: {e.message}", spec=move.spec)
        new = result.gm
        if self.max_params is not None and result.params_after > self.max_params:
            return skipped(f"{spec_of(p)} would make {result.params_after:,} parameters (budget {self.max_params:,})", spec_of(p))
        graph_info(new)["log"][-1][MOVE_KEY] = move.id
        return new, Outcome(move, True, spec_of(p), "", before, result.params_after)

    def _place(self, gm: fx.GraphModule, move: Move, params: int) -> Pass | None:
        """The pass of `move` with its place resolved from the move's seed among the pass's
        candidates that fit the budget (the spec's own place when it names one)."""
        ((name, args),) = parse_spec(move.spec)
        p = make_pass(name, args)
        if any("gg_shape" not in n.meta for n in gm.graph.nodes):
            annotate(gm, input_spec_of(gm))
        candidates = p.candidates(gm)
        if not candidates or any(k in args for c in candidates for k in c.args):
            return p  # the pass lists no places, or the spec already names one
        room = None if self.max_params is None else self.max_params - params
        fitting = [c for c in candidates if room is None or c.params <= room]
        if not fitting:
            return None
        chosen = random.Random(move.seed).choice(fitting)
        return make_pass(name, {**args, **chosen.args})


def applied_moves(gm: fx.GraphModule) -> set[str]:
    """Ids of the search moves recorded in `gm`'s mutation log."""
    return {str(e[MOVE_KEY]) for e in graph_info(gm).get("log", []) if MOVE_KEY in e}
