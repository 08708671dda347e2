"""Growth inside a captured part of a model that cannot be captured whole (architecture.md §3, tracing.md).

A detection model's forward loops over a list of images and its post-processing has sizes that follow the data
(boolean masks, nonzero, NMS): neither torch.fx nor torch.export captures it whole. Its parts often capture: the
backbone, a box head. Here the whole model is run once in eval mode on its example input with forward hooks on every
submodule (graph/calls.py), and the part is chosen by what is capturable and how much of the model it holds:

- a candidate is a submodule called exactly once in that run (a part grown for one call is verified on that call),
  holding parameters, whose arguments are tensors only (positional, or by keyword when the forward names them);
- candidates are tried largest first by parameter count (an outer module before its child at a tie); the first one
  that captures (trace(): fx, or torch.export) on the shapes and dtypes it actually received, and whose capture
  matches it in eval and train mode (capture.fidelity), is the part;
- none capturing is a TraceError naming why the whole could not be captured and why each candidate tried could not.

The part's GraphModule is what a pass grows. `with_part` puts a grown part back into a copy of the whole model, and
`check_whole` compares the whole model before and after in eval mode on its example input: the part's output on the
input it receives there and the whole model's outputs (detections), each to the protocol's tolerance (§5).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import GraphgrowError, PreservationError, TraceError, first_line
from ..core.protocol import compare_outputs, flat_tensors
from ..core.state import preserved_buffers, seeded, training_mode
from ..graph.calls import ArgSig, Calls, record_calls, record_outputs
from ..graph.inputs import InputSpec, TensorSpec, call, plain_spec, shown
from ..graph.shapes import example_input

MAX_TRIES = 8  # candidates captured at most, largest first: each failed try costs a capture attempt
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
}


@dataclass
class Part:
    """The captured part a pass grows: its module path in the whole model, the module, the example input it
    receives there, its checked capture, and why it was chosen."""

    path: str
    module: nn.Module
    spec: InputSpec
    gm: fx.GraphModule
    params: int
    total: int  # the whole model's parameters
    why_whole: str  # why the whole model could not be captured
    passed_over: list[str] = field(default_factory=list)  # larger candidates, each with why it is not the part
    whole_spec: InputSpec = ()  # the whole model's example input
    after: str | None = None  # the larger part this one was taken after (a pass did not apply there)

    @property
    def share(self) -> float:
        return self.params / self.total if self.total else 0.0

    def summary(self) -> str:
        """One line for the CLI: which part and why."""
        return (
            f"growing inside the part '{self.path}' ({type(self.module).__name__}, {self.params:,} of the model's "
            f"{self.total:,} parameters, {self.share:.0%}; input {shown(self.spec)}): the whole model cannot be "
            f"captured ({self.why_whole[:300]}), and '{self.path}' is the largest submodule that captures "
            "faithfully on the input it receives"
            + (f" after '{self.after}', where the passes do not apply" if self.after else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "class": type(self.module).__name__,
            "parameters": self.params,
            "model_parameters": self.total,
            "share": round(self.share, 4),
            "inputs": [t.record() for t in self.spec],
            "why_whole_not_captured": self.why_whole,
            "larger_candidates_passed_over": self.passed_over,
            "rule": "the largest submodule (by parameters) called once, on tensors only, that captures faithfully",
        }


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def part_spec(module: nn.Module, calls: Calls) -> tuple[InputSpec | None, str]:
    """The example input a submodule received as an input spec (shapes and dtypes), or None and why it cannot be
    one: a non-tensor argument, an unknown dtype, more arguments than the forward names."""
    try:
        params = [
            p
            for p in inspect.signature(module.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
    except (TypeError, ValueError):
        return None, "its forward's signature cannot be read"
    given: list[tuple[str, ArgSig]] = []
    for i, sig in enumerate(calls.args):
        if i >= len(params) or params[i].kind == params[i].KEYWORD_ONLY:
            return None, "it takes more positional arguments than its forward names"
        given.append((params[i].name, sig))
    given += list(calls.kwargs.items())
    if not given:
        return None, "it receives no input"
    for name, sig in given:
        if not sig.is_tensor:
            return None, f"its argument {name} is a {sig.kind}, not a tensor"
        if sig.dtype not in _DTYPE_NAMES or not sig.shape:
            return None, f"its argument {name} is a {sig.dtype} tensor of shape {sig.shape}"
    if len(given) == 1 and not calls.kwargs and given[0][0] == params[0].name:
        name, sig = given[0]
        return plain_spec(list(sig.shape or ()), name=name, dtype=_DTYPE_NAMES[sig.dtype]), ""  # type: ignore[index]
    specs = tuple(TensorSpec(name, tuple(sig.shape or ()), _DTYPE_NAMES[sig.dtype]) for name, sig in given)  # type: ignore[index]
    return specs, ""


def whole_input(model: nn.Module, spec: InputSpec) -> Any:
    """The whole model's seeded example input (the one every check here runs on)."""
    return example_input(model, spec, seed=0)


def _run_eval(x: Any) -> Callable[[nn.Module], Any]:
    def run(m: nn.Module) -> Any:
        with torch.no_grad(), training_mode(m, False), preserved_buffers(m), seeded(0):
            return call(m, x)

    return run


def find_calls(model: nn.Module, spec: InputSpec, max_memory: int | None = None) -> dict[str, Calls]:
    """Every submodule's calls in one eval run of the whole model on its example input, held to `max_memory` (each
    allocation sized before it happens)."""
    from ..core.allocation import AllocationGuard

    x = whole_input(model, spec)
    guard = AllocationGuard(max_memory) if max_memory is not None else None
    try:
        if guard is None:
            calls, _ = record_calls(model, _run_eval(x))
        else:
            with guard:
                calls, _ = record_calls(model, _run_eval(x))
    except GraphgrowError:
        raise
    except Exception as e:
        if guard is not None and guard.refusal is not None:
            raise TraceError(
                f"{type(model).__name__} needs more than --max-memory on {shown(spec)} to run once: {first_line(e)}",
                "raise --max-memory or give a smaller --input-shape",
            ) from e
        raise TraceError(
            f"{type(model).__name__} cannot run on its example input {shown(spec)}: {first_line(e)}",
            "give the input the model expects: --input-shape N,C,H,W",
        ) from e
    return calls


def candidates(model: nn.Module, calls: dict[str, Calls]) -> tuple[list[tuple[str, nn.Module, int, InputSpec]], list]:
    """Submodules that may be a part, largest first (parameters; an outer module first at a tie), with their input
    specs; and those passed over as [path, why] (largest first too, the ten largest)."""
    found, skipped = [], []
    for path, sub in model.named_modules():
        if not path:
            continue
        n = _count(sub)
        if n == 0:
            continue
        rec = calls.get(path)
        if rec is None or rec.count != 1:
            why = "it is not called" if rec is None else f"it is called {rec.count} times"
            skipped.append((n, path, why))
            continue
        spec, why = part_spec(sub, rec)
        if spec is None:
            skipped.append((n, path, why))
            continue
        found.append((path, sub, n, spec))
    found.sort(key=lambda c: (-c[2], c[0].count(".")))
    skipped.sort(key=lambda s: (-s[0], s[1].count(".")))
    return found, [[p, w] for _, p, w in skipped[:10]]


def capture_part(
    model: nn.Module,
    spec: InputSpec,
    why_whole: str,
    max_memory: int | None = None,
    progress: Callable[[str], None] = lambda _: None,
    after: str | None = None,
    not_inside: tuple[str, ...] = (),
) -> Part:
    """The largest submodule of `model` that captures faithfully on what it receives (module docstring); TraceError
    when none does, naming why the whole and each candidate could not be captured. `after`: the next such part after
    that one in the same order (a pass that does not apply to one part is tried on the next: jobs/part_growth.py), none
    inside the parts `not_inside` (a pass that does not apply to a part does not apply to a piece of it)."""
    from ..analysis.budget import check_input_memory
    from ..graph.shapes import annotate
    from .fidelity import check_fidelity
    from .trace import trace

    progress("the whole model cannot be captured: looking for the largest part that can (one eval run, hooks)")
    calls = find_calls(model, spec, max_memory)
    found, _skipped = candidates(model, calls)
    if after is not None:
        paths = [f[0] for f in found]
        found = found[paths.index(after) + 1 :] if after in paths else []
    found = [f for f in found if not any(f[0].startswith(p + ".") for p in not_inside)]
    total = _count(model)
    passed_over: list[str] = []
    for path, sub, n, pspec in found[:MAX_TRIES]:
        progress(f"capturing the part '{path}' ({n:,} parameters) on {shown(pspec)}")
        try:
            gm = trace(sub, pspec, check=False)
            check_input_memory(gm, pspec, max_memory)
            annotate(gm, pspec)
            check_fidelity(sub, gm, pspec)
        except GraphgrowError as e:
            passed_over.append(f"{path}: {first_line(e.message, 200)}")
            continue
        return Part(path, sub, pspec, gm, n, total, why_whole, passed_over, spec, after)
    none = "no other submodule holding parameters" if after else "no submodule holding parameters"
    tried = "; ".join(passed_over[:4]) or f"{none} is called once on tensors only"
    raise TraceError(
        f"{type(model).__name__} cannot be captured whole ({first_line(why_whole, 300)}), and no part of it captures "
        f"either ({tried[:600]})",
        "grow a submodule in Python (graphgrow.trace(model.PART, its input shape)), or make the forward capturable",
    )


def captures_of_the_rest(
    model: nn.Module, spec: InputSpec, held: set[int], max_memory: int | None = None
) -> list[tuple[str, fx.GraphModule]]:
    """Captures of the submodules holding the parameters outside `held` (ids of parameters), largest first, each on
    the input of its first call (a module called once per feature level, such as a detection head, included: the
    captures serve to ask whether a pass has a place there, never to grow); none inside another. Those that do not
    capture are left out (their parameters stay outside). At most MAX_TRIES captures are tried."""
    from .trace import trace

    calls = find_calls(model, spec, max_memory)
    found: list[tuple[str, fx.GraphModule]] = []
    tried: set[int] = set(held)
    order = sorted(
        ((p, m) for p, m in model.named_modules() if p and p in calls), key=lambda c: (-_count(c[1]), c[0].count("."))
    )
    attempts = 0
    for path, sub in order:
        own = [q for q in sub.parameters() if id(q) not in tried]
        if not own or attempts >= MAX_TRIES:
            continue
        pspec, _ = part_spec(sub, calls[path])
        if pspec is None:
            continue
        attempts += 1
        try:
            gm = trace(sub, pspec, check=False)
        except GraphgrowError:
            continue
        found.append((path, gm))
        tried |= {id(q) for q in sub.parameters()}
    return found


def with_part(model: nn.Module, path: str, part: nn.Module) -> nn.Module:
    """A copy of the whole model with the submodule at `path` replaced by `part` (the model is not modified)."""
    whole = copy.deepcopy(model)
    parent_path, _, name = path.rpartition(".")
    parent = whole.get_submodule(parent_path) if parent_path else whole
    parent._modules[name] = part  # a numbered child of a Sequential or ModuleList too
    return whole


def check_whole(original: nn.Module, grown: nn.Module, path: str, spec: InputSpec) -> dict[str, Any]:
    """The whole model before and after, in eval mode on its seeded example input: the part's output on the input
    it receives there, and every output of the whole model (detections), each to the protocol's tolerance.
    PreservationError when either differs; the report otherwise."""
    x = whole_input(original, spec)
    part_old, out_old = record_outputs(original, [path], _run_eval(x))
    part_new, out_new = record_outputs(grown, [path], _run_eval(x))
    report: dict[str, Any] = {"mode": "eval", "input": shown(spec)}
    for what, old, new in (
        ("the part's output", part_old.get(path), part_new.get(path)),
        ("outputs", out_old, out_new),
    ):
        try:
            check = compare_outputs(old, new, "eval")
        except PreservationError as e:
            raise PreservationError(
                f"the whole model's {what} changed after growing '{path}' (eval mode): {e.message}",
                "report it: the part was verified alone, so the model around it reads it differently",
            ) from e
        if not check.ok:
            raise PreservationError(
                f"the whole model's {what} changed after growing '{path}' (eval mode): rel err {check.rel_err:.3g}, "
                f"max |Δ| {check.max_abs_err:.3g}",
                "report it: the part was verified alone, so the model around it reads it differently",
            )
        key = "part" if what.startswith("the part") else "whole"
        report[key] = {"rel_err": check.rel_err, "max_abs_err": check.max_abs_err, "values": _values(new)}
    report["passed"] = True
    return report


def _values(out: Any) -> int:
    return sum(t.numel() for t in flat_tensors(out))
