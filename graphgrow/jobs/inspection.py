"""The jobs that read a model and leave it as it is: inspect it, list a pass's targets, diff two of its
generations, export it to ONNX (optionally folded) and check an ONNX file against it.

The growth jobs that change a model (mutate, grow, replay) are in workflow.py, which re-exports these.
Each returns plain data (the CLI formats it) and raises GraphgrowError subclasses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from ..analysis.budget import check_onnx_memory, check_session_memory
from ..analysis.targets import Candidate
from ..capture.input_shape import parse_example_input
from ..capture.trace import graph_info
from ..core.errors import InputError, SaveError, SpecError, with_context
from ..graph.shapes import param_count, total_flops
from ..io.factory import is_factory_name
from ..io.lineage import origin_of, require_lineage
from ..io.load import FACTORY_SEED, LoadedModel
from ..io.save import check_output_path
from .diagram import diagram_format
from .opening import Progress, _noop, open_model, shape_report
from .pipeline import Pipeline, parse_spec
from .summary import module_summary


def diff(
    source_a: str,
    source_b: str,
    diagram: str | None = None,
    trust: bool = False,
    progress: Progress = _noop,
    max_memory: int | None = None,
) -> dict:
    """What B changed against A, where B was grown from A (lineage.require_lineage: A's mutation log is the
    start of B's and both start from the same network). `max_memory` (None: 8G) bounds each model's activations."""
    if diagram:
        check_output_path(diagram, inputs=(source_a, source_b))
        diagram_format(diagram)  # refused before the models are loaded
    b = open_model(source_b, trust=trust, progress=progress, max_memory=max_memory)
    # B knows the shape; A may not
    a = open_model(source_a, input_shape=b.input_shape, trust=trust, progress=progress, max_memory=max_memory)
    lineage = require_lineage(a.gm, source_a, b.gm, source_b)
    log_a, log_b = graph_info(a.gm).get("log", []), graph_info(b.gm).get("log", [])
    from .diagram import node_changes

    items, gone = node_changes(a.gm, b.gm)
    report = {
        "a": source_a,
        "b": source_b,
        "lineage": lineage,
        "passes": [e.get("pass") for e in log_b[len(log_a) :]],
        "params": [param_count(a.gm), param_count(b.gm)],
        "removed": gone,
        **{k: [it.label for it in items if it.status == k] for k in ("added", "rebuilt", "reshaped")},
    }
    if diagram:
        from .diagram import draw

        out = check_output_path(diagram, inputs=(source_a, source_b))
        report["diagram"] = str(draw(a.gm, b.gm, out, f"{source_b} against {source_a}"))
    return report


def targets(
    source: str,
    spec: str,
    input_shape=None,
    trust: bool = False,
    leaves: Sequence[str] = (),
    progress: Progress = _noop,
    trace_mode: str = "eval",
    capture: str = "auto",
    data: str | None = None,
    max_memory: int | None = None,
    max_load: int | None = None,
    weights: str | None = None,
) -> dict:
    """Where one pass (its other arguments as given in `spec`) can apply, with what each place would add;
    with `data` (package.module:function → (inputs, loss_fn)) ranked by the first-order gain (rewrite.gain)."""
    from .pipeline import build_pipeline, spec_of

    passes = build_pipeline(spec)
    if len(passes) != 1:
        raise SpecError(
            f"targets lists the places of one pass, got {len(passes)}", "give one pass, e.g. --pass add_branch"
        )
    p = passes[0]
    opened = open_model(
        source,
        input_shape=input_shape,
        trust=trust,
        leaves=leaves,
        progress=progress,
        trace_mode=trace_mode,
        max_memory=max_memory,
        capture=capture,
        max_load=max_load,
        weights=weights,
    )
    progress(f"finding where {p.name} can apply")
    found = p.candidates(opened.gm)
    total = param_count(opened.gm)
    given = parse_spec(spec_of(p))[0][1]
    gains: dict[int, tuple[float | None, str | None]] = {}
    if data is not None:
        from ..rewrite.gain import rank_by_gain

        progress(f"ranking {len(found)} places by the gradient on {data}")
        ranked = rank_by_gain(opened.gm, p, found, data)
        found, gains = [c for c, _, _ in ranked], {id(c): (g, why) for c, g, why in ranked}
    return {
        "model": source,
        "pass": p.name,
        "params": total,
        **shape_report(opened.input_shape),
        "candidates": [
            {
                "spec": Candidate({**given, **c.args}, c.where, c.params).spec(p.name),
                "where": c.where,
                "params": c.params,
                "fraction": c.params / max(total, 1),
                "default": c.default,
                **({"gain": gains[id(c)][0], "gain_note": gains[id(c)][1]} if gains else {}),
            }
            for c in found
        ],
    }


def provenance(loaded: LoadedModel) -> dict[str, str]:
    """ONNX metadata that lets `check` rebuild the same reference: a factory's name and weight seed."""
    from ..io.export import FACTORY_SEED_KEY, SOURCE_KEY

    if loaded.kind != "factory" or loaded.factory_seed is None:
        return {}
    return {SOURCE_KEY: loaded.source, FACTORY_SEED_KEY: str(loaded.factory_seed)}


def export(
    source: str,
    out: str,
    input_shape=None,
    trust: bool = False,
    leaves: Sequence[str] = (),
    progress: Progress = _noop,
    trace_mode: str = "eval",
    fold: bool = False,
    opset: int | None = None,
    capture: str = "auto",
    external_data: bool | None = None,
    max_memory: int | None = None,
    max_load: int | None = None,
    weights: str | None = None,
) -> dict:
    """Export the model to ONNX; with `fold`, through the `fold` transform first (verified, logged);
    `external_data` as export_onnx takes it."""
    from ..io.export import export_onnx, mutation_log, wants_external
    from ..io.onnx_external import written
    from ..io.runtime import max_ir_version

    out_path = check_output_path(out, inputs=(source,))
    if external_data:  # the data file beside it is an output too (a model named NAME.data exported to NAME)
        from ..io.onnx_external import data_path

        try:
            check_output_path(data_path(out_path), inputs=(source,))
        except SaveError as e:
            raise with_context(
                e, f"--external-data writes the weights of {out_path} to {data_path(out_path)}"
            ) from None
    if opset is not None and not MIN_OPSET <= opset <= MAX_OPSET:
        raise InputError(
            f"--opset {opset} is outside what the exporter writes ({MIN_OPSET}–{MAX_OPSET})",
            "leave it out for the exporter's default",
        )
    opened = open_model(
        source,
        input_shape=input_shape,
        trust=trust,
        leaves=leaves,
        progress=progress,
        trace_mode=trace_mode,
        max_memory=max_memory,
        capture=capture,
        max_load=max_load,
        weights=weights,
    )
    gm = opened.gm
    folded = None
    if fold:
        progress("folding (+ verification)")
        folded = Pipeline.from_spec("fold").run(gm).results[0]
        gm = folded.gm
    check_onnx_memory(gm, wants_external(gm, external_data, out_path), check=False, max_memory=max_memory)
    progress("exporting to ONNX (torch.onnx.export, then the ONNX checker)")
    t = time.perf_counter()
    proto = export_onnx(
        gm,
        opened.input_shape,
        out_path,
        metadata=provenance(opened.loaded),
        max_ir_version=max_ir_version(),
        opset=opset,
        external_data=external_data,
    )
    return {
        "model": source,
        **shape_report(opened.input_shape),
        "outputs": [str(p) for p in written(proto, out_path)],
        "fold": folded.to_json() if folded is not None else None,
        "ir_version": proto.ir_version,
        "opset": [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")][:1],
        "log": mutation_log(proto),
        "timings": {"export": time.perf_counter() - t},
    }


MIN_OPSET, MAX_OPSET = 18, 23  # the dynamo exporter writes opset 18 and newer


def check(
    onnx_file: str,
    source: str,
    input_shape=None,
    provider: str = "auto",
    trust: bool = False,
    leaves: Sequence[str] = (),
    progress: Progress = _noop,
    trace_mode: str = "eval",
    seed: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    capture: str = "auto",
    max_memory: int | None = None,
    max_load: int | None = None,
    weights: str | None = None,
):
    """onnxruntime on `onnx_file` vs PyTorch on the model `source`. Returns (json, report).

    A factory name builds random weights: they are the exported ones only when built with the
    seed the export recorded (or `seed`); without either the comparison would be meaningless, so
    it is refused."""
    from ..io.export import SOURCE_KEY, load_onnx, metadata, onnx_factory_seed, onnx_input_shape
    from ..io.onnx_external import declared_bytes, external_folder
    from ..io.runtime import open_session
    from ..verify.equivalence import check_equivalence

    proto = load_onnx(onnx_file)
    check_session_memory(
        declared_bytes(proto), max_memory
    )  # the session holds the file's tensors, at their declared sizes
    shape = parse_example_input(input_shape) or onnx_input_shape(proto)
    meta = metadata(proto)
    factory_seed = FACTORY_SEED
    if is_factory_name(source) and weights is None:  # with --weights every value comes from the file
        recorded = onnx_factory_seed(proto) if seed is None else seed
        if recorded is None:
            raise InputError(
                f"{onnx_file} does not record how its weights were made, and {source} builds new random "
                "weights each time: the two could not agree",
                "compare against the model file it was exported from, or pass --seed N if you know "
                "the seed the factory was built with",
            )
        factory_seed = recorded
    opened = open_model(
        source,
        input_shape=shape,
        trust=trust,
        leaves=leaves,
        progress=progress,
        trace_mode=trace_mode,
        max_memory=max_memory,
        factory_seed=factory_seed,
        capture=capture,
        max_load=max_load,
        weights=weights,
    )
    check_onnx_memory(opened.gm, None, check=True, max_memory=max_memory)
    progress("checking onnxruntime against PyTorch")
    folder = external_folder(proto, onnx_file)  # load_onnx checked every location against it
    session = open_session(proto.SerializeToString(), provider, external_folder=folder)  # the bytes that were checked
    report = check_equivalence(opened.gm, session, opened.input_shape, reference=source, rtol=rtol, atol=atol)
    out: dict = {"onnx": str(onnx_file), "model": source, "equivalence": report.to_json()}
    if not report.passed:
        from ..verify.equivalence import first_divergence

        progress("finding the first ONNX node whose output diverges")
        out["first_divergence"] = first_divergence(
            opened.gm, proto, opened.input_shape, report.rtol, report.atol, folder
        )
    if is_factory_name(source):
        out["factory_seed"] = factory_seed
    if meta.get(SOURCE_KEY) not in (None, source):
        out["note"] = f"{onnx_file} was exported from {meta[SOURCE_KEY]}, not {source}"
    return out, report


def inspect(
    source: str,
    input_shape=None,
    trust: bool = False,
    leaves: Sequence[str] = (),
    progress: Progress = _noop,
    groups: bool = False,
    trace_mode: str = "eval",
    depth: int = 1,
    capture: str = "auto",
    max_memory: int | None = None,
    max_load: int | None = None,
    weights: str | None = None,
) -> dict:
    if str(source).lower().endswith(".onnx") and Path(source).is_file():
        if groups:
            raise InputError(
                "--groups needs the PyTorch model (channel groups are a graph analysis)",
                "inspect the .pt file the ONNX model was exported from",
            )
        progress(f"reading {source}")
        from ..io.export import describe_onnx

        return describe_onnx(str(source))
    opened = open_model(
        source,
        input_shape=input_shape,
        trust=trust,
        leaves=leaves,
        progress=progress,
        trace_mode=trace_mode,
        max_memory=max_memory,
        capture=capture,
        max_load=max_load,
        weights=weights,
    )
    gm = opened.gm
    nodes = []
    for n in gm.graph.nodes:
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if n.op == "call_module":
            target = f"{n.target}: {type(gm.get_submodule(n.target)).__name__}"
        nodes.append(
            {
                "name": n.name,
                "op": n.op,
                "target": target,
                "shape": n.meta.get("gg_shape"),
                "params": n.meta.get("gg_params", 0),
                "flops": n.meta.get("gg_flops", 0),
            }
        )
    report = {
        "model": source,
        **shape_report(opened.input_shape),
        "nodes": nodes,
        "params": param_count(gm),
        "flops": total_flops(gm),
        "log": graph_info(gm).get("log", []),
        "origin": origin_of(gm),
        "trace": graph_info(gm).get("trace", {}),
        "summary": module_summary(gm, depth),
    }
    if groups:
        from ..analysis.coupling import analyze

        coupling = analyze(gm)
        report["groups"] = [
            dict(g.to_json(), blocked_by=coupling.why_frozen(g.id), norms_reached=coupling.norms_reached(g.id))
            for g in coupling.groups
        ]
    return report
