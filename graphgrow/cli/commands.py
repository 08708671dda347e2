"""The `graphgrow` command's commands: mutate, replay, fold, export, check, inspect, targets, diff, search,
passes — their options, the job each runs (graphgrow.jobs.workflow does the work), and the generated CLI reference.
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Callable

import click
from rich.markup import escape
from rich.table import Table

from ..core.errors import GraphgrowError
from .flags import DATA_HELP, MAX_MEMORY_HELP, _common, _memory
from .run import err, out, run_command
from .safe_text import printable
from .show import (
    input_text,
    passes_markdown,
    print_equivalence,
    print_groups,
    print_log,
    print_mutation,
    print_onnx,
    print_search,
    print_summary,
    print_trace,
    type_name,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphgrow")
def main() -> None:
    """graphgrow: grow PyTorch models with verified, function-preserving graph passes,
    export them to ONNX and prove onnxruntime agrees.

    MODEL is a file written by torch.save (standard torch.nn layers load without
    --trust; graphgrow's own outputs too), a zoo name (timm:resnet26d,
    torchvision:resnet18, hf:MODEL_TYPE[/TASK] for Hugging Face transformers; random
    weights, input shape from the zoo) or a factory (package.module:factory), each
    optionally with literal arguments: 'timm:resnet26d(num_classes=10,drop_path_rate=0.1)',
    'hf:gpt2(n_layer=2,n_embd=64,n_head=4)', or a save_pretrained folder (safetensors).

    Exit codes: 0 ok, 1 a check failed, 2 bad input or a pass that cannot apply,
    3 internal error.
    """


@main.command()
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
    "for a Hugging Face folder MODEL, a new folder name (no .pt) writes the model's own class with the grown config (save_pretrained)",
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
    help="refuse a pass that would add more parameters, or cannot be sized before it runs (default 100M; e.g. 500M; none: no limit)",
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


@main.command()
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
    help="refuse a pass that would add more parameters, or cannot be sized before it runs (default 100M; e.g. 500M; none: no limit)",
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
                input_shape=load.input_shape,
                provider=provider,
                trust=load.trust,
                leaves=load.leaves,
                progress=progress,
                trace_mode=load.trace_mode,
                capture=load.capture,
                max_params=max_params,
                max_memory=max_memory,
                data=data,
                max_load=load.max_load,
            ),
            as_json,
        ),
        as_json,
        debug,
    )


@main.command()
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


@main.command()
@click.argument("model")
@click.option("-o", "--output", "output", required=True, metavar="OUT.onnx", help="ONNX file to write")
@click.option(
    "--fold",
    "fold_first",
    is_flag=True,
    help="fold growth's linear structure into plain layers first (eval mode; see `graphgrow fold`)",
)
@click.option("--opset", type=int, metavar="N", help="ONNX opset to write (18–23; default: the exporter's)")
@click.option(
    "--external-data",
    "external_data",
    is_flag=True,
    help="write the weights to OUT.onnx.data beside OUT.onnx (done anyway past 1.75 GiB of weights)",
)
@_common
def export(model, output, fold_first, opset, external_data, load, max_memory, as_json, debug):
    """Export MODEL to one self-contained ONNX file with a dynamic batch dimension.

    Weights past 1.75 GiB (protobuf's 2 GiB limit, less room for the graph) go to OUT.onnx.data
    beside OUT.onnx; keep the two together. A factory MODEL is built with its random weights
    seeded; the seed goes into the file's metadata so that `graphgrow check` rebuilds the same weights."""
    from ..jobs import workflow

    def job(progress):
        report = workflow.export(
            model,
            output,
            input_shape=load.input_shape,
            trust=load.trust,
            leaves=load.leaves,
            progress=progress,
            trace_mode=load.trace_mode,
            capture=load.capture,
            fold=fold_first,
            opset=opset,
            external_data=external_data or None,
            max_memory=_memory(max_memory),
            max_load=load.max_load,
        )
        if as_json:
            print(json.dumps(report, default=str))
        else:
            report = printable(report)
            if report["fold"] is not None:
                f = report["fold"]
                out.print(
                    f"folded: params {f['params_before']:,} → {f['params_after']:,}, FLOPs/example "
                    f"{f['flops_before']:,} → {f['flops_after']:,}",
                    markup=False,
                    highlight=False,
                )
            out.print(
                f"wrote {' + '.join(report['outputs'])} (IR {report['ir_version']}, opset {report['opset'][0] if report['opset'] else '?'}, "
                f"{len(report['log'])} logged mutations) in {report['timings']['export']:.1f}s"
            )
        return 0

    run_command(job, as_json, debug)


@main.command()
@click.argument("onnx_file", metavar="MODEL.onnx")
@click.argument("model")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--rtol", type=click.FloatRange(0, 1), help="relative tolerance (default 1e-4 on CPU, 1e-3 on CUDA)")
@click.option(
    "--atol",
    type=click.FloatRange(0, 1),
    help="absolute tolerance as a fraction of max|output| (default 1e-5 on CPU, 1e-4 on CUDA)",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**63 - 1),
    help="seed of a factory MODEL's random weights (default: the one the export recorded)",
)
@_common
def check(onnx_file, model, provider, rtol, atol, seed, load, max_memory, as_json, debug):
    """Run MODEL.onnx in onnxruntime and compare it with the PyTorch MODEL.

    A factory MODEL is rebuilt with the weight seed the export recorded; without one
    (and without --seed) the comparison is refused: new random weights could not agree."""
    from ..jobs import workflow

    def job(progress):
        report, rep = workflow.check(
            onnx_file,
            model,
            input_shape=load.input_shape,
            provider=provider,
            trust=load.trust,
            leaves=load.leaves,
            progress=progress,
            trace_mode=load.trace_mode,
            capture=load.capture,
            seed=seed,
            rtol=rtol,
            atol=atol,
            max_memory=_memory(max_memory),
            max_load=load.max_load,
        )
        if as_json:
            print(json.dumps(report, default=str))
        else:
            report = printable(report)
            print_equivalence(report["equivalence"])
            if "factory_seed" in report:
                out.print(f"{model} built with weight seed {report['factory_seed']}", markup=False, highlight=False)
            if report.get("note"):
                out.print(f"note: {report['note']}", markup=False, highlight=False)
            if not rep.passed:
                d = report.get("first_divergence")
                out.print(
                    f"first diverging node: {d['node']} ({d['op']}, module {d['module']}): max abs error "
                    f"{d['max_abs_err']:.3g}, max rel {d['max_rel_err']:.3g}"
                    if d
                    else "first diverging node: none found among the module outputs (the difference arises outside them)",
                    markup=False,
                    highlight=False,
                )
        return 0 if rep.passed else 1

    run_command(job, as_json, debug)


@main.command()
@click.argument("model")
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="list every node (default: skip nodes without a tensor shape) and every automatic leaf",
)
@click.option(
    "--groups", is_flag=True, help="show the channel-coupling groups (what grow_width widens together) instead of nodes"
)
@click.option(
    "--summary",
    is_flag=True,
    help="one row per module (torchinfo-like) instead of one per node: fits a large model on a screen",
)
@click.option(
    "--depth", type=click.IntRange(1, 10), default=1, show_default=True, help="module depth of --summary rows"
)
@_common
def inspect(model, show_all, groups, summary, depth, load, max_memory, as_json, debug):
    """Show MODEL's nodes with shapes, parameters and FLOPs, and its mutation log.

    An exported .onnx file shows its inputs, outputs, op counts, metadata and mutation log."""
    from ..jobs import workflow

    def job(progress):
        report = workflow.inspect(
            model,
            input_shape=load.input_shape,
            trust=load.trust,
            leaves=load.leaves,
            progress=progress,
            groups=groups,
            trace_mode=load.trace_mode,
            depth=depth,
            capture=load.capture,
            max_memory=_memory(max_memory),
            max_load=load.max_load,
        )
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        report = printable(report)  # names, log entries and metadata from the file: no raw control characters
        if report.get("format") == "onnx":
            print_onnx(report)
            return 0
        if groups:
            print_groups(report)
            return 0
        if summary:
            print_summary(model, report)
            return 0
        t = Table(title=f"{model} ({input_text(report)})")
        for col in ("node", "op", "target", "shape", "params", "FLOPs"):
            t.add_column(col, justify="right" if col in ("params", "FLOPs") else "left")
        for n in report["nodes"]:
            if n["shape"] is None and not show_all and n["op"] != "output":
                continue
            shape = "×".join(map(str, n["shape"])) if isinstance(n["shape"], tuple) else str(n["shape"] or "")
            t.add_row(
                n["name"],
                n["op"],
                str(n["target"]),
                shape,
                f"{n['params']:,}" if n["params"] else "",
                f"{n['flops']:,}" if n["flops"] else "",
            )
        out.print(t)
        out.print(f"total: {report['params']:,} parameters, {report['flops']:,} FLOPs per example")
        print_trace(report.get("trace") or {}, show_all)
        print_log(report["log"])
        return 0

    run_command(job, as_json, debug)


@main.command()
@click.argument("model")
@click.option(
    "--pass",
    "spec",
    required=True,
    metavar="SPEC",
    help="the pass, with any arguments other than its target, e.g. add_branch or 'add_branch(op=sepconv3x3)'",
)
@click.option(
    "--data", metavar="PKG.MOD:FN", help=DATA_HELP + ": rank the places by the first-order gain of growing there"
)
@_common
def targets(model, spec, data, load, max_memory, as_json, debug):
    """List where a pass can apply on MODEL: the spec that picks each place, the place in words
    (module path, stage, resolution, channels) and the parameters it would add; * marks the default.
    With --data (passes with init=gradmax), ranked by gain: ‖∂L/∂(zero last factor)‖² per new unit or block with
    GradMax's directions."""
    from ..jobs import workflow

    def job(progress):
        report = workflow.targets(
            model,
            spec,
            input_shape=load.input_shape,
            trust=load.trust,
            leaves=load.leaves,
            progress=progress,
            trace_mode=load.trace_mode,
            capture=load.capture,
            data=data,
            max_memory=_memory(max_memory),
            max_load=load.max_load,
        )
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        report = printable(report)
        if not report["candidates"]:
            out.print(f"{report['pass']} does not list places (it takes no target, or none applies)", markup=False)
            return 0
        t = Table(title=f"where {report['pass']} can apply on {model} ({report['params']:,} parameters)")
        ranked = data is not None
        for col in ("", "spec", "where", "adds", "of the model") + (("gain",) if ranked else ()):
            t.add_column(col, justify="right" if col in ("adds", "of the model", "gain") else "left", overflow="fold")
        for c in report["candidates"]:
            gain = (f"{c['gain']:.3g}" if c["gain"] is not None else escape(f"— {c['gain_note']}"),) if ranked else ()
            t.add_row(
                "*" if c["default"] else "",
                escape(c["spec"]),
                escape(c["where"]),
                f"{c['params']:,}",
                f"{100 * c['fraction']:.1f}%",
                *gain,
            )
        out.print(t)
        out.print(
            "* the default target (no target given)"
            + (
                "; gain: ‖∂L/∂(zero last factor)‖² per new unit "
                "(or per block, on its gate) on the --data batch, largest "
                "first"
                if ranked
                else ""
            )
        )
        return 0

    run_command(job, as_json, debug)


@main.command()
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
    help="architecture moves separated by ';', each a pass spec or noop, optionally *WEIGHT, e.g. 'grow_width(factor=2);deepen*2;add_residual;noop'",
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
    help="continue the search in --storage-path/--name from its checkpoints (give the arguments of the first run: the schedule and the original model come from the saved search); Ray Tune restores it from pickles, so it needs --trust: only for a folder of your own",
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
    help="checkpoints kept per trial (default: one per round, all kept; fewer saves disk, but PBT may then exploit one already deleted)",
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


@main.command()
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@click.option(
    "--diagram", metavar="OUT.svg", help="draw B against A (added, rebuilt, reshaped highlighted; .svg or .png)"
)
@click.option("--trust", is_flag=True, help="allow loading pickles with custom classes (only for files you trust)")
@click.option("--max-memory", "max_memory", metavar="SIZE", help=MAX_MEMORY_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
@click.option("--debug", is_flag=True, help="show tracebacks")
def diff(model_a, model_b, diagram, trust, max_memory, as_json, debug):
    """What B changed against A (two graphgrow files of one lineage): the passes between them, nodes added,
    layers rebuilt, shapes changed, nodes removed; --diagram draws it.

    One lineage: B was grown from A (A's mutation log is the start of B's, and both start from the
    same network — its parameter names and shapes, recorded by the first pass)."""
    from ..jobs import workflow

    def job(progress):
        report = workflow.diff(
            model_a, model_b, diagram=diagram, trust=trust, progress=progress, max_memory=_memory(max_memory)
        )
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        report = printable(report)
        out.print(
            f"{model_b} against {model_a}: {', '.join(report['passes']) or 'no passes'}; parameters "
            f"{report['params'][0]:,} → {report['params'][1]:,}",
            markup=False,
        )
        for key in ("added", "rebuilt", "reshaped", "removed"):
            if report[key]:
                out.print(
                    f"  {key} ({len(report[key])}): {', '.join(report[key][:12])}{' …' if len(report[key]) > 12 else ''}",
                    markup=False,
                )
        if report.get("diagram"):
            out.print(f"diagram: {report['diagram']}", markup=False)
        return 0

    run_command(job, as_json, debug)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option(
    "--markdown",
    is_flag=True,
    help="print the table of arguments docs/passes.md shows (from the passes' own field help)",
)
def passes(as_json, markdown):
    """List the installed passes with their arguments, defaults and what each argument means."""
    from ..jobs.registry import all_passes
    from .show import argument_type, contract

    found = all_passes()
    if markdown:
        print(passes_markdown(found))
        return
    if as_json:
        data = {}
        for name, cls in found.items():
            if isinstance(cls, GraphgrowError):
                data[name] = {"error": str(cls)}
            else:
                hints, helps, allowed = cls.argument_types(), cls.argument_help(), cls.argument_allowed()
                data[name] = {
                    "help": cls.help(),
                    "args": [
                        {
                            "name": f.name,
                            "type": type_name(hints[f.name]),
                            "default": f.default,
                            "help": helps[f.name],
                            "allowed": allowed[f.name].describe(),
                        }
                        for f in dataclasses.fields(cls)
                    ],
                    "requires": [r.name for r in cls.requires],
                    "ensures": [g.name for g in cls.ensures],
                }
        print(json.dumps(data, default=str))
        return
    for name, cls in found.items():
        if isinstance(cls, GraphgrowError):
            out.print(f"[bold]{name}[/]  [red]unavailable:[/] {cls}")
            continue
        out.print(f"[bold]{name}[/]  {escape(cls.help())}")
        if contract(cls):
            out.print(f"    ({escape(contract(cls))})")
        helps = cls.argument_help()
        for f in dataclasses.fields(cls):
            out.print(
                f"    {f.name}: {escape(argument_type(cls, f.name))} = {f.default!r}"
                + (f"  — {escape(helps[f.name])}" if helps[f.name] else "")
            )


def cli_reference(width: int = 100) -> str:
    """The README's CLI reference: `graphgrow --help` and every command's --help, at a fixed width so the
    text does not depend on the terminal that generated it."""
    root = click.Context(
        main, info_name="graphgrow", terminal_width=width, max_content_width=width, **main.context_settings
    )
    parts = []
    for cmd in [main, *(main.commands[n] for n in sorted(main.commands))]:
        ctx = root if cmd is main else click.Context(cmd, info_name=cmd.name, parent=root)
        name = ctx.command_path
        summary = "" if cmd is main else f" — {cmd.get_short_help_str(limit=300)}"
        parts.append(
            f"<details><summary><code>{name} --help</code>{html.escape(summary, quote=False)}</summary>\n\n```text\n"
            f"{cmd.get_help(ctx)}\n```\n\n</details>"
        )
    return "\n\n".join(parts)
