"""The jobs behind the CLI, as functions: open a model, mutate, export, check, inspect.

Each returns plain data (the CLI formats it) and raises GraphgrowError subclasses.
"""
from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np
import torch
from torch import fx, nn

from .errors import InputError, LoadError, SaveError, SpecError, ValidationError
from .load import (
    FACTORY_SEED, LoadedModel, check_output_path, default_output_path, is_factory_name, load_model, plain_output_path, save_model,
)
from .pass_base import Candidate
from .pipeline import Pipeline, PipelineResult, parse_spec
from .shapes import annotate, param_count, total_flops
from .trace import graph_info, trace

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


MAX_INPUT_ELEMENTS = 1 << 26  # 256 MiB of float32 for one example input; verification makes a few more
MAX_SIDE = 1 << 16


def parse_input_shape(text: str | Sequence[int] | None) -> list[int] | None:
    """'1,3,224,224' (or 1x3x224x224) → [1, 3, 224, 224]; InputError on anything else."""
    if text is None:
        return None
    if isinstance(text, str):
        parts = [p for p in re.split(r"[,\s]+|(?<=\d)[x×](?=\d)", text.strip()) if p]
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise InputError(f"--input-shape {text[:80]!r} is not a list of integers", "write it as N,C,H,W, e.g. 1,3,224,224") from None
    else:
        dims = [int(d) for d in text]
    if not dims or any(d <= 0 for d in dims) or len(dims) > 8:
        raise InputError(f"--input-shape {str(text)[:80]!r} is not a valid shape (positive sizes, 1 to 8 dims)", "e.g. 1,3,224,224")
    if dims[0] > 4096 or any(d > MAX_SIDE for d in dims) or torch.Size(dims).numel() > MAX_INPUT_ELEMENTS:
        raise InputError(f"input shape {str(text)[:80]!r} is too large for an example input "
                         f"(at most {MAX_INPUT_ELEMENTS:,} elements, {MAX_SIDE:,} per dimension)",
                         "use batch 1 and the real image size")
    return dims


def infer_input_shape(gm: fx.GraphModule) -> tuple[list[int] | None, str]:
    """The example input shape when the model itself fixes it, with how it was found.

    A first Linear fixes (1, in_features). A first conv fixes the channels; a
    Flatten → Linear with no adaptive pooling before it fixes the spatial size,
    found by a binary search over square sizes on the meta device (no compute).
    A model that accepts any size (global pooling) has no one shape: (None, why).
    """
    require_single_input(gm)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    first = next((u for u in placeholder.users if u.op == "call_module"), None)
    layer = gm.get_submodule(first.target) if first is not None else None
    if isinstance(layer, nn.Linear):
        return [1, layer.in_features], f"from the first layer {first.target}: Linear({layer.in_features}→…)"
    if not isinstance(layer, nn.modules.conv._ConvNd):
        return None, "the first layer does not fix the input shape"
    dims = layer.weight.dim() - 2
    channels = layer.in_channels
    flat_linear = _flatten_then_linear(gm)
    if flat_linear is None:
        return None, f"{first.target} ({type(layer).__name__}, {channels} channels) takes any image size"
    flat, lin = flat_linear
    want = gm.get_submodule(lin.target).in_features
    meta = copy.deepcopy(gm).to("meta").eval()

    def flat_size(side: int) -> int | None:
        return _meta_numel(meta, flat.name, [1, channels] + [side] * dims)

    def first_side(at_least: int) -> int:  # smallest side whose flattened size reaches `at_least`
        lo, hi = 1, 4096
        while lo < hi:
            mid = (lo + hi) // 2
            n = flat_size(mid)
            if n is None or n < at_least:
                lo = mid + 1
            else:
                hi = mid
        return lo

    where = f"the Linear {lin.target} after {flat.name} takes {want} features"
    smallest = first_side(want)
    if flat_size(smallest) != want:
        return None, f"{where}, which no square input gives"
    largest = first_side(want + 1) - 1
    side = "×".join([str(largest)] * dims)
    if largest != smallest:
        # Strided layers round down, so several sizes fit; the largest is the one every stride divides evenly.
        return [1, channels] + [largest] * dims, (f"{where}; square sides {smallest} to {largest} all give that, "
                                                  f"using {side}, which strides divide evenly (--input-shape to choose)")
    return [1, channels] + [largest] * dims, f"{where}, which only a square {side} input gives"


def _flatten_then_linear(gm: fx.GraphModule):
    """The first (flatten node, Linear node) pair, unless adaptive pooling comes before it."""
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d,
                                                                            nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d)):
            return None
        if n.op == "call_function" and "adaptive" in getattr(n.target, "__name__", ""):
            return None
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear):
            src = n.args[0] if n.args else None
            is_flat = isinstance(src, fx.Node) and (
                (src.op == "call_module" and isinstance(gm.get_submodule(src.target), nn.Flatten))
                or (src.op == "call_function" and src.target is torch.flatten)
                or (src.op == "call_method" and src.target in ("flatten", "view", "reshape")))
            return (src, n) if is_flat else None
    return None


def _meta_numel(meta: fx.GraphModule, node_name: str, shape: list[int]) -> int | None:
    """numel of a node's output for an input of `shape`, running `meta` (a meta-device copy): no compute."""
    seen: dict = {}

    class Stop(Exception):
        pass

    class Probe(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.name == node_name:
                seen["numel"] = out.numel()
                raise Stop
            return out

    try:
        Probe(meta).run(torch.empty(shape, device="meta"))
    except Stop:
        return seen["numel"]
    except Exception:
        return None
    return None


def require_single_input(gm: fx.GraphModule) -> None:
    """Refuse models with several inputs clearly, also when the shape was given."""
    count = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if count != 1:
        raise InputError(f"the model takes {count} inputs; graphgrow supports one input tensor for now",
                         "wrap the model so that forward takes a single tensor")


@dataclass
class OpenedModel:
    loaded: LoadedModel
    gm: fx.GraphModule
    input_shape: list[int]
    inferred_from: str | None = None  # how the input shape was inferred, when it was not given


def open_model(source: str, input_shape=None, trust: bool = False, leaves: Sequence[str] = (),
               progress: Progress = _noop, trace_mode: str = "eval", max_memory: int | None = None,
               factory_seed: int = FACTORY_SEED) -> OpenedModel:
    """Load (safely), trace, check the trace against the model, and annotate shapes. The
    example input shape comes from the argument, the file (graphgrow outputs remember
    it) or the first layer."""
    progress(f"loading {source}")
    loaded = load_model(source, trust=trust, factory_seed=factory_seed)
    shape = parse_input_shape(input_shape if input_shape is not None else loaded.input_shape)  # flag or stored: one check
    progress("tracing")
    gm = trace(loaded.module, shape, leaves, mode=trace_mode, check=False)  # fidelity checked below, once the shape is known
    if shape is None:
        shape, why = infer_input_shape(gm)
        if shape is None:
            raise InputError(
                f"cannot tell the example input shape of {source}: {why}",
                "pass --input-shape N,C,H,W (e.g. 1,3,224,224)",
            )
        progress(f"input shape {'×'.join(map(str, shape))} inferred: {why}")
        graph_info(gm)["input_shape"] = shape
        inferred = why
    else:
        require_single_input(gm)
        inferred = None
    _check_finite(loaded.module, source)
    from .budget import DEFAULT_MAX_MEMORY, check_input_memory

    check_input_memory(gm, shape, max_memory or DEFAULT_MAX_MEMORY)  # on the meta device, before any real forward
    progress("propagating shapes")
    try:
        annotate(gm, shape)
    except ValidationError as e:
        raise InputError(f"the model cannot run on an input of shape {tuple(shape)}: {e.message}",
                         "give the shape the model expects with --input-shape N,C,H,W") from e
    if loaded.kind != "graphgrow":  # a graphgrow file's graph is the model; anything else is checked against it
        from .fidelity import check_fidelity

        progress("checking the traced graph against the model (eval and train mode)")
        check_fidelity(loaded.module, gm, shape)
    return OpenedModel(loaded, gm, shape, inferred)


def _check_finite(model: nn.Module, source: str) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise LoadError(f"{source} has NaN or Inf values in '{name}'",
                            "graphgrow will not grow or export a broken model; fix or re-initialise those weights")


def mutate(source: str, specs: Sequence[str], out: str | None = None, onnx_out: str | None = None,
           check: bool = False, input_shape=None, provider: str = "auto", trust: bool = False,
           leaves: Sequence[str] = (), seed: int = 0, progress: Progress = _noop, trace_mode: str = "eval",
           max_params=None, max_memory=None, suffix: str = ".grown.pt", dry_run: bool = False) -> dict:
    """Load → run the pipeline with verification → save → (export) → (check). Returns the JSON report.
    Without `out` the result goes beside the model as NAME`suffix`. `dry_run`: the passes run and are
    verified, nothing is written (the report says where it would have gone)."""
    pipeline = Pipeline.from_spec(list(specs), seed=seed)  # spec errors before any work
    pipeline.limits = _limits(max_params, max_memory)
    out_path = check_output_path(out or default_output_path(source, suffix), inputs=(source,))
    onnx_path = check_output_path(onnx_out, inputs=(source,)) if onnx_out else None
    _distinct_outputs(out_path, onnx_path)
    opened = open_model(source, input_shape, trust, leaves, progress, trace_mode, pipeline.limits.max_memory)
    report = _grow_and_write(pipeline, opened, source, (source,), out_path, onnx_path, check, provider, progress, "pass",
                             dry_run=dry_run)
    plain = plain_output_path(source, suffix)
    if out is None and out_path != plain:
        report["output_note"] = f"{plain} already exists: the result went to {out_path.name} (give -o to choose the name)"
    return report


def _limits(max_params, max_memory):
    from .budget import DEFAULT_MAX_MEMORY, DEFAULT_MAX_NEW_PARAMS, Limits, parse_size

    return Limits(parse_size(max_params, "--max-params") if max_params is not None else DEFAULT_MAX_NEW_PARAMS,
                  parse_size(max_memory, "--max-memory") if max_memory is not None else DEFAULT_MAX_MEMORY)


def _distinct_outputs(*paths: Path | None) -> None:
    real = [Path(p).resolve() for p in paths if p is not None]
    if len(set(real)) != len(real):
        raise SaveError("-o and --onnx name the same file", "give the model and the ONNX file different names")


def _grow_and_write(pipeline: Pipeline, opened: OpenedModel, source: str, inputs: tuple, out_path: Path,
                    onnx_path: Path | None, check: bool, provider: str, progress: Progress, verb: str,
                    dry_run: bool = False) -> dict:
    """Run `pipeline` on the opened model, save the result, export and check it when asked (not when `dry_run`)."""
    timings: dict[str, float] = {}
    t = time.perf_counter()
    count = len(pipeline.passes)
    result = pipeline.run(opened.gm, progress=lambda i, p: progress(f"{verb} {i + 1}/{count}: {p.name} (+ verification)"))
    timings["passes"] = time.perf_counter() - t
    report: dict = {
        "model": source,
        "input_shape": opened.input_shape,
        "input_shape_inferred": opened.inferred_from,
        "passes": [r.to_json() for r in result.results],
        "preservation": _preservation_json(result),
        "outputs": [],
        "timings": timings,
    }
    if dry_run:
        report["dry_run"] = {"would_write": [str(p) for p in (out_path, onnx_path) if p is not None]}
        return report
    with StagedOutputs() as staged:  # every output appears at the end, together, or none does
        progress(f"saving {out_path}")
        save_model(result.gm, staged.reserve(out_path), inputs=inputs)
        if onnx_path or check:
            exported = export_and_check(result.gm, opened, staged.reserve(onnx_path) if onnx_path else None, check,
                                        provider, progress, timings)
            if check:
                report["equivalence"] = exported["equivalence"]
        if check and not report["equivalence"]["passed"]:
            staged.discard()  # a model that failed its check is not written
            return report
        report["outputs"] = [str(p) for p in staged.commit()]
    return report


class StagedOutputs:
    """Temp files beside each final output; `commit` renames them all, anything else removes them.

    A failure or a signal (SIGINT, SIGTERM, SIGHUP: the CLI turns them into exceptions) part-way
    through a command leaves neither a half-written file nor some outputs without the others.
    """

    def __init__(self) -> None:
        self.staged: list[tuple[Path, Path]] = []

    def reserve(self, final: Path) -> Path:
        final = Path(final)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".part", dir=final.parent if str(final.parent) else ".")
        os.close(fd)
        self.staged.append((Path(tmp), final))
        return Path(tmp)

    def commit(self) -> list[Path]:
        done = []
        for tmp, final in self.staged:
            os.replace(tmp, final)
            done.append(final)
        self.staged = []
        return done

    def discard(self) -> None:
        for tmp, _ in self.staged:
            tmp.unlink(missing_ok=True)
        self.staged = []

    def __enter__(self) -> "StagedOutputs":
        return self

    def __exit__(self, *exc) -> Literal[False]:
        self.discard()
        return False


def export_and_check(gm: fx.GraphModule, opened: OpenedModel, onnx_path: Path | None, check: bool, provider: str,
                     progress: Progress, timings: dict) -> dict:
    from .equivalence import check_equivalence
    from .export import export_onnx
    from .runtime import max_ir_version, open_session

    progress("exporting to ONNX (torch.onnx.export, then the ONNX checker)")
    t = time.perf_counter()
    proto = export_onnx(gm, opened.input_shape, onnx_path, metadata=provenance(opened.loaded), max_ir_version=max_ir_version())
    timings["export"] = time.perf_counter() - t
    result: dict = {"outputs": [str(onnx_path)] if onnx_path else []}
    if check:
        progress("checking onnxruntime against PyTorch")
        t = time.perf_counter()
        session = open_session(proto.SerializeToString(), provider)
        grown = check_equivalence(gm, session, opened.input_shape, reference="grown model")
        original = check_equivalence(opened.loaded.module, session, opened.input_shape, reference="original model")
        timings["check"] = time.perf_counter() - t
        result["equivalence"] = {
            **grown.to_json(),
            "passed": grown.passed and original.passed,
            "vs_original": original.to_json(),
        }
    return result


def _preservation_json(result: PipelineResult) -> dict:
    reports = [r.preservation for r in result.results if r.preservation is not None]
    return {
        "max_rel_err": max((p.max_rel_err for p in reports), default=0.0),
        "eval_ok": all(p.eval.ok for p in reports),
        "train_ok": all(p.train.ok for p in reports if p.train is not None),
        "trainable_ok": all(p.trainable_ok for p in reports),
        "verified_passes": len(reports),
    }


def replay(source: str, log_source: str, out: str | None = None, onnx_out: str | None = None, check: bool = False,
           input_shape=None, provider: str = "auto", trust: bool = False, leaves: Sequence[str] = (),
           progress: Progress = _noop, trace_mode: str = "eval",
           max_params=None, max_memory=None) -> dict:
    """Re-apply the mutation log of `log_source` (a graphgrow .pt or an exported .onnx) to the model `source`."""
    from .pipeline import from_log

    log, grown_shape = _read_log(log_source, trust)
    pipeline = from_log(log)
    pipeline.limits = _limits(max_params, max_memory)
    inputs = (source, log_source)
    out_path = check_output_path(out or default_output_path(source, ".replayed.pt"), inputs=inputs)
    onnx_path = check_output_path(onnx_out, inputs=inputs) if onnx_out else None
    _distinct_outputs(out_path, onnx_path)
    opened = open_model(source, input_shape or grown_shape, trust, leaves, progress, trace_mode, pipeline.limits.max_memory)
    report = _grow_and_write(pipeline, opened, source, inputs, out_path, onnx_path, check, provider, progress, "replaying")
    report["log_from"] = log_source
    return report


def _read_log(log_source: str, trust: bool) -> tuple[list[dict], list[int] | None]:
    """The mutation log and example input shape stored in a graphgrow .pt or an exported .onnx."""
    if str(log_source).endswith(".onnx"):
        from .export import load_onnx, mutation_log

        proto = load_onnx(log_source)
        return mutation_log(proto), _onnx_input_shape(proto)
    loaded = load_model(log_source, trust=trust)
    if loaded.kind != "graphgrow":
        raise LoadError(f"{log_source} has no mutation log (it was not written by graphgrow)",
                        "pass a file that graphgrow mutate wrote, or its exported .onnx")
    return loaded.log, loaded.input_shape


def targets(source: str, spec: str, input_shape=None, trust: bool = False, leaves: Sequence[str] = (),
            progress: Progress = _noop, trace_mode: str = "eval") -> dict:
    """Where one pass (its other arguments as given in `spec`) can apply, with what each place would add."""
    from .pipeline import build_pipeline, spec_of

    passes = build_pipeline(spec)
    if len(passes) != 1:
        raise SpecError(f"targets lists the places of one pass, got {len(passes)}", "give one pass, e.g. --pass add_branch")
    p = passes[0]
    opened = open_model(source, input_shape, trust, leaves, progress, trace_mode)
    progress(f"finding where {p.name} can apply")
    found = p.candidates(opened.gm)
    total = param_count(opened.gm)
    given = parse_spec(spec_of(p))[0][1]
    return {"model": source, "pass": p.name, "params": total, "input_shape": opened.input_shape,
            "candidates": [{"spec": Candidate({**given, **c.args}, c.where, c.params).spec(p.name), "where": c.where,
                            "params": c.params, "fraction": c.params / max(total, 1), "default": c.default} for c in found]}


def provenance(loaded: LoadedModel) -> dict[str, str]:
    """ONNX metadata that lets `check` rebuild the same reference: a factory's name and weight seed."""
    from .export import FACTORY_SEED_KEY, SOURCE_KEY

    if loaded.kind != "factory" or loaded.factory_seed is None:
        return {}
    return {SOURCE_KEY: loaded.source, FACTORY_SEED_KEY: str(loaded.factory_seed)}


def export(source: str, out: str, input_shape=None, trust: bool = False, leaves: Sequence[str] = (),
           progress: Progress = _noop, trace_mode: str = "eval", fold: bool = False, opset: int | None = None) -> dict:
    """Export the model to ONNX; with `fold`, through the `fold` transform first (verified, logged)."""
    from .export import export_onnx, mutation_log
    from .runtime import max_ir_version

    out_path = check_output_path(out, inputs=(source,))
    if opset is not None and not MIN_OPSET <= opset <= MAX_OPSET:
        raise InputError(f"--opset {opset} is outside what the exporter writes ({MIN_OPSET}–{MAX_OPSET})",
                         "leave it out for the exporter's default")
    opened = open_model(source, input_shape, trust, leaves, progress, trace_mode)
    gm = opened.gm
    folded = None
    if fold:
        progress("folding (+ verification)")
        folded = Pipeline.from_spec("fold").run(gm).results[0]
        gm = folded.gm
    progress("exporting to ONNX (torch.onnx.export, then the ONNX checker)")
    t = time.perf_counter()
    proto = export_onnx(gm, opened.input_shape, out_path, metadata=provenance(opened.loaded),
                        max_ir_version=max_ir_version(), opset=opset)
    return {"model": source, "input_shape": opened.input_shape, "outputs": [str(out_path)],
            "fold": folded.to_json() if folded is not None else None,
            "ir_version": proto.ir_version, "opset": [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")][:1],
            "log": mutation_log(proto),
            "timings": {"export": time.perf_counter() - t}}


MIN_OPSET, MAX_OPSET = 18, 23  # the dynamo exporter writes opset 18 and newer


def check(onnx_file: str, source: str, input_shape=None, provider: str = "auto", trust: bool = False,
          leaves: Sequence[str] = (), progress: Progress = _noop, trace_mode: str = "eval", seed: int | None = None,
          rtol: float | None = None, atol: float | None = None):
    """onnxruntime on `onnx_file` vs PyTorch on the model `source`. Returns (json, report).

    A factory name builds random weights: they are the exported ones only when built with the
    seed the export recorded (or `seed`); without either the comparison would be meaningless, so
    it is refused."""
    from .equivalence import check_equivalence
    from .export import FACTORY_SEED_KEY, SOURCE_KEY, load_onnx, metadata
    from .runtime import open_session

    proto = load_onnx(onnx_file)
    shape = parse_input_shape(input_shape) or _onnx_input_shape(proto)
    meta = metadata(proto)
    factory_seed = FACTORY_SEED
    if is_factory_name(source):
        recorded = meta.get(FACTORY_SEED_KEY)
        if seed is None and recorded is None:
            raise InputError(f"{onnx_file} does not record how its weights were made, and {source} builds new random "
                             "weights each time: the two could not agree",
                             "compare against the model file it was exported from, or pass --seed N if you know "
                             "the seed the factory was built with")
        factory_seed = seed if seed is not None else int(recorded)  # type: ignore[arg-type]
    opened = open_model(source, shape, trust, leaves, progress, trace_mode, factory_seed=factory_seed)
    progress("checking onnxruntime against PyTorch")
    session = open_session(str(onnx_file), provider)
    report = check_equivalence(opened.gm, session, opened.input_shape, reference=source, rtol=rtol, atol=atol)
    out: dict = {"onnx": str(onnx_file), "model": source, "equivalence": report.to_json()}
    if is_factory_name(source):
        out["factory_seed"] = factory_seed
    if meta.get(SOURCE_KEY) not in (None, source):
        out["note"] = f"{onnx_file} was exported from {meta[SOURCE_KEY]}, not {source}"
    return out, report


def _onnx_input_shape(proto) -> list[int] | None:
    """The example shape from the ONNX input (dynamic dims → 1), or from graphgrow's metadata."""
    from .export import INPUT_SHAPE_KEY, metadata

    stored = metadata(proto).get(INPUT_SHAPE_KEY)
    if stored:
        return json.loads(stored)
    if not proto.graph.input:
        return None
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    return [d.dim_value if d.dim_value > 0 else 1 for d in dims] or None


def inspect_onnx(path: str) -> dict:
    """An exported ONNX file: inputs, outputs, op histogram, parameters, graphgrow's metadata and mutation log."""
    import collections

    import onnx

    from .export import INPUT_SHAPE_KEY, LOG_KEY, load_onnx, metadata, mutation_log

    proto = load_onnx(path)

    def dims(value_info) -> list:
        return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]

    def elem(value_info) -> str:
        return onnx.TensorProto.DataType.Name(value_info.type.tensor_type.elem_type).lower()

    meta = metadata(proto)
    params = sum(int(np.prod(t.dims)) for t in proto.graph.initializer)
    return {
        "model": path, "format": "onnx", "ir_version": proto.ir_version,
        "opset": [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")][:1],
        "producer": f"{proto.producer_name} {proto.producer_version}".strip(),
        "inputs": [{"name": i.name, "shape": dims(i), "dtype": elem(i)} for i in proto.graph.input],
        "outputs": [{"name": o.name, "shape": dims(o), "dtype": elem(o)} for o in proto.graph.output],
        "nodes": len(proto.graph.node), "ops": dict(collections.Counter(n.op_type for n in proto.graph.node).most_common()),
        "params": params, "input_shape": json.loads(meta[INPUT_SHAPE_KEY]) if INPUT_SHAPE_KEY in meta else None,
        "log": mutation_log(proto),
        "metadata": {k: v for k, v in meta.items() if k != LOG_KEY},
    }


def inspect(source: str, input_shape=None, trust: bool = False, leaves: Sequence[str] = (),
            progress: Progress = _noop, groups: bool = False, trace_mode: str = "eval") -> dict:
    if str(source).lower().endswith(".onnx") and Path(source).is_file():
        if groups:
            raise InputError("--groups needs the PyTorch model (channel groups are a graph analysis)",
                             "inspect the .pt file the ONNX model was exported from")
        progress(f"reading {source}")
        return inspect_onnx(str(source))
    opened = open_model(source, input_shape, trust, leaves, progress, trace_mode)
    gm = opened.gm
    nodes = []
    for n in gm.graph.nodes:
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if n.op == "call_module":
            target = f"{n.target}: {type(gm.get_submodule(n.target)).__name__}"
        nodes.append({"name": n.name, "op": n.op, "target": target, "shape": n.meta.get("gg_shape"),
                      "params": n.meta.get("gg_params", 0), "flops": n.meta.get("gg_flops", 0)})
    report = {"model": source, "input_shape": opened.input_shape, "nodes": nodes, "params": param_count(gm),
              "flops": total_flops(gm), "log": graph_info(gm).get("log", []), "trace": graph_info(gm).get("trace", {})}
    if groups:
        from .coupling import analyze

        coupling = analyze(gm)
        report["groups"] = [dict(g.to_json(), blocked_by=coupling.why_frozen(g.id), norms_reached=coupling.norms_reached(g.id))
                            for g in coupling.groups]
    return report
