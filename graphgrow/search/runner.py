"""Population-based growth on Ray Tune: PBT exploits the better trials' weights and
architectures; its explore step chooses the next architecture move (and perturbs the
learning rate); the trials grow exactly, so a child continues from its parent without a
jump in the loss. Ray starts locally unless an address is given; nothing here schedules.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import fx

from ..analysis.budget import Limits
from ..capture.trace import graph_info
from ..core.errors import InputError, SaveError, SearchError, SearchInterrupted, first_line
from ..graph.shapes import param_count
from ..io.factory import import_object
from ..io.outputs import is_staging_name
from ..io.save import save_model
from .space import MutationSpace, check_data
from .trial import MODEL_FILE, OPTIMIZERS, STATE_FILE, TrialSetup, model_bytes, read_model_file, run_trial

ORIGINAL = "original.pt"  # the model the search started from, beside Tune's files: `graphgrow replay` reads it
BEST = "best.pt"


@dataclass
class SearchOptions:
    population: int = 4
    rounds: int = 5  # PBT perturbation points, one every `epochs_per_round` epochs
    epochs_per_round: int = 1
    metric: str = "val_loss"
    mode: str = "min"
    lr: float = 0.05  # the population starts at lr × 2^U(−1, 1); PBT perturbs it from there
    optimizer: str = "sgd"
    storage_path: str = "graphgrow-search"
    name: str = "search"
    address: str | None = None  # None: start Ray here; "auto" or host:port: join that cluster
    num_cpus: int | None = None  # for a local Ray (default: all cores)
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    seed: int = 0
    resume: bool = False
    trust: bool = False  # resuming restores Ray Tune's pickled state from the folder: only a folder the user trusts
    limits: Limits = field(default_factory=Limits)
    output: str | None = None  # where the best model goes (default: STORAGE/NAME/best.pt)
    keep_checkpoints: int | None = None  # per trial (≥ 2); None keeps every round's (see check())
    worker_logs: bool = False  # show the workers' output (prints of the training function, Ray's messages)

    def check(self) -> None:
        if self.population < 2:
            raise InputError(f"--population {self.population}: population-based training needs at least 2 trials")
        if self.rounds < 1 or self.epochs_per_round < 1:
            raise InputError("--rounds and --epochs-per-round must be at least 1")
        if self.mode not in ("min", "max"):
            raise InputError(f"--mode {self.mode!r}: use min or max")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise InputError(f"--lr {self.lr}: the learning rate must be a positive number")
        if self.optimizer not in OPTIMIZERS:
            raise InputError(f"--optimizer {self.optimizer!r}", f"one of {', '.join(OPTIMIZERS)}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 2:
            raise InputError(
                f"--keep-checkpoints {self.keep_checkpoints}: PBT needs at least 2 (one to exploit, one to restore)"
            )
        if "://" in self.storage_path:
            raise InputError(
                f"--storage-path {self.storage_path}: cloud storage is not supported yet",
                "give a folder every node can reach (the same path on each, e.g. an NFS mount)",
            )
        if self.cpus_per_trial <= 0 or self.gpus_per_trial < 0:
            raise InputError("--cpus-per-trial must be positive and --gpus-per-trial not negative")
        check_folder_name(self.name, "--name")
        if self.resume and not self.trust:
            # Tune.restore unpickles tuner.pkl and the trial states: a pickle placed in the folder would run. Tune
            # keeps no other form of its state, so a resumed folder is trusted like a file given with --trust.
            raise InputError(
                f"--resume restores the search in {self.experiment} from Ray Tune's pickles there (tuner.pkl, "
                "the trial states): a pickle in that folder would run code",
                "pass --trust as well if the folder is yours and no one else can write to it, or start a "
                "new search with another --name",
            )

    @property
    def experiment(self) -> Path:
        return Path(self.storage_path).expanduser().resolve() / self.name


_NAME_BYTES = 200  # a folder name, with room for what Ray appends


def check_folder_name(name: str, flag: str) -> None:
    """`name` becomes one folder under --storage-path: a single plain path component, so that nothing
    is written outside the storage (`../../x`), nothing is hidden (`.x`) or read as an option (`-x`)."""
    shown = repr(name[:80]) + ("…" if len(name) > 80 else "")
    why = None
    if name in ("", ".", ".."):
        why = "is not a folder name"
    elif any(c in name for c in "/\\\0") or os.sep in name or (os.altsep and os.altsep in name):
        why = "is a path, not one folder name"
    elif any(not c.isprintable() for c in name):
        why = "holds control characters"
    elif name[0] in ".-~":
        why = f"starts with {name[0]!r}"
    elif name != name.strip():
        why = "starts or ends with a space"
    elif len(os.fsencode(name)) > _NAME_BYTES:
        why = f"is longer than {_NAME_BYTES} bytes"
    if why:
        raise InputError(
            f"{flag} {shown} {why}",
            "give one plain folder name, e.g. --name search1 (put the folder elsewhere with --storage-path)",
        )


@dataclass
class SearchResult:
    best_path: Path
    metric: str
    best_value: float
    best_trial: str
    lineage: list[dict]  # the best model's mutation log (replayable on original_path)
    moves: list[dict]  # every move its lineage received, applied or not, with the metric before and after
    original_path: Path
    experiment: Path
    trials: list[dict]  # per trial: id, final metric, parameters, growths, moves
    history: dict[str, list[dict]]  # per trial: every reported row (for plots)
    seconds: float

    def to_json(self) -> dict:
        return {
            "best": str(self.best_path),
            "metric": self.metric,
            "value": self.best_value,
            "trial": self.best_trial,
            "lineage": self.lineage,
            "moves": self.moves,
            "original": str(self.original_path),
            "experiment": str(self.experiment),
            "trials": self.trials,
            "seconds": round(self.seconds, 1),
        }


def _ship_by_value(fn: Callable) -> None:
    """A function from the user's own (not installed) module travels by value, so workers on this
    machine or a cluster need no copy of that module on their path."""
    from ray import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if module is None or module.__name__ == "__main__" or not path:
        return
    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    if not any(os.path.abspath(path).startswith(os.path.abspath(p) + os.sep) for p in installed):
        cloudpickle.register_pickle_by_value(module)


def quiet_tune() -> None:
    """Tune's own status tables and checkpoint chatter off: the search prints its progress itself."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the legacy reporter honours verbose=0
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # "Remote file not found: …/result.json" for a trial restored before its first result: harmless
    logging.getLogger("ray.tune.logger").setLevel(logging.ERROR)


def start_ray(address: str | None, num_cpus: int | None, worker_logs: bool = False) -> bool:
    """Start (or join) Ray unless this process already did; True when we started it. Workers' output
    (the training function's prints, Ray's checkpoint messages) reaches this terminal only with
    `worker_logs`; a failing trial's traceback is in its error.txt either way."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": worker_logs,
    }
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(address="local", num_cpus=num_cpus, **kwargs)  # a new local Ray, even beside a `ray start` cluster
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise SearchError(
            f"cannot start {where}: {first_line(e)}",
            "check `ray status` on the head node" if address else "see Ray's log under /tmp/ray",
        ) from e
    return True


def _progress_callback(options: SearchOptions, say: Callable[[str], None]):
    from ray import tune

    class Progress(tune.Callback):
        """One line per growth or exploit as it happens, one per round when the whole population got there."""

        def __init__(self, say: Callable[[str], None]) -> None:  # an argument: the class is pickled, its closure too
            self.latest: dict[str, dict] = {}
            self.rounds_shown = 0
            self.say = say

        def __getstate__(self) -> dict:  # Tune pickles its callbacks with the experiment; a console does not pickle
            return {k: v for k, v in self.__dict__.items() if k != "say"}

        def __setstate__(self, state: dict) -> None:
            self.__dict__.update(state, say=print)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            tid = trial.trial_id
            for event in filter(None, str(result.get("event", "")).split(";")):
                kind, _, what = event.partition(":")
                if kind == "exploit":
                    self.say(f"  {tid}: continues from {what}'s checkpoint (weights and architecture)")
                elif kind == "grow":
                    self.say(
                        f"  {tid}: grew {what} → {int(result['params']):,} parameters "
                        f"({options.metric} moved by {float(result.get('growth_delta', 0)):.2g})"
                    )
            self.latest[tid] = result
            if len(self.latest) < options.population:
                return
            done = min(int(r["training_iteration"]) for r in self.latest.values()) // options.epochs_per_round
            if done <= self.rounds_shown:
                return
            self.rounds_shown = done
            pick = min if options.mode == "min" else max
            best_id = pick(self.latest, key=lambda t: float(self.latest[t][options.metric]))
            best = self.latest[best_id]
            sizes = ", ".join(f"{int(self.latest[t]['params']):,}" for t in sorted(self.latest))
            self.say(
                f"round {done}/{options.rounds}: best {options.metric} {float(best[options.metric]):.4g} ({best_id}, "
                f"{int(best['growths'])} growths); parameters per trial: {sizes}"
            )

    return Progress(say)


def search(
    model: fx.GraphModule | None,
    train: Callable,
    evaluate: Callable,
    space: MutationSpace,
    options: SearchOptions,
    say: Callable[[str], None] = print,
) -> SearchResult:
    """Run population-based growth of `model` (traced by graphgrow) on Ray Tune and return the best
    trial's model, saved as a graphgrow file, with its lineage.

    `train(model, optimizer)` trains one epoch in place (it may return a dict of numbers to report);
    `evaluate(model)` returns the metric (a number, or a dict holding `options.metric`).
    With `options.resume` the model is the search's own copy of the original (`model` may be None).
    """
    options.check()
    space = _resolved_data(space)  # a bad data function is refused before anything is written
    from ray import tune

    start = time.perf_counter()
    experiment = options.experiment
    original_path = experiment / ORIGINAL
    if options.resume:
        if not tune.Tuner.can_restore(str(experiment)):
            raise InputError(f"nothing to resume at {experiment}", "start the search without --resume")
        model = read_model_file(original_path)
    elif experiment.exists() and any(not is_staging_name(p.name) for p in experiment.iterdir()):
        raise InputError(
            f"{experiment} already holds a search",
            "pass --resume --trust to continue it (its state is Ray Tune's pickles: a folder of your own), "
            "or choose another --name",
        )
    elif model is None:
        raise InputError("no model to search from", "pass the traced model (graphgrow.trace)")
    else:
        try:
            experiment.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SaveError(f"cannot create {experiment}: {e.strerror or e}", "choose a writable --storage-path") from e
        save_model(model, original_path)
    for fn in (train, evaluate, space.data):
        if callable(fn):
            _ship_by_value(fn)
    setup = TrialSetup(
        model_bytes(model),
        train,
        evaluate,
        options.metric,
        space,
        options.optimizer,
        options.limits,
        "cuda" if options.gpus_per_trial > 0 else "cpu",
        options.epochs_per_round,
    )
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, setup=setup), {"cpu": options.cpus_per_trial, "gpu": options.gpus_per_trial}
    )
    quiet_tune()
    if not options.worker_logs:  # a failed trial's traceback is in its error.txt; the SearchError names it in one line
        logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    started = start_ray(options.address, options.num_cpus, options.worker_logs)
    try:
        if options.resume:
            say(f"resuming {experiment}")
            tuner = tune.Tuner.restore(str(experiment), trainable, resume_unfinished=True, resume_errored=True)
        else:
            tuner = _new_tuner(trainable, space, options, say)
        say(
            f"searching: population {options.population}, {options.rounds} rounds of {options.epochs_per_round} "
            f"epoch(s), moves {space}, {param_count(model):,} parameters to start"
        )
        results = tuner.fit()
    finally:
        if started:
            import ray

            ray.shutdown()
    return _collect(results, options, original_path, time.perf_counter() - start)


def _resolved_data(space: MutationSpace) -> MutationSpace:
    """The space with its data as a function (a `module:function` name imported here, so it travels to the
    workers by value like train and evaluate), called once to check that it gives (inputs, loss_fn)."""
    if space.data is None:
        return space
    data = import_object(space.data, role="data function") if isinstance(space.data, str) else space.data
    check_data(data)
    resolved = copy.copy(space)
    resolved.data = data
    return resolved


def _new_tuner(trainable, space: MutationSpace, options: SearchOptions, say: Callable[[str], None]):
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining
    from ray.tune.search.basic_variant import BasicVariantGenerator

    rng = random.Random(options.seed)

    def explore(config: dict) -> dict:
        # runs on the driver, which sees only the config: choose the move; the worker resolves it
        config["move"] = space.choose(rng).to_config()
        return config

    lo, hi = options.lr / 2, options.lr * 2
    # asynchronous PBT: with synch=True (and reused actors) a run here left one trial paused for good (Ray 2.60);
    # reused actors keep a restart from paying a new process and torch import (a 4-trial test: 17 s instead of 54 s)
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=options.epochs_per_round,
        hyperparam_mutations={"lr": tune.loguniform(lo / 5, hi * 5)},
        custom_explore_fn=explore,
        quantile_fraction=0.25,
        resample_probability=0.25,
        synch=False,
    )
    return tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(lo, hi), "move": None, "_mode": options.mode},
        tune_config=tune.TuneConfig(
            metric=options.metric,
            mode=options.mode,
            scheduler=pbt,
            num_samples=options.population,
            reuse_actors=True,
            search_alg=BasicVariantGenerator(random_state=options.seed),
        ),
        run_config=tune.RunConfig(
            name=options.name,
            storage_path=str(options.experiment.parent),
            verbose=0,
            stop={"training_iteration": options.rounds * options.epochs_per_round},
            # asynchronous PBT exploits a donor's checkpoint while the donor runs on: a small num_to_keep let the
            # donor delete it before the exploiting trial restored (8 trials, 2 CPUs: "checkpoint does not exist")
            checkpoint_config=tune.CheckpointConfig(num_to_keep=options.keep_checkpoints),
            failure_config=tune.FailureConfig(max_failures=0),
            callbacks=[_progress_callback(options, say)],
        ),
    )


def _history(result) -> list[dict]:
    """Every row a trial reported, from its progress.csv (Ray's Result.metrics_dataframe missed rows
    reported between two checkpoints: a trial of 24 epochs came back with 16)."""
    import pandas as pd

    path = Path(result.path) / "progress.csv"
    frame = pd.read_csv(path) if path.exists() else result.metrics_dataframe
    if frame is None:
        return []
    return [
        {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
        for row in frame.to_dict("records")
    ]


def _cut(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _collect(results, options: SearchOptions, original_path: Path, seconds: float) -> SearchResult:
    errors = results.errors
    if errors:
        last = [line for line in str(errors[0]).strip().splitlines() if line.strip()]  # a Ray error ends with the cause
        cause = last[-1].strip() if last else ""
        if "SaveError: " in cause:  # a checkpoint could not be written (a full disk): exit 2 like any write error
            raise SaveError(
                f"{len(errors)} of {len(results)} trials failed; the first: {_cut(cause.split('SaveError: ', 1)[1])}"
            )
        raise SearchError(
            f"{len(errors)} of {len(results)} trials failed; "
            f"the first: {first_line(last[-1]) if last else type(errors[0]).__name__}",
            f"each trial's error.txt under {options.experiment} has the traceback",
        )
    target = options.rounds * options.epochs_per_round
    behind = [r for r in results if int(r.metrics.get("training_iteration", 0)) < target]
    if behind:  # Tune stops gracefully on Ctrl-C and returns what it has
        done = min(int(r.metrics.get("training_iteration", 0)) for r in results)
        raise SearchInterrupted(
            f"the search stopped after {done} of {target} epochs; its checkpoints are in {options.experiment}",
            "run the same command with --resume --trust to continue it "
            "(a folder of your own: its state is Ray Tune's pickles)",
        )
    trials, history = [], {}
    for r in results:
        tid = str(r.metrics.get("trial_id", r.path))
        trials.append(
            {
                "trial": tid,
                options.metric: r.metrics.get(options.metric),
                "params": r.metrics.get("params"),
                "growths": r.metrics.get("growths"),
                "moves": r.metrics.get("moves"),
                "lr": r.metrics.get("lr"),
                "path": str(r.path),
            }
        )
        history[tid] = _history(r)
    best = results.get_best_result(options.metric, options.mode, scope="last", filter_nan_and_inf=True)
    if best.checkpoint is None:
        raise SearchError("the best trial left no checkpoint", f"see the trial folders under {options.experiment}")
    out = Path(options.output).expanduser().resolve() if options.output else options.experiment / BEST
    with best.checkpoint.as_directory() as folder:
        gm = read_model_file(Path(folder) / MODEL_FILE)
        state = json.loads((Path(folder) / STATE_FILE).read_text())
    save_model(gm, out)
    return SearchResult(
        out,
        options.metric,
        float(best.metrics[options.metric]),
        str(best.metrics.get("trial_id")),
        list(graph_info(gm).get("log", [])),
        list(state.get("moves", [])),
        original_path,
        options.experiment,
        trials,
        history,
        seconds,
    )
