"""What stays after folding, with the reason: each growth merge or gate that is still an add, and each
module growth added that is still called (real depth, a non-linear branch, nothing to merge into)."""

from __future__ import annotations

from graphgrow.passes.fold.algebra import is_sum  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.analysis import Analysis  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.graph import SITE, module_of  # noqa: TID251 (the fold package's own module)
from torch import fx, nn

from graphgrow.rewrite import graphgrow_modules

_NON_LINEAR = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.Sigmoid, nn.Tanh, nn.MaxPool2d)


def kept(gm: fx.GraphModule, analysis: Analysis) -> dict[str, str]:
    """site or module → why it stays (the report's `kept:`), merges and gates first."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if SITE in n.meta and is_sum(n):
            out.setdefault(n.meta[SITE], analysis.why.get(n, "it stays an add"))
    out.update(_kept_modules(gm, set(out)))
    return out


def _kept_modules(gm: fx.GraphModule, reported: set[str]) -> dict[str, str]:
    """Modules growth added (the log's modules_added) that are still called after folding and not already
    reported through their merge or gate: real depth or a non-linear branch, or a linear layer with nothing
    next to it that it merges into without adding multiply-adds."""
    added = graphgrow_modules(gm)
    kinds: dict[str, list[nn.Module]] = {}
    for n in gm.graph.nodes:
        top = str(n.target).split(".")[0] if n.op == "call_module" else ""
        if top in added and not any(top in r for r in reported):
            kinds.setdefault(top, []).append(module_of(gm, n))
    kept = {}
    for top, modules in kinds.items():
        non_linear = [type(m).__name__ for m in modules if isinstance(m, _NON_LINEAR)]
        kept[f"module '{top}'"] = (
            f"real depth or a non-linear branch ({non_linear[0]})"
            if non_linear
            else f"a {type(modules[0]).__name__} with no conv/Linear next to it that it merges into "
            "without adding multiply-adds"
        )
    return kept
