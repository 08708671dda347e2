"""The growth step of a data-parallel job (`torch.distributed`, DDP, launched by torchrun):
`grow(ddp, optimizer, spec)`.

Every rank must make the same change with the same new weights, DDP must be rebuilt around the new
parameters (it registers them when it is made), and the optimiser and learning-rate scheduler must follow
on every rank. One growth step, on every rank at the same point of the loop:

1. agree: each rank says its spec, its seed and a digest of its parameters; they must agree (rank 0's seed
   is used when none is given), else every rank raises before anything changes;
2. grow: every rank runs the pipeline with the agreed seed; rank 0 (`verify="rank0"`) also verifies it —
   the others wait for it on the side group, within `timeout`;
3. check: each rank reports its error, if any, and a sha256 of the new parameters, buffers and graph; any
   error or any difference raises on every rank (naming the rank and the first differing tensor), and every
   rank keeps its old objects;
4. rebuild: a new DistributedDataParallel with the old one's options, the optimiser carried by parameter
   name (carry_optimizer) and the scheduler re-pointed at it (carry_scheduler).

The coordination (replicas.py) talks on a gloo side group with its own timeout, so a rank that dies or
hangs during growth is a DistributedError on the others, not a hang.
"""

from __future__ import annotations

import functools
import inspect
import random
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx, nn

from ..core.errors import DistributedError, InputError
from ..rewrite.pass_base import Pass, require_traced
from . import replicas as rp
from .optim import carry_optimizer
from .pipeline import Pipeline, PipelineResult, build_pipeline, spec_of

Verify = Literal["rank0", "all", "none"]


@dataclass
class Grown:
    """What a growth step returns: the new objects to train with from here on (the old ones are unchanged)."""

    model: nn.Module  # a new DistributedDataParallel from grow(); the grown GraphModule from grow_replica()
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    result: PipelineResult  # the pipeline's result on this rank (verification reports on the verifying rank)
    seed: int  # the agreed seed (recorded in the mutation log: the growth replays bit-identically)
    seconds: dict[str, float] = field(default_factory=dict)  # agree, grow, wait, check, rebuild, carry, total

    @property
    def gm(self) -> fx.GraphModule:
        return self.result.gm


def grow(
    ddp: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    spec: str | Sequence[str],
    scheduler: Any = None,
    *,
    seed: int | None = None,
    verify: Verify = "rank0",
    timeout: float = 300.0,
    ddp_options: dict[str, Any] | None = None,
) -> Grown:
    """Grow the model inside a DistributedDataParallel wrapper on every rank (call it on every rank at the same
    point). Returns a new wrapper over the grown GraphModule, built with the old wrapper's options
    (`ddp_options` overrides them), the optimiser carried and the scheduler re-pointed. Raises on every rank
    when any rank fails, disagrees or does not answer within `timeout` seconds; then nothing changed."""
    module = getattr(ddp, "module", None)
    if not isinstance(ddp, nn.Module) or not isinstance(module, fx.GraphModule):
        raise InputError(
            f"grow() takes a DistributedDataParallel over a traced model, got {type(ddp).__name__}"
            + (f" over {type(module).__name__}" if module is not None else ""),
            "wrap gg.trace(model, input_shape=...) in DDP; for a bare model use grow_replica()",
        )
    options = {**rebuild_options(ddp), **(ddp_options or {})}
    synced = options.get("forward_sync_buffers", options.get("broadcast_buffers", True))
    grown = grow_replica(
        module,
        optimizer,
        spec,
        scheduler,
        seed=seed,
        verify=verify,
        timeout=timeout,
        sync_buffers=getattr(ddp, "process_group", None) if synced else False,
    )
    start = time.perf_counter()
    with warnings.catch_warnings():  # broadcast_buffers=False is deprecated but the only way to keep rank-local buffers
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        grown.model = type(ddp)(grown.model, **options)  # a collective: rank 0's parameters and buffers are broadcast
    grown.seconds["rebuild"] = time.perf_counter() - start
    grown.seconds["total"] += grown.seconds["rebuild"]
    return grown


def grow_replica(
    model: fx.GraphModule,
    optimizer: torch.optim.Optimizer | None,
    spec: str | Sequence[str],
    scheduler: Any = None,
    *,
    seed: int | None = None,
    verify: Verify = "rank0",
    timeout: float = 300.0,
    sync_buffers: Any = None,
    share: bool = False,
) -> Grown:
    """The growth step on a bare replica (no DDP wrapper: Lightning and other trainers wrap it themselves).
    Without an initialised process group it is the one-process growth step.

    `sync_buffers`: the process group on which the wrapper syncs buffers (None: the default group; False:
    buffers are rank-local). DDP sends rank 0's buffers (BatchNorm's running statistics) at the start of each
    forward, so after a step the other ranks hold their own until the next one: growth first makes them rank
    0's, as that forward would, so the model grows from the same state on every rank.

    `share`: the grown model may share the tensors growth left alone with `model` (a copy made only to grow, as
    fsdp.py's: one full copy less)."""
    require_traced(model)
    if scheduler is not None and optimizer is None:
        raise InputError("a scheduler was given without its optimiser", "pass the optimiser the scheduler drives")
    if verify not in ("rank0", "all", "none"):
        raise InputError(
            f"verify must be 'rank0', 'all' or 'none', got {verify!r}", "verify='rank0' checks once, on rank 0"
        )
    t0 = time.perf_counter()
    reps = rp.replicas(timeout)
    seconds: dict[str, float] = {}
    passes, agreed, local_buffers = _agree(reps, model, spec, seed)
    if sync_buffers is not False and reps.world > 1:
        _broadcast_buffers(model, sync_buffers)
        local_buffers = set()
    seconds["agree"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    checked = verify == "all" or (verify == "rank0" and reps.rank == 0)
    result: PipelineResult | None = None
    own: BaseException | None = None
    try:
        result = Pipeline(passes, verify=checked, seed=agreed, share=share).run(model)
    except Exception as e:  # reported to every rank below, then raised here again
        own = e
    seconds["grow"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    parts = rp.model_digests(result.gm, skip_buffers=local_buffers) if result is not None else {}
    hashed = time.perf_counter()
    records = reps.gather(
        {"error": rp.error_text(own) if own else None, "digest": rp.digest(parts)},
        "waiting for every rank to grow" + (" (rank 0 verifies)" if verify == "rank0" else ""),
    )
    seconds["wait"] = time.perf_counter() - hashed
    rp.raise_failures(reps, records, own, "growth")
    assert result is not None
    _check_identical(reps, records, parts)
    seconds["check"] = time.perf_counter() - t2 - seconds["wait"]  # the digests and their comparison

    t3 = time.perf_counter()
    new_opt = carry_optimizer(optimizer, model, result.gm) if optimizer is not None else None
    if scheduler is not None and new_opt is not None:
        carry_scheduler(scheduler, new_opt, optimizer)
    seconds["carry"] = time.perf_counter() - t3
    seconds["total"] = time.perf_counter() - t0
    return Grown(result.gm, new_opt, scheduler, result, agreed, seconds)


def parse_growth(spec: str | Sequence[str], seed: int | None) -> tuple[list[Pass], str]:
    """One rank's reading of a growth request: the passes (Pass objects as given, else built from the spec), their
    spec text (what the ranks compare), and the seed checked; raises on bad input (the caller gathers the error)."""
    passes = (
        list(spec)
        if isinstance(spec, (list, tuple)) and all(isinstance(p, Pass) for p in spec)
        else build_pipeline(spec)
    )
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise InputError(f"seed must be an int in 0 … 2**63 − 1, got {seed!r}", "or leave it out: rank 0 draws one")
    return passes, ",".join(spec_of(p) for p in passes)


def _agree(
    reps: rp.Replicas, model: fx.GraphModule, spec: str | Sequence[str], seed: int | None
) -> tuple[list[Pass], int, set[str]]:
    """The passes, the seed every rank uses and the buffers that are rank-local (they differ across ranks
    already, as with DDP(broadcast_buffers=False)); raises on every rank when the ranks disagree."""
    own: BaseException | None = None
    passes: list[Pass] = []
    try:
        passes, text = parse_growth(spec, seed)
    except Exception as e:
        own, text = e, ""
    params = rp.tensor_digests(model.named_parameters())
    buffers = rp.tensor_digests(model.named_buffers())
    proposal = seed if seed is not None else random.SystemRandom().randrange(2**31)
    records = reps.gather(
        {
            "error": rp.error_text(own) if own else None,
            "spec": text,
            "seed": seed,
            "proposal": proposal,
            "params": rp.digest(params),
            "buffers": rp.digest(buffers),
        },
        "agreeing on the growth step",
    )
    rp.raise_failures(reps, records, own, "reading the spec")
    for key, what in (("spec", "spec"), ("seed", "seed")):
        differs = rp.first_disagreement(records, key)
        if differs:
            raise DistributedError(
                f"rank {reps.rank}: rank {differs[0]}'s growth {what} {differs[1]!r} is not rank 0's "
                f"{records[0][key]!r}",
                "every rank must call grow() with the same spec and seed",
            )
    differs = rp.first_disagreement(records, "params")
    if differs:
        raise DistributedError(
            f"rank {reps.rank}: the replicas differ before growth: rank {differs[0]}'s parameters are not rank 0's",
            "DDP keeps replicas equal: did one rank load other weights or step alone?",
        )
    local = set(buffers) if rp.first_disagreement(records, "buffers") else set()
    return passes, int(records[0]["proposal"]), local


def _broadcast_buffers(model: nn.Module, group: Any) -> None:
    """Rank 0's buffers on every rank (on the training group: buffers live where the model trains)."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for b in model.buffers():
            dist.broadcast(b, src=src, group=group)


def _check_identical(reps: rp.Replicas, records: list[dict], parts: dict[str, str]) -> None:
    """Every rank's grown model bit-identical to rank 0's (one digest each); else name the first tensor that differs."""
    differs = rp.first_disagreement(records, "digest")
    if not differs:
        return
    per_rank = [r["parts"] for r in reps.gather({"parts": parts}, "naming the tensor that differs")]
    name = rp.first_differing_tensor(per_rank) or "?"
    raise DistributedError(
        f"rank {reps.rank}: the ranks grew different models: rank {differs[0]}'s {name} is not rank 0's",
        "growth must be deterministic on every rank (same torch build, same device type); every rank "
        "keeps its old model",
    )


def rebuild_options(ddp: nn.Module) -> dict[str, Any]:
    """The keyword arguments that make a wrapper like `ddp` (read back from it: device ids, output device, dim,
    process group, buffer sync, bucket size, unused-parameter search, gradient views, static graph, mixed
    precision). What cannot be read back (communication hooks, parameters to hook) is not carried."""
    accepted = inspect.signature(type(ddp).__init__).parameters
    opts: dict[str, Any] = {}
    for name in (
        "device_ids",
        "output_device",
        "dim",
        "process_group",
        "find_unused_parameters",
        "gradient_as_bucket_view",
        "static_graph",
        "mixed_precision",
        "skip_all_reduce_unused_params",
        "batched_grad_copy",
    ):
        if name in accepted and hasattr(ddp, name):
            opts[name] = getattr(ddp, name)
    if getattr(ddp, "device_mesh", None) is not None and "device_mesh" in accepted:
        opts["device_mesh"] = ddp.device_mesh
        opts.pop("process_group", None)
    if "forward_sync_buffers" in accepted and hasattr(ddp, "forward_sync_buffers"):
        opts["forward_sync_buffers"] = ddp.forward_sync_buffers
        if not ddp.forward_sync_buffers:  # rank-local buffers stay rank-local (no sync at construction either)
            opts.pop("forward_sync_buffers")
            opts["broadcast_buffers"] = False
    elif hasattr(ddp, "broadcast_buffers"):
        opts["broadcast_buffers"] = ddp.broadcast_buffers
    if hasattr(ddp, "bucket_bytes_cap") and "bucket_cap_mb" in accepted:
        opts["bucket_cap_mb"] = ddp.bucket_bytes_cap / (1024 * 1024)
    return opts


def carry_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, old: torch.optim.Optimizer | None = None) -> Any:
    """Re-point a learning-rate scheduler (and the schedulers inside SequentialLR / ChainedScheduler) at the
    carried optimiser. The scheduler keeps its counters and base rates: it is the same object, so a trainer
    holding it (Lightning) keeps working. Returns it."""
    base = getattr(scheduler, "base_lrs", None)
    if base is not None and len(base) != len(optimizer.param_groups):
        raise InputError(
            f"the scheduler drives {len(base)} parameter group(s), the carried optimiser has "
            f"{len(optimizer.param_groups)}",
            "growth removed every parameter of a group: rebuild the scheduler",
        )
    stack = [scheduler]
    while stack:
        s = stack.pop()
        if not hasattr(s, "optimizer"):
            raise InputError(
                f"{type(s).__name__} has no optimizer attribute: it is not a torch learning-rate scheduler",
                "pass a torch.optim.lr_scheduler object (or carry it yourself)",
            )
        s.optimizer = optimizer
        stack.extend(getattr(s, "_schedulers", []))
    _track_step(optimizer, called=bool(getattr(old, "_opt_called", True)))
    return scheduler


def _track_step(opt: torch.optim.Optimizer, called: bool) -> None:
    """What torch's schedulers do to the optimiser they are made with: mark `opt` when it steps, so the scheduler's
    'step() before optimizer.step()' warning stays right after the swap."""
    if not hasattr(opt.step, "_wrapped_by_lr_sched"):
        func = opt.step.__func__  # type: ignore[attr-defined]
        ref = weakref.ref(opt)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            o = ref()
            o._opt_called = True  # type: ignore[union-attr]
            return func.__get__(o, o.__class__)(*args, **kwargs)

        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.step = wrapper  # type: ignore[method-assign]
    if called:
        opt._opt_called = True  # type: ignore[attr-defined]
