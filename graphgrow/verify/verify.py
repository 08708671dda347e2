"""Verification after every pass: lint, recompile, shapes at two batch sizes, preservation, trainability."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..analysis.hearing import heard as _heard  # one threshold: what is refused, what a default avoids
from ..core.errors import NotApplicable, PreservationError, ValidationError
from ..core.protocol import BATCHES, TRAIN_PROTOCOL, ModeCheck, flat_tensors
from ..core.state import dropout_off, preserved_buffers, training_mode
from ..core.threads import check_threads
from ..graph.fx_edit import new_parameters, upstream_parameters
from ..graph.inputs import InputSpec, batch_of, positional
from ..graph.reference import recall, remember
from ..graph.shapes import ShapeRun, example_input, first_examples, run_recording, same_inputs, validate_batch_sizes
from .preserve import (
    PreservationReport,
    check_trainability,
    compare_mode,
    eval_forward,
    owner_calls,
    reads_old,
    refuse_if_silent,
    train_forward,
)


def annotation_input(new: fx.GraphModule, input_shape: InputSpec, seed: int = 0) -> Any:
    """What `shapes.annotate` should run the grown model on so that verification can reuse the run as its second
    batch size: the first examples of verification's own input (the example batch is below BATCHES[0]); None
    otherwise (annotate's own input)."""
    examples = max(batch_of(input_shape), 1)
    if examples >= BATCHES[0]:
        return None
    return first_examples(example_input(new, input_shape, seed=seed, batch=BATCHES[0]), examples)


def verify(
    old: fx.GraphModule,
    new: fx.GraphModule,
    input_shape: InputSpec,
    seed: int = 0,
    exact: bool = True,
    eval_only: bool = False,
    example_run: ShapeRun | None = None,
) -> PreservationReport:
    """Raise ValidationError / PreservationError unless `new` is a valid, exact, trainable growth of `old`.

    `exact=False` (a pass that changes the function on purpose) measures the change without refusing it.
    `eval_only=True` (a deployment transform such as fold) checks eval mode only, and no trainability.
    A small model is checked with one intra-op thread (core.threads.check_threads). `example_run`: annotate's run of
    `new` in eval mode on annotation_input's examples, reused as the second batch size (instead of BATCHES[1]).
    """
    with check_threads(new, input_shape):
        return _verify(old, new, input_shape, seed, exact, eval_only, example_run)


def _verify(
    old: fx.GraphModule,
    new: fx.GraphModule,
    input_shape: InputSpec,
    seed: int,
    exact: bool,
    eval_only: bool,
    example_run: ShapeRun | None = None,
) -> PreservationReport:
    try:
        new.graph.lint()
        new.recompile()
    except Exception as e:
        raise ValidationError(
            f"the rewritten graph is malformed: {e}", "this is a bug in the pass; please report it"
        ) from e
    b1 = BATCHES[0]
    x = example_input(new, input_shape, seed=seed, batch=b1)
    with training_mode(new, False):
        first = run_recording(new, x)
    examples = max(batch_of(input_shape), 1)
    if example_run is not None and examples < b1 and same_inputs(example_run.inputs, first_examples(x, examples)):
        # the example batch's run (made by annotate just before) is the second batch size: a size baked into the graph
        # shows up between it and b1 as between b1 and BATCHES[1], and its examples are the first of x
        validate_batch_sizes(new, input_shape, (b1, examples), first=first, first_input=x, second=example_run)
    else:
        validate_batch_sizes(new, input_shape, BATCHES, first=first, first_input=x)
    train_protocol = f"{TRAIN_PROTOCOL} {seed}"
    old_eval = recall(old, "eval", x)
    if old_eval is None:
        old_eval = eval_forward(old, x)
    ev = compare_mode(old, new, x, "eval", seed, old_eval, first.output)
    _refuse_change(ev, exact)
    if eval_only:
        remember(new, "eval", x, first.output)
        return PreservationReport(ev, None)
    old_train = recall(old, train_protocol, x)
    if old_train is None:
        old_train = train_forward(old, x, seed)
    checked: dict[str, Any] = {}

    def check_train(new_train: Any) -> None:  # the train-mode comparison, on the trainability check's first output
        checked["out"] = new_train
        checked["check"] = compare_mode(old, new, x, "train", seed, old_train, new_train)
        _refuse_change(checked["check"], exact)

    grown = new_parameters(old, new)
    upstream = upstream_parameters(old, new, grown)
    old_nodes = {n.name for n in old.graph.nodes}
    got, dead, cancelled = check_trainability(
        new, grown, upstream, input_shape, seed=seed, batch=b1, old_nodes=old_nodes, first_output=check_train
    )
    if "check" not in checked:  # nothing new to train: the train-mode comparison on its own
        check_train(train_forward(new, x, seed))
    tr: ModeCheck = checked["check"]
    if (
        dead
    ):  # the model may block its own gradient (a zero-initialised last BatchNorm): train everything, as training would
        again, dead, cancelled = check_trainability(
            new, grown, upstream, input_shape, seed=seed, batch=b1, train_all=True
        )
        got = {**again, **got}
    if dead:  # a new unit behind a ReLU can be off on two check examples and on for others: try more, other examples
        again, dead, cancelled = check_trainability(
            new, grown, upstream, input_shape, seed=seed + 1, batch=4 * b1, train_all=True
        )
        got = {**again, **got}
    unreached: list[str] = []
    if dead:
        refuse_if_silent(new, dead, x, old_nodes)
        deaf = deaf_points(old, new, dead, x, old_nodes)
        unreached = [p for p in dead if _owner_point(new, p, old_nodes) in deaf]
        if got and len(unreached) == len(dead):
            # every dead one sits in an old layer whose own weights get no gradient from the output either (an
            # index-only scorer such as DeepSeek's sparse-attention indexer, read through topk): the growth around
            # it learns, and its new entries are as trainable as its old ones
            dead = []
        elif deaf:
            raise NotApplicable(
                f"the model's output does not depend on '{deaf[0]}' on the check inputs (no gradient reaches it, "
                "in eval or train mode, or a vanishing one, below 1e-14 of the output's: a dead ReLU after it, too "
                "deep an untrained stack?): layers grown there cannot learn",
                "grow at another place, or train the model first",
            )
    if dead:
        raise PreservationError(
            f"new parameters get no gradient after 3 SGD steps, in train or eval mode: {', '.join(dead)}",
            "never zero both the incoming and the outgoing weights of new units (docs/architecture.md §4)",
        )
    # the next pass of a pipeline compares against exactly these outputs (the models are as they were when computed)
    remember(old, "eval", x, old_eval)
    remember(old, train_protocol, x, old_train)
    remember(new, "eval", x, first.output)
    remember(new, train_protocol, x, checked["out"])
    return PreservationReport(ev, tr, got, dead, cancelled, unreached)


def _owner_point(new: fx.GraphModule, param: str, old_nodes: set[str]) -> str | None:
    """The old node that holds `param` in `new`: the call of the old module that owns it (rebuilt wider), or the
    old get_attr reading it; None for a parameter of a new module."""
    owner = param.rpartition(".")[0]
    for n in new.graph.nodes:
        if n.name in old_nodes and (
            (n.op == "call_module" and n.target == owner) or (n.op == "get_attr" and n.target == param)
        ):
            return n.name
    return None


def _refuse_change(check: ModeCheck, exact: bool) -> None:
    if exact and not check.ok:
        lp = check.low_precision
        limit = f"{lp.tolerance:.3g}, {lp.dtype}'s tolerance, compared in float32" if lp is not None else "1e-5"
        raise PreservationError(
            f"the pass changed the model's {check.mode}-mode output: relative error {check.rel_err:.3g}, "
            f"max |Δ| {check.max_abs_err:.3g} (limit {limit} of max |out| {check.max_abs_ref:.3g})"
            + (f", {check.fp64_rel_err:.3g} in float64" if check.fp64_rel_err is not None else "")
            + (
                f", above {check.weight_noise:.3g}, what every weight moving by 1e-5 moves it"
                if check.weight_noise is not None
                else ""
            ),
            "this is a bug in the pass; please report it with the model",
        )


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.is_floating_point())  # token ids cannot carry a gradient


def deaf_points(
    old: fx.GraphModule, new: fx.GraphModule, dead: list[str], x: torch.Tensor, old_nodes: set[str]
) -> list[str]:
    """Old tensors at the modules owning `dead` parameters (what they read, or what a rebuilt old module
    gives) that get no gradient in the *old* model, in eval and train mode: the model, not the pass,
    keeps those layers from learning."""
    users = owner_calls(new, dead)
    # the tensor a new module reads, or the output of an old module that was rebuilt wider, or an old parameter read
    # directly (HRM's initial state, used under no_grad): a fresh leaf stands in for it, so its gradient is seen
    direct = {n.name for n in new.graph.nodes if n.op == "get_attr" and str(n.target) in dead and n.name in old_nodes}
    reads = sorted(
        {n.args[0].name for n in users if reads_old(n, old_nodes)}
        | {n.name for n in users if n.name in old_nodes}
        | direct
    )
    if not reads:
        return []
    heard: set[str] = set()
    g = torch.Generator().manual_seed(1)
    kept: dict[str, torch.Tensor] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.name in direct and isinstance(out, torch.Tensor) and out.is_floating_point():
                out = out.detach().clone().requires_grad_(True)
                kept[n.name] = out
            elif n.name in reads and isinstance(out, torch.Tensor) and out.requires_grad:
                out.retain_grad()
                kept[n.name] = out
            return out

    for mode in (False, True):
        kept.clear()
        with training_mode(old, mode), dropout_off(old), preserved_buffers(old):
            xi = {k: _grad_leaf(v) for k, v in x.items()} if isinstance(x, dict) else _grad_leaf(x)
            outs = [
                t for t in flat_tensors(Keep(old).run(*positional(xi))) if t.is_floating_point() and t.requires_grad
            ]
            if outs:
                sum((t * torch.randn(t.shape, generator=g).to(t)).sum() for t in outs).backward()
        heard |= {k for k, t in kept.items() if t.grad is not None and _heard(t.grad)}
    return [r for r in reads if r not in heard]
