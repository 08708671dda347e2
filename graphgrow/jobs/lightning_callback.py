"""GrowthCallback: growth during `Trainer.fit` in PyTorch Lightning
(optional extra: pip install 'graphgrow[lightning]').

The LightningModule keeps the traced model in an attribute (`self.model = gg.trace(net, input_shape=...)`).
At a scheduled step or epoch the callback runs the growth step of ddp.py on every rank (agreed
seed, rank 0 verifies, a checksum of the new parameters on every rank), puts the grown model in that
attribute, carries every optimiser Lightning holds by parameter name, re-points its schedulers, and
rebuilds the DDP wrapper (strategy `ddp`) with the old wrapper's options. Growth runs in
`on_train_batch_start` (or `on_train_epoch_start`), before Lightning reads the optimiser for that batch.

FSDP2: under `ModelParallelStrategy` (Lightning ≥ 2.4: FSDP2's fully_shard, applied by the module's
`configure_model`; it runs on the CPU with gloo) a traced model sharded there with `gg.distributed.shard(self.model,
layers, mesh=self.device_mesh["data_parallel"])` grows with fsdp.grow_fsdp, the optimisers carried shard by shard.
`FSDPStrategy` wraps the module in FSDP1's FullyShardedDataParallel (flat parameters): refused (InputError).

Checkpoints: the callback writes the model's mutation log into every Lightning checkpoint; a LightningModule
whose `on_load_checkpoint` calls `GrowthCallback.regrow(self, checkpoint)` grows its fresh model the same
way (bit-identical: the seeds are in the log) before Lightning loads the grown weights and optimiser state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel

from ..core.errors import InputError
from .ddp import Verify, carry_scheduler, grow_replica, rebuild_options
from .fsdp import _fit_sharded, grow_fsdp, is_fsdp
from .optim import carry_optimizer
from .pipeline import from_log

Decide = Callable[["pl.Trainer", "pl.LightningModule"], "str | None"]


class GrowthCallback(pl.Callback):
    """Grow `pl_module.<attr>` at the steps (or epochs) of `schedule` ({global step: spec}), or whenever `decide`
    returns a spec (it must return the same on every rank). `events` lists what happened."""

    def __init__(
        self,
        schedule: Mapping[int, str] | None = None,
        *,
        every: Literal["step", "epoch"] = "step",
        decide: Decide | None = None,
        attr: str = "model",
        seed: int | None = None,
        verify: Verify = "rank0",
        timeout: float = 300.0,
    ):
        if (schedule is None) == (decide is None):
            raise InputError(
                "GrowthCallback takes a schedule or a decide function (one of them)",
                "e.g. GrowthCallback({100: 'grow_width(factor=2)'})",
            )
        if every not in ("step", "epoch"):
            raise InputError(f"every must be 'step' or 'epoch', got {every!r}")
        self.schedule = dict(schedule or {})
        self.every, self.decide, self.attr = every, decide, attr
        self.seed, self.verify, self.timeout = seed, verify, timeout
        self.events: list[dict[str, Any]] = []
        self._done: set[int] = set()

    # --- when ---------------------------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.every == "step":
            self._maybe_grow(trainer, pl_module, trainer.global_step)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every == "epoch":
            self._maybe_grow(trainer, pl_module, trainer.current_epoch)

    def _maybe_grow(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: int) -> None:
        if when in self._done:  # gradient accumulation: one global step spans several batches
            return
        spec = self.schedule.get(when) if self.decide is None else self.decide(trainer, pl_module)
        if spec:
            self._done.add(when)
            self.grow(trainer, pl_module, spec, when)

    # --- how ----------------------------------------------------------------------------------------------------

    def grow(self, trainer: pl.Trainer, pl_module: pl.LightningModule, spec: str, when: int = -1) -> None:
        """One growth event now, on every rank."""
        start = time.perf_counter()
        old = getattr(pl_module, self.attr, None)
        if not isinstance(old, fx.GraphModule):
            raise InputError(
                f"{type(pl_module).__name__}.{self.attr} is {type(old).__name__}, not a traced model",
                f"set self.{self.attr} = gg.trace(net, input_shape=...) in the LightningModule's __init__ "
                "(or name the attribute: GrowthCallback(..., attr='net'))",
            )
        strategy = trainer.strategy
        _refuse_fsdp1(strategy)
        if is_fsdp(old):
            self._grow_sharded(trainer, pl_module, old, spec, when, start)
            return
        ddp = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
        options = rebuild_options(ddp) if ddp is not None else {}
        synced = options.get("forward_sync_buffers", options.get("broadcast_buffers", True))
        grown = grow_replica(
            old,
            None,
            spec,
            seed=self.seed,
            verify=self.verify,
            timeout=self.timeout,
            sync_buffers=options.get("process_group") if synced else False,
        )
        before, after = _container(pl_module, self.attr, old), _container(pl_module, self.attr, grown.gm)
        carried = {id(o): carry_optimizer(o, before, after) for o in strategy.optimizers}
        for config in strategy.lr_scheduler_configs:
            previous = config.scheduler.optimizer
            carry_scheduler(config.scheduler, carried[id(previous)], previous)
        setattr(pl_module, self.attr, grown.gm)
        strategy.optimizers = [carried[id(o)] for o in strategy.optimizers]  # Lightning re-wraps them
        if ddp is not None:
            strategy.model = type(ddp)(pl_module, **options)
        self._record(when, spec, grown.seed, old, grown.gm, start)

    def _grow_sharded(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        old: fx.GraphModule,
        spec: str,
        when: int,
        start: float,
    ) -> None:
        """ModelParallelStrategy with the traced model sharded by FSDP2 in configure_model: fsdp.grow_fsdp (one layer
        at a time where the model fits), every optimiser carried shard by shard, schedulers re-pointed. Lightning does
        not wrap the module under this strategy: the grown model goes into the attribute, the optimisers into the
        strategy."""
        strategy = trainer.strategy
        grown = grow_fsdp(old, None, spec, seed=self.seed, verify=self.verify, timeout=self.timeout)
        before, after = _container(pl_module, self.attr, old), _container(pl_module, self.attr, grown.gm)
        carried = {id(o): carry_optimizer(o, before, after, fit=_fit_sharded) for o in strategy.optimizers}
        for config in strategy.lr_scheduler_configs:
            previous = config.scheduler.optimizer
            carry_scheduler(config.scheduler, carried[id(previous)], previous)
        setattr(pl_module, self.attr, grown.gm)
        strategy.optimizers = [carried[id(o)] for o in strategy.optimizers]
        self._record(when, spec, grown.seed, old, grown.gm, start)

    def _record(self, when: int, spec: str, seed: int, old: nn.Module, new: nn.Module, start: float) -> None:
        self.events.append(
            {
                "when": when,
                "every": self.every,
                "spec": spec,
                "seed": seed,
                "params_before": sum(p.numel() for p in old.parameters()),
                "params_after": sum(p.numel() for p in new.parameters()),
                "seconds": time.perf_counter() - start,
            }
        )

    # --- checkpoints --------------------------------------------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        gm = getattr(pl_module, self.attr)
        checkpoint["graphgrow"] = {"attr": self.attr, "log": list(gm.meta.get("graphgrow", {}).get("log", []))}

    def state_dict(self) -> dict[str, Any]:
        return {"done": sorted(self._done), "events": list(self.events)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._done = set(state_dict.get("done", []))
        self.events = list(state_dict.get("events", []))

    @staticmethod
    def regrow(
        pl_module: pl.LightningModule, checkpoint: Mapping[str, Any], *, data: Any = None, trust: bool = False
    ) -> None:
        """Grow a fresh module's model as the checkpoint's was grown (call it from `on_load_checkpoint`): the
        passes in the checkpoint's mutation log beyond the fresh model's own, with their seeds, unverified (the
        weights are replaced by the checkpoint's next). A checkpoint is a file: a step grown with a data function
        (init=gradmax) runs with the `data` you pass (the function or its name), never with the name the log
        holds unless `trust` (InputError otherwise, before anything is grown)."""
        saved = checkpoint.get("graphgrow")
        if not saved:
            return
        if (
            not isinstance(saved, Mapping)
            or not isinstance(saved.get("attr"), str)
            or not isinstance(saved.get("log"), list)
        ):
            raise InputError(
                "the checkpoint's graphgrow record is malformed (it needs attr and log)",
                "the checkpoint should come from a run with GrowthCallback",
            )
        attr = saved["attr"]
        gm = getattr(pl_module, attr, None)
        if not isinstance(gm, fx.GraphModule):
            raise InputError(
                f"{type(pl_module).__name__}.{attr[:100]} is {type(gm).__name__}, not a traced model",
                "the checkpoint names the attribute GrowthCallback grew; build the module as that run did",
            )
        have = len(gm.meta.get("graphgrow", {}).get("log", []))
        todo = list(saved["log"])[have:]
        if todo:
            setattr(pl_module, attr, from_log(todo, verify=False, data=data, trust=trust).run(gm).gm)


def _refuse_fsdp1(strategy: Any) -> None:
    """Lightning's FSDPStrategy wraps the module in FSDP1's FullyShardedDataParallel (parameters flattened into one
    buffer per unit): there is no traced model with named parameters to grow under it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = getattr(strategy, "model", None)
    wrapped = isinstance(model, nn.Module) and any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    if type(strategy).__name__ == "FSDPStrategy" or wrapped:
        raise InputError(
            "GrowthCallback cannot grow under Lightning's FSDPStrategy: it wraps the model in FSDP1's "
            "FullyShardedDataParallel (flat parameters), not FSDP2's per-parameter shards",
            "use ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) and shard the traced model in "
            "configure_model: gg.distributed.shard(self.model, layers=[...], mesh=self.device_mesh['data_parallel'])",
        )


def _container(pl_module: nn.Module, attr: str, model: nn.Module) -> nn.Module:
    """A module with pl_module's parameter names where `attr` holds `model`: optimisers are carried by these names
    (a LightningModule may train parameters outside the grown model too)."""
    view = nn.Module()
    for name, child in pl_module.named_children():
        view.add_module(name, model if name == attr else child)
    for name, p in pl_module.named_parameters(recurse=False):
        view.register_parameter(name, p)
    return view
