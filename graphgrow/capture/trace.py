"""nn.Module → torch.fx.GraphModule that computes what the module computes, in eval and train mode.

torch.fx runs Python once. Three things make that run differ from the user's model,
and each is handled here rather than left for a pass to be blamed for:

- Reads of `self.training` would be frozen as a constant. During tracing every
  module's `training` flag is watched: a read becomes a graph node that reads the
  flag at run time (so `dropout(x, p, training=self.training)` and
  `stochastic_depth(..., self.training)` keep their runtime switch). A forward that
  *branches* on the flag (`if self.training:`) cannot be traced faithfully: that
  submodule becomes a leaf automatically, with the reason recorded. A top-level
  forward that branches on it is traced in one mode (`mode`, eval by default: the
  deployed function) and the report says so.
- A submodule fx cannot trace (data-dependent padding, Python control flow on
  tensor values) becomes a leaf automatically, innermost first.
- Optional forward arguments with defaults are fixed to their defaults: they are not
  model inputs.

The result is then checked against the module (see fidelity.py) before any pass runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

from torch import fx, nn

from ..analysis.deployed import train_only_modules, used_paths
from ..core import codegen
from ..core.errors import GraphgrowError, InputError, TraceError, first_line
from ..graph.graph_meta import META_KEY, graph_info, input_shape_of, scope_of, store_shape, trace_report  # noqa: F401 (re-exported)
from ..graph.inputs import check_names
from . import mode_merge, mode_paths
from .defaults import concrete_defaults, drop_fixed_placeholders
from .export_capture import capture_by_export, needs_export, with_ranges
from .input_shape import parse_example_input
from .tracer import _Frozen, _ModeBranch, _Shallow, _trace_once, _Tracer, tracer_stack_top
from .watch import settings

Mode = Literal["eval", "train"]
Capture = Literal["auto", "fx", "export"]
_MAX_AUTO_LEAVES = 256  # each retry re-traces the model; past this something else is wrong


class _Plan:
    """What the trace loop has learned so far: leaves, blocks to merge, frozen attributes, the top-level mode."""

    def __init__(self, model: nn.Module, user_leaves: set[str], mode: Mode, auto_leaves: bool):
        self.model, self.mode, self.auto_leaves = model, mode, auto_leaves
        self.leaves = set(user_leaves)
        self.auto: dict[str, str] = {}
        self.root_constant: bool | None = None
        self.mode_free: set[str] = set()
        self.split: set[str] = set()
        self.frozen: set[tuple[type, str]] = set()
        self.notes: list[str] = []
        self.fixed = concrete_defaults(model)
        self.name = type(model).__name__
        self.current: _Tracer | None = None  # the tracer of the trace running now (attempt() makes several)

    def tracer(self, policy: Callable[[Any, tuple[bool, ...]], bool] | None = None) -> _Tracer:
        return _Tracer(
            self.leaves,
            self.root_constant,
            self.mode_free,
            self.split,
            policy,
            live=bool(self.split),
            frozen=self.frozen,
        )

    def attempt(self) -> tuple[fx.Graph, _Tracer, list[mode_merge.Switch]]:
        """One full trace; with blocks to merge, one per path through their branches, merged (mode_merge)."""
        self.current = first = self.tracer(mode_paths.follow(()) if self.split else None)
        graph = _trace_once(self.model, first, self.fixed)
        if not self.split:
            return graph, first, []
        traces = {(): (graph, first)}
        todo = mode_paths.unexplored(first.conditions, ())
        while todo:
            policy = todo.pop(0)
            if policy in traces:
                continue
            if len(traces) >= mode_paths.MAX_PATHS:
                raise mode_paths.MergeError(
                    first.conditions[-1].reader, f"its branches have more than {mode_paths.MAX_PATHS} paths"
                )
            self.current = tracer = self.tracer(mode_paths.follow(policy))
            traces[policy] = (_trace_once(self.model, tracer, self.fixed), tracer)
            todo += mode_paths.unexplored(tracer.conditions, policy)
        merged, switches = mode_merge.merge(traces)
        return merged, first, switches

    def on_mode_branch(self, tracer: _Tracer) -> None:
        where, cls = tracer_stack_top(tracer)
        if not where:
            if self.root_constant is not None:
                raise TraceError(
                    f"cannot trace the top-level forward of {self.name}: it branches on self.training "
                    "even with the mode fixed"
                ) from None
            self.root_constant = self.mode == "train"
            self.notes.append(
                f"the top-level forward of {self.name} branches on self.training: traced its {self.mode}-mode "
                f"code{' (the deployed function)' if self.mode == 'eval' else ''}; "
                f"use --trace-mode {'train' if self.mode == 'eval' else 'eval'} for the other one"
            )
            return
        module = self.model.get_submodule(where)
        if _traces_alike_in_both_modes(module):
            self.mode_free.add(where)
            return
        if where in self.split:  # still branching while merged: no path policy reached it
            why = "branches on self.training (its forward differs between eval and train mode)"
            if not self.auto_leaves:
                raise TraceError(
                    f"submodule '{where}' ({cls}) of {self.name} {why}",
                    f"mark it as a leaf: --leaf {where} (Python: trace(model, leaves=['{where}']))",
                ) from None
            self.make_leaf(where, f"{cls}: {why}")
            return
        # every block of this class is merged: one retry per class, not per block
        self.split.update(
            p for p, m in self.model.named_modules() if type(m) is type(module) and not self.inside_leaf(p)
        )

    def alike(self, where: str) -> list[str]:
        """The other merged blocks of `where`'s class with its settings (the same code, traced the same way)."""
        mine = settings(self.model.get_submodule(where))
        return sorted(p for p in self.split if p != where and settings(self.model.get_submodule(p)) == mine)

    def inside_leaf(self, path: str) -> bool:
        return any(path == leaf or path.startswith(leaf + ".") for leaf in self.leaves)

    def owner(self, where: str) -> str:
        """The merged block a place belongs to (a failure inside a block makes the block the leaf)."""
        if where in self.split:
            return where
        return max((p for p in self.split if where.startswith(p + ".")), key=len, default=where)

    def make_leaf(self, where: str, why: str) -> None:
        where = self.owner(where)
        if where in self.leaves or not where:
            raise TraceError(
                f"cannot trace {where or 'the top level'} of {self.name}: {why}",
                f"mark it as a leaf: --leaf {where}" if where else "",
            )
        self.split.discard(where)
        _add_leaf(self.leaves, self.auto, where, why, self.name)

    def on_failure(self, tracer: _Tracer, e: Exception) -> None:
        where, cls = tracer_stack_top(tracer)
        reason = first_line(e)
        if tracer.live_nodes and not set(tracer.live_nodes.values()) <= self.frozen:
            self.frozen.update(tracer.live_nodes.values())  # a live number may be what broke it: retry frozen
            return
        if not where:
            raise TraceError(
                f"cannot trace the top-level forward of {self.name}: {reason}",
                "fx needs forward() without data-dependent control flow; wrap such parts in submodules "
                "(graphgrow keeps untraceable submodules as leaves)",
            ) from e
        if not self.auto_leaves or where in self.leaves:
            raise TraceError(
                f"cannot trace submodule '{where}' ({cls}) of {self.name}: {reason}",
                f"mark it as a leaf: --leaf {where} (Python: trace(model, leaves=['{where}']))",
            ) from e
        self.make_leaf(where, f"{cls}: cannot be traced ({reason})")


def _trace_graph(model: nn.Module, user_leaves: set[str], mode: Mode, auto_leaves: bool):
    """Trace, adding leaves, merging mode-branching blocks and fixing the top-level mode as needed.
    Returns (graph, tracer, switches, report)."""
    plan = _Plan(model, user_leaves, mode, auto_leaves)
    for _ in range(4 * _MAX_AUTO_LEAVES):
        plan.current = tracer = plan.tracer()
        try:
            graph, tracer, switches = plan.attempt()
            break
        except _ModeBranch:
            plan.on_mode_branch(plan.current)
        except _Frozen as f:
            plan.frozen.update(f.attrs)
        except mode_paths.MergeError as m:
            where = plan.owner(m.where)
            if where not in plan.split and auto_leaves:  # cannot tell which block: none of them is merged
                for block in sorted(plan.split):
                    plan.make_leaf(
                        block,
                        f"{type(model.get_submodule(block)).__name__}: branches on self.training "
                        f"and its paths could not be merged ({m.why})",
                    )
                continue
            cls = type(model.get_submodule(where)).__name__ if where else plan.name
            if not where or not auto_leaves:
                raise TraceError(
                    f"cannot merge the train- and eval-mode code of {where or plan.name} ({cls}): {m.why}",
                    f"mark it as a leaf: --leaf {where}" if where else "",
                ) from None
            for block in [where] + plan.alike(
                where
            ):  # its class with its settings fails alike: one retry, not one each
                plan.make_leaf(block, f"{cls}: branches on self.training and {m.why}")
        except Exception as e:  # fx raises many kinds; all mean "cannot trace"
            plan.on_failure(plan.current, e)
    else:
        raise TraceError(
            f"gave up tracing {plan.name}: too many retries", "name the untraceable submodules with --leaf"
        )
    drop_fixed_placeholders(graph)
    _drop_unused_mode_reads(graph)
    if plan.fixed:
        plan.notes.append(f"optional forward arguments fixed to their defaults: {', '.join(sorted(plan.fixed))}")
    live = sorted({str(n.target) for n in graph.nodes if n.op == "get_attr" and str(n.target) in tracer.live_paths})
    frozen = sorted(tracer.frozen_reads - set(live))
    if switches:
        plan.notes.append(
            f"{len(plan.split)} blocks branch on self.training: every path through their branches was "
            f"traced and merged ({len(switches)} run-time switches)"
        )
    if live:
        plan.notes.append(
            f"number attributes read at run time (changing them changes the graph's output): {', '.join(live)}"
        )
    if frozen:
        shown = ", ".join(frozen[:6]) + (f" (+{len(frozen) - 6} more)" if len(frozen) > 6 else "")
        plan.notes.append(f"number attributes read once while tracing (changing them later has no effect): {shown}")
    report = {
        "mode": mode,
        "auto_leaves": plan.auto,
        "user_leaves": sorted(user_leaves),
        "mode_reads": sorted(tracer.mode_reads),
        "top_level_mode_dependent": plan.root_constant is not None,
        "merged_blocks": sorted(plan.split),
        "live_attributes": live,
        "frozen_attributes": frozen,
        "notes": plan.notes,
    }
    return graph, tracer, switches, report


def _eval_paths(
    model: nn.Module, train: fx.Graph, leaves: set[str], auto_leaves: bool, live: bool
) -> set[str] | fx.Graph:
    """What the eval-mode code uses: its top-level forward traced one level deep, plus what the train graph
    uses inside the modules it calls (below the top level both modes trace alike: mode branches there were
    merged or made leaves) — a second full trace cost as much as the first. Falls back to that full trace.
    `live`: number attributes are read at run time, as in the train trace."""
    try:
        top = _trace_once(model, _Shallow(set(), False, live=live), concrete_defaults(model))
    except BaseException:  # noqa: BLE001 - any failure: the full eval-mode trace decides
        return _trace_graph(model, leaves, "eval", auto_leaves)[0]
    called = [str(n.target) for n in top.nodes if n.op == "call_module"]
    return used_paths(top) | {p for p in used_paths(train) if any(p.startswith(c + ".") for c in called)}


def _traces_alike_in_both_modes(module: nn.Module) -> bool:
    """True when `module`'s own forward, traced with its flag fixed to True and to False, gives the same
    graph (e.g. `dropout_p=self.drop.p if self.training else 0.` with p = 0): the branch does not matter."""
    codes = []
    for value in (True, False):
        tracer = _Tracer(set(), value)
        try:
            graph = _trace_once(module, tracer, concrete_defaults(module))
        except BaseException:  # noqa: BLE001 - anything, including a nested mode branch, means "not alike"
            return False
        codes.append(graph.python_code("self").src)
    if codes[0] != codes[1]:
        return False
    try:  # alike only at these numbers? `if self.training and self.p > 0` with p = 0 is not alike
        _trace_once(module, _Tracer(set(), True, live=True), concrete_defaults(module))
    except _Frozen:
        return False
    except BaseException:  # noqa: BLE001 - other failures were not about numbers: the frozen traces decided
        pass
    return True


def _remove_parked(model: nn.Module, before: set[str]) -> None:
    """fx parks tensor constants on the model it traces; the GraphModule holds its own references."""
    for name in set(vars(model)) - before:
        if name.startswith("_tensor_constant"):
            delattr(model, name)


def _untraceable_layers(model: nn.Module, report: dict, capture: str, spec: Any, user_leaves: set[str]) -> str:
    """With capture "auto" and an example input, the submodules fx kept whole because it cannot trace them (a branch
    on a tensor's size: TF-style "same" padding, a check of the channel count) that hold parameters, i.e. layers
    no pass could reach: '' when there are none, or the user chose leaves."""
    if capture != "auto" or spec is None or user_leaves:
        return ""
    held = [
        where
        for where, why in report["auto_leaves"].items()
        if ": cannot be traced (" in why and any(True for _ in model.get_submodule(where).parameters())
    ]
    if not held:
        return ""
    return f"{len(held)} submodules holding layers ({', '.join(held[:3])}{', …' if len(held) > 3 else ''})"


def _add_leaf(leaves: set[str], auto: dict[str, str], where: str, why: str, name: str) -> None:
    if len(auto) >= _MAX_AUTO_LEAVES:
        raise TraceError(
            f"gave up tracing {name} after making {len(auto)} submodules leaves",
            "name the untraceable submodules with --leaf",
        )
    leaves.add(where)
    auto[where] = why


def _drop_unused_mode_reads(graph: fx.Graph) -> None:
    for n in list(graph.nodes):
        if n.op == "get_attr" and str(n.target).split(".")[-1] == "training" and not n.users:
            graph.erase_node(n)


def trace(
    model: nn.Module,
    input_shape: Any = None,
    leaves: Iterable[str] = (),
    mode: Mode = "eval",
    auto_leaves: bool = True,
    check: bool = True,
    capture: Capture = "auto",
) -> fx.GraphModule:
    """Trace `model` into a GraphModule that graphgrow passes can rewrite.

    `leaves` are submodule paths kept as single opaque calls; submodules fx cannot
    trace, or whose forward branches on `self.training`, become leaves automatically
    (`auto_leaves=False` turns that off). `mode` picks the structure of a top-level
    forward that itself branches on `self.training` (auxiliary outputs): "eval" (the
    deployed function, default) or "train". `input_shape`, the example input for shape propagation and
    checks, stored as an input spec (`gm.meta["graphgrow"]["inputs"]`), is a shape ((1, 3, 224, 224): one
    float32 input), TensorSpecs, a dict name → TensorSpec / shape / (shape, dtype) / tensor, spec text, or
    example tensors, of which the shape and dtype are used, not the values (input_shape.parse_example_input).
    `capture` picks the way in: "fx" (symbolic tracing), "export"
    (torch.export, export_capture.py; needs the example input) or "auto": fx, and export when
    fx cannot trace the top level or the spec has several or integer inputs; the trace report's
    "capture" says which. With an input shape and `check=True`, the graph is
    compared with `model` in eval and train mode (fidelity.check_fidelity) and a
    TraceError names the first place where they differ. A GraphModule made by
    graphgrow is returned as is. `gm.meta["graphgrow"]["trace"]` reports what was done.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(
            f"expected a torch.nn.Module, got {type(model).__name__}",
            "build the model first, e.g. torchvision.models.resnet18()",
        )
    if mode not in ("eval", "train"):
        raise InputError(f"trace mode must be 'eval' or 'train', got {mode!r}", "--trace-mode eval|train")
    if capture not in ("auto", "fx", "export"):
        raise InputError(f"capture must be 'auto', 'fx' or 'export', got {capture!r}", "--capture auto|fx|export")
    spec = parse_example_input(input_shape, model)
    if spec is not None:  # token ids' range fixed from the model
        spec = with_ranges(model, spec)
        check_names(model, spec)
    if isinstance(model, fx.GraphModule) and META_KEY in model.meta:
        gm = model
    elif capture == "export" or (capture == "auto" and spec is not None and needs_export(spec)):
        gm = capture_by_export(model, spec, check, [])
    else:
        leaves = set(leaves)
        names = {n for n, _ in model.named_modules()}
        unknown = sorted(leaves - names)
        if unknown:
            raise TraceError(
                f"no submodule named {', '.join(map(repr, unknown))} in {type(model).__name__}",
                "leaf names are module paths as in model.named_modules(), e.g. 'layer1.0'",
            )
        before = set(vars(model))
        try:
            graph, tracer, switches, report = _trace_graph(model, leaves, mode, auto_leaves)
        except TraceError as e:
            _remove_parked(model, before)
            if capture != "auto" or spec is None or not str(e).startswith("cannot trace the top-level"):
                raise
            return capture_by_export(
                model, spec, check, [f"symbolic tracing failed ({first_line(e)}): captured with torch.export instead"]
            )
        report["capture"] = "fx"
        if mode == "train" and report["top_level_mode_dependent"]:  # what the deployed function never runs
            report["train_only_modules"] = train_only_modules(
                graph, lambda: _eval_paths(model, graph, leaves, auto_leaves, live=bool(report["live_attributes"]))
            )
        for node in graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            node.meta["gg_scope"] = tuple(stack.keys())
        gm = fx.GraphModule(tracer.root, codegen.adopt(graph), type(model).__name__)  # names reach code as data
        mode_merge.install(gm, switches)
        _remove_parked(model, before)
        gm.train(model.training)
        gm.meta[META_KEY] = {"log": [], "trace": report}
        held = _untraceable_layers(model, report, capture, spec, leaves)
        if held and mode == "eval":  # export captures the deployed (eval-mode) structure
            try:  # torch.export fixes the sizes those branches read to the example input's
                return capture_by_export(
                    model, spec, True, [f"symbolic tracing kept {held} whole: captured with torch.export instead"]
                )
            except GraphgrowError as e:
                report["notes"].append(f"torch.export could not capture it either ({first_line(e)})")
        if spec is not None and check:
            from .fidelity import check_fidelity

            check_fidelity(model, gm, spec)
    store_shape(gm, spec)
    return gm
