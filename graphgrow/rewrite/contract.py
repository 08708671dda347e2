"""What a pass requires of its input graph and ensures of its result, declared on the pass class
(`requires`, `ensures`) and checked by Pass.__call__ (and by a direct call of the pass's plain function, for
`requires`). A requirement that does not hold refuses the pass before any work (NotApplicable: the reason and the
way out); a guarantee that does not hold after the pass is a bug in the pass (ValidationError, exit 1).
Declare only what the pass needs and promises: `graphgrow passes` shows both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from ..core.errors import NotApplicable, ValidationError
from ..graph.shapes import param_count


@dataclass(frozen=True)
class Requirement:
    """A precondition on the input graph: `holds(gm)`; else NotApplicable(`why`, `hint`)."""

    name: str  # in words, as `graphgrow passes` shows it
    holds: Callable[[fx.GraphModule], bool]
    why: str
    hint: str

    def check(self, gm: fx.GraphModule) -> None:
        if not self.holds(gm):
            raise NotApplicable(self.why, self.hint)


@dataclass(frozen=True)
class Guarantee:
    """A postcondition on a pass that changed the graph: `broken(before, after)` says how it does not hold, or None."""

    name: str
    broken: Callable[[fx.GraphModule, fx.GraphModule], str | None]

    def check(self, pass_name: str, before: fx.GraphModule, after: fx.GraphModule) -> None:
        why = self.broken(before, after)
        if why is not None:
            raise ValidationError(
                f"pass {pass_name} broke its guarantee '{self.name}': {why} (a bug in the pass)",
                "report it with the model and the spec",
            )


def _params_changed(more: bool) -> Callable[[fx.GraphModule, fx.GraphModule], str | None]:
    def broken(before: fx.GraphModule, after: fx.GraphModule) -> str | None:
        b, a = param_count(before), param_count(after)
        return None if (a > b if more else a < b) else f"parameters {b:,} → {a:,}"

    return broken


ADDS_PARAMETERS = Guarantee("adds parameters", _params_changed(more=True))  # a growth pass that changed the graph
REMOVES_PARAMETERS = Guarantee("removes parameters", _params_changed(more=False))
