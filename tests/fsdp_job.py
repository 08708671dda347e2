"""The torchrun job behind tests/test_fsdp.py: growth of a decoder sharded with FSDP2, every scenario in one launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_job.py OUT

Each rank writes OUT/fsdp-rank{R}.json; the assertions are in tests/test_fsdp.py. Scenarios:
- grow: per spec, the decoder sharded per layer (gg.distributed.shard) trains 2 AdamW steps, grows with
  gg.distributed.grow, trains 2 more; beside it, the same growth done unsharded (grow_replica on a plain model
  and AdamW loaded from torch's own full state dicts) as the reference;
- failure: rank 1 fails inside the pipeline (at planning), inside a layer's window, inside the re-sharding, then in
  the grown model's check and in the optimiser carry with release_old; both ranks must keep the old model (and
  raise at once: the carry's gathers must not wait for the training group's timeout);
- memory: a growth event's peak of tensor bytes (the profiler's record of the CPU allocator) against the sharded
  steady state, with and without release_old;
- example: examples/grow_fsdp.py's training loop, through both of its growth events;
- killed: a rank killed (SIGKILL) during growth, in two processes forked at start-up (before this job's process
  group exists) that form a job of their own: the survivor must raise, not hang;
- lightning: GrowthCallback under Lightning's ModelParallelStrategy (FSDP2) in this process group.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import graphgrow as gg  # noqa: E402
from examples import grow_fsdp as ex  # noqa: E402
from graphgrow.jobs import fsdp, fsdp_layers, fsdp_spill, layerwise  # noqa: E402
from graphgrow.jobs.optim import carry_optimizer  # noqa: E402

SPECS = ["grow_hidden(by=8)", "grow_width(factor=2)", "grow_heads(by=1)", "deepen(block=transformer)"]
LAYERS = ["layers.0", "layers.1"]
FULL = StateDictOptions(full_state_dict=True)


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().clone()  # numpy() below would pin the tensor's own storage (not resizable)
        h.update(f"{name}|{tuple(t.shape)}|".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def probe(model) -> dict:
    """The loss on one fixed batch (the same on every rank), in eval and in train mode."""
    out = {}
    with torch.no_grad():
        for mode in ("eval", "train"):
            model.train(mode == "train")
            out[mode] = ex.loss_of(model, *ex.batch(10_000)).item()
    model.train()
    return out


def step(model, opt, n: int, rank: int, world: int) -> float:
    return ex.train_step(model, opt, n, rank, world)


def reference_step(model, opt, n: int) -> float:
    """The same step unsharded, on the whole global batch (FSDP averages the ranks' gradients of equal halves)."""
    x, y = ex.batch(n)
    opt.zero_grad()
    loss = ex.loss_of(model, x, y)
    loss.backward()
    opt.step()
    return loss.item()


def optimizer_full(model, opt) -> dict:
    """AdamW's state as full tensors by parameter name (torch's own gathering)."""
    return {
        f"{name}.{key}": value
        for name, state in get_optimizer_state_dict(model, opt, options=FULL)["state"].items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    }


def sharded(model, rank: int, world: int) -> bool:
    """Every parameter a DTensor on dim 0 whose local part is this rank's chunk (torch.chunk's sizes)."""
    for p in model.parameters():
        if not isinstance(p, DTensor) or p.placements[0].__class__.__name__ != "Shard":
            return False
        chunks = torch.empty(p.shape[0]).chunk(world)
        want = chunks[rank].shape[0] if rank < len(chunks) else 0
        if p.to_local().shape[0] != want:
            return False
    return True


_BASE: list = []


def fresh():
    """The traced decoder, traced once per process (1 s each) and copied."""
    if not _BASE:
        _BASE.append(ex.traced())
    return copy.deepcopy(_BASE[0])


def grow_scenario(spec: str, mesh, rank: int, world: int) -> dict:
    model = gg.distributed.shard(fresh(), LAYERS, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    r: dict = {"losses": [step(model, opt, n, rank, world) for n in range(2)]}
    ref = fresh()
    ref.load_state_dict(get_model_state_dict(model, options=FULL))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    set_optimizer_state_dict(ref, ref_opt, get_optimizer_state_dict(model, opt, options=FULL), options=FULL)
    units_before = fsdp.sharding_units(model)
    r["probe_before"] = probe(model)
    g = gg.distributed.grow(model, opt, spec, seed=7, timeout=120)
    grown, gopt = g.model, g.optimizer
    r["seconds"] = g.seconds
    r["sharded"] = sharded(grown, rank, world)
    r["units_before"] = [list(u.paths) for u in units_before]
    r["units_after"] = [list(u.paths) for u in fsdp.sharding_units(grown)]
    r["same_mesh"] = all(u.options["mesh"] is mesh for u in fsdp.sharding_units(grown))
    r["params_before"] = sum(p.numel() for p in model.parameters())
    r["params_after"] = sum(p.numel() for p in grown.parameters())
    r["opt_covers_model"] = {id(p) for grp in gopt.param_groups for p in grp["params"]} == {
        id(p) for p in grown.parameters()
    }
    full = get_model_state_dict(grown, options=FULL)
    r["digest"] = digest(full)
    # the reference: the same growth unsharded — window by window as the sharded job grows (layerwise.grow_plain)
    r["layerwise"] = "plan" in g.seconds
    ref_gm = layerwise.grow_plain(ref, gg.build_pipeline(spec), seed=7)
    ref_g = SimpleNamespace(gm=ref_gm, optimizer=carry_optimizer(ref_opt, ref, ref_gm))
    mine, theirs = (
        optimizer_full(grown, gopt),
        {
            f"{n}.{k}": v
            for n, p in ref_g.gm.named_parameters()
            for k, v in ref_g.optimizer.state.get(p, {}).items()
            if v.dim() > 0
        },
    )
    want = ref_g.gm.state_dict()
    r["differs_from_unsharded"] = sorted(n for n in want if n not in full or not torch.equal(full[n], want[n]))
    r["optimizer_differs"] = sorted(n for n in theirs if n not in mine or not torch.equal(mine[n], theirs[n]))
    r["optimizer_entries"] = len(mine)
    r["optimizer_digest"] = digest(mine)
    r["probe_after"] = probe(grown)
    r["losses_after"] = [step(grown, gopt, n, rank, world) for n in range(2, 4)]
    r["reference_after"] = [reference_step(ref_g.gm, ref_g.optimizer, n) for n in range(2, 4)]
    trained = get_model_state_dict(grown, options=FULL)
    r["max_param_gap"] = max((trained[n] - v).abs().max().item() for n, v in ref_g.gm.state_dict().items())
    new_names = [n for n in full if n not in dict(_BASE[0].named_parameters())]
    r["new_params"] = new_names
    r["new_params_moved"] = [n for n in new_names if not torch.equal(full[n], trained[n])]
    return r


def release_scenario(mesh, rank: int, world: int) -> dict:
    """grow(release_old=True, layerwise=False): the grow_width case again on the whole-model path, the old model's
    device memory freed while growing (copied to the host); then a pipeline failure on rank 1 there, which must put
    the old shards and state back. (release_old layer by layer: memory_scenario, failure_scenario's check, killed's
    gather.)"""
    model = gg.distributed.shard(fresh(), LAYERS, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for n in range(2):
        step(model, opt, n, rank, world)
    params = list(model.parameters())
    ref = fresh()  # release_old grows the whole model: its reference is grow_replica on a plain copy
    ref.load_state_dict(get_model_state_dict(model, options=FULL))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    set_optimizer_state_dict(ref, ref_opt, get_optimizer_state_dict(model, opt, options=FULL), options=FULL)
    ref_g = gg.distributed.grow_replica(ref, ref_opt, "grow_width(factor=2)", seed=7, timeout=60)

    def local() -> str:
        state = {f"{i}.{k}": v.to_local() for i, p in enumerate(params) for k, v in opt.state[p].items() if v.dim()}
        return digest({**{str(i): p.to_local() for i, p in enumerate(params)}, **state})

    before, out = local(), {}
    real_run = gg.Pipeline.run
    if rank == 1:
        gg.Pipeline.run = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected failure on rank 1"))
    try:
        gg.distributed.grow(model, opt, "grow_width(factor=2)", seed=7, timeout=60, release_old=True, layerwise=False)
    except gg.DistributedError as e:
        out["error"] = str(e)
    finally:
        gg.Pipeline.run = real_run  # type: ignore[method-assign]
    out["restored"] = local() == before
    g = gg.distributed.grow(model, opt, "grow_width(factor=2)", seed=7, timeout=60, release_old=True, layerwise=False)
    # what left the device: every old shard, gradient and AdamW moment (storages resized to nothing)
    old_state = [v.to_local() for p in params for v in opt.state[p].values() if v.dim()]
    old = [p.to_local() for p in params] + [p.grad.to_local() for p in params] + old_state
    out["released"] = all(not t.untyped_storage().nbytes() for t in old)
    out["digest"] = digest(get_model_state_dict(g.model, options=FULL))
    out["optimizer_digest"] = digest(optimizer_full(g.model, g.optimizer))
    out["reference_digest"] = digest(ref_g.gm.state_dict())
    out["reference_optimizer_digest"] = digest(
        {
            f"{n}.{k}": v
            for n, p in ref_g.gm.named_parameters()
            for k, v in ref_g.optimizer.state.get(p, {}).items()
            if v.dim()
        }
    )
    out["probe_after"] = probe(g.model)
    out["step_after"] = step(g.model, g.optimizer, 2, rank, world)
    return out


def options_scenario(mesh, rank: int, world: int) -> dict:
    """Units sharded with settings of their own (layers kept gathered after forward, bf16 compute): the grown model's
    units carry the same settings."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = gg.distributed.shard(fresh(), LAYERS, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, 0, rank, world)

    def settings(m) -> list:
        return [
            [u.paths[0], repr(u.options.get("reshard_after_forward")), repr(u.options["mp_policy"])]
            for u in fsdp.sharding_units(m)
        ]

    before, probe_before = settings(model), probe(model)
    g = gg.distributed.grow(model, opt, "grow_width(factor=2)", seed=2, timeout=120)
    return {
        "before": before,
        "after": settings(g.model),
        "probe_before": probe_before,
        "probe_after": probe(g.model),
        "step_after": step(g.model, g.optimizer, 1, rank, world),
    }


def failure_scenario(mesh, rank: int, world: int) -> dict:
    """Rank 1 fails in the pipeline, inside a window, in the re-sharding, in the final check and in the optimiser
    carry (its third state tensor, once gathered): both ranks raise and keep the old model, then train."""
    model = gg.distributed.shard(fresh(), LAYERS, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, 0, rank, world)
    params = list(model.parameters())

    def local() -> str:
        state = {f"{i}.{k}": v.to_local() for i, p in enumerate(params) for k, v in opt.state[p].items() if v.dim()}
        grads = {f"{i}.grad": p.grad.to_local() for i, p in enumerate(params)}
        return digest({**{str(i): p.to_local() for i, p in enumerate(params)}, **state, **grads})

    before = local()
    out: dict = {}

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure on rank 1")

    def fail_in_window(pipeline, gm, *args, **kwargs):  # planning (on the meta device) passes; a real window fails
        if any(p.device.type != "meta" for p in gm.parameters()):
            raise RuntimeError("injected failure on rank 1")
        return real_run(pipeline, gm, *args, **kwargs)

    real_run, real_reshard, real_unit = gg.Pipeline.run, fsdp.reshard, fsdp_layers.shard_unit
    real_compare, real_fit = fsdp_layers.compare_outputs, fsdp._fit_sharded
    fits = [0]

    def fail_third_fit(value, old, new):  # rank 1 raises in its own work on the third state tensor, after gathering it
        fits[0] += 1
        out = real_fit(value, old, new)
        if fits[0] == 3:
            raise RuntimeError("injected failure on rank 1")
        return out

    for where in ("pipeline", "window", "reshard", "check", "carry"):
        if rank == 1:
            if where == "pipeline":
                gg.Pipeline.run = fail  # type: ignore[method-assign]
            elif where == "window":
                gg.Pipeline.run = fail_in_window  # type: ignore[method-assign]
            elif where == "reshard":
                fsdp.reshard = fsdp_layers.shard_unit = fail  # type: ignore[assignment]
            elif where == "check":  # the whole grown model's check: with release_old every old shard, gradient
                fsdp_layers.compare_outputs = fail  # type: ignore[assignment]  # and moment is in the file then
            else:
                fsdp._fit_sharded = fail_third_fit  # type: ignore[assignment]
        start = time.perf_counter()
        try:
            release = where in ("check", "carry")
            gg.distributed.grow(model, opt, "grow_hidden(by=8)", seed=3, timeout=60, release_old=release)
            out[where] = {"error": None}
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out[where] = {"type": type(e).__name__, "error": str(e)}
        finally:
            gg.Pipeline.run, fsdp.reshard, fsdp_layers.shard_unit = real_run, real_reshard, real_unit
            fsdp_layers.compare_outputs, fsdp._fit_sharded = real_compare, real_fit  # type: ignore[assignment]
        out[where]["seconds"] = time.perf_counter() - start
        out[where]["kept"] = list(model.parameters()) == params and local() == before
        out[where]["opt_kept"] = opt.param_groups[0]["params"] == params
    out["step_after"] = step(model, opt, 1, rank, world)
    return out


SPANS = ("graphgrow-training-step", "graphgrow-growth-event")


def memory_scenario(mesh, rank: int, world: int) -> dict:
    """A growth event's peak of tensor memory against the sharded steady state: a decoder of hidden 128 with 4 layers
    (a layer's 0.5 MB of weights is well above the activations of its batch), two AdamW steps, then
    grow_hidden(by=8) — without release_old and with it, unverified (the state growth holds, alone), then with it and
    rank 0 verifying (the old model's reference forward, gathered by FSDP, and the windows' checks add their working
    set). Bytes held by tensors are tracked through the profiler (every allocation and free of torch's CPU allocator;
    each model is built inside the profiled span, so that freeing its old state counts); steady: when the span
    starts; peak: the highest during it; after: at the end, the old model still referenced."""
    from torch.profiler import ProfilerActivity, profile, record_function

    base, layers = ex.traced(dim=128, layers=4), [f"layers.{i}" for i in range(4)]
    out: dict = {}
    for case, release, verify in (("keep", False, "none"), ("release", True, "none"), ("verified", True, "rank0")):
        settle()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = gg.distributed.shard(copy.deepcopy(base), layers, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            step(model, opt, 0, rank, world)
            with record_function("graphgrow-training-step"):
                step(model, opt, 1, rank, world)
            settle()
            with record_function("graphgrow-growth-event"):
                g = gg.distributed.grow(
                    model, opt, "grow_hidden(by=8)", seed=1, timeout=60, release_old=release, verify=verify
                )
        events = prof.profiler.kineto_results.events()
        spans = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() in SPANS}
        held, peak, at, grown_by = 0, dict.fromkeys(SPANS, 0), {}, []
        for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
            for name, (start, end) in spans.items():
                if e.start_ns() >= start and name not in at:
                    at[name] = held  # held when the span starts
                if start <= e.start_ns() < end:
                    peak[name] = max(peak[name], held + e.nbytes())
                    if name == "graphgrow-growth-event" and e.nbytes() > 0:
                        grown_by.append(e.nbytes())
            held += e.nbytes()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in fsdp_spill.local_state(
            model.parameters(), opt)}  # fmt: skip
        old_state = sum(storages.values())
        grown_layer = sum(p.numel() * p.element_size() for n, p in g.model.named_parameters() if "layers.0." in n)
        out[case] = {
            "steady": at["graphgrow-growth-event"],
            "peak": peak["graphgrow-growth-event"],
            "train_peak": peak["graphgrow-training-step"],
            "train_steady": at["graphgrow-training-step"],
            "after": held,
            "old_state_left": old_state,
            "grown_layer_full": grown_layer,
            "grown_shards": sum(p.to_local().numel() * p.element_size() for p in g.model.parameters()),
            "probe_after": probe(g.model),
            "digest": digest(get_model_state_dict(g.model, options=FULL)),
            "optimizer_digest": digest(optimizer_full(g.model, g.optimizer)),
            "old_used": _use_old(model, opt),
            "largest_allocations": sorted(grown_by, reverse=True)[:8],  # said when the test fails
        }
        del g, model, opt
    out["layer_full"] = sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "layers.0." in n)
    out["model_full"] = sum(p.numel() * p.element_size() for p in base.parameters())
    return out


def settle() -> None:
    """Both ranks at the same point with nothing left to free: a cycle's tensors collected now, not inside a measured
    span, and neither rank's growth starting while the other still finishes its step (on a loaded 2-core machine)."""
    gc.collect()
    dist.barrier()


def _use_old(model, opt) -> dict:
    """What the old model and optimiser do when used after growth: None where they work (the old state kept), else
    the error's type (release_old: a typed error, not a crash on the freed tensors)."""
    out: dict = {}
    for what, use in (
        ("forward", lambda: probe(model)),
        ("state_dict", lambda: model.state_dict()),
        ("step", lambda: opt.step()),
        ("optimizer_state_dict", lambda: opt.state_dict()),
    ):
        try:
            use()
            out[what] = None
        except Exception as e:  # noqa: BLE001 - the test reads the type
            out[what] = type(e).__name__
    return out


def resume_scenario(mesh, rank: int, world: int, out: Path) -> dict:
    """Train, grow, train, save a sharded checkpoint, train on; then resume from it in this group (a fresh traced model
    regrown from the log, sharded, restored) and, on rank 0 alone, in a group of one (DCP re-shards)."""
    from torch.distributed.device_mesh import DeviceMesh

    def scheduled(model, opt, sched, n, local=False):
        loss = reference_step(model, opt, n) if local else step(model, opt, n, rank, world)
        sched.step()
        return loss

    def built(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    model = gg.distributed.shard(fresh(), LAYERS, mesh=mesh)
    opt, sched = built(model)
    for n in range(2):
        scheduled(model, opt, sched, n)
    g = gg.distributed.grow(model, opt, "grow_hidden(by=8)", sched, seed=5, timeout=120)
    model, opt = g.model, g.optimizer
    scheduled(model, opt, sched, 2)
    path = gg.distributed.save_sharded_checkpoint(out / "ckpt", model, opt, sched, step=3, extra={"note": "grown"})
    r: dict = {"probe_at_save": probe(model), "lr_at_save": sched.get_last_lr()}
    r["losses"] = [scheduled(model, opt, sched, n) for n in (3, 4)]
    r["files"] = sorted(p.name for p in path.iterdir())

    ck = gg.distributed.load_sharded_checkpoint(path)
    again = gg.distributed.shard(ck.regrow(fresh()), LAYERS, mesh=mesh)
    opt2, sched2 = built(again)
    ck.restore(again, opt2, sched2)
    r["step"], r["extra"] = ck.step, ck.extra
    r["probe_at_load"], r["lr_at_load"] = probe(again), sched2.get_last_lr()
    r["resumed_losses"] = [scheduled(again, opt2, sched2, n) for n in (3, 4)]

    solo = dist.new_group([0])  # every rank makes the group; rank 0 alone resumes in it
    if rank == 0:
        alone = gg.distributed.shard(ck.regrow(fresh()), LAYERS, mesh=DeviceMesh.from_group(solo, "cpu"))
        opt1, sched1 = built(alone)
        ck.restore(alone, opt1, sched1, process_group=solo)
        r["probe_at_load_1"] = probe(alone)
        r["resumed_losses_1"] = [scheduled(alone, opt1, sched1, n, local=True) for n in (3, 4)]
    dist.barrier()
    return r


def lightning_scenario(rank: int, world: int) -> dict:
    """GrowthCallback under Lightning's ModelParallelStrategy (FSDP2: the module shards its traced model in
    configure_model on the strategy's data-parallel mesh), CPU and gloo in this job's process group: the decoder
    grows at global step 2 (grow_hidden), probes just before and after the callback read the loss on a fixed batch;
    training goes on to step 5. FSDPStrategy (FSDP1's wrapper) is refused by the callback with an InputError."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = fresh()

        def configure_model(self):
            gg.distributed.shard(self.model, LAYERS, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return ex.loss_of(self.model, *batch)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}

    record: dict = {}

    class Probe(pl.Callback):
        def __init__(self, key: str):
            self.key = key

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2 and self.key not in record:
                record[self.key] = probe(pl_module.model)
                record[self.key + "_params"] = sum(p.numel() for p in pl_module.model.parameters())

    growth = gg.distributed.GrowthCallback({2: "grow_hidden(by=8)"}, seed=4, timeout=60)
    x, y = ex.batch(0, size=8 * 5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=5,
        callbacks=[Probe("before"), growth, Probe("after")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    net = Net()
    trainer.fit(net, DataLoader(TensorDataset(x, y), batch_size=8 // world))
    opt = trainer.optimizers[0]
    record["events"] = growth.events
    record["global_step"] = trainer.global_step
    record["sharded"] = sharded(net.model, rank, world)
    record["opt_is_model"] = {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in net.parameters()}
    record["opt_state"] = sum(1 for p in net.parameters() if opt.state.get(p))
    record["scheduler_follows"] = trainer.lr_scheduler_configs[0].scheduler.optimizer is opt
    try:
        gg.distributed.GrowthCallback({0: "grow_width"}).grow(
            SimpleNamespace(strategy=FSDPStrategy()),
            net,
            "grow_width",  # type: ignore[arg-type]
        )
    except gg.InputError as e:
        record["fsdp1"] = str(e)
    return record


KILL_POINTS = ("window", "gather")


class Waiting:
    """A child forked before this rank joins the job's process group (so it inherits no group, no gloo thread): it
    waits on a pipe; told the port of rank 0's store, it runs killed_scenario with the other rank's child as a job of
    two, then exits."""

    def __init__(self, point: str, rank: int, out: Path):
        self.point, self.out = point, out
        read, self.write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.write)
            with os.fdopen(read) as f:
                line = f.readline()
            code = 0
            if line:
                try:
                    killed_scenario(point, rank, int(line), out)
                except BaseException:  # noqa: BLE001 - the child's failure shows as no report and exit code 3
                    import traceback

                    traceback.print_exc()
                    code = 3
            os._exit(code)  # no interpreter shutdown: a group whose peer died must not be torn down politely
        os.close(read)

    def run(self, port: int, limit: float = 120.0) -> int | None:
        """Start the child and wait for it (at most `limit` s, then kill it): its exit status (-9: killed)."""
        os.write(self.write, f"{port}\n".encode())
        os.close(self.write)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        return None


def killed_scenario(point: str, rank: int, port: int, out: Path) -> None:
    """Two fresh processes (the children of ranks 0 and 1) train the decoder sharded, then grow; child 1 kills itself
    with SIGKILL at `point` — inside its first real layer window (pipeline), or before gathering layers.1's first
    tensor (a collective of the training group), growing with release_old (layer 0's old state is in the spill file
    by then). Child 0 must raise DistributedError, not hang, and hold its old shards and gradients: it writes what it
    saw."""
    from datetime import timedelta

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    store = dist.PrefixStore(point, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (2,))
    model = gg.distributed.shard(fresh(), LAYERS, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, 0, rank, 2)
    params = list(model.parameters())

    def local() -> str:
        return digest(
            {
                **{str(i): p.to_local() for i, p in enumerate(params)},
                **{f"{i}.grad": p.grad.to_local() for i, p in enumerate(params)},
            }
        )

    before = local()
    if rank == 1:
        die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        if point == "window":
            real_run = gg.Pipeline.run

            def run(pipeline, gm, *args, **kwargs):
                if any(p.device.type != "meta" for p in gm.parameters()):
                    die()
                return real_run(pipeline, gm, *args, **kwargs)

            gg.Pipeline.run = run  # type: ignore[method-assign]
        else:
            real_call = fsdp_layers._Fetch.__call__

            def fetch(self, name):
                if name.startswith("layers.1."):
                    die()
                return real_call(self, name)

            fsdp_layers._Fetch.__call__ = fetch  # type: ignore[method-assign]
    start = time.perf_counter()
    r: dict = {}
    try:
        # release_old at the gather point: the survivor has layer 0's old shards in its spill file and reads them back
        gg.distributed.grow(model, opt, "grow_hidden(by=8)", seed=3, timeout=20, release_old=point == "gather")
        r["error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        r.update(type=type(e).__name__, error=str(e))
    r["seconds"] = time.perf_counter() - start
    r["kept"] = list(model.parameters()) == params and local() == before
    (out / f"killed-{point}-rank{rank}.json").write_text(json.dumps(r))


def killed(children: list[Waiting], rank: int, out: Path) -> dict:
    """Each kill point in turn: both ranks start their waiting child for that point. The children meet at a store
    that rank 0 serves on a port the system chose (bound, then named: no other process can take it meanwhile)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    report = {}
    for child in children:
        status = child.run(port[0])
        path = out / f"killed-{child.point}-rank{rank}.json"
        report[child.point] = {"status": status, **(json.loads(path.read_text()) if path.exists() else {})}
        dist.barrier()
    return report


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    rank = int(os.environ["RANK"])
    children = [Waiting(point, rank, out) for point in KILL_POINTS]  # forked before the process group exists
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    report: dict = {"grow": {}, "seconds": {}}
    for spec in SPECS:
        start = time.perf_counter()
        report["grow"][spec] = grow_scenario(spec, mesh, rank, world)
        report["seconds"][spec] = time.perf_counter() - start
    start = time.perf_counter()
    report["release"] = release_scenario(mesh, rank, world)
    report["seconds"]["release"] = time.perf_counter() - start
    start = time.perf_counter()
    report["options"] = options_scenario(mesh, rank, world)
    report["seconds"]["options"] = time.perf_counter() - start
    start = time.perf_counter()
    report["failure"] = failure_scenario(mesh, rank, world)
    report["seconds"]["failure"] = time.perf_counter() - start
    start = time.perf_counter()
    report["memory"] = memory_scenario(mesh, rank, world)
    report["seconds"]["memory"] = time.perf_counter() - start
    start = time.perf_counter()
    report["resume"] = resume_scenario(mesh, rank, world, out)
    report["seconds"]["resume"] = time.perf_counter() - start
    start = time.perf_counter()
    report["example"] = ex.run(22, say=lambda *a, **k: None)
    report["seconds"]["example"] = time.perf_counter() - start
    start = time.perf_counter()
    report["killed"] = killed(children, rank, out)
    report["seconds"]["killed"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        import lightning.pytorch  # noqa: F401 - an optional extra
    except ImportError as e:
        report["lightning"] = {"skipped": str(e)}
    else:
        report["lightning"] = lightning_scenario(rank, world)
    report["seconds"]["lightning"] = time.perf_counter() - start
    (out / f"fsdp-rank{rank}.json").write_text(json.dumps(report, default=str))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
