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

from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .ddp import Grown, carry_scheduler, grow, grow_replica, rebuild_options
from .fsdp import grow_fsdp, shard
from .fsdp_checkpoint import ShardedCheckpoint, load_sharded_checkpoint, save_sharded_checkpoint


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
