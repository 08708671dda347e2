"""The architecture moves of a growth search, and how one is applied. No Ray here.

A search explores on the driver, which sees only a trial's config, and grows on a worker,
which holds the model. So a move is chosen in two halves: `MutationSpace.choose` (driver)
picks a pass spec, a seed and a fresh id; `MutationSpace.apply` (worker) resolves where the
pass goes from that seed — one of the pass's own candidate places that fits the budget —
and runs it, verified, like any pass. The same (model, move) always gives the same result,
and the id goes into the grown model's mutation log, so a trial that restarts from its own
checkpoint can tell a move it already made from a new one.

The place is drawn uniformly (policy "uniform") or aimed by the data (policy "gain": the place with
the largest first-order gain on a batch, rewrite.gain; "gain-sample": a place drawn with probability
proportional to its gain). Passes without a data-driven init keep the uniform draw.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from torch import fx

from ..analysis.budget import Limits
from ..analysis.targets import Candidate
from ..capture.trace import graph_info
from ..core.errors import GraphgrowError, InputError, SpecError
from ..graph.graph_meta import input_spec_of
from ..graph.shapes import annotate, param_count
from ..jobs.pipeline import Pipeline, _split_top, build_pipeline, make_pass, parse_spec, spec_of
from ..rewrite.gain import rank_by_gain, ranks_by_gain
from ..rewrite.gradmax import Data, load_data
from ..rewrite.pass_base import Pass

NOOP = "noop"
MOVE_KEY = "search_move"  # the key under which a log entry records the id of the move that made it
POLICIES = {
    "uniform": "a place drawn uniformly among those that fit the budget",
    "gain": (
        "the place with the largest first-order gain on the data batch (passes without a data-driven init: uniform)"
    ),
    "gain-sample": "a place drawn with probability proportional to its gain (passes without one: uniform)",
}
DATA_HINT = "give data (CLI: --data PKG.MOD:FN): a function returning (inputs, loss_fn), as for targets --data"


@dataclass(frozen=True)
class Move:
    """One architecture move as the driver chose it: a spec (or "noop"), a seed, a unique id."""

    id: str
    spec: str
    seed: int

    def to_config(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, value: object) -> Move | None:
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
    gain: float | None = None  # the chosen place's gain, when the policy ranked the places

    def to_json(self) -> dict:
        return {
            "id": self.move.id,
            "chosen": self.move.spec,
            "seed": self.move.seed,
            "grew": self.grew,
            "spec": self.spec,
            "reason": self.reason,
            "params_before": self.params_before,
            "params_after": self.params_after,
            "gain": self.gain,
        }


class MutationSpace:
    """Weighted pass specs, one of which may be "noop", and a size budget.

    `MutationSpace.parse("grow_width(factor=2)*2; deepen; add_residual; noop", max_params=1e6)`:
    moves separated by ';', an optional `*W` weight (default 1). Every spec is checked
    against the installed passes when the space is built, not mid-search.

    `policy` (POLICIES) says how the worker picks the place of a move; "gain" and "gain-sample" need
    `data` (a function, or its `package.module:function` name, returning (inputs, loss_fn)), which
    also fills `data` of the moves with init=gradmax.
    """

    def __init__(
        self,
        moves: Sequence[tuple[str, float]],
        max_params: int | None = None,
        policy: str = "uniform",
        data: Data | None = None,
    ):
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
                    raise SpecError(
                        f"move {spec!r} is {len(passes)} passes", "one pass per move; separate moves with ';'"
                    )
            checked.append((spec, float(weight)))
        if max_params is not None and max_params <= 0:
            raise SpecError(f"max_params must be positive, got {max_params}")
        self.moves = checked
        self.max_params = int(max_params) if max_params is not None else None
        self.policy, self.data = policy, data
        _check_policy(checked, policy, data)

    @classmethod
    def parse(
        cls, text: str, max_params: int | None = None, policy: str = "uniform", data: Data | None = None
    ) -> MutationSpace:
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
                    raise SpecError(
                        f"move {item!r}: weight {tail.strip()!r} is not a number", "write e.g. deepen*2"
                    ) from None
            moves.append((spec, weight))
        return cls(moves, max_params, policy, data)

    def __repr__(self) -> str:
        budget = f", max_params={self.max_params:,}" if self.max_params is not None else ""
        policy = f", policy={self.policy}" if self.policy != "uniform" else ""
        return f"MutationSpace({'; '.join(f'{s}*{w:g}' for s, w in self.moves)}{budget}{policy})"

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
            p, gain = self._place(gm, move, before)
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
            return skipped(
                f"{_shown(p)} would make {result.params_after:,} parameters (budget {self.max_params:,})", _shown(p)
            )
        graph_info(new)["log"][-1][MOVE_KEY] = move.id
        return new, Outcome(move, True, _shown(p), "", before, result.params_after, gain)

    def _place(self, gm: fx.GraphModule, move: Move, params: int) -> tuple[Pass | None, float | None]:
        """The pass of `move` with its place resolved from the move's seed among the pass's
        candidates that fit the budget (the spec's own place when it names one), by the policy;
        and the chosen place's gain when the policy ranked them."""
        ((name, args),) = parse_spec(move.spec)
        p = self._with_data(make_pass(name, args))
        if any("gg_shape" not in n.meta for n in gm.graph.nodes):
            annotate(gm, input_spec_of(gm))
        candidates = p.candidates(gm)
        if not candidates or any(k in args for c in candidates for k in c.args):
            return p, None  # the pass lists no places, or the spec already names one
        room = None if self.max_params is None else self.max_params - params
        fitting = [c for c in candidates if room is None or c.params <= room]
        if not fitting:
            return None, None
        rng = random.Random(move.seed)
        chosen, gain = rng.choice(fitting), None
        if self.policy != "uniform" and self.data is not None and ranks_by_gain(p):
            chosen, gain = self._by_gain(gm, p, fitting, move.seed, rng) or (chosen, None)
        return self._with_data(make_pass(name, {**args, **chosen.args})), gain

    def _by_gain(
        self, gm: fx.GraphModule, p: Pass, fitting: list[Candidate], seed: int, rng: random.Random
    ) -> tuple[Candidate, float] | None:
        """The place the gain policy picks among `fitting`, with its gain; None when the pass refuses
        every place (the uniform draw stands, and applying it says why)."""
        assert self.data is not None
        ranked = [(c, g) for c, g, _ in rank_by_gain(gm, p, fitting, self.data, seed=seed) if g is not None]
        if not ranked:
            return None
        if self.policy == "gain" or not any(g > 0 for _, g in ranked):
            return ranked[0]  # the largest first (rank_by_gain's order; ties keep the pass's order)
        return rng.choices(ranked, weights=[g for _, g in ranked])[0]

    def _with_data(self, p: Pass) -> Pass:
        """`p` with the space's data when it has init=gradmax and names no data of its own."""
        if self.data is not None and getattr(p, "init", None) == "gradmax" and getattr(p, "data", None) is None:
            return dataclasses.replace(p, data=self.data)  # type: ignore[call-arg]
        return p


def _shown(p: Pass) -> str:
    """The spec of `p` as the outcome shows it: a data function by its import name, not its repr."""
    data = getattr(p, "data", None)
    if callable(data):
        p = dataclasses.replace(p, data=f"{getattr(data, '__module__', '?')}:{getattr(data, '__qualname__', '?')}")  # type: ignore[call-arg]
    return spec_of(p)


def _check_policy(moves: list[tuple[str, float]], policy: str, data: Data | None) -> None:
    """A policy by name; the gain policies need data and a move whose pass can be ranked; data needs a reader."""
    if policy not in POLICIES:
        raise InputError(f"unknown search policy {policy!r}", f"one of: {', '.join(POLICIES)}")
    passes = [build_pipeline(spec)[0] for spec, _ in moves if spec != NOOP]
    blind = [p.name for p in passes if getattr(p, "init", None) == "gradmax" and getattr(p, "data", None) is None]
    if blind and data is None:
        raise InputError(
            f"the move {blind[0]}(init=gradmax) chooses new weights from data, and no data was given", DATA_HINT
        )
    if policy != "uniform":
        if data is None:
            raise InputError(
                f"policy {policy!r} ranks the places by the gradient on a batch, and no data was given", DATA_HINT
            )
        if not any(ranks_by_gain(p) for p in passes):
            raise InputError(
                f"policy {policy!r} ranks the places of passes with a data-driven init (grow_width), "
                "and none of these moves has one",
                "add e.g. grow_width to the moves, or use policy uniform",
            )
    elif data is not None and not any(getattr(p, "init", None) == "gradmax" for p in passes):
        raise InputError(
            "data is read by policy gain or gain-sample and by moves with init=gradmax, and neither is here",
            "add --policy gain, or drop --data",
        )


def check_data(data: Data) -> None:
    """Call the data function once (on the driver), so a bad one is refused before the search starts."""
    load_data(data, "search")


def applied_moves(gm: fx.GraphModule) -> set[str]:
    """Ids of the search moves recorded in `gm`'s mutation log."""
    return {str(e[MOVE_KEY]) for e in graph_info(gm).get("log", []) if MOVE_KEY in e}
