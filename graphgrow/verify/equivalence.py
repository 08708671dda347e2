"""torch vs onnxruntime: seeded inputs (one at another batch size), architecture.md §5 tolerances, a report.

With an input spec (named inputs, dtypes) the inputs are fed by name, every output leaf is compared
with the ONNX output of the same name (io/onnx_spec.py names them), and a model whose ONNX sequence
length is dynamic is also checked at a shorter length."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.errors import EquivalenceError
from ..core.protocol import flat_tensors
from ..core.state import no_tf32, training_mode
from ..graph.inputs import ExampleInput, InputSpec, as_spec, batch_of, call, is_positional
from ..graph.shapes import example_input
from ..io.onnx_spec import named_leaves, with_shorter_sequence
from ..io.runtime import Session

# (rtol, atol as a fraction of max|ref|). Not core.protocol's REL_TOL on purpose: that protocol compares two torch
# graphs on one runtime; this one compares onnxruntime's kernels with torch's, element by element, per provider
TOLERANCES = {"cpu": (1e-4, 1e-5), "cuda": (1e-3, 1e-4)}


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
    name: str = ""  # the ONNX output's name (`logits`, `hidden_states.0`)
    weight_noise: float | None = None  # max|Δ| PyTorch's output moves by when every weight moves by rtol (on a miss)


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

    @property
    def per_output(self) -> dict[str, float]:
        """Each output's largest absolute error over all inputs, by name (`#i` where it has none)."""
        out: dict[str, float] = {}
        for o in self.outputs:
            key = o.name or f"#{o.output}"
            out[key] = max(out.get(key, 0.0), o.max_abs)
        return out

    def to_json(self) -> dict:
        return {
            "provider": self.provider,
            "note": self.note,
            "reference": self.reference,
            "max_abs_err": self.max_abs_err,
            "max_rel_err": self.max_rel_err,
            "passed": self.passed,
            "per_output": self.per_output,
            "rtol": self.rtol,
            "atol": self.atol,
            "cases": [asdict(o) for o in self.outputs],
        }

    def table(self):
        from rich.table import Table

        t = Table(
            title=f"onnxruntime ({self.provider}) vs PyTorch ({self.reference}): "
            f"rtol {self.rtol:g}, atol {self.atol:g}·max|ref|"
        )
        for col in (
            "input",
            "output",
            "max abs",
            "mean abs",
            "p99 abs",
            "max rel",
            "cosine",
            "atol needed",
            "NaN/Inf",
            "ok",
        ):
            t.add_column(col, justify="left" if col in ("input", "output") else "right", no_wrap=True)
        for o in self.outputs:
            nan = "torch" if o.nan_torch else ("ort" if o.nan_ort else "-")
            t.add_row(
                o.case,
                f"{o.name or '#' + str(o.output)} {'×'.join(map(str, o.shape))}",
                f"{o.max_abs:.2e}",
                f"{o.mean_abs:.2e}",
                f"{o.p99_abs:.2e}",
                f"{o.max_rel:.2e}",
                f"{o.cosine:.8f}",
                f"{o.min_atol:.1e}",
                nan,
                ("[green]yes*[/]" if o.weight_noise is not None else "[green]yes[/]") if o.passed else "[red]NO[/]",
            )
        if any(o.weight_noise is not None for o in self.outputs):
            noise = max(o.weight_noise or 0.0 for o in self.outputs)
            t.caption = (
                f"* within what every weight moving by rtol moves PyTorch's output (max abs {noise:.2e}): "
                "errors relative to the summed terms, not to a cancelled output"
            )
        return t


def compare_arrays(
    ref: np.ndarray, got: np.ndarray, rtol: float, atol: float, case: str, index: int, name: str = ""
) -> OutputStats:
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    nan_ref, nan_got = not np.isfinite(ref64).all(), not np.isfinite(got64).all()
    if ref64.shape != got64.shape:
        return OutputStats(
            case,
            index,
            list(got.shape),
            float("inf"),
            float("inf"),
            float("inf"),
            float("inf"),
            0.0,
            float("inf"),
            nan_ref,
            nan_got,
            False,
            name,
        )
    diff = np.abs(ref64 - got64)
    scale = float(np.abs(ref64).max()) if ref64.size else 0.0
    rel = diff / np.maximum(np.abs(ref64), 1e-12 * max(scale, 1e-30))
    denom = np.linalg.norm(ref64) * np.linalg.norm(got64)
    cosine = float(np.dot(ref64.ravel(), got64.ravel()) / denom) if denom > 0 else float(np.array_equal(ref64, got64))
    excess = diff - rtol * np.abs(ref64)
    min_atol = float(max(excess.max(initial=0.0), 0.0) / scale) if scale > 0 else float(diff.max(initial=0.0))
    passed = not nan_ref and not nan_got and bool(np.all(diff <= atol * scale + rtol * np.abs(ref64)))
    return OutputStats(
        case,
        index,
        list(ref.shape),
        float(diff.max(initial=0)),
        float(diff.mean()) if diff.size else 0.0,
        float(np.percentile(diff, 99)) if diff.size else 0.0,
        float(rel.max(initial=0)),
        cosine,
        min_atol,
        nan_ref,
        nan_got,
        passed,
        name,
    )


def check_equivalence(
    model: torch.nn.Module,
    session: Session,
    input_shape: ExampleInput,
    seeds: Sequence[int] = (0, 1),
    other_batch: int = 3,
    reference: str = "grown model",
    raise_on_failure: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    noise_model: torch.nn.Module | None = None,
) -> EquivalenceReport:
    """Run seeded inputs through PyTorch (eval, TF32 off) and onnxruntime and compare every output.

    Inputs: one per seed at the example batch size, plus one at `other_batch`
    (the exported batch dimension is dynamic), plus, for an input spec whose sequence
    length the ONNX model keeps dynamic, one at a shorter length. `rtol`/`atol` replace
    the provider's tolerances. `noise_model`: the model whose weight noise judges a miss (default `model`): the grown
    model when `model` is the original it was grown from (the ONNX file computes the grown one's terms; a zero head's
    original has no terms at all).
    """
    input_shape = as_spec(input_shape, model)
    default_rtol, default_atol = TOLERANCES[session.provider]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    report = EquivalenceReport(session.provider, session.note, rtol, atol, reference=reference)
    next_seed = max(seeds, default=0) + 1
    cases: list[tuple[int, int, InputSpec]] = [(s, batch_of(input_shape), input_shape) for s in seeds] + [
        (next_seed, other_batch, input_shape)
    ]
    shorter = with_shorter_sequence(input_shape, {k: dict(enumerate(v)) for k, v in session.input_dims.items()})
    if shorter != input_shape:  # the ONNX model keeps a sequence length dynamic (a bare shape's keeps only the batch)
        cases.append((next_seed + 1, batch_of(input_shape), shorter))
    first_input, tie_cases = None, 0
    with torch.no_grad(), training_mode(model, False), no_tf32():
        for seed, batch, shape in cases:
            label = f"seed {seed}, batch {batch}" + (_lengths(shape, input_shape) if shape is not input_shape else "")
            x = example_input(model, shape, seed=seed, batch=batch)
            first_input = x if first_input is None else first_input
            by_name = not is_positional(input_shape)
            refs = _reference(call(model, x), session, label, by_name)
            got = session.run(feeds(x))
            if len(got) != len(refs):
                raise EquivalenceError(f"onnxruntime gives {len(got)} outputs, PyTorch {len(refs)} ({label})")
            stats = [
                compare_arrays(r, g, rtol, atol, label, i, name) for i, ((name, r), g) in enumerate(zip(refs, got))
            ]
            tie_order: Any = contextlib.nullcontext()
            if not all(o.passed for o in stats) and _topk_ties(model, x).tied:
                # PyTorch leaves the order among tied values unspecified, ONNX's TopK takes the lower index first:
                # PyTorch again with that order (one its topk allows) is the reference the export must match
                tie_order, tie_cases = _LowerIndexTopk(), tie_cases + 1
                with tie_order:
                    refs = _reference(call(model, x), session, label, by_name)
                stats = [
                    compare_arrays(r, g, rtol, atol, label, i, name) for i, ((name, r), g) in enumerate(zip(refs, got))
                ]
            if not all(o.passed for o in stats):
                with tie_order:
                    _judge_by_weight_noise(noise_model or model, x, session, label, by_name, refs, stats, rtol)
            report.outputs += stats
    if tie_cases:
        report.note = (report.note + "; " if report.note else "") + (
            f"a topk meets tied values on {tie_cases} check input(s): PyTorch's reference takes them by the lower "
            "index, as ONNX's TopK does (an order PyTorch's topk allows)"
        )
    if not report.passed and first_input is not None:
        _refuse_tied_selection(model, first_input, session.provider)
    if raise_on_failure and not report.passed:
        worst = max(report.outputs, key=lambda o: o.min_atol)
        raise EquivalenceError(
            f"onnxruntime ({session.provider}) and PyTorch disagree: max abs error {report.max_abs_err:.3g}, "
            f"would need atol {worst.min_atol:.2g}·max|ref| at rtol {rtol:g}"
            + (f" (output {worst.name})" if worst.name else ""),
            "see the report table; the exporter may have mistranslated an op",
        )
    return report


WEIGHT_NOISE_DRAWS = 3  # one random direction can move an output little by chance; the largest of three is judged


def _judge_by_weight_noise(
    model: torch.nn.Module,
    x: Any,
    session: Session,
    label: str,
    by_name: bool,
    refs: list[tuple[str, np.ndarray]],
    stats: list[OutputStats],
    rtol: float,
) -> None:
    """Judge the outputs that missed the element-wise tolerance by the same rtol applied where float32 rounds: the
    operands. PyTorch runs again with every floating parameter scaled by (1 + rtol·u), u uniform in [-1, 1]
    (seeded, three draws); an output passes when onnxruntime is no further from PyTorch than those runs moved it.

    Why: rounding errors are relative to the terms a result is summed from, not to the result. An output that is a
    cancelled sum (an untrained classifier's logits ~0.1 from features ~5) turns errors of a few 1e-6 of every
    intermediate into 1e-4 of itself: BiT (13 GroupNorms over 100k values, which onnxruntime's float32 reductions
    sum ~10x less accurately than torch's) agreed to 4e-6 of each conv's and norm's max and missed by 1.2e-4 on
    its logits. A mistranslated op moves intermediates by their own size, far beyond any weight noise of 1e-4."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not params:
        return
    g = torch.Generator().manual_seed(0)
    kept = [p.detach().clone() for p in params]
    noise = [0.0] * len(stats)
    refs = _reference(call(model, x), session, label, by_name)  # `model`'s own output: the noise is its movement
    try:
        for _ in range(WEIGHT_NOISE_DRAWS):
            with torch.no_grad():
                for p, k in zip(params, kept):
                    p.copy_(k * (1 + rtol * (2 * torch.rand(p.shape, generator=g, dtype=p.dtype) - 1)))
                moved = _reference(call(model, x), session, label, by_name)
            for i, ((_, r), (_, m)) in enumerate(zip(refs, moved)):
                if r.shape == m.shape:
                    noise[i] = max(noise[i], float(np.abs(m.astype(np.float64) - r).max(initial=0.0)))
    finally:
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.copy_(k)
    for o, n in zip(stats, noise):
        if not (o.passed or o.nan_torch or o.nan_ort):
            o.weight_noise = n
            o.passed = o.max_abs <= n


class TiedSelection(EquivalenceError):
    """The model selects among tied values (topk at a tie), where PyTorch and ONNX may pick differently: the two
    runtimes cannot be compared on it. A stated refusal (exit 2), not a failed check."""

    exit_code = 2


def _topk_ties(model: torch.nn.Module, x: Any) -> _TopkTies:
    """The model's topk calls on `x` (eval mode), and how many meet tied values at their k-th place."""
    watch = _TopkTies()
    with torch.no_grad(), training_mode(model, False), watch:
        call(model, x)
    return watch


def _refuse_tied_selection(model: torch.nn.Module, x: Any, provider: str) -> None:
    """TiedSelection when a topk of the model meets tied values at its k-th place on `x` and onnxruntime matched
    neither PyTorch's own order nor the lower-index one (_LowerIndexTopk). ONNX's TopK takes the lower index first
    among equal values; PyTorch leaves the order unspecified (its CPU kernel picked experts 2, 3 of four tied router
    scores where onnxruntime picked 0, 1: AFMoE's zero-initialised router)."""
    watch = _topk_ties(model, x)
    if watch.tied:
        raise TiedSelection(
            f"onnxruntime ({provider}) and PyTorch cannot be compared on this model: a topk meets tied values at its "
            f"k-th place on the check input ({watch.tied} of {watch.calls} topk calls), and ONNX's TopK breaks ties "
            "by the lower index where PyTorch's order is unspecified (e.g. a router whose weights are all zero)",
            "initialise or train the weights that tie (the router), then export again; the ONNX graph itself "
            "follows the model",
        )


class _LowerIndexTopk(TorchDispatchMode):
    """aten.topk with tied values taken by the lower index first (a stable sort), as ONNX's TopK does: one of the
    results PyTorch's topk may give, since it leaves the order among equal values unspecified."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten.topk.default:
            return func(*args, **kwargs)
        x, k = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        ordered = torch.sort(x, dim=dim, descending=largest, stable=True)
        return ordered.values.narrow(dim, 0, k), ordered.indices.narrow(dim, 0, k)


class _TopkTies(TorchDispatchMode):
    """Counts aten.topk calls whose k-th and (k+1)-th values (in the order asked) are equal somewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.tied = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten.topk.default:
            x, k = args[0], args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
            self.calls += 1
            if x.dim() and 0 < k < x.shape[dim]:
                ordered = x.sort(dim=dim, descending=largest).values
                self.tied += bool((ordered.narrow(dim, k - 1, 1) == ordered.narrow(dim, k, 1)).any())
        return out


def _lengths(shape: InputSpec, example: InputSpec) -> str:
    """The case label of a shorter run: the halved sizes (`, sequence 8`, or `, sizes 1×3×8` for other inputs)."""
    changed = [(t, e) for t, e in zip(shape, example) if t.shape != e.shape]
    if all(len(t.shape) == 2 for t, _ in changed):
        return f", sequence {'/'.join(map(str, sorted({t.shape[1] for t, _ in changed})))}"
    return ", sizes " + "/".join("×".join(map(str, t.shape)) for t, _ in changed)


def feeds(x: Any) -> Any:
    """An example input as onnxruntime takes it: one array, or arrays by input name (floats as float32, integers
    kept)."""
    if isinstance(x, dict):
        return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().numpy() for k, v in x.items()}
    return (x.detach().float() if x.is_floating_point() else x.detach()).cpu().numpy()


def _reference(out: Any, session: Session, label: str, by_name: bool) -> list[tuple[str, np.ndarray]]:
    """PyTorch's output leaves as arrays, in the ONNX outputs' order: by name for a spec's export (whose
    outputs are named after the keys), else in pytree order (then named after the ONNX outputs)."""
    onnx_names = session.output_names
    if by_name:
        leaves = [(n, t.detach().float().cpu().numpy()) for n, t in named_leaves(out)]
        index = dict(leaves)
        if len(index) == len(leaves) == len(onnx_names) and set(index) == set(onnx_names):
            return [(n, index[n]) for n in onnx_names]
        if len(leaves) != len(onnx_names):
            raise EquivalenceError(
                f"onnxruntime gives {len(onnx_names)} outputs ({', '.join(onnx_names[:8])}), "
                f"PyTorch {len(leaves)} ({', '.join(n for n, _ in leaves[:8])}) ({label})"
            )
    refs = [t.detach().float().cpu().numpy() for t in flat_tensors(out)]
    names = onnx_names if len(onnx_names) == len(refs) else [""] * len(refs)
    return list(zip(names, refs))


def first_divergence(
    model: torch.nn.Module, proto, input_shape: ExampleInput, rtol: float, atol: float, external_folder=None
) -> dict | None:
    """The first module, in the ONNX graph's order, whose output differs between onnxruntime (CPU)
    and PyTorch on the seed-0 input: the last ONNX node of each module's scope is that module's output.
    None when every module output that can be compared agrees."""
    from ..io.export import node_module
    from ..io.runtime import all_values

    input_shape = as_spec(input_shape, model)
    x = example_input(model, input_shape, seed=0, batch=batch_of(input_shape))
    recorded: dict[str, torch.Tensor] = {}

    def keep(path: str, out) -> None:
        tensors = flat_tensors(out)
        if tensors:
            recorded[path] = tensors[0]

    hooks = [
        m.register_forward_hook(lambda mod, inp, out, path=path: keep(path, out))
        for path, m in model.named_modules()
        if path
    ]
    try:
        with torch.no_grad(), training_mode(model, False), no_tf32():
            call(model, x)
    finally:
        for h in hooks:
            h.remove()
    values = all_values(proto, feeds(x), external_folder)
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
            return {
                "node": node.name,  # type: ignore[attr-defined]
                "op": node.op_type,  # type: ignore[attr-defined]
                "module": path,
                "max_abs_err": stats.max_abs,
                "max_rel_err": stats.max_rel,
            }
    return None
