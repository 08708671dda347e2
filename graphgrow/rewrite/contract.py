"""What a pass requires of its input graph and ensures of its result, declared on the pass class
(`requires`, `ensures`) and checked by Pass.__call__ (and by a direct call of the pass's plain function, for
`requires`). A requirement that does not hold refuses the pass before any work (NotApplicable: the reason and the
way out); a guarantee that does not hold after the pass is a bug in the pass (ValidationError, exit 1).
Declare only what the pass needs and promises: `graphgrow passes` shows both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx, nn

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


def used_param_count(gm: fx.GraphModule) -> int:
    """Parameters the graph reads (through call_module or get_attr), each once. A module the forward never calls
    (CLIP's post_layernorm under an image-classification head) is dropped with the unused ones after an edit
    (fx_edit.finish): it is not the pass's to count."""
    seen: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_module", "get_attr") or not isinstance(n.target, str):
            continue
        try:
            found = gm.get_submodule(n.target) if n.op == "call_module" else _attr(gm, n.target)
        except AttributeError:
            continue
        params = found.parameters() if isinstance(found, nn.Module) else [found]
        seen.update({id(p): p.numel() for p in params if isinstance(p, nn.Parameter)})
    return sum(seen.values())


def _attr(gm: fx.GraphModule, target: str) -> object:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _params_changed(more: bool) -> Callable[[fx.GraphModule, fx.GraphModule], str | None]:
    def broken(before: fx.GraphModule, after: fx.GraphModule) -> str | None:
        b, a = used_param_count(before), used_param_count(after)
        if a > b if more else a < b:
            return None
        return f"parameters {b:,} → {a:,}" + (
            f" (of {param_count(before):,} → {param_count(after):,} held)" if param_count(before) != b else ""
        )

    return broken


ADDS_PARAMETERS = Guarantee("adds parameters", _params_changed(more=True))  # a growth pass that changed the graph
REMOVES_PARAMETERS = Guarantee("removes parameters", _params_changed(more=False))
