"""The sharded growth step layer by layer (fsdp.grow_fsdp's default where the model fits, layerwise.py): no rank
holds more than the parts outside the stack and one layer's full tensors.

1. agree: every rank says its spec and seed proposal; they must agree (rank 0's seed when none is given);
2. plan: the passes run once on the model's structure (meta device, no collective), and on each window
   (layerwise.plan) — the same decision on every rank, so a model that does not fit falls back on every rank; then
   the old model's outputs on the verification input in eval and train mode (run sharded: a collective);
3. per layer, in the order the graph runs them: its old tensors gathered (`full_tensor()`, to the host, one at a time),
   its window grown with ddp.grow_replica (spec and seed agreed, rank 0 verifies the window in eval and train mode,
   every rank checks the others grew bit-identical tensors), the grown tensors put into the planned architecture and
   the layer's unit sharded with its old settings (fully_shard keeps this rank's shard; the full tensors go); every
   rank reports whether its sharding worked before the next collective; with a `Spill` (release_old), each old
   shard and gradient goes to its file (fsdp_spill.py) as soon as the tensor is gathered, so the old and grown
   states never coexist whole;
4. the parts outside the stack (and new modules there, each a unit of its own), then the root unit;
5. the whole grown model, sharded (FSDP gathers one unit at a time), checked against the old model's outputs of
   step 2 (verify="none" skips both).

Any failure raises on every rank before the optimiser is touched; without a Spill the old model is only read, with
one the caller restores it (fsdp.grow_fsdp).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import DistributedError, InputError, PreservationError, first_line
from ..core.protocol import compare_outputs
from ..graph.graph_meta import input_spec_of
from ..graph.shapes import example_input
from ..rewrite.pass_base import Pass
from ..verify.preserve import eval_forward, train_forward
from . import layerwise as lw
from . import replicas as rp
from .ddp import Verify, grow_replica, parse_growth
from .fsdp_spill import Spill, local_state
from .fsdp_units import _reshard_all, plan_units, sharding_units, unsharded_copy
from .pipeline import PipelineResult


def grow_by_layers(
    model: fx.GraphModule,
    spec: str | Sequence[str],
    units: list,
    *,
    seed: int | None,
    verify: Verify,
    timeout: float,
    spill: Spill | None = None,
) -> tuple[fx.GraphModule, int, dict[str, float]]:
    """The grown model, sharded like `model` (`units`: fsdp.sharding_units), its agreed seed and the seconds of each
    stage. Raises layerwise.NotLayerwise on every rank when the model does not fit (nothing has changed then).
    `spill`: each old parameter's shard and gradient go to it once the parameter is gathered (the caller restores it
    on failure)."""
    t0 = time.perf_counter()
    reps = rp.replicas(timeout)
    passes, agreed = _agree(reps, spec, seed)
    meta = unsharded_copy(model, meta=True)
    plan = _agreed_plan(reps, meta, passes, agreed)
    seconds = {"plan": time.perf_counter() - t0, "grow": 0.0, "reshard": 0.0}
    reference = None
    if verify != "none":  # the old model's outputs, before its state is released part by part
        t1 = time.perf_counter()
        reference = _reference(reps, model)
        seconds["check"] = time.perf_counter() - t1
    grown = lw.mark_log(copy.deepcopy(plan.gm), len(passes))
    modules = dict(grown.named_modules())
    called = [t for t in dict.fromkeys(n.target for n in grown.graph.nodes if n.op == "call_module") if t in modules]
    with_params = {p for p in called if any(True for _ in modules[p].parameters())}
    planned = plan_units(units, set(modules), called, with_params, {p for p, _ in model.named_modules()})
    by_part: dict[str, list] = {}
    for unit in planned[:-1]:
        names = [f"{p}.{n}" for p in unit.paths for n, _ in modules[p].named_parameters()]
        owners = {plan.owner(n) for n in names}
        if len(owners) != 1:
            raise lw.NotLayerwise(
                f"an FSDP unit ({', '.join(unit.paths[:3])}) holds tensors of several layers", "it grows as a whole"
            )
        by_part.setdefault(owners.pop(), []).append(unit)
    old = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def grow_window(win: fx.GraphModule, window_seed: int) -> fx.GraphModule:
        start = time.perf_counter()
        out = grow_replica(
            win, None, passes, seed=window_seed, verify=verify, timeout=timeout, sync_buffers=False, share=True
        ).gm
        seconds["grow"] += time.perf_counter() - start
        return out

    fetch = _Fetch(old, reps, spill, {n for n, _ in model.named_parameters()})
    for part, tensors in lw.grow_parts(plan, meta, fetch, grow_window, agreed):
        start = time.perf_counter()
        lw.fill(grown, tensors)
        del tensors
        todo = by_part.get(part, []) + ([planned[-1]] if part == lw.OUTSIDE else [])
        _shard_units(reps, grown, todo, part)
        seconds["reshard"] += time.perf_counter() - start
    if reference is not None:
        t2 = time.perf_counter()
        _check_whole(reps, reference, grown)
        seconds["check"] += time.perf_counter() - t2
    seconds["gather"] = fetch.seconds
    return grown, agreed, seconds


def _agreed_plan(reps: rp.Replicas, meta: fx.GraphModule, passes: list[Pass], seed: int) -> lw.Plan:
    """layerwise.plan on every rank, and the same verdict everywhere: a rank whose planning failed makes every rank
    raise; a rank whose model does not fit makes every rank fall back (NotLayerwise)."""
    own: BaseException | None = None
    unfit: lw.NotLayerwise | None = None
    try:
        plan = lw.plan(meta, passes, seed)
    except lw.NotLayerwise as e:
        unfit = e
    except Exception as e:  # reported to every rank, then raised here again
        own = e
    records = reps.gather(
        {"error": rp.error_text(own) if own else None, "unfit": unfit.message if unfit else None}, "planning growth"
    )
    rp.raise_failures(reps, records, own, "planning growth")
    why = next((r["unfit"] for r in records if r["unfit"]), None)
    if why is not None:
        raise unfit or lw.NotLayerwise(why, "it grows as a whole")
    return plan


def result_of(grown: fx.GraphModule) -> PipelineResult:
    return PipelineResult(grown, [])


class _Fetch:
    """An old tensor's full value on the host by name: a DTensor gathered on its mesh (a collective of the training
    group: a rank that died there is a DistributedError, not a bare backend error). With a `spill`, a parameter's
    shard and gradient go to it once gathered: growth reads each old tensor once, and its full value from then on."""

    def __init__(self, old: dict[str, Any], reps: rp.Replicas, spill: Spill | None, params: set[str]):
        self.old, self.reps, self.seconds = old, reps, 0.0
        self.spill, self.params = spill, params

    def __call__(self, name: str) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        start = time.perf_counter()
        t = self.old[name]
        try:
            out = t.full_tensor().to("cpu") if isinstance(t, DTensor) else t.detach().to("cpu", copy=True)
        except (RuntimeError, OSError) as e:  # DistBackendError is a RuntimeError
            raise DistributedError(
                f"rank {self.reps.rank}: growth stopped while gathering {name}: {first_line(e, 200)}", rp.HINT
            ) from e
        if self.spill is not None and name in self.params:
            self.spill.release(local_state([t]))
        self.seconds += time.perf_counter() - start
        return out.detach()


def shard_unit(grown: fx.GraphModule, unit: Any) -> None:
    """fully_shard on one planned unit of the grown model (module-level: tests make it fail on one rank)."""
    from torch.distributed.fsdp import fully_shard

    modules = dict(grown.named_modules())
    fully_shard([modules[p] for p in unit.paths] if unit.paths != ("",) else grown, **unit.options)


def _shard_units(reps: rp.Replicas, grown: fx.GraphModule, units: list, part: str) -> None:
    own: BaseException | None = None
    try:
        if units and units[-1].paths == ("",):
            left = [n for n, t in (*grown.named_parameters(), *grown.named_buffers()) if t.device.type == "meta"]
            if left:
                raise InputError(f"no window gave the grown model's {left[0]}", "grow the whole model")
        for unit in units:
            shard_unit(grown, unit)
    except Exception as e:  # reported to every rank, then raised here again
        own = e
    records = reps.gather({"error": rp.error_text(own) if own else None}, f"re-sharding {part or 'the root'}")
    rp.raise_failures(reps, records, own, "re-sharding")


def _agree(reps: rp.Replicas, spec: str | Sequence[str], seed: int | None) -> tuple[list[Pass], int]:
    own: BaseException | None = None
    passes: list[Pass] = []
    text = ""
    try:
        passes, text = parse_growth(spec, seed)
    except Exception as e:
        own = e
    proposal = seed if seed is not None else random.SystemRandom().randrange(2**31)
    records = reps.gather(
        {"error": rp.error_text(own) if own else None, "spec": text, "seed": seed, "proposal": proposal},
        "agreeing on the growth step",
    )
    rp.raise_failures(reps, records, own, "reading the spec")
    for key in ("spec", "seed"):
        differs = rp.first_disagreement(records, key)
        if differs:
            raise DistributedError(
                f"rank {reps.rank}: rank {differs[0]}'s growth {key} {differs[1]!r} is not rank 0's "
                f"{records[0][key]!r}",
                "every rank must call grow() with the same spec and seed",
            )
    return passes, int(records[0]["proposal"])


def _compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The half-precision dtype a unit computes in (MixedPrecisionPolicy.param_dtype), the coarsest; None: none."""
    found = [getattr(u.options.get("mp_policy"), "param_dtype", None) for u in sharding_units(model)]
    halves = [d for d in found if d in (torch.bfloat16, torch.float16)]
    return max(halves, key=lambda d: torch.finfo(d).eps) if halves else None


_MODES = (("eval", eval_forward), ("train", lambda m, x: train_forward(m, x, 0)))


@dataclass
class _Reference:
    """The old model's outputs on the verification input, in eval and train mode."""

    x: Any
    outputs: dict[str, Any]
    half: torch.dtype | None  # the units' half-precision compute dtype (None: float32)


def _reference(reps: rp.Replicas, old: fx.GraphModule) -> _Reference:
    """The old model run sharded on every rank (a collective each) on the verification input, in eval and train mode
    (dropout off, buffers restored), before growth releases anything of it."""
    own: BaseException | None = None
    ref: _Reference | None = None
    try:
        x = example_input(old, input_spec_of(old), seed=0)
        ref = _Reference(x, {mode: run(old, x) for mode, run in _MODES}, _compute_dtype(old))
    except Exception as e:  # reported to every rank, then raised here again
        own = e
    finally:  # a root unit keeps its gathered tensors registered after forward; the optimiser holds the shards
        _reshard_all(old)
    records = reps.gather({"error": rp.error_text(own) if own else None}, "running the old model")
    rp.raise_failures(reps, records, own, "running the old model")
    assert ref is not None
    return ref


def _check_whole(reps: rp.Replicas, ref: _Reference, new: fx.GraphModule) -> None:
    """The grown model computes what the old one did (`ref`), run sharded in eval and train mode on every rank; to the
    protocol's 1e-5, or within one unit in the last place of the units' half-precision compute dtype when they have
    one (MixedPrecisionPolicy: the windows were verified in float32)."""
    own: BaseException | None = None
    try:
        # both runs first (FSDP's all-gathers, a collective each), then the comparisons: a rank whose comparison fails
        # has run the same collectives as the others, and meets them at the report below
        outputs = {mode: run(new, ref.x) for mode, run in _MODES}
        for mode, _ in _MODES:
            check = compare_outputs(ref.outputs[mode], outputs[mode], mode)
            # both ran in the units' half-precision compute (when they have one): judged within one unit of its
            # last place, as the protocol judges float32 to 1e-5
            tol = torch.finfo(ref.half).eps if ref.half is not None else 0.0
            if not (check.ok or (check.rel_err <= tol and check.max_abs_err <= tol * max(check.max_abs_ref, 1e-30))):
                raise PreservationError(
                    f"the grown model, put together layer by layer, is not the old one in {mode} mode "
                    f"(relative error {check.rel_err:.3g})",
                    "grow the whole model (layerwise=False) and report the pass",
                )
    except Exception as e:  # reported to every rank, then raised here again
        own = e
    finally:
        _reshard_all(new)
    records = reps.gather({"error": rp.error_text(own) if own else None}, "checking the grown model")
    rp.raise_failures(reps, records, own, "checking the grown model")
