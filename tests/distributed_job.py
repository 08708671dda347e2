"""The data-parallel jobs tests/test_distributed.py launches (torchrun, gloo, CPU): one scenario per run.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_job.py grow OUT
    ... resume OUT            (any world size: continues the checkpoints `grow` wrote)
    ... lightning OUT         (GrowthCallback under Lightning's ddp strategy)
    python tests/distributed_job.py die|hang OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the test)

Each rank writes OUT/<scenario>-rank<r>.json with what the test checks. The data of step s is one global
batch drawn with seed s and split evenly across the ranks, so a run with 1 process sees the same examples
per step as one with 2.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graphgrow as gg  # noqa: E402
from graphgrow.jobs.replicas import digest, model_digests  # noqa: E402

GLOBAL_BATCH = 8
STEPS, GROW_AT, SAVE_AT = 7, 2, 4  # grow before step 2; checkpoint after step 4; train to step 7
SPECS = {"cnn": "grow_width(factor=2),add_residual", "transformer": "deepen"}


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 5),
    )


class Transformer(nn.Module):
    """Token ids → Embedding → a plain nn.TransformerEncoder (2 layers) → per-token logits. Dropout 0: a resumed run
    repeats the original's steps exactly. The activation is a module (nn.ReLU()), not F.relu: the encoder stays one
    opaque call in the fx trace, and a saved file that holds a function needs --trust to load."""

    def __init__(self, vocab: int = 50, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=64, dropout=0.0, activation=nn.ReLU(), batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 5)

    def forward(self, input_ids):
        return self.head(self.encoder(self.embed(input_ids)))


def transformer() -> nn.Module:
    return Transformer()


def traced(kind: str):
    torch.manual_seed(0)
    if kind == "cnn":
        return gg.trace(cnn().train(), input_shape=(2, 3, 12, 12))
    return gg.trace(transformer().train(), input_shape={"input_ids": ((2, 12), torch.int64)}, capture="fx")


def batch(kind: str, step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "cnn":
        x, y = torch.randn(GLOBAL_BATCH, 3, 12, 12, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
    else:
        x, y = (
            torch.randint(0, 50, (GLOBAL_BATCH, 12), generator=g),
            torch.randint(0, 5, (GLOBAL_BATCH, 12), generator=g),
        )
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_of(model: nn.Module, x, y) -> torch.Tensor:
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def probe(gm: nn.Module, kind: str) -> dict:
    """The loss on a fixed batch in eval and in train mode, on a copy (train mode moves BatchNorm's running stats)."""
    x, y = batch(kind, 999, 0, 1)
    m = copy.deepcopy(gm)
    out = {}
    with torch.no_grad():
        for mode in ("eval", "train"):
            m.train(mode == "train")
            out[mode] = loss_of(m, x, y).item()
    return out


def optimiser(params, lr=0.05):
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def step_once(model, opt, sched, kind, step, rank, world) -> float:
    x, y = batch(kind, step, rank, world)
    opt.zero_grad()
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    sched.step()
    mean = loss.detach().clone()
    if world > 1:
        dist.all_reduce(mean)
        mean /= world
    return mean.item()


def fingerprint(gm) -> str:
    """A digest of the parameters (buffers lag: DDP sends rank 0's at the start of the next forward)."""
    return digest({n: d for n, d in model_digests(gm).items() if n in dict(gm.named_parameters())})


def sync_buffers(gm) -> None:
    """Rank 0's buffers, as DDP's next forward would send them: the state a probe should see on every rank."""
    for b in gm.buffers():
        dist.broadcast(b, src=0)


def run_grow(out: Path, rank: int, world: int) -> dict:
    report = {}
    for kind, spec in SPECS.items():
        gm = traced(kind)
        ddp = DDP(gm)
        opt, sched = optimiser(ddp.parameters())
        r: dict = {"losses": {}}
        for step in range(STEPS):
            if step == GROW_AT:
                r["params_before"] = sum(p.numel() for p in ddp.module.parameters())
                sync_buffers(ddp.module)
                r["probe_before"] = probe(ddp.module, kind)
                r["lr_before"] = sched.get_last_lr()
                g = gg.distributed.grow(ddp, opt, spec, sched, timeout=300)
                ddp, opt, sched = g.model, g.optimizer, g.scheduler
                r["probe_after"] = probe(ddp.module, kind)
                r["lr_after"] = sched.get_last_lr()
                r["params_after"] = sum(p.numel() for p in ddp.module.parameters())
                r["opt_covers_model"] = {id(p) for grp in opt.param_groups for p in grp["params"]} == {
                    id(p) for p in ddp.module.parameters()
                }
                r["momentum_carried"] = sum(1 for p in opt.state.values() if "momentum_buffer" in p)
                r["seconds"] = g.seconds
                r["seed"] = g.seed
                new = [n for n, _ in ddp.module.named_parameters() if n not in dict(gm.named_parameters())]
                r["new_params"] = new
                r["new_at_growth"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters() if n in new}
            r["losses"][step] = step_once(ddp, opt, sched, kind, step, rank, world)
            if step == SAVE_AT:
                sync_buffers(ddp.module)
                gg.distributed.save_checkpoint(out / f"ckpt-{kind}", ddp, opt, sched, step=step + 1)
                r["probe_at_save"] = probe(ddp.module, kind)
        params = dict(ddp.module.named_parameters())
        r["new_params_moved"] = [n for n, v in r.pop("new_at_growth").items() if not torch.equal(v, params[n])]
        r["fingerprint"] = fingerprint(ddp.module)
        report[kind] = r
    report["disagreements"] = disagreements(ddp, opt, sched, rank, world)
    return report


def disagreements(ddp, opt, sched, rank: int, world: int) -> dict:
    """Growth steps that must fail on every rank and change nothing: different specs, and ranks that grow different
    weights (rank 1's pipeline perturbs a new parameter). The group stays usable: a training step follows."""
    out = {}
    gm, before = ddp.module, fingerprint(ddp.module)
    try:
        gg.distributed.grow(ddp, opt, "deepen" if rank == 0 else "insert_adapter", sched, timeout=300)
    except gg.DistributedError as e:
        out["spec"] = str(e)
    real_run = gg.Pipeline.run

    def perturbed(self, model, *args, **kwargs):
        result = real_run(self, model, *args, **kwargs)
        with torch.no_grad():
            dict(result.gm.named_parameters())["deepen_linear_relu_gate"].add_(1e-3)
        return result

    if rank == 1:
        gg.Pipeline.run = perturbed  # type: ignore[method-assign]
    try:
        gg.distributed.grow(ddp, opt, "deepen", sched, timeout=300)
    except gg.DistributedError as e:
        out["weights"] = str(e)
    gg.Pipeline.run = real_run  # type: ignore[method-assign]
    out["kept"] = (
        ddp.module is gm and fingerprint(gm) == before and opt.param_groups[0]["params"][0] is next(gm.parameters())
    )
    out["step_after"] = step_once(ddp, opt, sched, "transformer", STEPS, rank, world)
    return out


def run_resume(out: Path, rank: int, world: int) -> dict:
    report = {}
    for kind in SPECS:
        ck = gg.distributed.load_checkpoint(out / f"ckpt-{kind}")
        gm = ck.model
        opt, sched = optimiser(gm.parameters())
        ck.restore(opt, sched)
        model = DDP(gm) if world > 1 else gm
        r = {"step": ck.step, "probe_at_load": probe(gm, kind), "losses": {}}
        for step in range(ck.step, STEPS):
            r["losses"][step] = step_once(model, opt, sched, kind, step, rank, world)
        r["fingerprint"] = fingerprint(gm)
        report[kind] = r
    return report


def run_fault(out: Path, rank: int, world: int, how: str) -> dict:
    """Rank 1 dies (SIGKILL) or hangs inside the growth step; rank 0 must come back with a DistributedError."""
    gm = traced("cnn")
    ddp = DDP(gm)
    opt, sched = optimiser(ddp.parameters())
    step_once(ddp, opt, sched, "cnn", 0, rank, world)
    if rank == 1:

        def stop(*args, **kwargs):
            if how == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)

        gg.Pipeline.run = stop  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        gg.distributed.grow(ddp, opt, "deepen", sched, timeout=float(os.environ.get("GROW_TIMEOUT", "8")))
    except gg.DistributedError as e:
        return {
            "error": str(e),
            "type": type(e).__name__,
            "seconds": time.perf_counter() - start,
            "model_kept": ddp.module is gm and fingerprint(gm) == fingerprint(ddp.module),
        }
    return {"error": None, "seconds": time.perf_counter() - start}


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "grow":
        report = run_grow(out, rank, world)
    elif scenario == "resume":
        report = run_resume(out, rank, world)
    elif scenario == "lightning":
        from distributed_lightning import run_lightning

        report = run_lightning(out, rank, world)
    else:
        report = run_fault(out, rank, world, scenario)
    name = f"{scenario}-w{world}-rank{rank}.json"
    (out / name).write_text(json.dumps(report, default=str))
    if scenario in ("die", "hang"):
        os._exit(0)  # the group is broken: no clean shutdown to wait for
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
