"""Function preservation and trainability checks (torch vs torch), architecture.md §4–5.

Preservation: the check protocol's comparison (core.protocol: ‖new − old‖/‖old‖ ≤ 1e-5 and
max|Δ| ≤ 1e-5·max|old|) on seeded random inputs, in eval and in train mode (same dropout draws,
buffers restored afterwards).
Trainability: the new parameters get a non-zero gradient at once (the zero last
factor) and every one of them within two SGD steps on a random batch.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import NotApplicable, PreservationError
from ..core.protocol import ModeCheck, compare_outputs, flat_tensors, weight_noise
from ..core.state import dropout_off, preserved_buffers, seeded, training_mode
from ..graph.float32_run import is_half
from ..graph.inputs import InputSpec, call
from ..graph.shapes import example_input
from . import gradient_sink
from .gradient_sink import GradientSink, gradient_bytes, restore_rng, rng_state
from .low_precision import compare_half
from .zero_factor import ZeroFactors
from .zero_factor import new_region as _new_region


@dataclass
class PreservationReport:
    eval: ModeCheck
    train: ModeCheck | None  # None: eval-mode semantics only (a deployment transform such as fold)
    trainable: dict[str, int] = field(default_factory=dict)  # new param → SGD step at which it first got a gradient
    dead: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # no train-mode gradient: a later normalisation cancels them
    # no gradient, in an old layer the output does not reach in the old model either (its old weights get none)
    unreached: list[str] = field(default_factory=list)

    @property
    def degenerate(self) -> bool:
        """The old output was all zeros: the comparison says little."""
        return self.eval.max_abs_ref == 0.0 or (self.train is not None and self.train.max_abs_ref == 0.0)

    @property
    def max_rel_err(self) -> float:
        return max(self.eval.rel_err, self.train.rel_err if self.train is not None else 0.0)

    @property
    def trainable_ok(self) -> bool:
        return not self.dead

    def to_json(self) -> dict:
        return {
            "max_rel_err": self.max_rel_err,
            "eval_ok": self.eval.ok,
            "train_ok": self.train.ok if self.train is not None else None,
            "trainable_ok": self.trainable_ok,
            "eval_rel_err": self.eval.rel_err,
            "train_rel_err": self.train.rel_err if self.train is not None else None,
            "eval_fp64_rel_err": self.eval.fp64_rel_err,
            "train_fp64_rel_err": self.train.fp64_rel_err if self.train is not None else None,
            "new_parameters": self.trainable,
            "unreached_parameters": self.unreached,
            **({"low_precision": _low_precision_json(self.eval, self.train)} if self.eval.low_precision else {}),
        }


def _low_precision_json(ev: ModeCheck, tr: ModeCheck | None) -> dict:
    lp = ev.low_precision
    assert lp is not None
    own = max(lp.own_rel_err, tr.low_precision.own_rel_err if tr is not None and tr.low_precision else 0.0)
    return {
        "dtype": lp.dtype,
        "compared_in": "float32, node by node, on the stored values",
        "exact": ev.fp32_ok and (tr is None or tr.fp32_ok),
        "tolerance": max(lp.ulp, own),
        "ulp": lp.ulp,
        "own_rel_err": own,
    }


def compare_mode(
    old: nn.Module, new: nn.Module, x: torch.Tensor, mode: str, seed: int, old_out: Any, new_out: Any
) -> ModeCheck:
    """Compare two outputs of one mode (neither model is changed).

    A miss of the tolerance in fp32 is measured again in float64 on copies: splitting a
    weight into shares (Net2Net) is exact in real arithmetic but rounds differently in
    fp32, and deep train-mode BatchNorm stacks amplify that. The float64 verdict
    decides; the fp32 error stays in the report. A bfloat16/float16 model is compared in float32 on its stored
    values, node by node, with the dtype's tolerance (low_precision.py). Missed in both, the error is judged against
    how far the grown model's output moves when every weight moves by REL_TOL (core.protocol.weight_noise): an
    output that cancels (a zero-initialised head reading grown features through columns that cancel: exactly 0
    before, ~1e-9 after) has no relative error to speak of, only one relative to its terms.
    """
    if isinstance(old, fx.GraphModule) and isinstance(new, fx.GraphModule) and is_half(new):
        return compare_half(old, new, x, mode, seed, old_out)  # in float32 on the stored values (low_precision.py)
    check = compare_outputs(old_out, new_out, mode)
    x64 = _in_float64(x)
    if check.ok:
        return check
    if x64 is not None:
        try:
            with torch.no_grad():
                old64, new64 = copy.deepcopy(old).double(), copy.deepcopy(new).double()
                if mode == "eval":
                    again = compare_outputs(eval_forward(old64, x64), eval_forward(new64, x64), "eval")
                else:
                    again = compare_outputs(train_forward(old64, x64, seed), train_forward(new64, x64, seed), "train")
            check.fp64_rel_err = again.rel_err
            check.fp64_ok = again.ok
        except Exception:  # noqa: BLE001 - a model that cannot run in float64 (a fixed float32 cast mixes dtypes, an
            pass  # input it does not take): the float32 verdict stands, as for inputs that cannot be recast
    if not check.ok:  # an output that cancels (~0 where its terms are ~1) is judged against the terms' rounding floor
        forward = eval_forward if mode == "eval" else (lambda m, x: train_forward(m, x, seed))
        with contextlib.suppress(Exception):  # a model that cannot run on `x` here: the verdict stands
            check.weight_noise = max(weight_noise(new, lambda m: forward(m, x)), default=0.0)
    return check


def _in_float64(x: Any) -> Any:
    """The check input in float64 for the re-measure: a float32 tensor cast, or named inputs with their float32
    tensors cast and token ids and masks kept (CPM-Ant's growth is judged on token ids too); None for inputs of
    another floating dtype (a half model is judged by low_precision.py) or of another kind."""
    if isinstance(x, torch.Tensor):
        return x.double() if x.dtype == torch.float32 else None
    if not isinstance(x, dict) or not all(isinstance(v, torch.Tensor) for v in x.values()):
        return None
    if any(v.is_floating_point() and v.dtype != torch.float32 for v in x.values()):
        return None
    return {k: v.double() if v.is_floating_point() else v for k, v in x.items()}


def eval_forward(m: nn.Module, x: torch.Tensor):
    """`m`'s eval-mode output on `x`, without gradient."""
    with torch.no_grad(), training_mode(m, False):
        return call(m, x)


def train_forward(m: nn.Module, x: torch.Tensor, seed: int):
    """`m`'s train-mode output on `x`: dropout off, global RNG seeded, buffers restored afterwards; no gradient
    (core.protocol.TRAIN_PROTOCOL names this run)."""
    with torch.no_grad(), training_mode(m, True), dropout_off(m), preserved_buffers(m), seeded(seed):
        return call(m, x)


NARROW_STEPS = True  # training everything, take a step with the new parameters' gradients first (tests turn it off)


def check_trainability(
    new: nn.Module,
    new_params: dict,
    upstream: list[str],
    input_shape: InputSpec,
    seed: int = 0,
    batch: int = 2,
    steps: int = 3,
    lr: float = 0.01,
    train_all: bool = False,
    old_nodes: set[str] | None = None,
    first_output: Callable[[Any], None] | None = None,
) -> tuple[dict[str, int], list[str], list[str]]:
    """Which new parameters get a non-zero gradient, and at which SGD step (0 = at once).

    Returns (first step per parameter, dead, cancelled). *Cancelled* parameters get
    no gradient in train mode but do in eval mode: a following normalisation removes
    their effect on batch statistics (like a conv bias before BatchNorm) — redundant,
    reported, not refused. *Dead* ones get no gradient either way.

    Train mode as in train_forward (same input, dropout off, seeded): the first
    forward's output is handed to `first_output` (the train-mode preservation check
    needs exactly that output). Loss = <output, R> for a fixed random R, normalised SGD steps. New
    parameters whose shape grew count by their new region only. `upstream` names old
    parameters just before the new nodes: when the gradient reaches them at step 0
    but no new parameter gets one, the contribution is dead from the start
    (PreservationError). Only the parameters under test require grad, so backward
    stops where they end; when nothing gets a gradient at first (a zero-initialised
    head, as in torchvision's ViT) every parameter trains, as it would in real
    training; so too when the model's own all-zero weight or gain (a post-norm γ = 0) may
    block the new path while the layers before learn through a skip. `new` is restored
    exactly afterwards. Large step-0 gradients are read as backward makes them and freed
    (gradient_sink.py): step 0 runs again, keeping them, only when an SGD step must follow.
    """
    if not new_params:
        return {}, [], []
    params = dict(new.named_parameters())
    cancelled: list[str] = []
    saved_flags = {n: p.requires_grad for n, p in params.items()}
    # SGD steps replace a parameter's data instead of writing into it, and the end puts the original back: no copy
    # of the whole model, and storage shared with the input model (Pass(share=True)) is never written
    saved_values = {n: p.data for n, p in params.items()}
    x = example_input(new, input_shape, seed=seed, batch=batch)
    got: dict[str, int] = {}
    proj: list[torch.Tensor] | None = None

    def eval_mode_learners(names: list[str]) -> list[str]:
        """Those of `names` that get a gradient in eval mode (at the current values)."""
        for n, p in params.items():
            p.requires_grad_(n in names)
            p.grad = None
        with torch.enable_grad(), training_mode(new, False):
            outs = [t for t in flat_tensors(call(new, x)) if t.is_floating_point()]
            loss = torch.stack([(t * r).sum() for t, r in zip(outs, proj or [])]).sum() if outs else torch.zeros(())
            if loss.requires_grad:
                loss.backward()
        return [
            n
            for n in names
            if params[n].grad is not None and _new_region(params[n].grad, new_params[n][0]).abs().sum() > 0
        ]

    # the model's own zero weights (torchvision's ViT head) move in step 0's SGD step, as in training: when they
    # block every gradient at first, the steps that train everything then start one step earlier
    blocking = {n for n, p in params.items() if n not in new_params and p.dim() >= 2 and not p.detach().any()}
    own_zeros = blocking or {  # also a zero gain (a norm's γ, a layer scale): it blocks what it multiplies
        n
        for n, p in params.items()
        if n not in new_params
        and n.rpartition(".")[2] != "bias"
        and p.is_floating_point()
        and p.numel()
        and not p.detach().any()
    }
    try:
        with training_mode(new, True), dropout_off(new), preserved_buffers(new), seeded(seed):
            step, last_step, had, again, full_at = -1, steps, 0, False, -1
            while step < last_step:
                step += 1
                # training everything because the model's own zero weights blocked step 0 (they have moved since), a
                # step is first taken with the new parameters' gradients only (the same gradients: which other leaves
                # require one does not change them); only when an SGD step must follow is it taken again with every
                # gradient, which that step moves
                narrow = NARROW_STEPS and train_all and bool(blocking) and step >= 1 and step != full_at
                waiting = {n for n in new_params if n not in got}
                watched = (
                    (waiting if narrow else set(params))
                    if train_all
                    else (waiting | set(upstream) | blocking if step == 0 else set(new_params))
                )
                for n, p in params.items():
                    p.requires_grad_(n in watched)
                    p.grad = None
                # not when the model's own zero weights block gradients: SGD steps follow, step 0 would run twice
                lean = (
                    step == 0
                    and not again
                    and not blocking
                    and gradient_bytes(params, watched) >= gradient_sink.LEAN_BYTES
                )
                start = rng_state() if lean or narrow else None
                with ZeroFactors(new, new_params, params, enabled=len(got) < len(new_params)) as factors:
                    out = factors.forward(x)
                if step == 0 and first_output is not None and not again:
                    first_output(out)
                outs = [t for t in flat_tensors(out) if t.is_floating_point()]
                if proj is None:
                    g = torch.Generator().manual_seed(seed + 2)
                    proj = [torch.randn(t.shape, generator=g).to(t) for t in outs]
                loss = torch.stack([(t * r).sum() for t, r in zip(outs, proj)]).sum() if outs else torch.zeros(())
                del out, outs
                if lean:  # the zero factors' own gradients stay: the argument for step 1 needs them
                    if _settled_lean(params, watched, new_params, factors, loss, got):
                        break
                    restore_rng(start)  # an SGD step follows and needs every gradient: step 0 again, keeping them
                    step, again = -1, True
                    continue
                if loss.requires_grad:
                    loss.backward(retain_graph=factors.kept)
                with torch.no_grad():
                    # any non-zero gradient counts: a real one can be tiny (a gate behind a head that has just started
                    # to move gets 1e-10), so a relative floor cannot tell it from rounding (a bias before a train-mode
                    # BatchNorm gets 1e-12 of the others, and then counts as learning: redundant, never refused)
                    for name, (old_shape, _) in new_params.items():
                        grad = params[name].grad
                        if name not in got and grad is not None and _new_region(grad, old_shape).abs().sum() > 0:
                            got[name] = step
                    if (
                        factors.kept
                    ):  # what the next SGD step would show, from this step's zero factors (zero_factor.py)
                        got.update(factors.argue(params, got, step))
                    if step == 0 and not got and not train_all:
                        # the layers before get a gradient and the new ones none: dead, unless the model's own zero
                        # factor (Swin V2's post-norm γ = 0, a zero layer scale or gain) blocks the new path; training
                        # moves it at the first step, as a zero head's, so train everything then (a truly dead path,
                        # two zero factors of its own, stays dead and is refused after the steps)
                        if any(_has_grad(params[n]) for n in upstream) and not own_zeros:
                            refuse_if_silent(new, list(new_params), x, old_nodes)
                            raise PreservationError(
                                "no new parameter gets a gradient at insertion although the layers before it do: "
                                "the new contribution is dead",
                                "the last factor of a new path must be zero and the others non-zero "
                                "(docs/architecture.md §4)",
                            )
                        train_all = True  # the model blocks its own gradient at first: train everything
                        last_step += 1  # step 0 only watched the new parameters; give the full budget
                    if len(got) == len(new_params) or step == last_step:
                        break
                    if narrow:  # not settled: the SGD step needs every gradient, so this step again with them
                        restore_rng(start)
                        full_at, step = step, step - 1
                        continue
                    for p in params.values():
                        if p.grad is not None:
                            p.data = p.detach() - lr * p.grad / (p.grad.norm() + 1e-12) * (p.norm() + 1e-3)
                            # freed as the step goes: the new values and the gradients are not all held at once
                            p.grad = None
                    # a step in which gradient reached new parameters before but no further ones: stop early if the
                    # rest is cancelled in train mode (learns in eval mode), rather than spending the remaining steps
                    if step >= 1 and got and len(got) == had:
                        missing = [n for n in new_params if n not in got]
                        if set(eval_mode_learners(missing)) == set(missing):
                            cancelled = missing
                            break
                    had = len(got)
            missing = [n for n in new_params if n not in got and n not in cancelled]
        if missing:  # cancelled by a following normalisation in train mode, or dead?
            cancelled += eval_mode_learners(missing)
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.data = saved_values[n]
                p.grad = None
                p.requires_grad_(saved_flags[n])
    dead = [n for n in new_params if n not in got and n not in cancelled]
    return got, dead, cancelled


def _settled_lean(
    params: dict, watched: set[str], new_params: dict, factors: ZeroFactors, loss: torch.Tensor, got: dict[str, int]
) -> bool:
    """Step 0's backward with each gradient read and freed as it comes; True (and `got` filled) when every new
    parameter gets a gradient at once or, by the zero-factor argument, at step 1, so no SGD step is needed."""
    old_shapes = {n: old for n, (old, _) in new_params.items()}
    sink = GradientSink(params, watched, old_shapes, keep=set(factors.layers) | set(factors.gates))
    try:
        if loss.requires_grad:
            loss.backward(retain_graph=factors.kept)
    finally:
        sink.remove()
    found = {n: 0 for n in new_params if n in sink.reached}
    with torch.no_grad():
        if factors.kept:
            found.update(factors.argue(params, found, 0))
    for p in params.values():
        p.grad = None
    if len(found) < len(new_params):
        return False
    got.update(found)
    return True


def _has_grad(p: torch.Tensor) -> bool:
    return p.grad is not None and bool((p.grad != 0).any())


def owner_calls(gm: nn.Module, names: list[str]) -> list:
    """The call_module nodes of `gm` whose module owns one of the parameters `names`, or contains
    one that does (a new nn.Sequential block is called as a whole)."""
    owners = {name.rpartition(".")[0] for name in names if "." in name}
    graph = getattr(gm, "graph", None)
    return [
        n
        for n in (graph.nodes if graph is not None else ())
        if n.op == "call_module" and any(o == n.target or o.startswith(f"{n.target}.") for o in owners)
    ]


_FREE_OPS = ("call_function", "call_method", "call_module")


def reads_old(n, old_nodes: set[str], through_free_of: nn.Module | None = None) -> bool:
    """Whether node `n`'s first argument is a node of the model before the pass; with `through_free_of` (the graph's
    module), also through new nodes without parameters in between (a branch's leading ReLU: zeros in, zeros out)."""
    a = n.args[0] if n.args else None
    while (
        through_free_of is not None
        and getattr(a, "name", None) not in old_nodes
        and getattr(a, "op", None) in _FREE_OPS
    ):
        if a.op == "call_module" and any(True for _ in through_free_of.get_submodule(a.target).parameters()):
            return False
        a = a.args[0] if a.args else None
    return getattr(a, "name", None) in old_nodes


def silent_inputs(gm: nn.Module, dead: list[str], x: torch.Tensor, old_nodes: set[str]) -> list[str]:
    """Modules owning `dead` parameters that read an old node's tensor which is identically zero in eval
    and train mode: the model (a dead ReLU), not the pass, keeps them from learning."""
    owners = sorted({str(n.target) for n in owner_calls(gm, dead) if reads_old(n, old_nodes, through_free_of=gm)})
    seen: dict[str, float] = {}
    hooks = []
    for path in owners:

        def record(module, args, path=path):
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            seen[path] = max(seen.get(path, 0.0), float(t.detach().abs().max()) if t is not None else float("inf"))

        hooks.append(gm.get_submodule(path).register_forward_pre_hook(record))
    try:
        with torch.no_grad(), preserved_buffers(gm):
            for mode in (False, True):
                with training_mode(gm, mode), dropout_off(gm):
                    call(gm, x)
    finally:
        for h in hooks:
            h.remove()
    return [p for p in owners if seen.get(p, float("inf")) == 0.0]


def refuse_if_silent(gm: nn.Module, names: list[str], x: torch.Tensor, old_nodes: set[str] | None) -> None:
    """NotApplicable when new layers cannot learn because the old tensor they read is zero (the model's doing, not
    the pass's)."""
    if not old_nodes:
        return
    silent = silent_inputs(gm, names, x, old_nodes)
    if silent:
        raise NotApplicable(
            f"the tensor entering '{silent[0]}' is zero on every check input (a dead ReLU before it?): "
            "layers grown there cannot learn",
            "grow at another place, or train the model first",
        )
