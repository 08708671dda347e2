"""What a growth job writes and reports, shared by workflow.py (a model captured whole) and part_growth.py (a model
grown inside a part): outputs staged and renamed together (StagedOutputs), the ONNX export and its onnxruntime check,
the preservation summary and the diagram of a change."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from torch import fx

from ..io import outputs
from .inspection import provenance
from .opening import OpenedModel, Progress
from .pipeline import PipelineResult


def _draw(
    before: fx.GraphModule, after: fx.GraphModule, tmp: Path, final: Path, title: str, progress: Progress
) -> None:
    from .diagram import draw

    progress(f"drawing {final}")
    draw(before, after, tmp, title, fmt=final.suffix)


class StagedOutputs:
    """Staging files beside each final output (outputs.staging_file); `commit` renames them all, anything
    else removes them.

    A failure or a signal (SIGINT, SIGTERM, SIGHUP: the CLI turns them into exceptions) part-way
    through a command leaves neither a half-written file nor some outputs without the others: the
    renames run with those signals held (outputs.commit). A write that fails is SaveError.
    """

    def __init__(self) -> None:
        self.staged: list[tuple[Path, Path]] = []
        self.fresh: dict[Path, Path] = {}

    def reserve(self, final: Path, fresh: Path | None = None) -> Path:
        """A staging file for `final`; `fresh`: `final` is a name graphgrow chose, and the output goes to the first
        free name from `fresh` on, claimed at the commit (outputs.claim)."""
        final = Path(final)
        try:
            tmp = outputs.staging_file(final, "part")
        except OSError as e:
            raise outputs.write_error(final, e) from e
        self.staged.append((tmp, final))
        if fresh is not None:
            self.fresh[final] = fresh
        return tmp

    def commit(self) -> list[Path]:
        staged, self.staged = self.staged, []
        try:
            return outputs.commit(staged, self.fresh)
        except BaseException:
            self.staged = [(tmp, final) for tmp, final in staged if tmp.exists()]  # those not renamed are removed
            raise

    def discard(self) -> None:
        for tmp, _ in self.staged:
            outputs.discard(tmp)
        self.staged = []

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, *exc) -> Literal[False]:
        self.discard()
        return False


def export_and_check(
    gm: fx.GraphModule,
    opened: OpenedModel,
    onnx_path: Path | None,
    check: bool,
    provider: str,
    progress: Progress,
    timings: dict,
) -> dict:
    from ..io.export import export_onnx
    from ..io.onnx_external import external_folder, written
    from ..io.runtime import max_ir_version, open_session
    from ..verify.equivalence import check_equivalence

    progress("exporting to ONNX (torch.onnx.export, then the ONNX checker)")
    t = time.perf_counter()
    proto = export_onnx(
        gm, opened.input_shape, onnx_path, metadata=provenance(opened.loaded), max_ir_version=max_ir_version()
    )
    timings["export"] = time.perf_counter() - t
    result: dict = {"outputs": [str(p) for p in written(proto, onnx_path)] if onnx_path else []}
    if check:
        progress("checking onnxruntime against PyTorch")
        t = time.perf_counter()
        session = open_session(proto.SerializeToString(), provider, external_folder=external_folder(proto, onnx_path))
        grown = check_equivalence(gm, session, opened.input_shape, reference="grown model")
        original = check_equivalence(
            opened.loaded.module, session, opened.input_shape, reference="original model", noise_model=gm
        )
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
