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

import inspect
from typing import AbstractSet, Any, Iterable, Literal, Sequence

from torch import fx, nn

from ..core.errors import first_line, InputError, TraceError
from ..graph.graph_meta import META_KEY, graph_info, input_shape_of, scope_of, trace_report  # noqa: F401 (re-exported)

Mode = Literal["eval", "train"]
_MAX_AUTO_LEAVES = 256  # each retry re-traces the model; past this something else is wrong


class _ModeBranch(BaseException):
    """Python control flow on a module's `training` flag (BaseException: user code's `except Exception` must not eat it)."""


class _ModeProxy(fx.Proxy):
    """A traced read of `training`: usable as a value, not as a condition."""

    def __bool__(self) -> bool:
        raise _ModeBranch()


class _Tracer(fx.Tracer):
    """Symbolic tracer that honours leaves, remembers where it is and traces `training` reads."""

    def __init__(self, leaves: set[str], root_constant: bool | None, mode_free: AbstractSet[str] = frozenset()):
        super().__init__()
        self.leaves = leaves
        self.root_constant = root_constant  # the top-level forward's `training`, when it branches on it
        self.mode_free = mode_free  # modules that branch on `training` but trace the same in both modes
        self.stack: list[tuple[str, str]] = []  # (module path, class name), innermost last
        self.mode_reads: dict[str, str] = {}  # module path whose flag was read → path of the reader
        self.branch_at: tuple[str, str] | None = None  # where a `_ModeBranch` came from

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.stack.append((self.path_of_module(m), type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()  # not reached on error: the failing module stays on top
        return out

    def read_training(self, owner: nn.Module, value: bool) -> Any:
        """What `owner.training` evaluates to while tracing."""
        reader = self.stack[-1][0] if self.stack else ""
        if not reader and self.root_constant is not None:
            return self.root_constant
        if reader in self.mode_free:
            return value  # either mode traces to the same graph: a constant is faithful
        try:
            path = self.path_of_module(owner)
        except NameError:  # not part of the model (a temporary module built in forward)
            return value
        self.mode_reads[path] = reader
        node = self.create_node("get_attr", f"{path}.training" if path else "training", (), {})
        return _ModeProxy(node, self)


class _WatchTraining:
    """While active, reading any module's `training` asks the tracer (the class of each module is
    swapped for a subclass with a `training` property; classes are put back on exit)."""

    _subclasses: dict[type, type] = {}

    def __init__(self, model: nn.Module, tracer: _Tracer):
        self.model, self.tracer = model, tracer
        self.swapped: list[tuple[nn.Module, type]] = []

    @classmethod
    def _watched(cls, base: type, tracer_box: list) -> type:
        def get(self):
            value = self.__dict__.get("training", True)
            return tracer_box[0].read_training(self, value) if tracer_box else value

        def put(self, value):
            self.__dict__["training"] = value

        sub = type(base.__name__, (base,), {"training": property(get, put), "__module__": base.__module__,
                                            "__qualname__": base.__qualname__, "_gg_watched": True})
        return sub

    def __enter__(self):
        box = [self.tracer]
        self.box = box
        for m in self.model.modules():
            cls = type(m)
            try:
                m.__class__ = self._watched(cls, box)
            except TypeError:  # scripted or slotted classes cannot be swapped; fx cannot trace them anyway
                continue
            self.swapped.append((m, cls))
        return self

    def __exit__(self, *exc):
        self.box.clear()
        for m, cls in reversed(self.swapped):
            m.__class__ = cls
        return False


def _concrete_defaults(model: nn.Module) -> dict[str, Any]:
    """Forward parameters that have defaults (and *args/**kwargs): fixed, not model inputs."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    fixed = {}
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is not p.empty and i > 0:
            fixed[p.name] = p.default
    return fixed


def _drop_fixed_placeholders(graph: fx.Graph) -> None:
    """Remove placeholders of arguments fixed to their defaults, with the asserts fx hangs on them.

    fx gives such a placeholder its default as `args`; the first placeholder (the model input) stays.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders[1:]:
        if not ph.args:
            continue
        dependents: list[fx.Node] = []
        todo = [ph]
        while todo:
            n = todo.pop()
            for u in n.users:
                if u not in dependents:
                    dependents.append(u)
                    todo.append(u)
        if any(d.op == "output" for d in dependents):
            continue  # the argument's value flows to the output: keep it as it is
        order = {n: i for i, n in enumerate(graph.nodes)}
        for d in sorted(dependents, key=lambda n: -order[n]):
            graph.erase_node(d)
        graph.erase_node(ph)


def _trace_once(model: nn.Module, tracer: _Tracer, fixed: dict[str, Any]) -> fx.Graph:
    with _WatchTraining(model, tracer):
        return tracer.trace(model, concrete_args=fixed or None)


def _trace_graph(model: nn.Module, user_leaves: set[str], mode: Mode, auto_leaves: bool):
    """Trace, adding leaves and fixing the top-level mode as needed. Returns (graph, tracer, report)."""
    leaves = set(user_leaves)
    auto: dict[str, str] = {}
    root_constant: bool | None = None
    mode_free: set[str] = set()
    notes: list[str] = []
    fixed = _concrete_defaults(model)
    name = type(model).__name__
    while True:
        tracer = _Tracer(leaves, root_constant, mode_free)
        try:
            graph = _trace_once(model, tracer, fixed)
            break
        except _ModeBranch:
            where, cls = tracer_stack_top(tracer)
            if not where:
                if root_constant is not None:
                    raise TraceError(f"cannot trace the top-level forward of {name}: it branches on self.training "
                                     "even with the mode fixed") from None
                root_constant = mode == "train"
                notes.append(f"the top-level forward of {name} branches on self.training: traced its {mode}-mode "
                             f"code{' (the deployed function)' if mode == 'eval' else ''}; "
                             f"use --trace-mode {'train' if mode == 'eval' else 'eval'} for the other one")
                continue
            if _traces_alike_in_both_modes(model.get_submodule(where)):
                mode_free.add(where)
                continue
            why = "branches on self.training (its forward differs between eval and train mode)"
            if not auto_leaves:
                raise TraceError(f"submodule '{where}' ({cls}) of {name} {why}",
                                 f"mark it as a leaf: --leaf {where} (Python: trace(model, leaves=['{where}']))") from None
            _add_leaf(leaves, auto, where, f"{cls}: {why}", name)
        except Exception as e:  # fx raises many kinds; all mean "cannot trace"
            where, cls = tracer_stack_top(tracer)
            reason = first_line(e)
            if not where:
                raise TraceError(
                    f"cannot trace the top-level forward of {name}: {reason}",
                    "fx needs forward() without data-dependent control flow; wrap such parts in submodules "
                    "(graphgrow keeps untraceable submodules as leaves)",
                ) from e
            if not auto_leaves or where in leaves:
                raise TraceError(
                    f"cannot trace submodule '{where}' ({cls}) of {name}: {reason}",
                    f"mark it as a leaf: --leaf {where} (Python: trace(model, leaves=['{where}']))",
                ) from e
            _add_leaf(leaves, auto, where, f"{cls}: cannot be traced ({reason})", name)
    _drop_fixed_placeholders(graph)
    _drop_unused_mode_reads(graph)
    if fixed:
        notes.append(f"optional forward arguments fixed to their defaults: {', '.join(sorted(fixed))}")
    report = {"mode": mode, "auto_leaves": auto, "user_leaves": sorted(user_leaves),
              "mode_reads": sorted(tracer.mode_reads), "top_level_mode_dependent": root_constant is not None,
              "notes": notes}
    return graph, tracer, report


def _traces_alike_in_both_modes(module: nn.Module) -> bool:
    """True when `module`'s own forward, traced with its flag fixed to True and to False, gives the same
    graph (e.g. `dropout_p=self.drop.p if self.training else 0.` with p = 0): the branch does not matter."""
    codes = []
    for value in (True, False):
        tracer = _Tracer(set(), value)
        try:
            graph = _trace_once(module, tracer, _concrete_defaults(module))
        except BaseException:  # noqa: BLE001 - anything, including a nested mode branch, means "not alike"
            return False
        codes.append(graph.python_code("self").src)
    return codes[0] == codes[1]


def tracer_stack_top(tracer: _Tracer) -> tuple[str, str]:
    if not tracer.stack:
        return "", ""
    return tracer.stack[-1]


def _add_leaf(leaves: set[str], auto: dict[str, str], where: str, why: str, name: str) -> None:
    if len(auto) >= _MAX_AUTO_LEAVES:
        raise TraceError(f"gave up tracing {name} after making {len(auto)} submodules leaves",
                         "name the untraceable submodules with --leaf")
    leaves.add(where)
    auto[where] = why


def _drop_unused_mode_reads(graph: fx.Graph) -> None:
    for n in list(graph.nodes):
        if n.op == "get_attr" and str(n.target).split(".")[-1] == "training" and not n.users:
            graph.erase_node(n)


def trace(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    leaves: Iterable[str] = (),
    mode: Mode = "eval",
    auto_leaves: bool = True,
    check: bool = True,
) -> fx.GraphModule:
    """Trace `model` into a GraphModule that graphgrow passes can rewrite.

    `leaves` are submodule paths kept as single opaque calls; submodules fx cannot
    trace, or whose forward branches on `self.training`, become leaves automatically
    (`auto_leaves=False` turns that off). `mode` picks the structure of a top-level
    forward that itself branches on `self.training` (auxiliary outputs): "eval" (the
    deployed function, default) or "train". `input_shape` (e.g. (1, 3, 224, 224)) is
    the example input used for shape propagation and verification; it is stored in
    `gm.meta["graphgrow"]`. With an input shape and `check=True`, the graph is
    compared with `model` in eval and train mode (fidelity.check_fidelity) and a
    TraceError names the first place where they differ. A GraphModule made by
    graphgrow is returned as is. `gm.meta["graphgrow"]["trace"]` reports what was done.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected a torch.nn.Module, got {type(model).__name__}",
                         "build the model first, e.g. torchvision.models.resnet18()")
    if mode not in ("eval", "train"):
        raise InputError(f"trace mode must be 'eval' or 'train', got {mode!r}", "--trace-mode eval|train")
    if isinstance(model, fx.GraphModule) and META_KEY in model.meta:
        gm = model
    else:
        leaves = set(leaves)
        names = {n for n, _ in model.named_modules()}
        unknown = sorted(leaves - names)
        if unknown:
            raise TraceError(
                f"no submodule named {', '.join(map(repr, unknown))} in {type(model).__name__}",
                "leaf names are module paths as in model.named_modules(), e.g. 'layer1.0'",
            )
        graph, tracer, report = _trace_graph(model, leaves, mode, auto_leaves)
        for node in graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            node.meta["gg_scope"] = tuple(stack.keys())
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        gm.train(model.training)
        gm.meta[META_KEY] = {"input_shape": None, "log": [], "trace": report}
        if input_shape is not None and check:
            from .fidelity import check_fidelity

            check_fidelity(model, gm, input_shape)
    info = gm.meta[META_KEY]
    if input_shape is not None:
        info["input_shape"] = [int(d) for d in input_shape]
    return gm
