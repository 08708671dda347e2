"""torch vs onnxruntime: seeded inputs (one at another batch size), DESIGN §5 tolerances, a report."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..core.errors import EquivalenceError
from .preserve import flat_tensors
from ..io.runtime import Session
from ..graph.shapes import example_input
from ..core.state import no_tf32, training_mode

TOLERANCES = {"cpu": (1e-4, 1e-5), "cuda": (1e-3, 1e-4)}  # (rtol, atol as a fraction of max|ref|)


@dataclass
class OutputStats:
    case: str  # "seed 0, batch 1"
    output: int
    shape: list[int]
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    cosine: float
    min_atol: float  # smallest atol (fraction of max|ref|) that passes at this rtol
    nan_torch: bool
    nan_ort: bool
    passed: bool


@dataclass
class EquivalenceReport:
    provider: str
    note: str
    rtol: float
    atol: float
    outputs: list[OutputStats] = field(default_factory=list)
    reference: str = "grown model"

    @property
    def passed(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def max_abs_err(self) -> float:
        return max((o.max_abs for o in self.outputs), default=float("nan"))

    @property
    def max_rel_err(self) -> float:
        return max((o.max_rel for o in self.outputs), default=float("nan"))

    def to_json(self) -> dict:
        return {
            "provider": self.provider, "note": self.note, "reference": self.reference,
            "max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err, "passed": self.passed,
            "rtol": self.rtol, "atol": self.atol, "cases": [asdict(o) for o in self.outputs],
        }

    def table(self):
        from rich.table import Table

        t = Table(title=f"onnxruntime ({self.provider}) vs PyTorch ({self.reference}): rtol {self.rtol:g}, atol {self.atol:g}·max|ref|")
        for col in ("input", "output", "max abs", "mean abs", "p99 abs", "max rel", "cosine", "atol needed", "NaN/Inf", "ok"):
            t.add_column(col, justify="left" if col in ("input", "output") else "right", no_wrap=True)
        for o in self.outputs:
            nan = "torch" if o.nan_torch else ("ort" if o.nan_ort else "-")
            t.add_row(o.case, f"#{o.output} {'×'.join(map(str, o.shape))}", f"{o.max_abs:.2e}", f"{o.mean_abs:.2e}",
                      f"{o.p99_abs:.2e}", f"{o.max_rel:.2e}", f"{o.cosine:.8f}", f"{o.min_atol:.1e}", nan,
                      "[green]yes[/]" if o.passed else "[red]NO[/]")
        return t


def compare_arrays(ref: np.ndarray, got: np.ndarray, rtol: float, atol: float, case: str, index: int) -> OutputStats:
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    nan_ref, nan_got = not np.isfinite(ref64).all(), not np.isfinite(got64).all()
    if ref64.shape != got64.shape:
        return OutputStats(case, index, list(got.shape), float("inf"), float("inf"), float("inf"), float("inf"), 0.0,
                           float("inf"), nan_ref, nan_got, False)
    diff = np.abs(ref64 - got64)
    scale = float(np.abs(ref64).max()) if ref64.size else 0.0
    rel = diff / np.maximum(np.abs(ref64), 1e-12 * max(scale, 1e-30))
    denom = np.linalg.norm(ref64) * np.linalg.norm(got64)
    cosine = float(np.dot(ref64.ravel(), got64.ravel()) / denom) if denom > 0 else float(np.array_equal(ref64, got64))
    excess = diff - rtol * np.abs(ref64)
    min_atol = float(max(excess.max(initial=0.0), 0.0) / scale) if scale > 0 else float(diff.max(initial=0.0))
    passed = (not nan_ref and not nan_got and bool(np.all(diff <= atol * scale + rtol * np.abs(ref64))))
    return OutputStats(case, index, list(ref.shape), float(diff.max(initial=0)), float(diff.mean()) if diff.size else 0.0,
                       float(np.percentile(diff, 99)) if diff.size else 0.0, float(rel.max(initial=0)), cosine,
                       min_atol, nan_ref, nan_got, passed)


def check_equivalence(model: torch.nn.Module, session: Session, input_shape: Sequence[int],
                      seeds: Sequence[int] = (0, 1), other_batch: int = 3, reference: str = "grown model",
                      raise_on_failure: bool = False, rtol: float | None = None, atol: float | None = None) -> EquivalenceReport:
    """Run seeded inputs through PyTorch (eval, TF32 off) and onnxruntime and compare every output.

    Inputs: one per seed at the example batch size, plus one at `other_batch`
    (the exported batch dimension is dynamic). `rtol`/`atol` replace the provider's tolerances.
    """
    default_rtol, default_atol = TOLERANCES[session.provider]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    report = EquivalenceReport(session.provider, session.note, rtol, atol, reference=reference)
    cases = [(s, int(input_shape[0])) for s in seeds] + [(max(seeds, default=0) + 1, other_batch)]
    with torch.no_grad(), training_mode(model, False), no_tf32():
        for seed, batch in cases:
            x = example_input(model, input_shape, seed=seed, batch=batch)
            refs = [t.detach().float().cpu().numpy() for t in flat_tensors(model(x))]
            got = session.run(x.detach().float().cpu().numpy())
            label = f"seed {seed}, batch {batch}"
            if len(got) != len(refs):
                raise EquivalenceError(f"onnxruntime gives {len(got)} outputs, PyTorch {len(refs)} ({label})")
            report.outputs += [compare_arrays(r, g, rtol, atol, label, i) for i, (r, g) in enumerate(zip(refs, got))]
    if raise_on_failure and not report.passed:
        worst = max(report.outputs, key=lambda o: o.min_atol)
        raise EquivalenceError(
            f"onnxruntime ({session.provider}) and PyTorch disagree: max abs error {report.max_abs_err:.3g}, "
            f"would need atol {worst.min_atol:.2g}·max|ref| at rtol {rtol:g}",
            "see the report table; the exporter may have mistranslated an op",
        )
    return report


def first_divergence(model: torch.nn.Module, proto, input_shape: Sequence[int], rtol: float, atol: float) -> dict | None:
    """The first module, in the ONNX graph's order, whose output differs between onnxruntime (CPU)
    and PyTorch on the seed-0 input: the last ONNX node of each module's scope is that module's output.
    None when every module output that can be compared agrees."""
    from ..io.export import node_module
    from ..io.runtime import all_values

    x = example_input(model, input_shape, seed=0, batch=int(input_shape[0]))
    recorded: dict[str, torch.Tensor] = {}

    def keep(path: str, out) -> None:
        tensors = flat_tensors(out)
        if tensors:
            recorded[path] = tensors[0]

    hooks = [m.register_forward_hook(lambda mod, inp, out, path=path: keep(path, out))
             for path, m in model.named_modules() if path]
    try:
        with torch.no_grad(), training_mode(model, False), no_tf32():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    values = all_values(proto, x.detach().float().cpu().numpy())
    last: dict[str, object] = {}
    for node in proto.graph.node:
        path = node_module(node)
        if path in recorded:
            last.pop(path, None)
            last[path] = node  # re-inserted: the order is that of each module's last node
    for path, node in last.items():
        ref, got = recorded[path], values.get(node.output[0])  # type: ignore[attr-defined]
        if got is None or tuple(ref.shape) != got.shape:
            continue
        stats = compare_arrays(ref.detach().float().cpu().numpy(), got, rtol, atol, "seed 0", 0)
        if not stats.passed:
            return {"node": node.name, "op": node.op_type, "module": path, "max_abs_err": stats.max_abs,  # type: ignore[attr-defined]
                    "max_rel_err": stats.max_rel}
    return None
