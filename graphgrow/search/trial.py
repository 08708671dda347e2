"""One member of the population, as a Ray Tune function trainable: train, report, checkpoint,
and grow when the config carries a move the checkpoint has not seen.

The architecture always comes from the checkpoint (a graphgrow file), never from the config:
after an exploit the checkpoint is the donor's, after a pause it is the trial's own. A trial
restarts from its own checkpoint far more often than it exploits, so a move is applied only
when its id is new to the checkpoint's record. Ray is imported inside `run_trial` only.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..analysis.budget import Limits
from ..capture.trace import graph_info
from ..core.errors import InputError, LoadError
from ..graph.shapes import param_count
from ..io.load import load_model
from ..io.outputs import is_write_error, torch_save, write_error
from ..io.save import save_model
from ..jobs.optim import carry_optimizer
from .space import Move, MutationSpace, applied_moves

MODEL_FILE = "model.pt"  # a graphgrow file: `graphgrow export` and `graphgrow replay` read it as is
TRAINER_FILE = "trainer.pt"  # optimiser state
STATE_FILE = "search.json"  # the moves this lineage saw and made, the epoch, the trial that wrote it

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
}


@dataclass
class TrialSetup:
    """What every trial shares, shipped once to the workers (tune.with_parameters)."""

    model: bytes  # the original model, as a graphgrow file
    train: Callable[[nn.Module, torch.optim.Optimizer], Any]  # one epoch, in place; may return a dict of metrics
    evaluate: Callable[[nn.Module], Any]  # a float (the metric) or a dict holding it
    metric: str
    space: MutationSpace
    optimizer: str = "sgd"
    limits: Limits = field(default_factory=Limits)
    device: str = "cpu"
    epochs_per_round: int = 1  # a checkpoint at the end of each round


@dataclass
class TrialState:
    model: fx.GraphModule
    optimizer_state: dict | None = None  # optimizer_record()
    epoch: int = 0
    writer: str | None = None  # the trial that wrote the checkpoint (another one: we exploited it)
    seen: list[str] = field(default_factory=list)  # ids of every move this lineage received
    moves: list[dict] = field(default_factory=list)  # what each move did, with the metric before and after


def model_bytes(gm: fx.GraphModule) -> bytes:
    """`gm` as the bytes of a graphgrow file (shipped to the workers through Ray's object store)."""
    with tempfile.TemporaryDirectory(prefix="graphgrow-") as folder:
        return save_model(gm, Path(folder) / MODEL_FILE).read_bytes()


def read_model(data: bytes) -> fx.GraphModule:
    """The model of a graphgrow file's bytes, through the safe loader (no code from the file runs)."""
    with tempfile.TemporaryDirectory(prefix="graphgrow-") as folder:
        path = Path(folder) / MODEL_FILE
        path.write_bytes(data)
        return read_model_file(path)


def read_model_file(path: Path) -> fx.GraphModule:
    """The model of a graphgrow file (a checkpoint's, the search's original), through the safe loader."""
    model = load_model(path).module
    if not isinstance(model, fx.GraphModule):
        raise LoadError(f"{path} holds no graphgrow model", "the search folder is damaged")
    return model


def read_state(folder: str | Path) -> TrialState:
    folder = Path(folder)
    state = json.loads((folder / STATE_FILE).read_text())
    trainer = torch.load(folder / TRAINER_FILE, weights_only=True)
    return TrialState(
        read_model_file(folder / MODEL_FILE),
        trainer.get("optimizer"),
        int(state["epoch"]),
        state.get("writer"),
        list(state.get("seen", [])),
        list(state.get("moves", [])),
    )


def write_state(folder: str | Path, state: TrialState, optimizer: torch.optim.Optimizer) -> None:
    folder = Path(folder)
    save_model(copy.deepcopy(state.model).cpu() if _on_cuda(state.model) else state.model, folder / MODEL_FILE)
    path = folder / TRAINER_FILE
    try:  # a full disk is SaveError here too: the search names it instead of an internal error
        torch_save({"optimizer": optimizer_record(optimizer, state.model)}, path)
        path = folder / STATE_FILE
        path.write_text(
            json.dumps(
                {"epoch": state.epoch, "writer": state.writer, "seen": state.seen, "moves": state.moves}, default=str
            )
        )
    except Exception as e:
        if is_write_error(e):
            raise write_error(path, e) from e
        raise


def _on_cuda(model: nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (isinstance(v, torch.Tensor) and v.numel() == 1)


def scalars(d: dict) -> dict[str, float]:
    """The numbers of a dict (what Tune can plot and compare), as floats."""
    return {str(k): float(v) for k, v in d.items() if _is_number(v)}


def metrics_of(value: Any, metric: str, where: str) -> dict[str, float]:
    """evaluate()'s result as a dict of floats holding `metric`."""
    if _is_number(value):
        return {metric: float(value)}
    if isinstance(value, dict) and metric in value and _is_number(value[metric]):
        return scalars(value)
    raise InputError(
        f"{where} returned {type(value).__name__}{' without ' + repr(metric) if isinstance(value, dict) else ''}",
        f"return a number or a dict with the key {metric!r} (--metric)",
    )


def _optimizer(setup: TrialSetup, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return OPTIMIZERS[setup.optimizer](model.parameters(), lr)


def optimizer_record(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """The optimiser's settings and per-parameter state keyed by parameter name. Not by position
    (torch's state_dict): a model read back from its file lists its parameters in graph order,
    while a grown model in memory lists the new ones last."""
    names = {p: n for n, p in model.named_parameters()}
    (group,) = optimizer.param_groups  # the search builds one group
    return {
        "settings": {k: v for k, v in group.items() if k != "params"},
        "state": {names[p]: dict(st) for p, st in optimizer.state.items() if p in names},
    }


def restore_optimizer(setup: TrialSetup, model: nn.Module, record: dict) -> torch.optim.Optimizer:
    settings = record["settings"]
    optimizer = _optimizer(setup, model, settings["lr"])
    optimizer.param_groups[0].update(settings)
    params = dict(model.named_parameters())
    device = next(model.parameters()).device
    for name, st in record["state"].items():
        optimizer.state[params[name]] = {
            k: v.to(device) if isinstance(v, torch.Tensor) and k != "step" else v for k, v in st.items()
        }
    return optimizer


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _state_to(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                st[k] = v.to(device)


def grow(
    setup: TrialSetup, state: TrialState, optimizer: torch.optim.Optimizer, move: Move, trial: str
) -> tuple[torch.optim.Optimizer, dict]:
    """Apply `move` to the state's model (on the CPU, where graphgrow verifies), carry the optimiser
    over, record what happened with the metric just before and just after."""
    device = next(state.model.parameters()).device
    before = metrics_of(setup.evaluate(state.model), setup.metric, "evaluate")[setup.metric]
    state.model.cpu()
    _state_to(optimizer, "cpu")
    new, outcome = setup.space.apply(state.model, move, setup.limits)
    if outcome.grew:
        optimizer = carry_optimizer(optimizer, state.model, new)
        state.model = new
    state.model.to(device)
    _state_to(optimizer, device)
    after = metrics_of(setup.evaluate(state.model), setup.metric, "evaluate")[setup.metric] if outcome.grew else before
    record = {**outcome.to_json(), "epoch": state.epoch, "trial": trial, "metric_before": before, "metric_after": after}
    state.seen.append(move.id)
    state.moves.append(record)
    return optimizer, record


def run_trial(config: dict, setup: TrialSetup) -> None:
    """The function trainable: runs until Tune stops it, reporting and checkpointing every epoch."""
    import ray
    from ray import tune

    trial = tune.get_context().get_trial_id() or "local"
    node = ray.get_runtime_context().get_node_id()[:8]  # which Ray node ran each epoch (a cluster spreads trials)
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        state = TrialState(read_model(setup.model))
    else:
        with checkpoint.as_directory() as folder:
            state = read_state(folder)
    events: list[str] = []
    if state.writer is not None and state.writer != trial:
        events.append(f"exploit:{state.writer}")
    state.model.to(setup.device)
    if state.optimizer_state is None:
        optimizer = _optimizer(setup, state.model, config["lr"])
    else:
        optimizer = restore_optimizer(setup, state.model, state.optimizer_state)
    _set_lr(optimizer, config["lr"])
    move = Move.from_config(config.get("move"))
    delta = 0.0
    if move is not None and move.id not in state.seen and move.id not in applied_moves(state.model):
        optimizer, record = grow(setup, state, optimizer, move, trial)
        aimed = f" at gain {record['gain']:.3g}" if record.get("gain") is not None else ""  # the gain policies' pick
        events.append(f"grow:{record['spec']}{aimed}" if record["grew"] else f"keep:{record['spec']}")
        delta = abs(record["metric_after"] - record["metric_before"])
    state.writer = trial
    seed = zlib.crc32(trial.encode())
    while True:
        torch.manual_seed(seed + state.epoch)
        extra = setup.train(state.model, optimizer)
        metrics = metrics_of(setup.evaluate(state.model), setup.metric, "evaluate")
        if isinstance(extra, dict):  # training's own numbers (e.g. train_loss); evaluate's win a clash
            metrics = {**scalars(extra), **metrics}
        state.epoch += 1
        if not math.isfinite(metrics[setup.metric]):
            metrics[setup.metric] = float("inf") if config.get("_mode", "min") == "min" else float("-inf")
        report = {
            **metrics,
            "epoch": state.epoch,
            "params": param_count(state.model),
            "growths": len(graph_info(state.model).get("log", [])),
            "moves": len(state.moves),
            "lr": config["lr"],
            "event": ";".join(events),
            "growth_delta": delta,
            "node": node,
        }
        if state.epoch % setup.epochs_per_round:
            tune.report(report)  # checkpoints only where PBT may exploit or pause: the round boundaries
        else:
            with tempfile.TemporaryDirectory(prefix="graphgrow-ckpt-") as folder:
                write_state(folder, state, optimizer)
                tune.report(report, checkpoint=tune.Checkpoint.from_directory(folder))
        events, delta = [], 0.0  # an event is reported once, on the first epoch after it
