"""mutate on a model that cannot be captured whole: the passes grow its largest capturable part (capture/parts.py),
verified under the usual protocol; the grown part goes back into a copy of the whole model, which is compared with
the original in eval mode on its example input; the whole model is saved (io/part_file.py: rebuilt by its name on
load) and the part is exported to ONNX and checked on onnxruntime (the whole cannot be exported: torch.onnx.export
captures the model with torch.export, which is what failed)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torch import nn

from ..analysis.budget import check_onnx_memory
from ..capture.parts import Part, capture_part, captures_of_the_rest, check_whole, with_part
from ..core.errors import GraphgrowError, NotApplicable, TraceError, with_context
from ..io import part_file
from ..io.load import LoadedModel, custom_classes
from ..io.save import atomic_write
from .opening import OpenedModel, Progress, shape_report
from .pipeline import Pipeline
from .staging import StagedOutputs, _draw, _preservation_json, export_and_check


def grow_part(
    pipeline: Pipeline,
    opened: OpenedModel,
    source: str,
    paths: tuple[Path, Path | None, Path | None, Path | None],
    check: bool,
    provider: str,
    progress: Progress,
    dry_run: bool = False,
) -> dict:
    """workflow._grow_and_write for an opened part (opened.part set): grow, check the whole, save, export, check.
    `paths`: the model's output, the ONNX file's, the diagram's, and (for a default output name) the first of the
    fresh names to claim."""
    out_path, onnx_path, diagram, fresh = paths  # -o, --onnx, --diagram; a default -o's first free name from fresh
    part = opened.part
    if part is None:
        raise TraceError("internal: grow_part called on a model opened whole")
    timings: dict[str, float] = {}
    t = time.perf_counter()
    part, result, not_applicable = _run_on_parts(pipeline, part, opened.loaded.module, progress)
    timings["passes"] = time.perf_counter() - t
    progress(f"putting the grown '{part.path}' back into the whole model; comparing it with the original (eval mode)")
    t = time.perf_counter()
    whole = with_part(opened.loaded.module, part.path, result.gm)
    whole_check = check_whole(opened.loaded.module, whole, part.path, part.whole_spec)
    timings["whole_check"] = time.perf_counter() - t
    report: dict = {
        "model": source,
        **shape_report(part.whole_spec),
        "input_shape_inferred": None,
        "part": {**part.to_json(), "larger_parts_where_the_passes_do_not_apply": not_applicable},
        "part_note": part.summary(),
        "passes": [r.to_json() for r in result.results],
        "preservation": _preservation_json(result),
        "whole_check": whole_check,
        "outputs": [],
        "timings": timings,
    }
    if dry_run:
        report["dry_run"] = {"would_write": [str(p) for p in (out_path, onnx_path) if p is not None]}
        return report
    name = part_file.stored_name(opened.loaded.kind, source, opened.loaded.model_name)  # before anything is written
    if onnx_path or check:
        from ..io.export import wants_external

        limit = pipeline.limits.max_memory if pipeline.limits else None
        check_onnx_memory(result.gm, wants_external(result.gm, None, onnx_path), check, limit)
    with StagedOutputs() as staged:
        progress(f"saving {out_path} (the whole model; the grown part '{part.path}' as a stored graph)")
        staged_model = staged.reserve(out_path, fresh=fresh)
        atomic_write(
            staged_model,
            lambda tmp: part_file.save(
                tmp, name, part.path, result.gm, whole, part.whole_spec, opened.loaded.factory_seed
            ),
        )
        if onnx_path or check:
            report["onnx_note"] = (
                f"the ONNX file is the grown part '{part.path}' ({type(part.module).__name__}, input "
                f"{', '.join(map(repr, part.spec))}), not the whole model: the whole cannot be exported, since "
                "torch.onnx.export captures the model with torch.export, which cannot capture it"
            )
            part_opened = OpenedModel(LoadedModel(part.module, source, "part"), part.gm, part.spec, part=part)
            exported = export_and_check(
                result.gm,
                part_opened,
                staged.reserve(onnx_path) if onnx_path else None,
                check,
                provider,
                progress,
                timings,
            )
            if check:
                report["equivalence"] = exported["equivalence"]
        if check and not report["equivalence"]["passed"]:
            staged.discard()
            return report
        if diagram is not None:
            _draw(part.gm, result.gm, staged.reserve(diagram), diagram, f"{source}: {part.path}", progress)
        report["outputs"] = [str(p) for p in staged.commit()]
    custom = custom_classes(result.gm)
    if custom:
        report["trust_note"] = (
            f"reading {Path(report['outputs'][0]).name} back needs --trust: its part keeps modules of custom classes "
            f"whole ({', '.join(custom[:3])}); loading them runs that installed code"
        )
    return report


MAX_PARTS = 8  # parts a pipeline is tried on, largest first, while its passes do not apply (NotApplicable)


def _run_on_parts(pipeline: Pipeline, part: Part, model: nn.Module, progress: Progress) -> tuple[Part, Any, list[str]]:
    """The pipeline run on the part; where a pass does not apply there (NotApplicable: an MLP head has no conv for
    add_branch), on the next part that captures, largest first, up to MAX_PARTS: the part belongs to the pass's
    default place, and a default place is one where the pass applies (architecture.md §3). Returns the part it ran
    on, the result, and the larger parts where it did not apply, each with why. Where it applies to none, the
    refusal is the largest part's: said of every part of the model when the parts tried hold all its parameters (the
    pass grows parameters, so it has no place in the model), of those parts only otherwise."""
    count = len(pipeline.passes)
    refusals: list[tuple[Part, NotApplicable]] = []
    while True:
        try:
            result = pipeline.run(
                part.gm, progress=lambda i, p: progress(f"pass {i + 1}/{count}: {p.name} (+ verification)")
            )
            return part, result, [f"{tried.path}: {e.message[:300]}" for tried, e in refusals]
        except NotApplicable as e:
            refusals.append((part, e))
        if len(refusals) >= MAX_PARTS:
            raise _refusal(pipeline, model, refusals, "") from refusals[0][1]
        progress(f"the passes do not apply to the part '{part.path}': trying the next part that captures")
        inside = tuple(tried.path for tried, _ in refusals)
        try:
            part = capture_part(
                model, part.whole_spec, part.why_whole, pipeline_memory(pipeline), progress, part.path, inside
            )
        except TraceError:
            raise _refusal(pipeline, model, refusals, " (no other part captures)") from refusals[0][1]
        progress(part.summary())


def _refusal(
    pipeline: Pipeline, model: nn.Module, refusals: list[tuple[Part, NotApplicable]], why_last: str
) -> GraphgrowError:
    """The first part's refusal, said of the whole model when every parameter of it lies in a part tried or in a
    module that is not a part (called once per feature level, say) but whose capture on its first call the passes
    do not apply to either."""
    (first_part, first), paths = refusals[0], [tried.path for tried, _ in refusals]
    held = {id(p): p for tried, _ in refusals for p in tried.module.parameters()}  # a part within another counts once
    probed = []
    if sum(p.numel() for p in held.values()) < first_part.total:
        for path, gm in captures_of_the_rest(model, first_part.whole_spec, set(held), pipeline_memory(pipeline)):
            try:
                pipeline.run(gm)
                continue  # the passes apply there, but it is no part (called more than once): no place is not shown
            except NotApplicable:
                pass
            except GraphgrowError:
                continue
            probed.append(path)
            held.update({id(p): p for p in model.get_submodule(path).parameters()})
    count = sum(p.numel() for p in held.values())
    if count == first_part.total:
        named = ", ".join(f"'{p}'" for p in paths)
        also = f"; and the modules {', '.join(repr(p) for p in probed)}, captured on their first call" if probed else ""
        return with_context(
            first, f"in every part of the model that holds parameters ({named}{also}: all {count:,} of them)"
        )
    more = f" and {len(refusals) - 1} more that capture" if len(refusals) > 1 else ""
    return with_context(
        first,
        f"in the part '{paths[0]}'{more}{why_last}; {first_part.total - count:,} of the model's {first_part.total:,} "
        "parameters lie outside the parts that capture",
    )


def pipeline_memory(pipeline: Pipeline) -> int | None:
    return pipeline.limits.max_memory if pipeline.limits else None
