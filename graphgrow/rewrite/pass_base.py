"""The pass contract (architecture.md §3): frozen dataclass passes, PassResult, verify after each."""

from __future__ import annotations

import dataclasses
import functools
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx

from ..analysis.budget import Limits, check_grown, pass_allocations
from ..analysis.targets import Candidate
from ..core.errors import InputError, SpecError, ValidationError
from ..core.protocol import ModeCheck
from ..graph.fx_edit import Rewrite, finish, sharing_parameters
from ..graph.graph_meta import graph_info, input_spec_of
from ..graph.inline import inline_containers
from ..graph.shapes import annotate, param_count, total_flops
from ..io.lineage import record_origin
from ..verify.preserve import PreservationReport
from ..verify.verify import annotation_input, verify
from .arguments import Allowed, PassFunction, allowed_values, arg, check_arguments, pass_function
from .contract import Guarantee, Requirement

__all__ = ["Pass", "PassResult", "arg", "pass_function", "Requirement", "Guarantee", "require_traced"]


@dataclass
class PassResult:
    """A verified (or unverified, when asked) pass application."""

    gm: fx.GraphModule
    changed: bool
    name: str
    args: dict[str, Any]
    targets: dict[str, Any]
    notes: list[str]
    nodes_added: list[str]
    nodes_removed: list[str]
    params_before: int
    params_after: int
    flops_before: int
    flops_after: int
    seed: int
    seconds: float
    preservation: PreservationReport | None = None
    exact: bool = True  # False when the pass changed the function on purpose (allow_narrowing, allow_change)
    modules_added: list[str] = dataclasses.field(
        default_factory=list
    )  # new top-level modules (stages.graphgrow_modules)

    def log_entry(self) -> dict:
        """What goes into the mutation log (saved with the model and into ONNX metadata)."""
        return {
            "pass": self.name,
            "args": {k: _named(v) for k, v in self.args.items()},
            "seed": self.seed,
            "targets": _plain(self.targets),
            "params_before": self.params_before,
            "params_after": self.params_after,
            "flops_before": self.flops_before,
            "flops_after": self.flops_after,
            "nodes_added": len(self.nodes_added),
            "nodes_removed": len(self.nodes_removed),
            "exact": self.exact,
            "modules_added": self.modules_added,
        }

    def to_json(self) -> dict:
        d = {"name": self.name, **self.log_entry()}
        d.update(
            notes=self.notes,
            nodes_added=self.nodes_added,
            nodes_removed=self.nodes_removed,
            changed=self.changed,
            seconds=round(self.seconds, 4),
        )
        if self.preservation is not None:
            d["preservation"] = self.preservation.to_json()
        return d

    def summary(self) -> str:
        lines = [f"{self.name}({', '.join(f'{k}={v}' for k, v in self.args.items() if v is not None)})"]
        for k, v in self.targets.items():
            lines.append(f"  {k}: {v}")
        lines.append(f"  nodes: +{len(self.nodes_added)} −{len(self.nodes_removed)}")
        lines.append(f"  params: {self.params_before:,} → {self.params_after:,}")
        lines.append(f"  FLOPs/example: {self.flops_before:,} → {self.flops_after:,}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _named(value: Any) -> Any:
    """A pass argument as the log keeps it: a function given in Python (gradmax's `data`) by its import name,
    never the object — a log holding a function could not be loaded without running code."""
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', type(value).__name__)}"
    return value


def _plain(value: Any) -> Any:
    """JSON-friendly copy of a targets dict (tuples → lists, other objects → str)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class Pass:
    """Base of all passes. Subclasses are frozen dataclasses; every field has a default.

    Set `function` to the pass's plain function, which works on a copy and takes the fields
    as keyword arguments plus `generator` (or override `apply(gm, generator) -> Rewrite`);
    decorated with `@pass_function`, it gives its arguments no defaults: a call that leaves one out
    gets the default declared here. Declare each argument once, with `arg(default, help, ...)`
    (and what values it allows: arguments.py); values are checked when the pass is constructed
    (SpecError). `requires`/`ensures` declare what the pass needs of its input graph and promises of
    its result (contract.py). `name` is the CLI name; the class docstring's first line is the
    one-line help shown by `graphgrow passes`.
    """

    name: ClassVar[str] = ""
    grows: ClassVar[bool] = True  # False for transforms that never add parameters (fold): no size estimate first
    function: ClassVar[Callable[..., Rewrite] | None] = None  # the plain function: function(gm, **fields, generator=g)
    requires: ClassVar[tuple[Requirement, ...]] = ()  # checked before the pass runs: NotApplicable with the reason
    ensures: ClassVar[tuple[Guarantee, ...]] = ()  # checked after it changed the graph: ValidationError (a bug)

    def __post_init__(self) -> None:
        check_arguments(self)  # bad values are refused here: a spec is checked before any model is loaded
        found = self.conflict()
        if found is not None:
            argument, why, hint = found
            raise SpecError(f"{self.name}({argument}=...): {why}", hint, argument=argument)

    def conflict(self) -> tuple[str, str, str] | None:
        """A rule over several arguments that no model can satisfy (add_branch: init=gradmax aims one branch, so
        count=1): (the argument to point at, why, what to do), or None. Checked with the values, at parse time;
        override it only for such rules (what depends on the model is the pass's NotApplicable)."""
        return None

    def check_requires(self, gm: fx.GraphModule) -> None:
        """NotApplicable unless every requirement of this pass holds on `gm`."""
        for requirement in type(self).requires:
            requirement.check(gm)

    def apply(self, gm: fx.GraphModule, generator: torch.Generator) -> Rewrite:
        """Call `function` with the fields as keyword arguments (override for anything else)."""
        function = type(self).function
        if function is None:
            raise NotImplementedError(f"{type(self).__name__} sets neither `function` nor `apply`")
        if isinstance(function, PassFunction):
            function = function.raw  # this pass's own values: already checked
        return function(gm, **self.args(), generator=generator)

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """Where this pass (with its other arguments as given) can apply on `gm`, most useful first; [] when the
        pass does not list them. Each candidate's `args` select it in a spec. A graph not yet annotated with shapes
        (straight from graphgrow.trace) is annotated first: every subclass's own `candidates` is wrapped so."""
        return []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        function = cls.__dict__.get("function")
        if isinstance(function, PassFunction):
            function.bind(cls)  # its defaults and checks: this class's declaration
        own = cls.__dict__.get("candidates")
        if own is None or getattr(own, "annotates_first", False):
            return

        @functools.wraps(own)
        def candidates(self: Pass, gm: fx.GraphModule) -> list[Candidate]:
            require_traced(gm)
            if any("gg_shape" not in n.meta for n in gm.graph.nodes):
                annotate(gm, input_spec_of(gm))  # the analyses read shapes: without them a pass would list nothing
            return own(self, gm)

        candidates.annotates_first = True  # type: ignore[attr-defined]
        cls.candidates = candidates  # type: ignore[method-assign]

    @classmethod
    def argument_types(cls) -> dict[str, Any]:
        return typing.get_type_hints(cls)

    @classmethod
    def argument_help(cls) -> dict[str, str]:
        """Each argument's help line (from `arg(default, help)`; empty when declared without)."""
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}

    @classmethod
    def argument_allowed(cls) -> dict[str, Allowed]:
        """Each argument's allowed values (declared choices or range, a Literal's choices)."""
        return allowed_values(cls)

    @classmethod
    def code_arguments(cls) -> list[str]:
        """The arguments whose value names code to import and call (declared `arg(..., names_code=True)`)."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("names_code")]

    @classmethod
    def help(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    def args(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __call__(
        self,
        gm: fx.GraphModule,
        verify_result: bool = True,
        seed: int = 0,
        limits: Limits | None = None,
        share: bool = False,
    ) -> PassResult:
        """Apply to a copy of `gm`, verify, and return the result. `gm` is never modified.

        The pass runs under `limits`: an allocation that would take what it holds past `limits.max_memory`
        is refused before it happens, and the grown model is sized (parameters added; new weights, verification's
        gradients and activations, on the meta device) before verification runs it. `share=True`: the parameters the
        pass does not change are the input's own tensors, not copies (the pass costs what it adds; training
        the result then moves the input's weights too — for when the input is dropped, docs/performance.md)."""
        start = time.perf_counter()
        require_traced(gm)
        input_shape = input_spec_of(gm)
        if any("gg_shape" not in n.meta for n in gm.graph.nodes):
            annotate(gm, input_shape)
        self.check_requires(gm)
        limits = limits or Limits()
        fingerprint = _fingerprint(gm)
        before_nodes = {n.name for n in gm.graph.nodes}
        generator = torch.Generator().manual_seed(seed)
        with sharing_parameters(share), pass_allocations(self.name, limits if self.grows else Limits.lifted()):
            rw = self.apply(gm, generator)
        _check_untouched(gm, fingerprint, self.name)
        new = rw.gm
        if new is gm:
            raise ValidationError(
                f"pass {self.name} returned its input instead of a copy",
                "passes must be functional; see rewrite.copy_graph_module",
            )
        if inline_containers(new, set(dict(new.named_children())) - set(dict(gm.named_children()))):
            finish(new)  # a block the pass inserted as one module is read by every analysis as its layers
        if rw.changed:
            for guarantee in type(self).ensures:
                guarantee.check(self.name, gm, new)
        sized = check_grown(self.name, gm, new, input_shape, limits, share) if self.grows else None
        if rw.eval_only:
            new.eval()
        else:
            _follow_modes(gm, new)
        checked = verify_result and rw.changed
        example_run = annotate(
            new, input_shape, previous=gm, example=annotation_input(new, input_shape) if checked else None
        )
        after_nodes = {n.name for n in new.graph.nodes}
        # verification's input does not depend on the pass seed: the next pass of a pipeline reuses these outputs
        report = (
            verify(gm, new, input_shape, exact=rw.exact, eval_only=rw.eval_only, example_run=example_run)
            if checked
            else None
        )
        notes = list(rw.notes) + ([sized] if sized else [])  # the grown model was measured on a real run
        if report is not None and not rw.exact:
            train_err = f", train rel err {report.train.rel_err:.3g}" if report.train is not None else ""
            notes.append(f"function changed on purpose: eval rel err {report.eval.rel_err:.3g}{train_err}")
        if report is not None and report.eval.low_precision is not None:
            notes.append(_half_note(report.eval, report.train))
        if report is not None and report.cancelled:
            notes.append(
                f"{', '.join(report.cancelled)} get a gradient only in eval mode: a following normalisation "
                "cancels them in train mode (redundant, like a conv bias before BatchNorm)"
            )
        if report is not None and report.degenerate:
            notes.append(
                "the model's output is identically zero on the check inputs (a zero-initialised head?): "
                "preservation was checked on zeros only"
            )
        result = PassResult(
            gm=new,
            changed=rw.changed,
            name=self.name,
            args=self.args(),
            targets=rw.targets,
            notes=notes,
            nodes_added=sorted(after_nodes - before_nodes),
            nodes_removed=sorted(before_nodes - after_nodes),
            params_before=param_count(gm),
            params_after=param_count(new),
            flops_before=total_flops(gm),
            flops_after=total_flops(new),
            seed=seed,
            seconds=time.perf_counter() - start,
            preservation=report,
            exact=rw.exact,
            modules_added=sorted(set(dict(new.named_children())) - set(dict(gm.named_children()))),
        )
        info = graph_info(new)
        info["log"] = list(graph_info(gm).get("log", [])) + [result.log_entry()]
        record_origin(gm, new)
        return result


def _half_note(ev: ModeCheck, tr: ModeCheck | None) -> str:
    """What the report says about a bfloat16/float16 model grown in its own dtype (verify.low_precision)."""
    lp = ev.low_precision
    assert lp is not None
    errs = f"eval rel err {ev.rel_err:.3g}" + (f", train {tr.rel_err:.3g}" if tr is not None else "")
    if ev.fp32_ok and (tr is None or tr.fp32_ok):
        return f"grown in {lp.dtype}; compared in float32 on the stored values: exact ({errs})"
    return (
        f"grown in {lp.dtype}; compared in float32 on the stored values: {errs} from rounding the grown values to "
        f"{lp.dtype}, within its tolerance {lp.tolerance:.3g} (one {lp.dtype} ulp {lp.ulp:.3g}; the original's own "
        f"{lp.dtype} arithmetic differs from float32 by {lp.own_rel_err:.3g})"
    )


def require_traced(model: Any) -> None:
    """InputError unless `model` is a graph from graphgrow.trace (passes rewrite graphs, not modules)."""
    if not isinstance(model, fx.GraphModule):
        raise InputError(
            f"passes run on a traced model (torch.fx.GraphModule), got {type(model).__name__}",
            "trace it first: gm = graphgrow.trace(model, input_shape=(1, 3, 224, 224))",
        )


def _follow_modes(old: fx.GraphModule, new: fx.GraphModule) -> None:
    """New modules take the training flag of the input model (an eval-mode model stays all eval);
    rebuilt ones keep the flag of the module they replace."""
    before = {path: m.training for path, m in old.named_modules()}
    for path, m in new.named_modules():
        m.training = before.get(path, old.training)


def _fingerprint(gm: fx.GraphModule) -> tuple:
    """Cheap identity of a module's state: tensor versions bump on any in-place change."""
    tensors = [(n, t.data_ptr(), t._version, tuple(t.shape)) for n, t in gm.state_dict(keep_vars=True).items()]
    return len(gm.graph.nodes), tuple(tensors)


def _check_untouched(gm: fx.GraphModule, fingerprint: tuple, name: str) -> None:
    if _fingerprint(gm) != fingerprint:
        raise ValidationError(
            f"pass {name} modified its input model (a bug in the pass)",
            "passes must work on a copy (graphgrow.rewrite.begin or copy_graph_module)",
        )
