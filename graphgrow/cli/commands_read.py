"""The `graphgrow` commands that leave the model as it is: export, check, inspect, targets, diff (the jobs of
graphgrow.jobs.inspection); registered on the group in commands.py.
"""

from __future__ import annotations

import json

import click
from rich.markup import escape
from rich.table import Table

from .flags import DATA_HELP, MAX_MEMORY_HELP, _common, _memory
from .run import out, run_command
from .safe_text import printable
from .show import (
    input_text,
    print_equivalence,
    print_groups,
    print_log,
    print_onnx,
    print_summary,
    print_trace,
)


@click.command()
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
            **load.job_arguments(),
            progress=progress,
            fold=fold_first,
            opset=opset,
            external_data=external_data or None,
            max_memory=_memory(max_memory),
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
                f"wrote {' + '.join(report['outputs'])} (IR {report['ir_version']}, "
                f"opset {report['opset'][0] if report['opset'] else '?'}, "
                f"{len(report['log'])} logged mutations) in {report['timings']['export']:.1f}s"
            )
        return 0

    run_command(job, as_json, debug)


@click.command()
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
            **load.job_arguments(),
            provider=provider,
            progress=progress,
            seed=seed,
            rtol=rtol,
            atol=atol,
            max_memory=_memory(max_memory),
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
                    else "first diverging node: none found among the module outputs "
                    "(the difference arises outside them)",
                    markup=False,
                    highlight=False,
                )
        return 0 if rep.passed else 1

    run_command(job, as_json, debug)


@click.command()
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
            **load.job_arguments(),
            progress=progress,
            groups=groups,
            depth=depth,
            max_memory=_memory(max_memory),
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


@click.command()
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
            **load.job_arguments(),
            progress=progress,
            data=data,
            max_memory=_memory(max_memory),
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


@click.command()
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
                    f"  {key} ({len(report[key])}): {', '.join(report[key][:12])}"
                    f"{' …' if len(report[key]) > 12 else ''}",
                    markup=False,
                )
        if report.get("diagram"):
            out.print(f"diagram: {report['diagram']}", markup=False)
        return 0

    run_command(job, as_json, debug)
