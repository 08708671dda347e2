"""Training checkpoints that resume across growth, in a new process group and at another world size.

A checkpoint is a folder:

    model.pt   the grown model as a graphgrow file (architecture, weights, mutation log): `graphgrow inspect`
               reads it, and it loads without trusting the file, like every graphgrow output
    state.pt   the optimiser's state and parameter groups *by parameter name*, the scheduler's state, the
               step, the parameter names and shapes it belongs to, and your own `extra` values (plain data,
               read with torch.load(weights_only=True))

Nothing in it depends on the number of ranks (DDP keeps one replica per rank, all equal), so a checkpoint
written by 2 processes resumes with 1, 2 or 8. `save_checkpoint` is called on every rank: rank 0 writes
(the folder appears whole: staged, then renamed), the others wait for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import InputError, LoadError, SaveError, first_line
from ..io.load import load_model
from ..io.save import save_model
from . import replicas as rp

FORMAT = "graphgrow.checkpoint"
VERSION = 1


def _unwrap(model: nn.Module) -> fx.GraphModule:
    inner = getattr(model, "module", model) if not isinstance(model, fx.GraphModule) else model
    if not isinstance(inner, fx.GraphModule):
        raise InputError(
            f"a checkpoint holds a traced model, got {type(inner).__name__}",
            "save the model gg.trace made (or the DDP over it)",
        )
    return inner


def named_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """optimizer.state_dict() with parameter names where torch writes positions."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = [i for i, p in enumerate(order) if id(p) not in names]
    if unknown:
        raise InputError(
            f"the optimiser holds {len(unknown)} parameter(s) that are not in the model",
            "pass the model the optimiser was built for (after growth: the grown one)",
        )
    sd = optimizer.state_dict()
    return {
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(order[i])] for i in g["params"]]}
            for g in sd["param_groups"]
        ],
        "state": {names[id(order[i])]: s for i, s in sd["state"].items()},
    }


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    step: int = 0,
    extra: dict | None = None,
    timeout: float = 300.0,
) -> Path:
    """Write a checkpoint folder at `path` (replacing an earlier checkpoint there). Call it on every rank:
    rank 0 writes, the others wait until the folder is in place. Returns the path."""
    gm = _unwrap(model)
    out = Path(path)
    reps = rp.replicas(timeout)
    error = None
    if reps.rank == 0:
        try:
            _write(out, gm, optimizer, scheduler, step, extra)
        except Exception as e:  # reported to every rank, then raised
            error = e
    records = reps.gather({"error": rp.error_text(error) if error else None}, f"writing the checkpoint {out}")
    rp.raise_failures(reps, records, error, "writing the checkpoint")
    return out


def _write(out: Path, gm: fx.GraphModule, optimizer, scheduler, step: int, extra: dict | None) -> None:
    if out.exists() and not (out.is_dir() and (out / "state.pt").is_file()):
        raise SaveError(
            f"{out} exists and is not a graphgrow checkpoint folder", "choose another path; nothing was written"
        )
    if not out.parent.is_dir():
        raise SaveError(f"folder {out.parent} does not exist", "create it first")
    state = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "extra": extra or {},
        "params": {n: list(p.shape) for n, p in gm.named_parameters()},
        "optimizer": named_optimizer_state(optimizer, gm) if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent))
    try:
        save_model(gm, staged / "model.pt")
        torch.save(state, staged / "state.pt")
        try:
            torch.load(
                staged / "state.pt", weights_only=True
            )  # the reader's promise, checked before anything is replaced
        except Exception as e:
            raise SaveError(
                f"the checkpoint state is not plain data: {first_line(e, 200)}",
                "keep `extra` and the scheduler's state to numbers, strings, lists, dicts and tensors",
            ) from e
        swap_in(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def swap_in(staged: Path, out: Path) -> None:
    """Put the finished folder `staged` at `out`: an earlier folder there is moved aside first and removed only once
    the new one is in place, so `out` always holds one whole checkpoint."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}") if out.exists() else None
    if old is not None:
        os.replace(out, old)
    os.replace(staged, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class Checkpoint:
    """A loaded checkpoint: the grown model, the step, your extra values, and the optimiser and scheduler state
    to `restore` into the ones you build over `model`."""

    model: fx.GraphModule
    step: int
    extra: dict
    optimizer_state: dict | None
    scheduler_state: dict | None
    path: Path
    params: dict = field(default_factory=dict)

    def restore(self, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> None:
        """Load the saved state into an optimiser built over `self.model`'s parameters (its groups are rebuilt to
        the saved ones, by name: parameters a growth event added keep the group they were in) and into a
        scheduler built over that optimiser."""
        if optimizer is not None:
            if self.optimizer_state is None:
                raise InputError(f"{self.path} holds no optimiser state", "it was saved without an optimiser")
            _restore_optimizer(optimizer, self.model, self.optimizer_state)
        if scheduler is not None:
            if self.scheduler_state is None:
                raise InputError(f"{self.path} holds no scheduler state", "it was saved without a scheduler")
            scheduler.load_state_dict(self.scheduler_state)


def _restore_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, saved: dict) -> None:
    params = dict(model.named_parameters())
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if mine != {id(p) for p in params.values()}:
        raise InputError(
            "the optimiser is not built over the checkpoint's model parameters",
            "build it as torch.optim.X(checkpoint.model.parameters(), ...) after moving the model to its device",
        )
    saved_names = [n for g in saved["param_groups"] for n in g["params"]]
    if sorted(saved_names) != sorted(params):
        missing = sorted(set(params) - set(saved_names))[:3] or sorted(set(saved_names) - set(params))[:3]
        raise LoadError(
            f"the saved optimiser state does not fit the model (first names that differ: {missing})",
            "the state.pt and model.pt of a checkpoint belong together; do not mix folders",
        )
    optimizer.param_groups.clear()
    optimizer.state.clear()
    for g in saved["param_groups"]:
        optimizer.add_param_group(
            {**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in g["params"]]}
        )
    index = {n: i for i, n in enumerate(saved_names)}
    groups, start = [], 0
    for g in saved["param_groups"]:
        groups.append({**g, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    optimizer.load_state_dict({"state": {index[n]: s for n, s in saved["state"].items()}, "param_groups": groups})


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", trust: bool = False
) -> Checkpoint:
    """Read a checkpoint folder (nothing in it runs code unless `trust`: a model whose opaque leaves hold
    custom classes or functions needs it, as with load_model). The model comes on `map_location`; move it
    where it trains before building the optimiser over it."""
    folder = Path(path)
    if not (folder / "state.pt").is_file() or not (folder / "model.pt").is_file():
        raise LoadError(
            f"{folder} is not a graphgrow checkpoint folder (model.pt and state.pt)",
            "pass the folder save_checkpoint wrote",
        )
    try:
        state = torch.load(folder / "state.pt", map_location=map_location, weights_only=True)
    except Exception as e:
        raise LoadError(
            f"cannot read {folder / 'state.pt'}: {first_line(e, 200)}", "the checkpoint is damaged; use an earlier one"
        ) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        raise LoadError(
            f"{folder / 'state.pt'} is not a graphgrow checkpoint (version {VERSION})",
            "pass the folder save_checkpoint wrote",
        )
    gm = load_model(folder / "model.pt", trust=trust).module
    if not isinstance(gm, fx.GraphModule):
        raise LoadError(f"{folder / 'model.pt'} holds no traced model", "the checkpoint is damaged")
    shapes = {n: list(p.shape) for n, p in gm.named_parameters()}
    if shapes != state.get("params"):
        raise LoadError(
            f"{folder}: model.pt's parameters are not the ones state.pt was saved with",
            "the two files of a checkpoint belong together; do not mix folders",
        )
    _check_state(state, folder / "state.pt")
    gm.to(map_location)
    return Checkpoint(
        gm,
        state["step"],
        dict(state.get("extra") or {}),
        state.get("optimizer"),
        state.get("scheduler"),
        folder,
        state["params"],
    )


def _check_state(state: dict, where: Path) -> None:
    """state.pt's fields have the types save_checkpoint writes (LoadError naming the field otherwise), and the
    optimiser state fits the model's parameters — all before anything is restored, so a damaged or crafted file
    never leaves an optimiser half-loaded or holding state of the wrong shape (found only at opt.step())."""

    def bad(field: str, why: str) -> LoadError:
        return LoadError(f"{where}: {field} {why}", "the checkpoint is damaged; use an earlier one")

    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad("step", f"is {type(step).__name__} {repr(step)[:40]}, not a step number (0 or more)")
    for key in ("extra", "scheduler"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            raise bad(key, f"is {type(state[key]).__name__}, not a dict")
    saved = state.get("optimizer")
    if saved is None:
        return
    groups, per_param = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, dict) else (None, None)
    if (
        not isinstance(groups, list)
        or not isinstance(per_param, dict)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise bad("optimizer", "is not an optimiser state by parameter name (param_groups with params, state)")
    shapes = {n: torch.Size(s) for n, s in state["params"].items()}
    names = [n for g in groups for n in g["params"]]
    if len(set(names)) != len(names) or not set(names) <= shapes.keys() or not set(per_param) <= set(names):
        raise bad("optimizer", "names parameters the model does not have, or one twice")
    total = sum(shapes[n].numel() for n in names)
    for name, entry in per_param.items():
        if not isinstance(entry, dict):
            raise bad(f"optimizer state of {name[:100]}", f"is {type(entry).__name__}, not a dict")
        for key, value in entry.items():
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and not _fits(t.shape, shapes[name], total):
                    raise bad(
                        f"optimizer state {key}[{str(name)[:100]}]",
                        f"has shape {list(t.shape)}, which does not fit the parameter's {list(shapes[name])}",
                    )


def _fits(shape: torch.Size, param: torch.Size, total: int) -> bool:
    """An optimiser's state tensor for `param`: its shape (momentum, Adam's averages), one that broadcasts to it
    (a step count, Adafactor's row and column factors), or one flat vector over every parameter (LBFGS keeps
    its history on the first parameter)."""
    if len(shape) <= len(param) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(param))):
        return True
    return len(shape) == 1 and shape[0] == total
