"""The fixed-point driver and the pass: prepare once, then run the rules, the moves and the merge analysis
round after round until nothing changes; emit one layer per maximal form; report what folded and what stays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from graphgrow.passes.fold.algebra import reassociate  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.analysis import analyse  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.emit import describe_form, emit  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.prepare import prepare  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.report import kept as kept_report  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.rules import MOVES, RULES  # noqa: TID251 (the fold package's own module)
from torch import fx

from graphgrow import Pass, Rewrite, annotate, arg
from graphgrow.rewrite import copy_graph_module, finish, input_spec_of, pass_function


def _refresh(gm: fx.GraphModule, input_shape) -> None:
    """Drop dead nodes, recompile and record shapes again after an edit."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    annotate(gm, input_shape)


@pass_function  # the argument's default: Fold's declaration
def fold(gm: fx.GraphModule, grow_kernels: bool, generator: torch.Generator | None = None) -> Rewrite:
    """Fold linear structure into plain layers, in eval-mode semantics (see the package docstring).
    `grow_kernels`: a branch with a larger kernel than the main conv's may enlarge it (more FLOPs than
    before growth, fewer than unfolded); off by default."""

    code_before = gm.code
    gm = copy_graph_module(gm)
    gm.eval()
    input_shape = input_spec_of(gm)  # named inputs with their dtypes where the graph has a spec (token ids)
    notes: list[str] = ["eval-mode semantics: BatchNorm uses running statistics; dropout and drop-path are off"]
    prepare(gm, notes)
    folded: list[str] = []
    for _ in range(
        50
    ):  # every round that changes something removes nodes or orders a sum; 50 is far beyond real models
        _refresh(gm, input_shape)
        changes = sum(rule(gm) for rule in RULES)
        if changes:
            _refresh(gm, input_shape)
        moved = [line for move in MOVES for line in move(gm)]
        folded += moved
        analysis = analyse(gm, grow_kernels)
        if reassociate(gm, analysis.forms):
            _refresh(gm, input_shape)
            analysis = analyse(gm, grow_kernels)
        absorbed = set().union(*(f.nodes - {n} for n, f in analysis.forms.items())) if analysis.forms else set()
        replaced: dict[fx.Node, fx.Node] = {}  # a form's source may itself be emitted earlier in this round
        for n, f in list(analysis.forms.items()):
            if n in absorbed or len(f.nodes) < 2 or not f.weighted:
                continue
            folded.append(describe_form(gm, f))
            replaced[n] = emit(gm, n, f, replaced.get(f.src, f.src))
            changes += 1
        if not changes and not moved:
            break
    finish(gm)
    annotate(gm, input_shape)
    kept = kept_report(gm, analyse(gm, grow_kernels))
    targets: dict[str, Any] = {"folded": folded or "nothing to fold"}
    if kept:
        targets["kept"] = [f"{k}: {v}" for k, v in kept.items()]
    return Rewrite(gm, targets, notes, changed=gm.code != code_before, exact=True, eval_only=True)


@dataclass(frozen=True)
class Fold(Pass):
    """Fold growth's linear structure (BatchNorm, gates, parallel branches, adapters) into plain layers; eval mode."""

    name: ClassVar[str] = "fold"
    grows: ClassVar[bool] = False
    function = fold
    grow_kernels: bool = arg(
        False, "let a larger-kernel branch enlarge the main conv (fewer FLOPs than unfolded, more than before growth)"
    )
