"""The growth step of a job sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`, parameters as DTensor shards):
`grow_fsdp(model, optimizer, spec)`, which `graphgrow.distributed.grow` calls for such a model.

No rank holds the full tensors, so one growth step, on every rank at the same point of the loop:

1. gather: every rank builds a plain (unsharded) copy of the traced model in host memory, one parameter at a time
   (`DTensor.full_tensor()` on the model's own mesh, then moved to the CPU); the sharded model is not touched;
2. grow: the DDP growth step on that copy, on the CPU (ddp.grow_replica: agree on spec, seed and parameter digests,
   the pipeline with the agreed seed, rank 0 verifies, every rank checks the others grew bit-identical tensors);
3. re-shard: the grown copy is sharded again with the old model's units — the same mesh and settings
   (reshard_after_forward, mixed precision, offload) and the same modules per unit, by path; a module growth added
   (passes add at the root) becomes a unit of its own, like a layer (plan_units); fully_shard moves each unit to
   the mesh's device in turn and keeps only this rank's shard; every rank reports whether it could, and any
   failure raises on every rank before the optimiser is touched;
4. carry: an optimiser of the same class over the new shards, its state (AdamW's moments) moved by parameter name:
   a state tensor whose shape and placement did not change is cloned shard for shard; a grown one is gathered, put in
   the leading box of zeros of the new shape (optim.carry_optimizer's rule) and cut to this rank's new shard — one
   tensor at a time. The scheduler is re-pointed (ddp.carry_scheduler).

Memory. On the accelerator a growth event adds one gathered tensor at a time (steps 1 and 4) and one unit's full
tensors (step 3) to the old shards and optimiser state and the new ones — the old are kept until every rank has
succeeded, so that a failure leaves them in place. With `release_old=True` they leave the device instead: the
optimiser state is gathered to the host too, then every old shard, gradient and moment is copied to the host and
its storage freed (class Released; put back on failure), so the device holds the grown model's state plus one unit.
In host memory every rank holds the whole unsharded model and the grown one (sharing the tensors growth left alone),
and with release_old the old optimiser state: in a CPU-only job (gloo, as in the tests) that is the same memory,
and the event peaks at about the full model over the sharded steady state.

That is the whole-model path. By default (`layerwise`) a model with one stack of repeated layers grows one layer at a
time instead (fsdp_layers.py, layerwise.py): the growth planned on the meta device, each layer gathered, grown in a
window (the model with that one layer), cut into its new shards and released before the next; the host holds the
parts outside the stack and one layer. Steps 1–3 above are then per layer; step 4 is the same. The old shards,
gradients and moments are still kept whole until the end (the peak rises by the grown model's sharded state), unless
`release_old=True`: then the old moments go to a temporary file first (growth does not read them; the carry reads
each back once), and each old shard and its gradient as soon as the tensor is gathered (growth holds its full value
from then on) (fsdp_spill.py; read back on failure), so the peak stays within one layer of the sharded steady state
— on the host too, rank 0's checks of each window included.

Why release_old is not the default: after success the old model's and optimiser's tensors have no memory behind
them, and reading one crashes the process (a null data pointer: a segmentation fault on the CPU, not a Python error).
A job often holds the old objects in places it does not think of (a checkpoint manager, an EMA copy, a closure over
`model.parameters()`, a trainer's strategy); kept, they are stale but safe. `_retire` turns the usual ways of
reaching them (the model's forward and state_dict, the optimiser's step and state_dict) into an InputError; a
tensor read directly still crashes. It also writes the old sharded state (parameters, gradients, moments: four
times the parameters' shard) to $TMPDIR, which on many clusters is memory (tmpfs).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import InputError
from ..rewrite.pass_base import require_traced
from . import replicas as rp
from .ddp import Grown, Verify, carry_scheduler, grow_replica
from .fsdp_carry import CarryAgreement, checked_fit
from .fsdp_spill import Spill, local_moments, local_state
from .fsdp_units import (  # noqa: F401 - Unit, is_fsdp, plan_units, sharding_units, unsharded_copy: fsdp's names too
    Unit,
    _reshard_all,
    is_fsdp,
    plan_units,
    sharding_units,
    unsharded_copy,
)
from .optim import _fit, carry_optimizer


def shard(model: fx.GraphModule, layers: Iterable[str], **options: Any) -> fx.GraphModule:
    """FSDP2 on a traced model, one unit per layer: `fully_shard` on the modules the graph calls under each path in
    `layers` (e.g. "layers.0") that hold parameters, grouped as one unit, then on the model (the root: the rest).
    `options` go to every fully_shard call (mesh, reshard_after_forward, mp_policy, offload_policy).

    A traced model runs its layers' leaf modules from the graph: the layer's own container is never called, so
    fully_shard on it would never gather its parameters — the unit is the list of leaves. Parameters the graph reads
    directly (get_attr) stay with the root, whose forward gathers them."""
    from torch.distributed.fsdp import fully_shard

    require_traced(model)
    called = [n.target for n in model.graph.nodes if n.op == "call_module"]
    for prefix in layers:
        unit = [
            model.get_submodule(t)
            for t in dict.fromkeys(called)
            if isinstance(t, str) and (t == prefix or t.startswith(prefix + ".")) and _holds_parameters(t, model)
        ]
        if not unit:
            raise InputError(
                f"no module the graph calls under {prefix!r} holds parameters",
                "name layer paths as the traced model's modules are named (e.g. layers.0)",
            )
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


def _holds_parameters(path: str, model: nn.Module) -> bool:
    return any(True for _ in model.get_submodule(path).parameters())


def grow_fsdp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    spec: str | Sequence[str],
    scheduler: Any = None,
    *,
    seed: int | None = None,
    verify: Verify = "rank0",
    timeout: float = 300.0,
    release_old: bool = False,
    layerwise: bool | None = None,
) -> Grown:
    """Grow a traced model sharded with FSDP2 on every rank (call it on every rank at the same point). Returns the
    grown model sharded with the same units, mesh and settings, the optimiser carried shard by shard and the
    scheduler re-pointed. Raises on every rank when any rank fails, disagrees or does not answer within `timeout`
    seconds; then every rank keeps its old model, optimiser and scheduler (module docstring).

    `release_old`: the old model's shards, gradients and optimiser state leave memory while the grown model is
    built, so no rank holds both models: layer by layer, each old shard and its gradient go to a temporary file once
    the tensor is gathered, and each AdamW moment once its grown one is made (fsdp_spill.py: the peak stays one
    layer's working set above the sharded steady state, on the host as on the device); on the whole-model
    path they are copied to host memory instead (the optimiser state gathered there first: class Released). A
    failure puts them back; after success the old model and optimiser are empty: their forward, step and
    state_dict raise InputError, and reading one of their tensors crashes the process — drop them (module
    docstring: why this is not the default).

    `layerwise`: grow one layer at a time (fsdp_layers.py: no rank holds more than the parts outside the stack and
    one layer's full tensors); None (default) where the model and growth fit (layerwise.plan), else the whole model
    in host memory as described above; True: refuse (InputError) what does not fit."""
    if not is_fsdp(model) or not isinstance(model, fx.GraphModule):
        raise InputError(
            f"grow_fsdp() takes a traced model sharded with fully_shard, got {type(model).__name__}",
            "gg.distributed.shard(gg.trace(model, ...), layers=[...]) or fully_shard on the traced model",
        )
    if scheduler is not None and optimizer is None:
        raise InputError("a scheduler was given without its optimiser", "pass the optimiser the scheduler drives")
    units = sharding_units(model)
    if not units or units[-1].paths != ("",):
        raise InputError(
            "the model's root is not sharded (fully_shard(model) after its layers)",
            "FSDP2 needs the root unit; gg.distributed.shard does both",
        )
    t0 = time.perf_counter()
    _reshard_all(model)
    if layerwise is not False:
        from .fsdp_layers import grow_by_layers, result_of
        from .layerwise import NotLayerwise

        spill = Spill() if release_old else None
        try:
            if spill is not None and optimizer is not None:
                # the old moments leave first (growth never reads them; the carry reads each back once): what the
                # windows and their verification hold on top of the sharded state then has room left by them
                spill.release(local_moments(optimizer))
            gm, agreed, seconds = grow_by_layers(
                model, spec, units, seed=seed, verify=verify, timeout=timeout, spill=spill
            )
        except BaseException as e:
            if spill is not None:
                spill.restore()  # the parts released so far come back before anything else happens
            # NotLayerwise: the same on every rank (decided from the structure and the agreed growth): fall back
            if not isinstance(e, NotLayerwise) or layerwise:
                raise
        else:
            grown = Grown(gm, None, None, result_of(gm), agreed, seconds)
            if spill is None:
                return _carry(grown, model, optimizer, scheduler, _fit_sharded, timeout, t0)
            try:
                done = _carry(grown, model, optimizer, scheduler, _fit_sharded, timeout, t0, spill)
            except BaseException:
                spill.restore()
                raise
            spill.close()
            _retire(model, optimizer)
            return done
    plain = unsharded_copy(model)
    fit: Callable[[Any, torch.Tensor, torch.Tensor], Any] = _fit_sharded
    released: Released | None = None
    if release_old:
        on_host = _host_state(optimizer) if optimizer is not None else {}
        fit = functools.partial(_fit_from_host, on_host)
        released = Released(_device_tensors(model, optimizer))
        if released.kept:
            warnings.warn(
                f"release_old: {released.kept / 2**20:.1f} MiB of the old model's state stays on the device (storages "
                "torch does not let resize, e.g. a tensor once viewed with .numpy())",
                stacklevel=2,
            )
    gathered = time.perf_counter() - t0
    try:
        grown = grow_replica(
            plain, None, spec, None, seed=seed, verify=verify, timeout=timeout, sync_buffers=False, share=True
        )
        del plain
        t1 = time.perf_counter()
        reps = rp.replicas(timeout)
        own: BaseException | None = None
        try:
            _own_parameters(grown.gm)
            reshard(grown.gm, units, {p for p, _ in model.named_modules()})
        except Exception as e:  # reported to every rank, then raised here again
            own = e
        records = reps.gather({"error": rp.error_text(own) if own else None}, "re-sharding the grown model")
        rp.raise_failures(reps, records, own, "re-sharding")
    except BaseException:
        if released is not None:
            released.restore()
        raise
    grown.seconds["reshard"] = time.perf_counter() - t1
    grown.seconds["gather"] = gathered
    try:
        done = _carry(grown, model, optimizer, scheduler, fit, timeout, t0)
    except BaseException:
        if released is not None:
            released.restore()
        raise
    if released is not None:
        _retire(model, optimizer)
    return done


def _retire(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """The old model and optimiser after release_old: their tensors have no memory behind them, and reading one
    would crash the process. Their forward, state_dict and the optimiser's step raise a typed error instead (hooks
    on these objects only: the grown model is another object)."""

    def refuse(*_: Any, **__: Any) -> None:
        raise InputError(
            "this model (or optimiser) was grown with release_old=True: its tensors were freed",
            "use the grown model and optimiser the growth step returned (g.model, g.optimizer)",
        )

    model.register_forward_pre_hook(refuse, prepend=True)  # before FSDP's own, which would gather freed shards
    model.register_state_dict_pre_hook(refuse)
    if optimizer is not None:
        optimizer.register_step_pre_hook(refuse)
        optimizer.register_state_dict_pre_hook(refuse)


def _spilling(spill: Spill, fit: Callable[[Any, torch.Tensor, torch.Tensor], Any]) -> Callable:
    """`fit` on an old state tensor read back from `spill` for the call (released up front), or released to it after
    the call (not released yet): the old and new moments coexist one at a time."""

    def run(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
        if not (isinstance(value, torch.Tensor) and value.dim() > 0):
            return fit(value, old, new)
        mine = local_state([value])
        with spill.borrow(mine):
            out = fit(value, old, new)
        spill.release(mine)
        return out

    return run


def _carry(
    grown: Grown,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    fit: Callable,
    timeout: float,
    t0: float,
    spill: Spill | None = None,
) -> Grown:
    """The optimiser carried shard by shard and the scheduler re-pointed; the grown model is sharded already. Every
    rank agrees on the outcome (fsdp_carry.py): a rank that fails makes every rank raise at once, not wait in a
    gather. With `spill`, each old state tensor is read back from it only while its fit runs (before the exchange: a
    failed read is reported like any other failure)."""
    t2 = time.perf_counter()
    if optimizer is not None:
        agreement = CarryAgreement(rp.replicas(timeout))
        fit = checked_fit(agreement, fit)
        if spill is not None:
            fit = _spilling(spill, fit)
        try:
            grown.optimizer = carry_optimizer(optimizer, model, grown.gm, fit=fit)
        except BaseException as e:
            agreement.fail(e)
            raise
        agreement.check()  # a rank that failed after its last state tensor is heard here
        if scheduler is not None:  # after the agreement (it changes the scheduler); its checks are the same everywhere
            carry_scheduler(scheduler, grown.optimizer, optimizer)
            grown.scheduler = scheduler
    grown.seconds["carry"] = time.perf_counter() - t2
    grown.seconds["total"] = time.perf_counter() - t0
    return grown


class Released:
    """Tensors whose device memory is freed while growth runs (each storage copied to the host, then resized to
    nothing: the tensors stay the same objects) and put back by `restore`."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.saved: list[tuple[Any, int, torch.Tensor]] = []
        self.kept = 0  # bytes left in place: storages torch does not let resize (kept, not released)
        seen: set[int] = set()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or not storage.nbytes():
                continue
            seen.add(storage.data_ptr())
            if not storage.resizable():
                self.kept += storage.nbytes()
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8)
            host.copy_(_as_bytes(storage))
            self.saved.append((storage, storage.nbytes(), host))
        for storage, _, _ in self.saved:
            storage.resize_(0)

    def restore(self) -> None:
        for storage, nbytes, host in self.saved:
            storage.resize_(nbytes)
            _as_bytes(storage).copy_(host)


def _as_bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _device_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The old model's local shards, their gradients and the optimiser's per-parameter state (not its step counts)."""
    from torch.distributed.tensor import DTensor

    out = []
    for p in model.parameters():
        for t in (p, p.grad, *(optimizer.state.get(p, {}).values() if optimizer is not None else ())):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                out.append(t.to_local() if isinstance(t, DTensor) else t)
    return out


def _host_state(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """id(state tensor) → its full value in host memory, gathered one tensor at a time (every rank in the same order:
    the optimiser's parameters, then each state's keys sorted)."""
    from torch.distributed.tensor import DTensor

    out: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for _, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, DTensor):
                    out[id(value)] = value.full_tensor().to("cpu")
    return out


def _fit_from_host(on_host: dict[int, torch.Tensor], value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """_fit_sharded from the host copies `_host_state` made (the device state is released by then)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, DTensor) or not isinstance(new, DTensor):
        return _fit(value, old, new)
    fitted = _fit(on_host[id(value)], old, new)
    return distribute_tensor(fitted.to(new.device), new.device_mesh, new.placements, src_data_rank=None)


def _own_parameters(gm: nn.Module) -> None:
    """New Parameter objects over the same host tensors (ties kept): fully_shard swaps a unit's tensors onto the device
    through its Parameter objects, and the pipeline's intermediate models may share them — a shared one would keep the
    full tensor alive on the device after the unit is sharded."""
    fresh: dict[int, nn.Parameter] = {}
    for m in gm.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = fresh.setdefault(id(p), nn.Parameter(p.detach(), p.requires_grad))


def reshard(gm: fx.GraphModule, units: list[Unit], before: set[str]) -> fx.GraphModule:
    """fully_shard on `gm` with the units `plan_units` makes from the old model's `units` (`before`: its module
    paths), innermost first, the root last."""
    from torch.distributed.fsdp import fully_shard

    modules = dict(gm.named_modules())
    called = [t for t in dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "call_module") if t in modules]
    with_params = {p for p in called if any(True for _ in modules[p].parameters())}
    for unit in plan_units(units, set(modules), called, with_params, before):
        fully_shard([modules[p] for p in unit.paths] if unit.paths != ("",) else gm, **unit.options)
    return gm


def _fit_sharded(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """optim._fit for DTensor shards: unchanged shape and placement → the shard cloned; else the state gathered, fit to
    the new shape (old values in the leading box, zeros elsewhere) and cut to this rank's shard of `new`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, DTensor) or not isinstance(new, DTensor):
        return _fit(value, old, new)
    if value.shape == new.shape and value.placements == new.placements and value.device_mesh == new.device_mesh:
        return value.detach().clone()
    fitted = _fit(value.full_tensor(), old, new)
    return distribute_tensor(fitted, new.device_mesh, new.placements, src_data_rank=None)
