"""The jobs behind the CLI, as functions: open a model, mutate, export, check, inspect.

Each returns plain data (the CLI formats it) and raises GraphgrowError subclasses.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import fx, nn

from .errors import InputError, LoadError, ValidationError
from .load import LoadedModel, check_output_path, default_output_path, load_model, save_model
from .pipeline import Pipeline, PipelineResult
from .shapes import annotate, param_count, total_flops
from .trace import graph_info, trace

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


def parse_input_shape(text: str | Sequence[int] | None) -> list[int] | None:
    """'1,3,224,224' (or 1x3x224x224) → [1, 3, 224, 224]; InputError on anything else."""
    if text is None:
        return None
    if isinstance(text, str):
        parts = [p for p in re.split(r"[,\s]+|(?<=\d)[x×](?=\d)", text.strip()) if p]
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise InputError(f"--input-shape {text!r} is not a list of integers", "write it as N,C,H,W, e.g. 1,3,224,224") from None
    else:
        dims = [int(d) for d in text]
    if not dims or any(d <= 0 for d in dims) or len(dims) > 8:
        raise InputError(f"--input-shape {text!r} is not a valid shape (positive sizes, 1 to 8 dims)", "e.g. 1,3,224,224")
    if dims[0] > 4096 or (torch.Size(dims).numel() > 2**31):
        raise InputError(f"--input-shape {text!r} is too large for an example input", "use batch 1 and the real image size")
    return dims


def infer_input_shape(gm: fx.GraphModule) -> list[int] | None:
    """The example input shape when the first layer fixes it (a Linear or Embedding-free MLP); else None."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise InputError(f"the model takes {len(placeholders)} inputs; graphgrow supports one input tensor for now",
                         "wrap the model so that forward takes a single tensor")
    for user in placeholders[0].users:
        if user.op == "call_module" and isinstance(gm.get_submodule(user.target), nn.Linear):
            return [1, gm.get_submodule(user.target).in_features]
    return None


def _first_layer(gm: fx.GraphModule) -> str:
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    for user in ph.users:
        if user.op == "call_module":
            return f"{user.target} ({gm.get_submodule(user.target)})"
    return "unknown"


@dataclass
class OpenedModel:
    loaded: LoadedModel
    gm: fx.GraphModule
    input_shape: list[int]


def open_model(source: str, input_shape=None, trust: bool = False, leaves: Sequence[str] = (),
               progress: Progress = _noop) -> OpenedModel:
    """Load (safely), trace, and annotate shapes. The example input shape comes from
    the argument, the file (graphgrow outputs remember it) or the first layer."""
    progress(f"loading {source}")
    loaded = load_model(source, trust=trust)
    shape = parse_input_shape(input_shape) or loaded.input_shape
    progress("tracing")
    gm = trace(loaded.module, shape, leaves)
    if shape is None:
        shape = infer_input_shape(gm)
        if shape is None:
            raise InputError(
                f"cannot tell the example input shape of {source}: its first layer is {_first_layer(gm)}",
                "pass --input-shape N,C,H,W (e.g. 1,3,224,224)",
            )
        graph_info(gm)["input_shape"] = shape
    else:
        infer_input_shape(gm)  # still refuses multi-input models clearly
    _check_finite(loaded.module, source)
    progress("propagating shapes")
    try:
        annotate(gm, shape)
    except ValidationError as e:
        raise InputError(f"the model cannot run on an input of shape {tuple(shape)}: {e.message}",
                         "give the shape the model expects with --input-shape N,C,H,W") from e
    return OpenedModel(loaded, gm, shape)


def _check_finite(model: nn.Module, source: str) -> None:
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise LoadError(f"{source} has NaN or Inf values in '{name}'",
                            "graphgrow will not grow or export a broken model; fix or re-initialise those weights")


def mutate(source: str, specs: Sequence[str], out: str | None = None, onnx_out: str | None = None,
           check: bool = False, input_shape=None, provider: str = "auto", trust: bool = False,
           leaves: Sequence[str] = (), seed: int = 0, progress: Progress = _noop) -> dict:
    """Load → run the pipeline with verification → save → (export) → (check). Returns the JSON report."""
    pipeline = Pipeline.from_spec(list(specs), seed=seed)  # spec errors before any work
    out_path = check_output_path(out or default_output_path(source), inputs=(source,))
    onnx_path = check_output_path(onnx_out, inputs=(source,)) if onnx_out else None
    opened = open_model(source, input_shape, trust, leaves, progress)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    result = pipeline.run(opened.gm, progress=lambda i, p: progress(f"pass {i + 1}/{len(pipeline.passes)}: {p.name} (+ verification)"))
    timings["passes"] = time.perf_counter() - t
    report = {
        "model": source,
        "input_shape": opened.input_shape,
        "passes": [_pass_json(r) for r in result.results],
        "preservation": _preservation_json(result),
        "outputs": [],
        "timings": timings,
    }
    progress(f"saving {out_path}")
    save_model(result.gm, out_path, inputs=(source,))
    report["outputs"].append(str(out_path))
    if onnx_path or check:
        exported = export_and_check(result.gm, opened, onnx_path, check, provider, progress, timings)
        report["outputs"] += exported["outputs"]
        if check:
            report["equivalence"] = exported["equivalence"]
    return report


def export_and_check(gm: fx.GraphModule, opened: OpenedModel, onnx_path: Path | None, check: bool, provider: str,
                     progress: Progress, timings: dict) -> dict:
    from .equivalence import check_equivalence
    from .export import export_onnx
    from .runtime import max_ir_version, open_session

    progress("exporting to ONNX")
    t = time.perf_counter()
    proto = export_onnx(gm, opened.input_shape, onnx_path, max_ir_version=max_ir_version())
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
        result["reports"] = (grown, original)
    return result


def _pass_json(r) -> dict:
    d = r.to_json()
    d["targets"] = d.pop("targets")
    return d


def _preservation_json(result: PipelineResult) -> dict:
    reports = [r.preservation for r in result.results if r.preservation is not None]
    return {
        "max_rel_err": max((p.max_rel_err for p in reports), default=0.0),
        "eval_ok": all(p.eval.ok for p in reports),
        "train_ok": all(p.train.ok for p in reports),
        "trainable_ok": all(p.trainable_ok for p in reports),
        "verified_passes": len(reports),
    }


def export(source: str, out: str, input_shape=None, trust: bool = False, leaves: Sequence[str] = (),
           progress: Progress = _noop) -> dict:
    from .export import export_onnx
    from .runtime import max_ir_version

    out_path = check_output_path(out, inputs=(source,))
    opened = open_model(source, input_shape, trust, leaves, progress)
    progress("exporting to ONNX")
    t = time.perf_counter()
    proto = export_onnx(opened.gm, opened.input_shape, out_path, max_ir_version=max_ir_version())
    return {"model": source, "input_shape": opened.input_shape, "outputs": [str(out_path)],
            "ir_version": proto.ir_version, "opset": [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")][:1],
            "log": json.loads(next((p.value for p in proto.metadata_props if p.key == "graphgrow.mutation_log"), "[]")),
            "timings": {"export": time.perf_counter() - t}}


def check(onnx_file: str, source: str, input_shape=None, provider: str = "auto", trust: bool = False,
          leaves: Sequence[str] = (), progress: Progress = _noop):
    """onnxruntime on `onnx_file` vs PyTorch on the model `source`. Returns (json, report)."""
    from .equivalence import check_equivalence
    from .export import load_onnx
    from .runtime import open_session

    proto = load_onnx(onnx_file)
    shape = parse_input_shape(input_shape) or _onnx_input_shape(proto)
    opened = open_model(source, shape, trust, leaves, progress)
    progress("checking onnxruntime against PyTorch")
    session = open_session(str(onnx_file), provider)
    report = check_equivalence(opened.gm, session, opened.input_shape, reference=source)
    return {"onnx": str(onnx_file), "model": source, "equivalence": report.to_json()}, report


def _onnx_input_shape(proto) -> list[int] | None:
    """The example shape from the ONNX input (dynamic dims → 1), or from graphgrow's metadata."""
    for p in proto.metadata_props:
        if p.key == "graphgrow.input_shape":
            return json.loads(p.value)
    if not proto.graph.input:
        return None
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    return [d.dim_value if d.dim_value > 0 else 1 for d in dims] or None


def inspect(source: str, input_shape=None, trust: bool = False, leaves: Sequence[str] = (),
            progress: Progress = _noop) -> dict:
    opened = open_model(source, input_shape, trust, leaves, progress)
    gm = opened.gm
    nodes = []
    for n in gm.graph.nodes:
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if n.op == "call_module":
            target = f"{n.target}: {type(gm.get_submodule(n.target)).__name__}"
        nodes.append({"name": n.name, "op": n.op, "target": target, "shape": n.meta.get("gg_shape"),
                      "params": n.meta.get("gg_params", 0), "flops": n.meta.get("gg_flops", 0)})
    return {"model": source, "input_shape": opened.input_shape, "nodes": nodes, "params": param_count(gm),
            "flops": total_flops(gm), "log": graph_info(gm).get("log", [])}
