"""The jobs behind the CLI, as functions: open a model, then mutate it, grow it or replay a log on it.

The jobs that leave the model as it is (inspect, targets, diff, export, check) are in inspection.py;
they are re-exported here, where the CLI, the tests and the examples call them (`workflow.inspect`, ...).
Each returns plain data (the CLI formats it) and raises GraphgrowError subclasses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..analysis.budget import Limits, check_onnx_memory
from ..capture.trace import graph_info
from ..core.errors import InputError, LoadError, SaveError, SpecError
from ..io.hf_folder import check_new_folder, is_hf_folder
from ..io.lineage import origin_of
from ..io.load import custom_classes, load_model
from ..io.save import check_output_path, default_output_path, plain_output_path, save_model
from .diagram import diagram_format
from .inspection import MAX_OPSET as MAX_OPSET
from .inspection import MIN_OPSET as MIN_OPSET
from .inspection import check as check
from .inspection import diff as diff
from .inspection import export as export
from .inspection import inspect as inspect
from .inspection import targets as targets
from .native import native_of, native_report
from .opening import OpenedModel as OpenedModel
from .opening import Progress, _noop, shape_report
from .opening import open_model as open_model
from .options import LoadOptions, OutputOptions
from .part_growth import grow_part
from .pipeline import Pipeline
from .staging import StagedOutputs, _draw, _preservation_json, export_and_check
from .summary import module_summary as module_summary


def mutate(
    source: str,
    specs: Sequence[str],
    out: str | None = None,
    onnx_out: str | None = None,
    check: bool = False,
    input_shape=None,
    provider: str = "auto",
    trust: bool = False,
    leaves: Sequence[str] = (),
    seed: int = 0,
    progress: Progress = _noop,
    trace_mode: str = "eval",
    max_params=None,
    max_memory=None,
    suffix: str = ".grown.pt",
    dry_run: bool = False,
    diagram: str | None = None,
    capture: str = "auto",
    data: str | None = None,
) -> dict:
    """grow() with its options as keyword arguments (the Python convenience; the CLI builds the options itself).
    `max_params`/`max_memory`: sizes as the flags take them ('500M', '8G', 'none'), or None for the defaults."""
    return grow(
        source,
        specs,
        load=LoadOptions(
            input_shape=input_shape, trust=trust, leaves=tuple(leaves), trace_mode=trace_mode, capture=capture
        ),
        output=OutputOptions(out=out, onnx_out=onnx_out, suffix=suffix, dry_run=dry_run, diagram=diagram),
        limits=Limits.parse(max_params, max_memory),
        check=check,
        provider=provider,
        seed=seed,
        progress=progress,
        data=data,
    )


def grow(
    source: str,
    specs: Sequence[str],
    *,
    load: LoadOptions,
    output: OutputOptions,
    limits: Limits,
    check: bool = False,
    provider: str = "auto",
    seed: int = 0,
    progress: Progress = _noop,
    data: str | None = None,
) -> dict:
    """Load → run the pipeline with verification → save → (export) → (check). Returns the JSON report.
    `data`: package.module:function giving (inputs, loss_fn) to the passes with init=gradmax.
    `output.diagram`: also draw the graph after growth against the one before (diagram.draw; .svg or .png).
    Without `output.out` the result goes beside the model as NAME`output.suffix`. `output.dry_run`: the passes
    run and are verified, nothing is written (the report says where it would have gone)."""
    out, onnx_out, suffix, diagram = output.out, output.onnx_out, output.suffix, output.diagram
    pipeline = Pipeline.from_spec(list(specs), seed=seed)  # spec errors before any work
    if data is not None:
        pipeline.passes = with_data(pipeline.passes, data)
    pipeline.limits = limits
    pipeline.share = (
        True  # the model loaded here is only read after the pipeline: the result shares what it leaves alone
    )
    if out is not None and is_hf_folder(Path(source)):
        check_new_folder(Path(out))
    out_path = check_output_path(
        out or default_output_path(source, suffix), inputs=(source,)
    )  # default: claimed when written
    onnx_path = check_output_path(onnx_out, inputs=(source,)) if onnx_out else None
    diagram_path = check_output_path(diagram, inputs=(source,)) if diagram else None
    if diagram_path is not None:
        diagram_format(diagram_path)  # a wrong extension is refused before the passes run
    _distinct_outputs(out_path, onnx_path, diagram_path)
    if out is not None and is_hf_folder(Path(source)) and out_path.suffix not in (".pt", ".pth"):
        from .stream_grow import grow_streaming, stream_reason  # a checkpoint over --max-memory: window by window

        why = (
            None
            if onnx_path or check or output.dry_run or diagram or data
            else stream_reason(Path(source), limits.max_memory)
        )
        if why:
            return grow_streaming(source, specs, out_path, seed=seed, progress=progress, reason=why)
    opened = _open(source, load, progress, limits.max_memory, parts=True)  # the largest capturable part if need be
    if opened.part is not None:  # the whole cannot be captured: grown inside its largest capturable part
        paths = (out_path, onnx_path, diagram_path, plain_output_path(source, suffix) if out is None else None)
        return grow_part(pipeline, opened, source, paths, check, provider, progress, output.dry_run)
    # a Hugging Face folder grown into a folder (-o without .pt): the model's own class, written by save_pretrained
    native = (
        out_path
        if out is not None and opened.loaded.kind == "hf-folder" and out_path.suffix not in (".pt", ".pth")
        else None
    )
    report = _grow_and_write(
        pipeline,
        opened,
        source,
        (source,),
        out_path,
        onnx_path,
        check,
        provider,
        progress,
        "pass",
        dry_run=output.dry_run,
        diagram=diagram_path,
        fresh=plain_output_path(source, suffix) if out is None else None,
        native=native,
    )
    plain = plain_output_path(source, suffix)
    went = Path(report["outputs"][0]) if report["outputs"] and not output.dry_run else out_path
    if out is None and went != plain:
        report["output_note"] = f"{plain} already exists: the result went to {went.name} (give -o to choose the name)"
    elif out is None and opened.loaded.kind == "hf-folder":
        report["output_note"] = (
            "graphgrow's own file; -o NEWFOLDER (no .pt) writes a Hugging Face folder of the model's own class"
        )
    return report


def with_data(passes: list, data: str) -> list:
    """--data fills `data` of each pass with init=gradmax that does not name its own."""
    import dataclasses

    aimed = [p for p in passes if getattr(p, "init", None) == "gradmax"]
    if not aimed:
        raise SpecError(
            "--data is read by passes with init=gradmax, and none of these has it",
            "e.g. --pass 'grow_width(init=gradmax)' --data mytask:batch",
        )
    return [dataclasses.replace(p, data=data) if p in aimed and p.data is None else p for p in passes]


def _open(source: str, load: LoadOptions, progress: Progress, max_memory: int | None, **extra: Any) -> OpenedModel:
    """open_model with the command's load options, every argument by name (max_memory None: the default, 8G)."""
    return open_model(
        source,
        input_shape=load.input_shape,
        trust=load.trust,
        leaves=load.leaves,
        progress=progress,
        trace_mode=load.trace_mode,
        max_memory=max_memory,
        capture=load.capture,
        max_load=load.max_load,
        weights=load.weights,
        **extra,
    )


def _distinct_outputs(*paths: Path | None) -> None:
    real = [Path(p).resolve() for p in paths if p is not None]
    if len(set(real)) != len(real):
        raise SaveError("two outputs (-o, --onnx, --diagram) name the same file", "give each output its own name")


def _grow_and_write(
    pipeline: Pipeline,
    opened: OpenedModel,
    source: str,
    inputs: tuple,
    out_path: Path,
    onnx_path: Path | None,
    check: bool,
    provider: str,
    progress: Progress,
    verb: str,
    dry_run: bool = False,
    diagram: Path | None = None,
    fresh: Path | None = None,
    native: Path | None = None,
) -> dict:
    """Run `pipeline` on the opened model, save the result, export and check it when asked (not when `dry_run`).
    `fresh`: `out_path` is a default name: the model goes to the first free one of `fresh`, `fresh`-1, … as it is
    written (another run may have taken `out_path` meanwhile). `native`: a Hugging Face folder to write (native.py)."""
    timings: dict[str, float] = {}
    t = time.perf_counter()
    count = len(pipeline.passes)
    result = pipeline.run(
        opened.gm, progress=lambda i, p: progress(f"{verb} {i + 1}/{count}: {p.name} (+ verification)")
    )
    timings["passes"] = time.perf_counter() - t
    report: dict = {
        "model": source,
        **shape_report(opened.input_shape),
        "input_shape_inferred": opened.inferred_from,
        "passes": [r.to_json() for r in result.results],
        "preservation": _preservation_json(result),
        "outputs": [],
        "timings": timings,
    }
    title = f"{source} + {', '.join(r.name for r in result.results)}"
    if dry_run:  # no model is written; a diagram asked for is the preview itself
        report["dry_run"] = {"would_write": [str(p) for p in (out_path, onnx_path) if p is not None]}
        if diagram is not None:
            with StagedOutputs() as staged:
                _draw(opened.gm, result.gm, staged.reserve(diagram), diagram, title, progress)
                report["outputs"] = [str(p) for p in staged.commit()]
        return report
    if onnx_path or check:  # before anything is written: the export and the check must fit too
        from ..io.export import wants_external

        check_onnx_memory(
            result.gm,
            wants_external(result.gm, None, onnx_path),
            check,
            pipeline.limits.max_memory if pipeline.limits else None,
        )
    own = (
        native_of(result.gm, opened.loaded, progress) if native is not None else None
    )  # refused before anything is written
    with StagedOutputs() as staged:  # every output appears at the end, together, or none does
        if own is None:
            progress(f"saving {out_path}")
            save_model(result.gm, staged.reserve(out_path, fresh=fresh), inputs=inputs)
        if onnx_path or check:
            exported = export_and_check(
                result.gm, opened, staged.reserve(onnx_path) if onnx_path else None, check, provider, progress, timings
            )
            if check:
                report["equivalence"] = exported["equivalence"]
        if check and not report["equivalence"]["passed"]:
            staged.discard()  # a model that failed its check is not written
            return report
        if diagram is not None:
            _draw(opened.gm, result.gm, staged.reserve(diagram), diagram, title, progress)
        report["outputs"] = [str(p) for p in staged.commit()]
        if own is not None and native is not None:
            from ..io.hf_folder import write_folder

            progress(f"writing {native} (save_pretrained)")
            report["outputs"].insert(0, str(write_folder(own, native, Path(source))))
            report["native"] = native_report(opened.loaded.module, own)
        out_path = Path(report["outputs"][0])  # the model's name, as claimed
    custom = custom_classes(result.gm) if own is None else []
    if custom:  # said now, not discovered at the next command's refusal
        shown = ", ".join(custom[:3]) + (f" and {len(custom) - 3} more" if len(custom) > 3 else "")
        report["trust_note"] = (
            f"reading {out_path.name} back needs --trust: it keeps modules of custom classes whole "
            f"({shown}); loading them runs that installed code"
        )
    return report


def replay(
    source: str,
    log_source: str,
    out: str | None = None,
    onnx_out: str | None = None,
    check: bool = False,
    input_shape=None,
    provider: str = "auto",
    trust: bool = False,
    leaves: Sequence[str] = (),
    progress: Progress = _noop,
    trace_mode: str = "eval",
    max_params=None,
    max_memory=None,
    capture: str = "auto",
    data=None,
    max_load: int | None = None,
    weights: str | None = None,
) -> dict:
    """Re-apply the mutation log of `log_source` (a graphgrow .pt or an exported .onnx) to the model `source`.
    `data`: the data function (a name or the function) for the steps that logged one; the logged name itself
    is used only with `trust` (pipeline.from_log)."""
    from .pipeline import from_log, logged_code

    log, grown_shape, grown_origin = _read_log(log_source, trust, need_shape=input_shape is None)
    if data is not None and not logged_code(log):
        raise InputError(
            f"--data was given, and no step of {log_source}'s mutation log was grown with data", "leave --data out"
        )
    pipeline = from_log(log, data=data, trust=trust)  # a malformed log, or a logged name to import, refused first
    inputs = (source, log_source)
    out_path = check_output_path(
        out or default_output_path(source, ".replayed.pt"), inputs=inputs
    )  # default: claimed when written
    onnx_path = check_output_path(onnx_out, inputs=inputs) if onnx_out else None
    _distinct_outputs(out_path, onnx_path)
    limits = Limits.parse(max_params, max_memory)
    opened = _open(
        source,
        LoadOptions(
            input_shape=input_shape or grown_shape,
            trust=trust,
            leaves=tuple(leaves),
            trace_mode=trace_mode,
            capture=capture,
            max_load=max_load,
            weights=weights,
        ),
        progress,
        limits.max_memory,
    )
    done = graph_info(opened.gm).get("log", [])
    if log[: len(done)] != done:
        raise InputError(
            f"{source} was not grown on the way to {log_source}: its mutation log is not the start of that one",
            f"replay onto the model {log_source} was grown from",
        )
    origin = origin_of(opened.gm)
    if grown_origin and origin and origin != grown_origin:
        raise InputError(
            f"{log_source} was not grown from {source}: it starts from a different network "
            "— the parameter names or shapes differ",
            f"replay onto the model {log_source} was grown from",
        )
    if len(done) == len(log):
        raise InputError(
            f"{source} already has every mutation of {log_source}: nothing to replay",
            "replay onto an earlier model of its lineage",
        )
    pipeline = from_log(log[len(done) :], data=data, trust=trust)  # a model part of the way there gets the rest
    pipeline.limits = limits
    report = _grow_and_write(
        pipeline,
        opened,
        source,
        inputs,
        out_path,
        onnx_path,
        check,
        provider,
        progress,
        "replaying",
        fresh=plain_output_path(source, ".replayed.pt") if out is None else None,
    )
    report["log_from"] = log_source
    return report


def _read_log(log_source: str, trust: bool, need_shape: bool = True) -> tuple[list[dict], Any, str | None]:
    """The mutation log, example input shape and origin fingerprint stored in a graphgrow .pt or an exported .onnx."""
    if str(log_source).endswith(".onnx"):
        from ..io.export import load_onnx, mutation_log, onnx_input_shape, onnx_origin

        proto = load_onnx(log_source)
        return mutation_log(proto), onnx_input_shape(proto) if need_shape else None, onnx_origin(proto)
    loaded = load_model(log_source, trust=trust)
    if loaded.kind != "graphgrow":
        raise LoadError(
            f"{log_source} has no mutation log (it was not written by graphgrow)",
            "pass a file that graphgrow mutate wrote, or its exported .onnx",
        )
    return loaded.log, loaded.input_shape, graph_info(loaded.module).get("origin")
