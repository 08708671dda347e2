"""Growth in a data-parallel job: the digits CNN (examples/digits_task.py) trained by DistributedDataParallel on
several processes, grown at set epochs with gg.distributed.grow, checkpointed after every epoch, resumable in a
new job of any size.

    torchrun --standalone --nproc_per_node=2 examples/grow_ddp.py --out ddp_run
    torchrun --standalone --nproc_per_node=1 examples/grow_ddp.py --out ddp_run --resume ddp_run/epoch-3

gloo on the CPU, NCCL when every rank has a GPU. Every epoch sees the same 64-example global batches whatever
the number of processes (each rank takes its share), so a resumed job continues the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import graphgrow as gg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_task import BATCH, INPUT_SHAPE, digits  # noqa: E402
from digits_task import model as base_model  # noqa: E402

EVENTS = {1: "grow_width(target=0,factor=2)", 3: "deepen(after=_5)"}  # epoch → pass spec


def setup() -> tuple[int, int, torch.device]:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def optimiser(params):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)


def evaluate(model: nn.Module, device) -> dict:
    """Held-out loss and accuracy in eval mode (the same on every rank: one replica's view)."""
    _, (x, y) = digits()
    model.eval()
    with torch.no_grad():
        out = model(x.to(device))
    return {
        "val_loss": nn.functional.cross_entropy(out, y.to(device)).item(),
        "val_acc": (out.argmax(1) == y.to(device)).float().mean().item(),
    }


def train_epoch(ddp, opt, epoch: int, rank: int, world: int, device) -> tuple[float, float]:
    """One epoch over the same global batches for any world size; returns (mean loss, seconds per step)."""
    (x, y), _ = digits()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
    ddp.train()
    total, steps, start = 0.0, 0, time.perf_counter()
    for idx in order.split(BATCH):
        mine = idx[rank::world]  # this rank's share of the global batch
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[mine].to(device)), y[mine].to(device))
        loss.backward()
        opt.step()
        total, steps = total + loss.item(), steps + 1
    return total / steps, (time.perf_counter() - start) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("ddp_run"), help="checkpoint folders go here (epoch-N)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--resume", type=Path, help="a checkpoint folder to continue from")
    args = ap.parse_args(argv)
    rank, world, device = setup()
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.resume:  # the grown architecture, its weights, and the optimiser and scheduler state by name
        ck = gg.distributed.load_checkpoint(args.resume)
        gm, first = ck.model.to(device), ck.step
        opt, sched = optimiser(gm.parameters())
        ck.restore(opt, sched)
        say(
            f"resumed {args.resume} at epoch {first} with {world} process(es): "
            f"{sum(p.numel() for p in gm.parameters()):,} parameters"
        )
    else:
        gm, first = gg.trace(base_model(), input_shape=INPUT_SHAPE).to(device), 0
        opt, sched = optimiser(gm.parameters())
    ddp = DDP(gm)
    args.out.mkdir(parents=True, exist_ok=True)
    for epoch in range(first, args.epochs):
        if epoch in EVENTS:
            before = evaluate(ddp.module, device)["val_loss"]
            g = gg.distributed.grow(ddp, opt, EVENTS[epoch], sched, seed=epoch, timeout=120)
            ddp, opt, sched = g.model, g.optimizer, g.scheduler
            after = evaluate(ddp.module, device)["val_loss"]
            say(
                f"epoch {epoch}: {EVENTS[epoch]} on {world} rank(s) in {g.seconds['total']:.2f} s "
                f"({', '.join(f'{k} {v:.3f}' for k, v in g.seconds.items() if k != 'total')}); "
                f"val loss {before:.6f} → {after:.6f}"
            )
        loss, step_s = train_epoch(ddp, opt, epoch, rank, world, device)
        sched.step()
        metrics = evaluate(ddp.module, device)
        say(
            f"epoch {epoch}: train loss {loss:.4f}, val loss {metrics['val_loss']:.4f}, "
            f"val acc {metrics['val_acc']:.3f}, "
            f"{step_s * 1000:.1f} ms per step, lr {sched.get_last_lr()[0]:.4f}"
        )
        gg.distributed.save_checkpoint(args.out / f"epoch-{epoch + 1}", ddp, opt, sched, step=epoch + 1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
