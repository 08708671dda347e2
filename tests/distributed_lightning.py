"""The Lightning scenario of tests/distributed_job.py: GrowthCallback under the `ddp` strategy, 2 CPU processes.

A CNN grows at global step 3 (grow_width, then add_residual); probes on each side of the callback measure the
loss on a fixed batch just before and just after. After fit, a Lightning checkpoint is written and loaded into a
fresh module whose on_load_checkpoint regrows it; a second fit continues from it.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from distributed_job import cnn, fingerprint, probe
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import graphgrow as gg

GROW_AT = 3


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = gg.trace(cnn().train(), input_shape=(2, 3, 12, 12))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"},
        }

    def on_load_checkpoint(self, checkpoint):
        gg.distributed.GrowthCallback.regrow(self, checkpoint)  # the fresh model grows as the saved one did


class Probe(pl.Callback):
    """The loss on a fixed batch at the growth step: one Probe runs before GrowthCallback, one after."""

    def __init__(self, key: str, record: dict):
        self.key, self.record = key, record

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == GROW_AT and self.key not in self.record:
            for b in pl_module.model.buffers():  # rank 0's BatchNorm statistics, as DDP's next forward sends them
                dist.broadcast(b, src=0)
            self.record[self.key] = probe(pl_module.model, "cnn")
            self.record[self.key + "_params"] = sum(p.numel() for p in pl_module.model.parameters())
            opt = trainer.optimizers[0]
            self.record[self.key + "_opt_is_model"] = {id(p) for g in opt.param_groups for p in g["params"]} == {
                id(p) for p in pl_module.parameters()
            }
            self.record[self.key + "_sched_follows"] = trainer.lr_scheduler_configs[0].scheduler.optimizer is opt
            self.record[self.key + "_ddp_params"] = sum(p.numel() for p in trainer.strategy.model.parameters())


class Loaded(pl.Callback):
    """The model as the resumed fit starts (after Lightning restored the checkpoint)."""

    def __init__(self, record: dict):
        self.record = record

    def on_train_start(self, trainer, pl_module):
        self.record["loaded_fingerprint"] = fingerprint(pl_module.model)
        self.record["loaded_step"] = trainer.global_step


def data():
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(64, 3, 12, 12, generator=g), torch.randint(0, 5, (64,), generator=g))


def trainer(steps: int, callbacks, out) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        num_sanity_val_steps=0,
    )


def run_lightning(out, rank: int, world: int) -> dict:
    record: dict = {}
    growth = gg.distributed.GrowthCallback({GROW_AT: "grow_width(factor=2),add_residual"}, timeout=60)
    net = Net()
    t = trainer(6, [Probe("before", record), growth, Probe("after", record)], out)
    t.fit(net, DataLoader(data(), batch_size=8))
    record["events"] = [{k: v for k, v in e.items()} for e in growth.events]
    record["fingerprint"] = fingerprint(net.model)
    record["lr"] = t.lr_scheduler_configs[0].scheduler.get_last_lr()
    ckpt = out / "lightning.ckpt"
    t.save_checkpoint(ckpt)  # every rank calls it; rank 0 writes
    saved = copy.deepcopy(net.model.state_dict())

    fresh = Net()  # un-grown: on_load_checkpoint regrows it before Lightning loads the grown weights
    at_start = Loaded(record)
    t2 = trainer(8, [gg.distributed.GrowthCallback({GROW_AT: "deepen"}), at_start], out)
    t2.fit(fresh, DataLoader(data(), batch_size=8), ckpt_path=str(ckpt))
    record["resumed_params"] = sum(p.numel() for p in fresh.model.parameters())
    record["resumed_keys_match"] = sorted(fresh.model.state_dict()) == sorted(saved)
    record["resumed_fingerprint"] = fingerprint(fresh.model)
    record["resumed_global_step"] = t2.global_step
    return record
