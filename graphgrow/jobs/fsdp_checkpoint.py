"""Checkpoints of a job sharded with FSDP2 that resume across growth: torch.distributed.checkpoint (DCP) for the
weights and the optimiser, the mutation log for the architecture.

A checkpoint is a folder:

    dcp/       the model's and the optimiser's state as DCP writes them (get_state_dict: every rank writes its
               own shards; a job of another size reads them re-sharded)
    state.pt   the mutation log (every growth event with its seed), the parameter names and shapes, the step, the
               scheduler's state and your `extra` values (plain data, read with torch.load(weights_only=True))

No rank gathers the model to write it. A new job rebuilds the grown architecture from the original one by replaying
the log (`regrow`: bit-identical structure, unverified — the weights are the checkpoint's next), shards it as the
job does, then `restore` loads the shards into it and into an optimiser built over it.

`save_sharded_checkpoint` is called on every rank; the folder is written under a staging name and put in place by
rank 0 once every rank has written its part (it appears whole or not at all).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import InputError, LoadError, SaveError, first_line
from . import replicas as rp
from .checkpoint import swap_in
from .fsdp import is_fsdp

FORMAT = "graphgrow.sharded_checkpoint"
VERSION = 1


def _log_of(model: nn.Module) -> list[dict]:
    meta = getattr(model, "meta", None)
    if not isinstance(model, fx.GraphModule) or not isinstance(meta, dict) or "graphgrow" not in meta:
        raise InputError(
            f"a sharded checkpoint holds a traced model, got {type(model).__name__}",
            "shard the model gg.trace made (gg.distributed.shard)",
        )
    return list(meta["graphgrow"].get("log", []))


def save_sharded_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    step: int = 0,
    extra: dict | None = None,
    timeout: float = 300.0,
) -> Path:
    """Write a sharded checkpoint folder at `path` (replacing an earlier one there). Call it on every rank of a job
    whose traced model is sharded with FSDP2; every rank writes its shards. Returns the path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not is_fsdp(model):
        raise InputError(
            f"save_sharded_checkpoint takes a model sharded with FSDP2, got {type(model).__name__}",
            "for a DDP job or one process use gg.distributed.save_checkpoint",
        )
    log = _log_of(model)
    out = Path(path)
    staged = out.with_name(f".{out.name}.part")
    reps = rp.replicas(timeout)
    error: BaseException | None = None
    if reps.rank == 0:
        try:
            _prepare(out, staged)
        except Exception as e:  # reported to every rank, then raised
            error = e
    records = reps.gather({"error": rp.error_text(error) if error else None}, f"preparing the checkpoint {out}")
    rp.raise_failures(reps, records, error, "writing the checkpoint")
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optim"] = optim_state
    dcp.save(state, checkpoint_id=staged / "dcp")
    if reps.rank == 0:
        try:
            plain = {
                "format": FORMAT,
                "version": VERSION,
                "step": int(step),
                "extra": extra or {},
                "log": log,
                "params": {n: list(p.shape) for n, p in model.named_parameters()},
                "optimizer": optimizer is not None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
            }
            torch.save(plain, staged / "state.pt")
            torch.load(staged / "state.pt", weights_only=True)  # the reader's promise, checked before the swap
        except Exception as e:
            error = SaveError(
                f"the checkpoint state is not plain data: {first_line(e, 200)}",
                "keep `extra` and the scheduler's state to numbers, strings, lists, dicts and tensors",
            )
    records = reps.gather({"error": rp.error_text(error) if error else None}, f"writing the checkpoint {out}")
    if reps.rank == 0 and error is None and not any(r.get("error") for r in records):
        swap_in(staged, out)
    elif reps.rank == 0:
        shutil.rmtree(staged, ignore_errors=True)
    rp.raise_failures(reps, records, error, "writing the checkpoint")
    reps.barrier(f"putting the checkpoint {out} in place")
    return out


def _prepare(out: Path, staged: Path) -> None:
    if out.exists() and not (out.is_dir() and (out / "state.pt").is_file() and (out / "dcp").is_dir()):
        raise SaveError(
            f"{out} exists and is not a graphgrow sharded checkpoint folder", "choose another path; nothing was written"
        )
    if not out.parent.is_dir():
        raise SaveError(f"folder {out.parent} does not exist", "create it first")
    shutil.rmtree(staged, ignore_errors=True)  # a staging folder an interrupted save left
    staged.mkdir()


@dataclass
class ShardedCheckpoint:
    """A sharded checkpoint's plain part: the growth log, step, extra values and scheduler state. `regrow` rebuilds
    the grown architecture; `restore` loads the weights and optimiser state once it is sharded."""

    path: Path
    step: int
    extra: dict
    log: list[dict]
    params: dict
    has_optimizer: bool
    scheduler_state: dict | None = field(default=None)

    def regrow(self, model: fx.GraphModule, *, data: Any = None, trust: bool = False) -> fx.GraphModule:
        """`model` (the traced original, unsharded) grown as the saved one was: the log's passes beyond its own,
        with their seeds, unverified. A step grown with a data function (init=gradmax) needs `data` again (or
        `trust` for the name the log holds). LoadError when the result is not the saved architecture."""
        from .pipeline import from_log

        have = _log_of(model)
        if self.log[: len(have)] != have:
            raise LoadError(
                f"{self.path}: the model's own growth log is not the start of the checkpoint's",
                "regrow the model the checkpointed run started from",
            )
        todo = self.log[len(have) :]
        grown = from_log(todo, verify=False, data=data, trust=trust).run(model).gm if todo else model
        shapes = {n: list(p.shape) for n, p in grown.named_parameters()}
        if shapes != self.params:
            raise LoadError(
                f"{self.path}: the regrown model's parameters are not the checkpoint's",
                "regrow the model the checkpointed run started from (same sizes)",
            )
        return grown

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        process_group: Any = None,
    ) -> None:
        """Load the saved shards into `model` (sharded with FSDP2, this job's mesh: DCP re-shards across world sizes)
        and into an optimiser built over its parameters, and the scheduler's state. Call it on every rank of
        `process_group` (default: the whole job)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        shapes = {n: list(p.shape) for n, p in model.named_parameters()}
        if shapes != self.params:
            raise LoadError(
                f"{self.path}: the model's parameters are not the ones the checkpoint was saved with",
                "build it with ShardedCheckpoint.regrow, then shard it",
            )
        if optimizer is not None and not self.has_optimizer:
            raise InputError(f"{self.path} holds no optimiser state", "it was saved without an optimiser")
        if scheduler is not None and self.scheduler_state is None:
            raise InputError(f"{self.path} holds no scheduler state", "it was saved without a scheduler")
        model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
        state: dict[str, Any] = {"model": model_state}
        if optimizer is not None:
            state["optim"] = optim_state
        dcp.load(state, checkpoint_id=self.path / "dcp", process_group=process_group)
        set_state_dict(
            model,
            optimizer if optimizer is not None else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
        )
        if scheduler is not None:
            scheduler.load_state_dict(self.scheduler_state)


def load_sharded_checkpoint(path: str | os.PathLike) -> ShardedCheckpoint:
    """Read a sharded checkpoint's plain part (nothing in it runs code); the shards load in `restore`."""
    folder = Path(path)
    if not (folder / "state.pt").is_file() or not (folder / "dcp").is_dir():
        raise LoadError(
            f"{folder} is not a graphgrow sharded checkpoint folder (dcp/ and state.pt)",
            "pass the folder save_sharded_checkpoint wrote",
        )
    try:
        state = torch.load(folder / "state.pt", weights_only=True)
    except Exception as e:
        raise LoadError(
            f"cannot read {folder / 'state.pt'}: {first_line(e, 200)}", "the checkpoint is damaged; use an earlier one"
        ) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        raise LoadError(
            f"{folder / 'state.pt'} is not a graphgrow sharded checkpoint (version {VERSION})",
            "pass the folder save_sharded_checkpoint wrote",
        )
    step, log, params = state.get("step"), state.get("log"), state.get("params")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise LoadError(f"{folder / 'state.pt'}: step is not a step number", "the checkpoint is damaged")
    if not isinstance(log, list) or not all(isinstance(e, dict) for e in log) or not isinstance(params, dict):
        raise LoadError(f"{folder / 'state.pt'}: the growth log or the parameter shapes are malformed", "damaged")
    for key in ("extra", "scheduler"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            raise LoadError(f"{folder / 'state.pt'}: {key} is not a dict", "the checkpoint is damaged")
    return ShardedCheckpoint(
        folder, step, dict(state.get("extra") or {}), log, params, bool(state.get("optimizer")), state.get("scheduler")
    )
