"""The `graphgrow` command: mutate, replay, fold, export, check, inspect, targets, diff, search, passes.

Exit codes: 0 success; 1 a check failed (verification, export, equivalence);
2 bad input or a pass that cannot apply; 3 an internal error (a bug: please report).
Errors are one line on stderr; --debug shows the traceback.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import html
import json
import os
import signal
import sys
import traceback
from typing import Callable

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .core.errors import GraphgrowError, SpecError, first_line

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, soft_wrap=True)

MAX_MESSAGE = 500  # user-supplied text in messages is cut: a 2 MB argument is not echoed whole


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + f"… ({len(text) - MAX_MESSAGE:,} more characters)"


INPUT_SHAPE_HELP = "example input shape N,C,H,W (needed when the model file cannot tell it), e.g. 1,3,224,224"


def _common(f: Callable) -> Callable:
    f = click.option("--input-shape", "input_shape", metavar="N,C,H,W", help=INPUT_SHAPE_HELP)(f)
    f = click.option("--trust", is_flag=True, help="allow loading pickles with custom classes (runs code from the file; only for files you trust)")(f)
    f = click.option("--leaf", "leaves", multiple=True, metavar="MODULE", help="keep this submodule as one opaque call when tracing (repeatable; untraceable and mode-branching submodules become leaves automatically)")(f)
    f = click.option("--trace-mode", "trace_mode", type=click.Choice(["eval", "train"]), default="eval", show_default=True,
                     help="structure to trace when the model's top-level forward branches on self.training "
                          "(eval: the deployed function; train: keeps auxiliary outputs)")(f)
    f = click.option("--max-load", metavar="SIZE", expose_value=False, callback=_set_max_load,
                     help="refuse a model file that would unpack to more than this (default 16G)")(f)
    f = click.option("--max-memory", metavar="SIZE", expose_value=False, callback=_set_max_memory, help=MAX_MEMORY_HELP)(f)
    f = click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout instead of tables")(f)
    f = click.option("--debug", is_flag=True, help="show tracebacks")(f)
    return f


MAX_MEMORY_HELP = ("refuse a model (or a pass's result) whose activations at the largest batch run would need more "
                   "than this, or cannot be estimated (default 8G; none: no limit)")


def _set_max_memory(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Process-wide like --max-load; checked where it is used (a bad value is the usual one-line error)."""
    if value is not None:
        from .analysis.budget import set_max_memory

        set_max_memory(value)


def _set_max_load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """The load-size cap is process-wide (one command per process), so the flag sets it directly."""
    if value is None:
        return
    from .io import load
    from .analysis.budget import parse_size

    try:
        load.MAX_LOAD_BYTES = parse_size(value, "--max-load")
    except GraphgrowError as e:
        raise click.BadParameter(e.message) from e


@contextlib.contextmanager
def _progress():
    """A spinner on stderr for long steps (export takes seconds to a minute)."""
    with err.status("starting", spinner="dots") as status:
        yield lambda msg: status.update(msg)


class _Signalled(KeyboardInterrupt):
    """SIGTERM/SIGHUP as an exception, so staged outputs and temp files are cleaned up as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # signals seen: C extensions (an import mid-flight) may turn our exception into another
_exit_code: list[int] = []  # once the command's exit code is decided (outputs and report written)


def _raise_signal(signum, frame) -> None:
    if _exit_code:  # the command is done and said so: a late signal ends the process now, with the command's code
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_exit_code[0])
    _received.append(signum)
    raise _Signalled(signum)


def _ignore_late_signals() -> None:
    """At interpreter exit (atexit), after the command has finished: Python stops running its signal
    handlers while it tears down (seconds with torch loaded), so a signal then would kill the process
    with no message and no exit code of the command's (128 + signal): ignored instead."""
    if _exit_code:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            with contextlib.suppress(AttributeError, ValueError, OSError):
                signal.signal(getattr(signal, name), signal.SIG_IGN)


def _exit(code: int) -> None:
    from .io.outputs import discard_all

    discard_all()  # no staging file outlives the command, whatever stopped it
    _exit_code[:] = [code]
    sys.exit(code)


def _interrupted(signum: int) -> None:
    from .io.outputs import committed

    name = signal.Signals(signum).name
    written = committed()  # renamed into place before the signal came: whole, and staying
    if written:
        err.print(f"interrupted ({name}) after writing {_cut(', '.join(map(str, written)))}: these outputs are complete",
                  markup=False, highlight=False)
    else:
        err.print(f"interrupted ({name}); nothing was written or overwritten", markup=False)
    _exit(128 + signum)


def _run(job: Callable[[Callable[[str], None]], int], as_json: bool, debug: bool) -> None:
    from .io.outputs import forget_committed

    _received.clear()
    _exit_code.clear()
    forget_committed()
    atexit.unregister(_ignore_late_signals)  # once, however many commands a process runs (tests)
    atexit.register(_ignore_late_signals)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_signal)
    if hasattr(signal, "SIGXFSZ"):  # past `ulimit -f` a write fails with EFBIG (exit 2) instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        with _progress() as progress:
            code = job(progress)
    except GraphgrowError as e:
        if _received:  # the signal surfaced wrapped in one of our errors
            _interrupted(_received[0])
        if debug:
            traceback.print_exc()
        err.print("[bold red]error:[/] " + escape(_cut(GraphgrowError.__str__(e))), markup=True, highlight=False)
        pointer = e.pointer() if isinstance(e, SpecError) else ""
        if pointer:  # the spec with a caret under the problem: printed as is (_cut would fold its spacing)
            err.print(pointer, markup=False, highlight=False)
        if as_json:
            print(json.dumps({"error": {"type": type(e).__name__, "message": e.message, "hint": e.hint}}))
        _exit(e.exit_code)
    except KeyboardInterrupt as e:
        _interrupted(e.signum if isinstance(e, _Signalled) else signal.SIGINT)
    except Exception as e:  # a bug in graphgrow: still one line unless --debug
        if _received:
            _interrupted(_received[0])
        if debug:
            traceback.print_exc()
        first = escape(_cut(first_line(e, MAX_MESSAGE)))
        err.print(f"[bold red]internal error:[/] {type(e).__name__}: {first} (run with --debug for the traceback and please report it)",
                  markup=True, highlight=False)
        _exit(3)
    _exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphgrow")
def main() -> None:
    """graphgrow: grow PyTorch models with verified, function-preserving graph passes,
    export them to ONNX and prove onnxruntime agrees.

    MODEL is a file written by torch.save (standard torch.nn layers load without
    --trust; graphgrow's own outputs too), a zoo name (timm:resnet26d,
    torchvision:resnet18; random weights, input shape from the zoo) or a factory
    (package.module:factory), each optionally with literal arguments:
    'timm:resnet26d(num_classes=10,drop_path_rate=0.1)'.

    Exit codes: 0 ok, 1 a check failed, 2 bad input or a pass that cannot apply,
    3 internal error.
    """


@main.command()
@click.argument("model")
@click.option("--pass", "specs", multiple=True, required=True, metavar="SPEC",
              help="pass spec, e.g. add_residual or 'add_residual(start=layer1,end=layer2)'; repeat or comma-separate to chain")
@click.option("-o", "--output", "output", metavar="OUT.pt", help="where to save the grown model (default: beside MODEL as NAME.grown.pt)")
@click.option("--onnx", "onnx_out", metavar="OUT.onnx", help="also export the grown model to this ONNX file")
@click.option("--check", is_flag=True, help="run the ONNX model in onnxruntime and compare with PyTorch (grown and original)")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="onnxruntime execution provider for --check")
@click.option("--max-params", "max_params", metavar="N", help="refuse a pass that would add more parameters, or cannot be sized before it runs (default 100M; e.g. 500M; none: no limit)")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True, help="seed for new weights")
@click.option("--dry-run", is_flag=True, help="run and verify the passes and show the report, but write no model (a --diagram is still drawn)")
@click.option("--diagram", metavar="OUT.svg", help="also draw the graph after growth against before (added, rebuilt, reshaped highlighted; .svg or .png)")
@_common
def mutate(model, specs, output, onnx_out, check, provider, max_params, seed, dry_run, diagram, input_shape, trust, leaves, trace_mode, as_json, debug):
    """Apply passes to MODEL, verify each, save the result (and ONNX, and check it)."""
    from .jobs import workflow

    _run(_growth_job(lambda progress: workflow.mutate(
        model, specs, output, onnx_out, check, input_shape, provider, trust, leaves, seed, progress, trace_mode=trace_mode,
        max_params=max_params, dry_run=dry_run, diagram=diagram), as_json), as_json, debug)


def _growth_job(make_report: Callable[[Callable[[str], None]], dict], as_json: bool) -> Callable:
    """mutate and replay: print the report, exit 1 when the equivalence check failed."""
    def job(progress):
        report = make_report(progress)
        if as_json:
            print(json.dumps(report, default=str))
        else:
            _print_mutation(report)
        eq = report.get("equivalence")
        return 1 if eq is not None and not eq["passed"] else 0

    return job


def _print_mutation(report: dict) -> None:
    verb = f"replay of {report['log_from']} on" if "log_from" in report else "mutate"
    out.print(f"[bold]graphgrow {verb}[/] {report['model']} (input {'×'.join(map(str, report['input_shape']))})")
    if report.get("input_shape_inferred"):
        out.print(f"input shape inferred: {report['input_shape_inferred']}")
    for i, p in enumerate(report["passes"], 1):
        args = ", ".join(f"{k}={v}" for k, v in p["args"].items() if v is not None)
        out.print(f"[bold]{i}. {p['name']}[/]({args})")
        for k, v in p["targets"].items():
            if isinstance(v, list):
                out.print(f"   {k}:", markup=False, highlight=False)
                for item in v:
                    out.print(f"     - {item}", markup=False, highlight=False)
            else:
                out.print(f"   {k}: {v}")
        out.print(f"   nodes: +{len(p['nodes_added'])} −{len(p['nodes_removed'])}")
        out.print(f"   params: {p['params_before']:,} → {p['params_after']:,}")
        out.print(f"   FLOPs/example: {p['flops_before']:,} → {p['flops_after']:,}")
        pres = p.get("preservation")
        if pres and pres["train_rel_err"] is None:
            out.print(f"   verified in eval mode: rel err {pres['eval_rel_err']:.1e}")
        elif pres:
            steps = ", ".join(f"{k}@{v}" for k, v in pres["new_parameters"].items())
            out.print(f"   verified: eval rel err {pres['eval_rel_err']:.1e}, train rel err {pres['train_rel_err']:.1e}; "
                      f"new parameters learn (first gradient at SGD step): {steps or 'none new'}")
        for note in p.get("notes", []):
            out.print(f"   note: {note}")
    eq = report.get("equivalence")
    if eq is not None:
        _print_equivalence(eq)
        _print_equivalence(eq["vs_original"])
    for path in report["outputs"]:
        out.print(f"wrote {path}")
    if report.get("dry_run"):
        out.print(f"dry run: no model written (would write {', '.join(report['dry_run']['would_write'])})", markup=False, highlight=False)
    if report.get("output_note") and report["outputs"]:
        out.print(f"note: {report['output_note']}", markup=False, highlight=False)
    if report.get("trust_note"):
        out.print(f"note: {report['trust_note']}", markup=False, highlight=False)
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in report.get("timings", {}).items())
    if timing:
        out.print(f"time: {timing}")


def _print_equivalence(eq: dict) -> None:
    from .verify.equivalence import EquivalenceReport, OutputStats

    rep = EquivalenceReport(eq["provider"], eq["note"], eq["rtol"], eq["atol"],
                            [OutputStats(**c) for c in eq["cases"]], eq.get("reference", "model"))
    out.print(rep.table())
    out.print(f"provider: {eq['note']}")
    verdict = "[green]PASS[/]" if rep.passed else "[red]FAIL[/]"
    out.print(f"equivalence vs {rep.reference}: {verdict} (max abs {rep.max_abs_err:.2e}, max rel {rep.max_rel_err:.2e})")


@main.command()
@click.argument("model")
@click.argument("log_from", metavar="GROWN")
@click.option("-o", "--output", "output", metavar="OUT.pt", help="where to save the result (default: beside MODEL as NAME.replayed.pt)")
@click.option("--onnx", "onnx_out", metavar="OUT.onnx", help="also export the result to this ONNX file")
@click.option("--check", is_flag=True, help="run the ONNX model in onnxruntime and compare with PyTorch")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--max-params", "max_params", metavar="N", help="refuse a pass that would add more parameters, or cannot be sized before it runs (default 100M; e.g. 500M; none: no limit)")
@_common
def replay(model, log_from, output, onnx_out, check, provider, max_params, input_shape, trust, leaves, trace_mode, as_json, debug):
    """Re-apply the mutation log of GROWN (a graphgrow .pt or exported .onnx) to MODEL, seed for seed.

    MODEL is the network GROWN was grown from, or a model part of the way (its log the start of
    GROWN's: only the rest is applied); a different network is refused."""
    from .jobs import workflow

    _run(_growth_job(lambda progress: workflow.replay(
        model, log_from, output, onnx_out, check, input_shape, provider, trust, leaves, progress, trace_mode=trace_mode,
        max_params=max_params), as_json), as_json, debug)


@main.command()
@click.argument("model")
@click.option("-o", "--output", "output", metavar="OUT.pt", help="where to save the folded model (default: beside MODEL as NAME.folded.pt)")
@click.option("--onnx", "onnx_out", metavar="OUT.onnx", help="also export the folded model to this ONNX file")
@click.option("--check", is_flag=True, help="run the ONNX model in onnxruntime and compare with PyTorch (folded and original, eval mode)")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="onnxruntime execution provider for --check")
@click.option("--grow-kernels", is_flag=True, help="let a branch with a larger kernel enlarge the main conv (fewer FLOPs than unfolded, more than before growth)")
@_common
def fold(model, output, onnx_out, check, provider, grow_kernels, input_shape, trust, leaves, trace_mode, as_json, debug):
    """Fold growth's linear structure into plain layers for deployment (eval-mode semantics, verified, logged)."""
    from .jobs import workflow

    spec = "fold(grow_kernels=true)" if grow_kernels else "fold"
    _run(_growth_job(lambda progress: workflow.mutate(
        model, [spec], output, onnx_out, check, input_shape, provider, trust, leaves, 0, progress, trace_mode=trace_mode,
        suffix=".folded.pt"), as_json), as_json, debug)


@main.command()
@click.argument("model")
@click.option("-o", "--output", "output", required=True, metavar="OUT.onnx", help="ONNX file to write")
@click.option("--fold", "fold_first", is_flag=True, help="fold growth's linear structure into plain layers first (eval mode; see `graphgrow fold`)")
@click.option("--opset", type=int, metavar="N", help="ONNX opset to write (18–23; default: the exporter's)")
@_common
def export(model, output, fold_first, opset, input_shape, trust, leaves, trace_mode, as_json, debug):
    """Export MODEL to one self-contained ONNX file with a dynamic batch dimension.

    A factory MODEL is built with its random weights seeded; the seed goes into the file's
    metadata so that `graphgrow check` rebuilds the same weights."""
    from .jobs import workflow

    def job(progress):
        report = workflow.export(model, output, input_shape, trust, leaves, progress, trace_mode=trace_mode, fold=fold_first,
                                 opset=opset)
        if as_json:
            print(json.dumps(report, default=str))
        else:
            if report["fold"] is not None:
                f = report["fold"]
                out.print(f"folded: params {f['params_before']:,} → {f['params_after']:,}, FLOPs/example "
                          f"{f['flops_before']:,} → {f['flops_after']:,}", markup=False, highlight=False)
            out.print(f"wrote {output} (IR {report['ir_version']}, opset {report['opset'][0] if report['opset'] else '?'}, "
                      f"{len(report['log'])} logged mutations) in {report['timings']['export']:.1f}s")
        return 0

    _run(job, as_json, debug)


@main.command()
@click.argument("onnx_file", metavar="MODEL.onnx")
@click.argument("model")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--rtol", type=click.FloatRange(0, 1), help="relative tolerance (default 1e-4 on CPU, 1e-3 on CUDA)")
@click.option("--atol", type=click.FloatRange(0, 1), help="absolute tolerance as a fraction of max|output| (default 1e-5 on CPU, 1e-4 on CUDA)")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), help="seed of a factory MODEL's random weights (default: the one the export recorded)")
@_common
def check(onnx_file, model, provider, rtol, atol, seed, input_shape, trust, leaves, trace_mode, as_json, debug):
    """Run MODEL.onnx in onnxruntime and compare it with the PyTorch MODEL.

    A factory MODEL is rebuilt with the weight seed the export recorded; without one
    (and without --seed) the comparison is refused: new random weights could not agree."""
    from .jobs import workflow

    def job(progress):
        report, rep = workflow.check(onnx_file, model, input_shape, provider, trust, leaves, progress, trace_mode=trace_mode,
                                     seed=seed, rtol=rtol, atol=atol)
        if as_json:
            print(json.dumps(report, default=str))
        else:
            _print_equivalence(report["equivalence"])
            if "factory_seed" in report:
                out.print(f"{model} built with weight seed {report['factory_seed']}", markup=False, highlight=False)
            if report.get("note"):
                out.print(f"note: {report['note']}", markup=False, highlight=False)
            if not rep.passed:
                d = report.get("first_divergence")
                out.print(f"first diverging node: {d['node']} ({d['op']}, module {d['module']}): max abs error "
                          f"{d['max_abs_err']:.3g}, max rel {d['max_rel_err']:.3g}" if d else
                          "first diverging node: none found among the module outputs (the difference arises outside them)",
                          markup=False, highlight=False)
        return 0 if rep.passed else 1

    _run(job, as_json, debug)


@main.command()
@click.argument("model")
@click.option("--all", "show_all", is_flag=True, help="list every node (default: skip nodes without a tensor shape) and every automatic leaf")
@click.option("--groups", is_flag=True, help="show the channel-coupling groups (what grow_width widens together) instead of nodes")
@click.option("--summary", is_flag=True, help="one row per module (torchinfo-like) instead of one per node: fits a large model on a screen")
@click.option("--depth", type=click.IntRange(1, 10), default=1, show_default=True, help="module depth of --summary rows")
@_common
def inspect(model, show_all, groups, summary, depth, input_shape, trust, leaves, trace_mode, as_json, debug):
    """Show MODEL's nodes with shapes, parameters and FLOPs, and its mutation log.

    An exported .onnx file shows its inputs, outputs, op counts, metadata and mutation log."""
    from .jobs import workflow

    def job(progress):
        report = workflow.inspect(model, input_shape, trust, leaves, progress, groups=groups, trace_mode=trace_mode, depth=depth)
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        if report.get("format") == "onnx":
            _print_onnx(report)
            return 0
        if groups:
            _print_groups(report)
            return 0
        if summary:
            _print_summary(model, report)
            return 0
        t = Table(title=f"{model} (input {'×'.join(map(str, report['input_shape']))})")
        for col in ("node", "op", "target", "shape", "params", "FLOPs"):
            t.add_column(col, justify="right" if col in ("params", "FLOPs") else "left")
        for n in report["nodes"]:
            if n["shape"] is None and not show_all and n["op"] != "output":
                continue
            shape = "×".join(map(str, n["shape"])) if isinstance(n["shape"], tuple) else str(n["shape"] or "")
            t.add_row(n["name"], n["op"], str(n["target"]), shape, f"{n['params']:,}" if n["params"] else "",
                      f"{n['flops']:,}" if n["flops"] else "")
        out.print(t)
        out.print(f"total: {report['params']:,} parameters, {report['flops']:,} FLOPs per example")
        _print_trace(report.get("trace") or {}, show_all)
        _print_log(report["log"])
        return 0

    _run(job, as_json, debug)


def _print_summary(model: str, report: dict) -> None:
    t = Table(title=f"{model} (input {'×'.join(map(str, report['input_shape']))}): one row per module")
    for col in ("module", "type", "output shape", "params", "FLOPs", "nodes"):
        t.add_column(col, justify="right" if col in ("params", "FLOPs", "nodes") else "left")
    for r in report["summary"]:
        shape = "×".join(map(str, r["shape"])) if isinstance(r["shape"], (tuple, list)) else str(r["shape"] or "")
        t.add_row(escape(r["module"]), r["type"], shape, f"{r['params']:,}" if r["params"] else "",
                  f"{r['flops']:,}" if r["flops"] else "", str(r["nodes"]))
    out.print(t)
    out.print(f"total: {report['params']:,} parameters, {report['flops']:,} FLOPs per example, {len(report['nodes'])} nodes")
    _print_log(report["log"])


def _print_onnx(report: dict) -> None:
    out.print(f"[bold]{escape(report['model'])}[/]: ONNX IR {report['ir_version']}, opset "
              f"{report['opset'][0] if report['opset'] else '?'}, {report['producer'] or 'unknown producer'}")
    for kind in ("inputs", "outputs"):
        for v in report[kind]:
            out.print(f"{kind[:-1]} {v['name']}: {v['dtype']} [{', '.join(map(str, v['shape']))}]", markup=False, highlight=False)
    ops = ", ".join(f"{op} {n}" for op, n in report["ops"].items())
    out.print(f"{report['nodes']:,} nodes ({ops}); {report['params']:,} parameters", markup=False, highlight=False)
    for k, v in report["metadata"].items():
        out.print(f"metadata {k}: {v}", markup=False, highlight=False)
    _print_log(report["log"])


def _print_log(log: list) -> None:
    for i, e in enumerate(log, 1):
        out.print(f"mutation {i}: {e['pass']}({', '.join(f'{k}={v}' for k, v in e['args'].items() if v is not None)}) "
                  f"params {e['params_before']:,} → {e['params_after']:,}", markup=False, highlight=False)


def _print_trace(trace: dict, show_all: bool = False) -> None:
    """How the model was traced: automatic leaves and why (the same reason once, with its modules,
    unless --all), notes, the fidelity checks that passed."""
    if not trace:
        return
    leaves = trace.get("auto_leaves") or {}
    if leaves:
        out.print(f"automatic leaves ({len(leaves)}):", markup=False)
        by_reason: dict[str, list[str]] = {}
        for path, why in leaves.items():
            by_reason.setdefault(why, []).append(path)
        for why, paths in by_reason.items():
            if show_all or len(paths) <= 3:
                for path in paths:
                    out.print(f"  {path}: {why}", markup=False)
            else:
                shown = ", ".join(paths[:3])
                out.print(f"  {len(paths)} × {why}: {shown}, … (--all lists every one)", markup=False)
    for note in trace.get("notes", []):
        out.print(f"trace: {note}", markup=False)
    if trace.get("fidelity"):
        out.print(f"trace matches the model: {', '.join(trace['fidelity'])} (mode@batch)", markup=False)


def _print_groups(report: dict) -> None:
    t = Table(title=f"channel groups of {report['model']}: tensors whose channel count must change together")
    for col in ("group", "channels", "tensors", "sources (grow out)", "consumers (grow in)", "status"):
        t.add_column(col, justify="right" if col in ("group", "channels", "tensors") else "left")
    for g in report["groups"]:
        blocked = g["blocked_by"]
        status = "[green]growable[/]" if not blocked else "[red]frozen:[/] " + escape("; ".join(blocked[:2])) + (
            f" (+{len(blocked) - 2} more)" if len(blocked) > 2 else "")
        if not blocked and g.get("norms_reached"):
            status += " (LayerNorm: init=net2net, integer factor)"
        t.add_row(str(g["id"]), str(g["channels"]), str(len(g["members"])), ", ".join(g["sources"]) or "-",
                  ", ".join(g["consumers"]) or "-", status)
    out.print(t)


@main.command()
@click.argument("model")
@click.option("--pass", "spec", required=True, metavar="SPEC", help="the pass, with any arguments other than its target, e.g. add_branch or 'add_branch(op=sepconv3x3)'")
@_common
def targets(model, spec, input_shape, trust, leaves, trace_mode, as_json, debug):
    """List where a pass can apply on MODEL: the spec that picks each place, the place in words
    (module path, stage, resolution, channels) and the parameters it would add; * marks the default."""
    from .jobs import workflow

    def job(progress):
        report = workflow.targets(model, spec, input_shape, trust, leaves, progress, trace_mode=trace_mode)
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        if not report["candidates"]:
            out.print(f"{report['pass']} does not list places (it takes no target, or none applies)", markup=False)
            return 0
        t = Table(title=f"where {report['pass']} can apply on {model} ({report['params']:,} parameters)")
        for col in ("", "spec", "where", "adds", "of the model"):
            t.add_column(col, justify="right" if col in ("adds", "of the model") else "left", overflow="fold")
        for c in report["candidates"]:
            t.add_row("*" if c["default"] else "", escape(c["spec"]), escape(c["where"]), f"{c['params']:,}", f"{100 * c['fraction']:.1f}%")
        out.print(t)
        out.print("* the default target (no target given)")
        return 0

    _run(job, as_json, debug)


@main.command()
@click.argument("model")
@click.option("--train", "train_fn", required=True, metavar="PKG.MOD:FN",
              help="train_epoch(model, optimizer): one epoch in place; may return a dict of numbers to report")
@click.option("--eval", "eval_fn", required=True, metavar="PKG.MOD:FN", help="evaluate(model): the metric, or a dict holding it")
@click.option("--mutations", required=True, metavar="MOVES",
              help="architecture moves separated by ';', each a pass spec or noop, optionally *WEIGHT, e.g. 'grow_width(factor=2);deepen*2;add_residual;noop'")
@click.option("--population", type=click.IntRange(2), default=4, show_default=True, help="trials trained side by side")
@click.option("--rounds", type=click.IntRange(1), default=5, show_default=True, help="exploit/explore points (each may grow the worse trials)")
@click.option("--epochs-per-round", type=click.IntRange(1), default=1, show_default=True)
@click.option("--metric", default="val_loss", show_default=True, help="what evaluate returns and the search ranks by")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=0.05, show_default=True,
              help="learning rate around which the population starts (×½ … ×2); PBT perturbs it")
@click.option("--optimizer", type=click.Choice(["sgd", "adam", "adamw"]), default="sgd", show_default=True, help="sgd has momentum 0.9")
@click.option("--storage-path", default="graphgrow-search", show_default=True, metavar="DIR",
              help="where trials and checkpoints go (storage every node can reach on a cluster)")
@click.option("--name", default="search", show_default=True, help="the search's folder under --storage-path")
@click.option("--address", metavar="ADDR", help="join this Ray cluster ('auto' or host:port) instead of starting Ray here")
@click.option("--num-cpus", type=click.IntRange(1), help="CPUs of the local Ray (default: all)")
@click.option("--cpus-per-trial", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--gpus-per-trial", type=click.FloatRange(min=0), default=0.0, show_default=True, help="GPU share of each trial (e.g. 0.5: two per GPU)")
@click.option("--max-params", "max_params", metavar="N", help="parameter budget of a grown model (e.g. 2M); moves past it are skipped")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True, help="seed of the moves and the starting learning rates")
@click.option("--resume", is_flag=True, help="continue the search in --storage-path/--name from its checkpoints (give the arguments of the first run: the schedule and the original model come from the saved search)")
@click.option("-o", "--output", "output", metavar="OUT.pt", help="where to write the best model (default: DIR/NAME/best.pt)")
@click.option("--plot", metavar="OUT.png", help="also draw the metric of every trial over time, with growths and exploits marked")
@click.option("--keep-checkpoints", type=click.IntRange(2), metavar="N",
              help="checkpoints kept per trial (default: one per round, all kept; fewer saves disk, but PBT may then exploit one already deleted)")
@click.option("--worker-logs", is_flag=True, help="show the trials' own output (prints of the training function, Ray's messages)")
@_common
def search(model, train_fn, eval_fn, mutations, population, rounds, epochs_per_round, metric, mode, lr, optimizer,
           storage_path, name, address, num_cpus, cpus_per_trial, gpus_per_trial, max_params, seed, resume, output, plot,
           keep_checkpoints, worker_logs, input_shape, trust, leaves, trace_mode, as_json, debug):
    """Population-based growth of MODEL on Ray Tune: trials train side by side; at every round the
    worse ones continue from a better one's checkpoint and grow by one move (exactly: no jump in
    the loss). Prints progress, then the best model's path, its metric and its lineage."""
    def job(progress):
        from .search.job import run
        from .search.runner import SearchOptions

        options = SearchOptions(population=population, rounds=rounds, epochs_per_round=epochs_per_round, metric=metric,
                                mode=mode, lr=lr, optimizer=optimizer, storage_path=storage_path, name=name, address=address,
                                num_cpus=num_cpus, cpus_per_trial=cpus_per_trial, gpus_per_trial=gpus_per_trial, seed=seed,
                                resume=resume, output=output, keep_checkpoints=keep_checkpoints, worker_logs=worker_logs)
        report = run(model, train_fn, eval_fn, mutations, options, input_shape, trust, leaves, trace_mode, max_params, plot,
                     say=lambda msg: err.print(msg, markup=False, highlight=False), progress=progress)
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        _print_search(report)
        return 0

    _run(job, as_json, debug)


def _print_search(report: dict) -> None:
    t = Table(title=f"population after the search ({report['seconds']:.0f} s)")
    for col in ("trial", report["metric"], "parameters", "growths", "lr"):
        t.add_column(col, justify="left" if col == "trial" else "right")
    for row in sorted(report["trials"], key=lambda r: r["trial"]):
        value = row.get(report["metric"])
        t.add_row(escape(row["trial"]) + (" *" if row["trial"] == report["trial"] else ""),
                  "-" if value is None else f"{value:.4g}", f"{row.get('params') or 0:,.0f}",
                  str(row.get("growths")), "-" if row.get("lr") is None else f"{row['lr']:.3g}")
    out.print(t)
    out.print(f"best: {report['best']} ({report['metric']} {report['value']:.4g}, trial {report['trial']})", markup=False)
    if report["lineage"]:
        out.print("lineage (from the original):", markup=False)
        for i, e in enumerate(report["lineage"], 1):
            args = ",".join(f"{k}={v}" for k, v in e.get("args", {}).items() if v is not None)
            out.print(f"  {i}. {e['pass']}({args}) seed {e['seed']}: {e['params_before']:,} → {e['params_after']:,} parameters",
                      markup=False)
        out.print(f"replay it: graphgrow replay {report['original']} {report['best']}", markup=False)
    else:
        out.print("lineage: the best trial did not grow (the original architecture won)", markup=False)
    out.print(f"deploy it: graphgrow export {report['best']} -o best.onnx", markup=False)
    if report.get("plot"):
        out.print(f"plot: {report['plot']}", markup=False)


@main.command()
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@click.option("--diagram", metavar="OUT.svg", help="draw B against A (added, rebuilt, reshaped highlighted; .svg or .png)")
@click.option("--trust", is_flag=True, help="allow loading pickles with custom classes (only for files you trust)")
@click.option("--max-memory", metavar="SIZE", expose_value=False, callback=_set_max_memory, help=MAX_MEMORY_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
@click.option("--debug", is_flag=True, help="show tracebacks")
def diff(model_a, model_b, diagram, trust, as_json, debug):
    """What B changed against A (two graphgrow files of one lineage): the passes between them, nodes added,
    layers rebuilt, shapes changed, nodes removed; --diagram draws it.

    One lineage: B was grown from A (A's mutation log is the start of B's, and both start from the
    same network — its parameter names and shapes, recorded by the first pass)."""
    from .jobs import workflow

    def job(progress):
        report = workflow.diff(model_a, model_b, diagram, trust, progress)
        if as_json:
            print(json.dumps(report, default=str))
            return 0
        out.print(f"{model_b} against {model_a}: {', '.join(report['passes']) or 'no passes'}; parameters "
                  f"{report['params'][0]:,} → {report['params'][1]:,}", markup=False)
        for key in ("added", "rebuilt", "reshaped", "removed"):
            if report[key]:
                out.print(f"  {key} ({len(report[key])}): {', '.join(report[key][:12])}{' …' if len(report[key]) > 12 else ''}",
                          markup=False)
        if report.get("diagram"):
            out.print(f"diagram: {report['diagram']}", markup=False)
        return 0

    _run(job, as_json, debug)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--markdown", is_flag=True, help="print the table of arguments docs/passes.md shows (from the passes' own field help)")
def passes(as_json, markdown):
    """List the installed passes with their arguments, defaults and what each argument means."""
    from .jobs.registry import all_passes

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
                hints, helps = cls.argument_types(), cls.argument_help()
                data[name] = {"help": cls.help(), "args": [
                    {"name": f.name, "type": _type_name(hints[f.name]), "default": f.default, "help": helps[f.name]}
                    for f in dataclasses.fields(cls)]}
        print(json.dumps(data, default=str))
        return
    for name, cls in found.items():
        if isinstance(cls, GraphgrowError):
            out.print(f"[bold]{name}[/]  [red]unavailable:[/] {cls}")
            continue
        out.print(f"[bold]{name}[/]  {escape(cls.help())}")
        hints, helps = cls.argument_types(), cls.argument_help()
        for f in dataclasses.fields(cls):
            out.print(f"    {f.name}: {escape(_type_name(hints[f.name]))} = {f.default!r}" + (f"  — {escape(helps[f.name])}" if helps[f.name] else ""))


def passes_markdown(found: dict) -> str:
    """The argument table of docs/passes.md: one row per argument of every installed pass."""
    rows = ["| pass | argument | type | default | meaning |", "|---|---|---|---|---|"]
    for name, cls in found.items():
        if isinstance(cls, GraphgrowError):
            continue
        hints, helps = cls.argument_types(), cls.argument_help()
        fields = dataclasses.fields(cls)
        if not fields:
            rows.append(f"| `{name}` | none | | | |")
        for f in fields:
            cells = [f"`{name}`", f"`{f.name}`", _type_name(hints[f.name]), f"`{f.default!r}`", helps[f.name]]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def cli_reference(width: int = 100) -> str:
    """The README's CLI reference: `graphgrow --help` and every command's --help, at a fixed width so the
    text does not depend on the terminal that generated it."""
    root = click.Context(main, info_name="graphgrow", terminal_width=width, max_content_width=width, **main.context_settings)
    parts = []
    for cmd in [main, *(main.commands[n] for n in sorted(main.commands))]:
        ctx = root if cmd is main else click.Context(cmd, info_name=cmd.name, parent=root)
        name = ctx.command_path
        summary = "" if cmd is main else f" — {cmd.get_short_help_str(limit=300)}"
        parts.append(f"<details><summary><code>{name} --help</code>{html.escape(summary, quote=False)}</summary>\n\n```text\n"
                     f"{cmd.get_help(ctx)}\n```\n\n</details>")
    return "\n\n".join(parts)


def _type_name(t) -> str:
    """int, float | None, one of conv3x3|conv5x5|... (a Literal's choices spelled out)."""
    import types
    import typing

    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return "one of " + "|".join(map(str, typing.get_args(t)))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    if t is type(None):
        return "None"
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


if __name__ == "__main__":
    main()
