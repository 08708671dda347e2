"""The check protocol: one tolerance, the check batch sizes, one output comparison.

Every check that says "this module computes what that one computes" in torch — the trace's fidelity
(capture), a pass's preservation (verify), the batch-size check (graph.shapes), the native model's
check (jobs) — reads its numbers from here, so they cannot drift apart:

- REL_TOL: outputs agree when ‖new − old‖/‖old‖ ≤ REL_TOL and max|Δ| ≤ REL_TOL·max|old| (measured in float64).
- BATCHES: the two batch sizes of a check; a batch size baked into a view/reshape shows up between them. The
  first is the check input's batch (the reference outputs are kept for it, graph.reference).
- TRAIN_PROTOCOL: how a train-mode check runs (dropout off, RNG seeded); its name keys kept outputs.
- weight_noise: the floor under an output that is a cancelled sum (an identically-zero classifier's logits): errors
  are relative to the terms a result is summed from, so a miss of REL_TOL·max|out| is judged against how far the
  output moves when every weight moves by the same relative tolerance (the ONNX check judges its misses so too).

ONNX export's equivalence (verify.equivalence) is another protocol on purpose: onnxruntime's kernels are not
torch's, so it compares element by element with per-provider rtol/atol and keeps its own tolerances there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .errors import PreservationError, ValidationError

REL_TOL = 1e-5
BATCHES = (2, 3)
TRAIN_PROTOCOL = "train, dropout off, seeded"  # how verify.preserve.train_forward runs (a name for kept outputs)


def within_tolerance(rel_err: float, max_abs_err: float, max_abs_ref: float, tol: float = REL_TOL) -> bool:
    """Whether an error measured by `measure` is within the protocol's tolerance (or `tol`)."""
    return rel_err <= tol and max_abs_err <= tol * max(max_abs_ref, 1e-30)


@dataclass
class LowPrecision:
    """How a half-precision model's growth was judged (verify.low_precision): compared in float32 on the stored
    values, within max(`ulp`, `own_rel_err`) when not within REL_TOL."""

    dtype: str
    ulp: float  # torch.finfo(dtype).eps: one unit in the last place, relative
    own_rel_err: float  # the original's own half-precision output against its float32 run

    @property
    def tolerance(self) -> float:
        return max(self.ulp, self.own_rel_err)


@dataclass
class ModeCheck:
    mode: str
    rel_err: float
    max_abs_err: float
    max_abs_ref: float
    fp64_rel_err: float | None = None  # set when the fp32 comparison missed and float64 was asked
    fp64_ok: bool | None = None
    low_precision: LowPrecision | None = None  # a bfloat16/float16 model: compared in float32, the dtype's tolerance
    weight_noise: float | None = None  # on a miss: max|Δ| the output moves by when every weight moves by REL_TOL

    @property
    def fp32_ok(self) -> bool:
        return within_tolerance(self.rel_err, self.max_abs_err, self.max_abs_ref)

    @property
    def within_dtype(self) -> bool:
        """Not exact to REL_TOL, but within the half-precision dtype's tolerance (LowPrecision)."""
        lp = self.low_precision
        return (
            lp is not None
            and not self.fp32_ok
            and within_tolerance(self.rel_err, self.max_abs_err, self.max_abs_ref, lp.tolerance)
        )

    @property
    def within_noise(self) -> bool:
        """Not within REL_TOL of the output, but within what the output moves by when every weight moves by REL_TOL:
        the output is a sum that cancels (weight_noise)."""
        return self.weight_noise is not None and self.max_abs_err <= self.weight_noise

    @property
    def ok(self) -> bool:
        return self.fp32_ok or bool(self.fp64_ok) or self.within_dtype or self.within_noise


def flat_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of an output (a tensor, tuple, dict, dataclass of tensors), in pytree order."""
    flat, _ = tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def measure(old: torch.Tensor, new: torch.Tensor, mode: str) -> ModeCheck:
    """The relative and max-abs error of `new` against `old` (same shape), in float64.

    Equal tensors measure 0 (also where both hold the same Inf); a non-finite value in `new` otherwise makes the
    relative error infinite."""
    old, new = old.detach().double(), new.detach().double()
    max_ref = old.abs().max().item() if old.numel() else 0.0
    if torch.equal(old, new):
        return ModeCheck(mode, 0.0, 0.0, max_ref)
    diff = new - old
    norm = old.norm().item()
    rel = diff.norm().item() / norm if norm > 0 else (0.0 if diff.norm().item() == 0 else float("inf"))
    if not torch.isfinite(new).all():
        rel = float("inf")
    return ModeCheck(mode, rel, diff.abs().max().item() if diff.numel() else 0.0, max_ref)


def compare_outputs(old_out: Any, new_out: Any, mode: str) -> ModeCheck:
    """The protocol's comparison: every output tensor of `new_out` against `old_out`'s, measured together.

    A different number or shape of output tensors raises PreservationError; NaN/Inf in the old output
    raises ValidationError (the comparison would say nothing)."""
    a, b = flat_tensors(old_out), flat_tensors(new_out)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise PreservationError(
            f"{mode}-mode outputs changed structure: {[tuple(t.shape) for t in a]} → {[tuple(t.shape) for t in b]}"
        )
    old = torch.cat([t.detach().double().flatten() for t in a]) if a else torch.zeros(1, dtype=torch.float64)
    new = torch.cat([t.detach().double().flatten() for t in b]) if b else torch.zeros(1, dtype=torch.float64)
    if not torch.isfinite(old).all():
        raise ValidationError(
            f"the model's own {mode}-mode output has NaN or Inf before the pass",
            "check the weights for NaN/Inf (graphgrow inspect shows them) and fix them first",
        )
    return measure(old, new, mode)


WEIGHT_NOISE_DRAWS = 3  # one random direction can move an output little by chance; the largest of three counts


def weight_noise(model: torch.nn.Module, run: Callable[[torch.nn.Module], Any], rel: float = REL_TOL) -> list[float]:
    """How far each output tensor of `run(model)` (in flat_tensors order) moves when every floating parameter of
    `model` is scaled by (1 + rel·u), u uniform in [-1, 1] (seeded; the largest max|Δ| of WEIGHT_NOISE_DRAWS draws).
    The draws run on a copy: `model` is not touched (a graph of its own that autograd holds stays valid).

    Why: float32 rounds each op's result relative to its operands, not to the final sum. An output that cancels (a
    zero-initialised classifier reading features of size 1, whose grown copy reads new features through columns
    that cancel) is ~1e-9 where its terms are ~1: any relative comparison with it measures rounding only. The
    movement under weight noise of the protocol's own relative size is an absolute floor of that size relative to
    the terms; a wrong result moves the output by the terms' own size, far above it."""
    with torch.no_grad():
        # the reference run on a copy too: a train-mode run updates BatchNorm's running stats in place, which would
        # touch the model (and invalidate a graph autograd holds over them)
        base = [t.detach().double() for t in flat_tensors(run(copy.deepcopy(model)))]
        params = [p for p in model.parameters() if p.is_floating_point()]
        if not params:
            return [0.0] * len(base)
        moving = copy.deepcopy(model)
        g = torch.Generator().manual_seed(0)
        pairs = [(p, k) for p, k in zip(moving.parameters(), model.parameters()) if k.is_floating_point()]
        noise = [0.0] * len(base)
        for _ in range(WEIGHT_NOISE_DRAWS):
            for p, k in pairs:
                u = 2 * torch.rand(k.shape, generator=g, dtype=torch.float64) - 1
                p.copy_((k.detach().double() * (1 + rel * u)).to(k.dtype))
            for i, (b, m) in enumerate(zip(base, flat_tensors(run(moving)))):
                if b.shape == m.shape and b.numel():
                    noise[i] = max(noise[i], float((m.detach().double() - b).abs().max()))
    return noise
