"""The `graphgrow` commands that grow a model: mutate, replay, fold (the fold transform, a pass like the others)
and search (population-based growth); registered on the group in commands.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import click

from .flags import DATA_HELP, _common, _memory
from .run import err, run_command
from .safe_text import printable
from .show import (
    print_mutation,
    print_search,
)


@click.command()
@click.argument("model")
@click.option(
    "--pass",
    "specs",
    multiple=True,
    required=True,
    metavar="SPEC",
    help="pass spec, e.g. add_residual or 'add_residual(start=layer1,end=layer2)'; repeat or comma-separate to chain",
)
@click.option(
    "-o",
    "--output",
    "output",
    metavar="OUT.pt",
    help="where to save the grown model (default: beside MODEL as NAME.grown.pt); "
    "for a Hugging Face folder MODEL, a new folder name (no .pt) writes the model's own class "
    "with the grown config (save_pretrained)",
)
@click.option("--onnx", "onnx_out", metavar="OUT.onnx", help="also export the grown model to this ONNX file")
@click.option(
    "--check", is_flag=True, help="run the ONNX model in onnxruntime and compare with PyTorch (grown and original)"
)
@click.option(
    "--provider",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="onnxruntime execution provider for --check",
)
@click.option(
    "--max-params",
    "max_params",
    metavar="N",
    help="refuse a pass that would add more parameters, or cannot be sized before it runs "
    "(default 100M; e.g. 500M; none: no limit)",
)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True, help="seed for new weights")
@click.option(
    "--dry-run",
    is_flag=True,
    help="run and verify the passes and show the report, but write no model (a --diagram is still drawn)",
)
@click.option(
    "--diagram",
    metavar="OUT.svg",
    help="also draw the graph after growth against before (added, rebuilt, reshaped highlighted; .svg or .png)",
)
@click.option("--data", metavar="PKG.MOD:FN", help=DATA_HELP + " for the passes with init=gradmax")
@_common
def mutate(
    model,
    specs,
    output,
    onnx_out,
    check,
    provider,
    max_params,
    seed,
    dry_run,
    diagram,
    data,
    load,
    max_memory,
    as_json,
    debug,
):
    """Apply passes to MODEL, verify each, save the result (and ONNX, and check it)."""
    from ..analysis.budget import Limits
    from ..jobs import workflow
    from ..jobs.options import OutputOptions

    run_command(
        _growth_job(
            lambda progress: workflow.grow(
                model,
                specs,
                load=load,
                output=OutputOptions(out=output, onnx_out=onnx_out, dry_run=dry_run, diagram=diagram),
                limits=Limits.parse(max_params, max_memory),
                check=check,
                provider=provider,
                seed=seed,
                progress=progress,
                data=data,
            ),
            as_json,
        ),
        as_json,
        debug,
    )


def _growth_job(make_report: Callable[[Callable[[str], None]], dict], as_json: bool) -> Callable:
    """mutate and replay: print the report, exit 1 when the equivalence check failed."""

    def job(progress):
        report = make_report(progress)
        if as_json:
            print(json.dumps(report, default=str))
        else:
            print_mutation(printable(report))  # names and log entries from files: no raw control characters
        eq = report.get("equivalence")
        return 1 if eq is not None and not eq["passed"] else 0

    return job


@click.command()
@click.argument("model")
@click.argument("log_from", metavar="GROWN")
@click.option(
    "-o",
    "--output",
    "output",
    metavar="OUT.pt",
    help="where to save the result (default: beside MODEL as NAME.replayed.pt)",
)
@click.option("--onnx", "onnx_out", metavar="OUT.onnx", help="also export the result to this ONNX file")
@click.option("--check", is_flag=True, help="run the ONNX model in onnxruntime and compare with PyTorch")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option(
    "--max-params",
    "max_params",
    metavar="N",
    help="refuse a pass that would add more parameters, or cannot be sized before it runs "
    "(default 100M; e.g. 500M; none: no limit)",
)
@click.option(
    "--data",
    metavar="PKG.MOD:FN",
    help=DATA_HELP + "; used by the logged steps grown with one "
    "(a name stored in GROWN is never imported: name it again, or pass --trust)",
)
@_common
def replay(model, log_from, output, onnx_out, check, provider, max_params, data, load, max_memory, as_json, debug):
    """Re-apply the mutation log of GROWN (a graphgrow .pt or exported .onnx) to MODEL, seed for seed.

    MODEL is the network GROWN was grown from, or a model part of the way (its log the start of
    GROWN's: only the rest is applied); a different network is refused."""
    from ..jobs import workflow

    run_command(
        _growth_job(
            lambda progress: workflow.replay(
                model,
                log_from,
                out=output,
                onnx_out=onnx_out,
                check=check,
                **load.job_arguments(),
                provider=provider,
                progress=progress,
                max_params=max_params,
                max_memory=max_memory,
                data=data,
            ),
            as_json,
        ),
        as_json,
        debug,
    )


@click.command()
@click.argument("model")
@click.option(
    "-o",
    "--output",
    "output",
    metavar="OUT.pt",
    help="where to save the folded model (default: beside MODEL as NAME.folded.pt)",
)
@click.option("--onnx", "onnx_out", metavar="OUT.onnx", help="also export the folded model to this ONNX file")
@click.option(
    "--check",
    is_flag=True,
    help="run the ONNX model in onnxruntime and compare with PyTorch (folded and original, eval mode)",
)
@click.option(
    "--provider",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="onnxruntime execution provider for --check",
)
@click.option(
    "--grow-kernels",
    is_flag=True,
    help="let a branch with a larger kernel enlarge the main conv (fewer FLOPs than unfolded, more than before growth)",
)
@_common
def fold(model, output, onnx_out, check, provider, grow_kernels, load, max_memory, as_json, debug):
    """Fold growth's linear structure into plain layers for deployment (eval-mode semantics, verified, logged)."""
    from ..analysis.budget import Limits
    from ..jobs import workflow
    from ..jobs.options import OutputOptions

    spec = "fold(grow_kernels=true)" if grow_kernels else "fold"
    run_command(
        _growth_job(
            lambda progress: workflow.grow(
                model,
                [spec],
                load=load,
                output=OutputOptions(out=output, onnx_out=onnx_out, suffix=".folded.pt"),
                limits=Limits.parse(max_memory=max_memory),
                check=check,
                provider=provider,
                seed=0,
                progress=progress,
            ),
            as_json,
        ),
        as_json,
        debug,
    )


@click.command()
@click.argument("model")
@click.option(
    "--train",
    "train_fn",
    required=True,
    metavar="PKG.MOD:FN",
    help="train_epoch(model, optimizer): one epoch in place; may return a dict of numbers to report",
)
@click.option(
    "--eval", "eval_fn", required=True, metavar="PKG.MOD:FN", help="evaluate(model): the metric, or a dict holding it"
)
@click.option(
    "--mutations",
    required=True,
    metavar="MOVES",
    help="architecture moves separated by ';', each a pass spec or noop, optionally *WEIGHT, "
    "e.g. 'grow_width(factor=2);deepen*2;add_residual;noop'",
)
@click.option(
    "--policy",
    type=click.Choice(["uniform", "gain", "gain-sample"]),
    default="uniform",
    show_default=True,
    help="where a move grows: uniform (a random place), gain (the place with the largest first-order gain on the "
    "--data batch, as targets --data ranks them) or gain-sample (a place drawn in proportion to its gain); "
    "passes without a data-driven init (no init=gradmax) keep the random place",
)
@click.option(
    "--data",
    metavar="PKG.MOD:FN",
    help=DATA_HELP + ", read by --policy gain/gain-sample and by moves with init=gradmax "
    "(the training function gives no batch)",
)
@click.option("--population", type=click.IntRange(2), default=4, show_default=True, help="trials trained side by side")
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=5,
    show_default=True,
    help="exploit/explore points (each may grow the worse trials)",
)
@click.option("--epochs-per-round", type=click.IntRange(1), default=1, show_default=True)
@click.option("--metric", default="val_loss", show_default=True, help="what evaluate returns and the search ranks by")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=0.05,
    show_default=True,
    help="learning rate around which the population starts (×½ … ×2); PBT perturbs it",
)
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "adam", "adamw"]),
    default="sgd",
    show_default=True,
    help="sgd has momentum 0.9",
)
@click.option(
    "--storage-path",
    default="graphgrow-search",
    show_default=True,
    metavar="DIR",
    help="where trials and checkpoints go (storage every node can reach on a cluster)",
)
@click.option("--name", default="search", show_default=True, help="the search's folder under --storage-path")
@click.option(
    "--address", metavar="ADDR", help="join this Ray cluster ('auto' or host:port) instead of starting Ray here"
)
@click.option("--num-cpus", type=click.IntRange(1), help="CPUs of the local Ray (default: all)")
@click.option("--cpus-per-trial", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option(
    "--gpus-per-trial",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="GPU share of each trial (e.g. 0.5: two per GPU)",
)
@click.option(
    "--max-params",
    "max_params",
    metavar="N",
    help="parameter budget of a grown model (e.g. 2M); moves past it are skipped",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**63 - 1),
    default=0,
    show_default=True,
    help="seed of the moves and the starting learning rates",
)
@click.option(
    "--resume",
    is_flag=True,
    help="continue the search in --storage-path/--name from its checkpoints (give the arguments of the first run: "
    "the schedule and the original model come from the saved search); Ray Tune restores it from pickles, "
    "so it needs --trust: only for a folder of your own",
)
@click.option(
    "-o", "--output", "output", metavar="OUT.pt", help="where to write the best model (default: DIR/NAME/best.pt)"
)
@click.option(
    "--plot", metavar="OUT.png", help="also draw the metric of every trial over time, with growths and exploits marked"
)
@click.option(
    "--keep-checkpoints",
    type=click.IntRange(2),
    metavar="N",
    help="checkpoints kept per trial (default: one per round, all kept; fewer saves disk, "
    "but PBT may then exploit one already deleted)",
)
@click.option(
    "--worker-logs", is_flag=True, help="show the trials' own output (prints of the training function, Ray's messages)"
)
@_common
def search(
    model,
    train_fn,
    eval_fn,
    mutations,
    policy,
    data,
    population,
    rounds,
    epochs_per_round,
    metric,
    mode,
    lr,
    optimizer,
    storage_path,
    name,
    address,
    num_cpus,
    cpus_per_trial,
    gpus_per_trial,
    max_params,
    seed,
    resume,
    output,
    plot,
    keep_checkpoints,
    worker_logs,
    load,
    max_memory,
    as_json,
    debug,
):
    """Population-based growth of MODEL on Ray Tune: trials train side by side; at every round the
    worse ones continue from a better one's checkpoint and grow by one move (exactly: no jump in
    the loss). Prints progress, then the best model's path, its metric and its lineage."""

    def job(progress):
        from ..analysis.budget import Limits
        from ..search.job import run
        from ..search.runner import SearchOptions

        options = SearchOptions(
            population=population,
            rounds=rounds,
            epochs_per_round=epochs_per_round,
            metric=metric,
            mode=mode,
            lr=lr,
            optimizer=optimizer,
            storage_path=storage_path,
            name=name,
            address=address,
            num_cpus=num_cpus,
            cpus_per_trial=cpus_per_trial,
            gpus_per_trial=gpus_per_trial,
            seed=seed,
            resume=resume,
            trust=load.trust,
            output=output,
            keep_checkpoints=keep_checkpoints,
            worker_logs=worker_logs,
            limits=Limits(max_memory=_memory(max_memory)),
        )
        report = run(
            model,
            train=train_fn,
            evaluate=eval_fn,
            mutations=mutations,
            options=options,
            load=load,
            max_params=max_params,
            plot=plot,
            say=lambda msg: err.print(msg, markup=False, highlight=False),
            progress=progress,
            policy=policy,
            data=data,
        )
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        print_search(printable(report))
        return 0

    run_command(job, as_json, debug)
