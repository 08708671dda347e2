"""`graphgrow.distributed`: growth inside the training jobs people run — data-parallel (DDP under torchrun),
PyTorch Lightning, checkpointed and resumed. One place to import it all from (docs/distributed.md):

    grow(ddp, optimizer, spec, scheduler=...)   the growth step on every rank; a new DDP, optimiser carried (ddp.py)
    grow_replica(model, optimizer, spec, ...)   the same for a bare replica (a trainer that wraps it itself)
    carry_scheduler(scheduler, optimizer)       a learning-rate scheduler re-pointed at the carried optimiser
    save_checkpoint / load_checkpoint           checkpoints that resume across growth, at any world size (checkpoint.py)
    GrowthCallback                              Lightning's callback (lightning_callback.py; imports Lightning
                                                when used)
  FSDP2 (a traced model sharded with fully_shard):
    shard(traced, layers=[...], mesh=...)       fully_shard on a traced model, one unit per layer (fsdp.py)
    grow(sharded, optimizer, spec, ...)         the growth step: re-sharded alike, optimiser state by shard (fsdp.py)
    save_sharded_checkpoint / load_sharded_checkpoint
                                                DCP shards and the growth log; ShardedCheckpoint.regrow rebuilds the
                                                grown architecture, .restore loads it (fsdp_checkpoint.py)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..core.errors import InputError
from . import ddp
from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .ddp import Grown, Verify, carry_scheduler, grow_replica, rebuild_options
from .fsdp import grow_fsdp, is_fsdp, shard
from .fsdp_checkpoint import ShardedCheckpoint, load_sharded_checkpoint, save_sharded_checkpoint


def grow(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    spec: str | Sequence[str],
    scheduler: Any = None,
    *,
    seed: int | None = None,
    verify: Verify = "rank0",
    timeout: float = 300.0,
    ddp_options: dict[str, Any] | None = None,
    release_old: bool = False,
    layerwise: bool | None = None,
) -> Grown:
    """The growth step on every rank (call it on every rank at the same point of the loop): a traced model in a
    DistributedDataParallel wrapper grows into a new wrapper (ddp.grow; `ddp_options` override the old wrapper's),
    a traced model sharded with FSDP2 grows sharded the same way (fsdp.grow_fsdp). The optimiser is carried and the
    scheduler re-pointed; on any failure every rank raises and keeps its old objects. `release_old` (FSDP2, opt-in):
    the old model's and optimiser's memory is freed while the grown one is built, and they are empty afterwards
    (fsdp.py: why it is not the default); `layerwise` (FSDP2): one layer at a
    time, by default where the model fits (fsdp.grow_fsdp)."""
    if is_fsdp(model):
        if ddp_options:
            raise InputError("ddp_options are for a DDP wrapper; this model is sharded with FSDP2", "leave them out")
        return grow_fsdp(
            model,
            optimizer,
            spec,
            scheduler,
            seed=seed,
            verify=verify,
            timeout=timeout,
            release_old=release_old,
            layerwise=layerwise,
        )
    if release_old or layerwise:
        raise InputError(
            "release_old and layerwise are for a model sharded with FSDP2", "a DDP replica is rebuilt, not re-sharded"
        )
    return ddp.grow(
        model, optimizer, spec, scheduler, seed=seed, verify=verify, timeout=timeout, ddp_options=ddp_options
    )


def __getattr__(name: str):
    if name == "GrowthCallback":  # Lightning is an optional extra: imported only when the callback is asked for
        from .lightning_callback import GrowthCallback

        return GrowthCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Checkpoint",
    "Grown",
    "ShardedCheckpoint",
    "carry_scheduler",
    "grow",
    "grow_fsdp",
    "grow_replica",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "rebuild_options",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "shard",
]  # and GrowthCallback, on demand
