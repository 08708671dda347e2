"""nn.Module → GraphModule through torch.export, for models symbolic tracing cannot take (issue 22).

transformers 5 dropped its fx tracer; its models are written for `torch.export(strict=False)`.
The exported program is an ATen graph with parameters as inputs; graphgrow's passes, coupling
and files work on fx graphs of module calls and torch functions. So the program is turned back:

- parameters, buffers and constants become get_attr nodes on the model's own tensors (shared);
- every node carries `nn_module_stack`: the work of one call of a childless torch.nn layer
  (Linear, Embedding, LayerNorm, Conv, Dropout, …) with one tensor in and one out is raised back
  to a `call_module` of that layer under its original path;
- a childless layer of the model's own class that behaves as a torch.nn layer (GPT-2's Conv1D is a
  Linear, LlamaRMSNorm an RMSNorm: standins.py runs both to decide) is raised the same way, as that layer;
- the rest is written as torch / operator functions where a table knows the ATen op
  (aten_table.py); an op it does not know stays an ATen call and the report lists it;
- the output gets the model's structure back: a ModelOutput or dict becomes a dict.

Mode: the model is exported in eval and in train mode, and the two graphs must be the same
but for constants (a dropout's `train` flag, attention's dropout_p). Such a constant becomes
a run-time read of the owning module's `training` flag, as fx tracing does, so one graph
computes both modes; any other difference is refused, naming the module.
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..core import codegen
from ..core.errors import GraphgrowError, InputError, TraceError, first_line
from ..graph.graph_meta import META_KEY, store_shape
from ..graph.inputs import DTYPES, InputSpec, first_embedding, spec_inputs
from .aten_table import DROPPED, to_torch
from .standins import standin, tied_parameters

_SKIP_RAISE = (nn.MultiheadAttention,)


def _raisable(m: nn.Module) -> bool:
    """A torch.nn layer whose forward is one computation graphgrow's passes know as a module."""
    return (
        type(m).__module__.startswith("torch.nn.modules.")
        and not any(True for _ in m.children())
        and not isinstance(m, _SKIP_RAISE)
    )


def _export(model: nn.Module, inputs: dict[str, torch.Tensor], train: bool):
    was = model.training
    dims = {k: {d: torch.export.Dim.AUTO for d in range(v.dim())} for k, v in inputs.items()}
    try:
        model.train(train)
        return torch.export.export(model, (), dict(inputs), dynamic_shapes=dims, strict=False)
    except Exception as e:
        raise TraceError(
            f"torch.export cannot capture {type(model).__name__} in {'train' if train else 'eval'} mode: "
            f"{first_line(e)}",
            "check that the model runs on the example inputs; caches off (use_cache=False)",
        ) from e
    finally:
        model.train(was)


def _rebuild(spec: TreeSpec, leaves: Iterable[Any]) -> Any:
    """The model's output structure over graph nodes: mappings (ModelOutput too) → dict, sequences kept."""
    it = iter(leaves)

    def go(s: TreeSpec) -> Any:
        if s.is_leaf():
            return next(it)
        kids = [go(s.child(i)) for i in range(s.num_children)]
        if isinstance(s.type, type) and issubclass(s.type, dict):
            return dict(zip(s.context, kids))
        if s.type is list:
            return kids
        return tuple(kids)

    return go(spec)


def _lift(ep, model: nn.Module) -> tuple[fx.Graph, dict[str, torch.Tensor]]:
    """The exported graph with parameters/buffers as get_attr, user inputs as placeholders, the output restructured."""
    sig = ep.graph_signature
    owned = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    consts = dict(sig.inputs_to_lifted_tensor_constants)
    extra: dict[str, torch.Tensor] = {}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if sig.buffers_to_mutate:
        raise TraceError(
            f"{type(model).__name__} updates buffers in its forward "
            f"({', '.join(sorted(sig.buffers_to_mutate.values())[:3])}), "
            "which graphgrow's export capture does not keep yet",
            "capture with --capture fx, or mark the module a leaf",
        )
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name in owned:
                env[n] = g.get_attr(owned[n.name])
            elif n.name in consts:
                name = f"_gg_constant_{len(extra)}"
                extra[name] = ep.constants[consts[n.name]]
                env[n] = g.get_attr(name)
            else:
                env[n] = g.placeholder(n.name)
        elif n.op == "output":
            user = [o for o, s in zip(n.args[0], sig.output_specs) if s.kind.name == "USER_OUTPUT"]
            g.output(_rebuild(ep.call_spec.out_spec, [env[o] if isinstance(o, fx.Node) else o for o in user]))
            continue
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    for n in list(g.nodes):
        if n.op == "call_function" and (str(n.target) in DROPPED or _same_dtype_to(n)):
            if n.users and n.args:  # a no-op view (alias, contiguous): its input instead
                n.replace_all_uses_with(n.args[0])
            if not n.users:
                g.erase_node(n)
    return g, extra


def _same_dtype_to(n: fx.Node) -> bool:
    """`x.to(dtype)` where x already has that dtype: x itself (eager returns it), so a layer's upcast of its
    input (an RMSNorm's `.to(float32)`) does not make later readers of x look like readers of the layer."""
    if str(n.target) != "aten.to.dtype" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    before, after = n.args[0].meta.get("val"), n.meta.get("val")
    return isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype


def _stack(n: fx.Node) -> list[tuple[str, str]]:
    """(call key, module path) of the modules around a node, outermost first."""
    return [(k, v[0]) for k, v in (n.meta.get("nn_module_stack") or {}).items()]


def _raise_layers(g: fx.Graph, model: nn.Module, standins: dict[str, nn.Module | None]) -> list[str]:
    """Rewrite each call of a raisable torch.nn layer (or of a layer that behaves as one: `standins`, filled
    here) as one call_module node; returns the layers left as functions."""
    mods = dict(model.named_modules())
    tied = tied_parameters(model)
    groups: dict[str, list[fx.Node]] = {}
    path_of: dict[str, str] = {}
    for n in g.nodes:
        if n.op != "call_function":
            continue
        for key, path in _stack(n):
            if path in mods and path not in standins and not _raisable(mods[path]):
                standins[path] = standin(mods[path], tied)
            if path in mods and (_raisable(mods[path]) or standins.get(path) is not None):
                groups.setdefault(key, []).append(n)
                path_of[key] = path
                break
    kept = []
    for key, nodes in groups.items():
        path, inside = path_of[key], set(nodes)
        own = {id(t) for t in list(mods[path].parameters()) + list(mods[path].buffers())}
        ext: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if (
                    a not in inside
                    and a not in ext
                    and not (a.op == "get_attr" and id(_attr(model, a.target)) in own)
                    and isinstance(a.meta.get("val"), torch.Tensor)
                ):  # sizes: the layer reads them off its input
                    ext.append(a)
        outs = [n for n in nodes if any(u not in inside for u in n.users)]
        if len(ext) != 1 or len(outs) != 1:
            kept.append(path)
            continue
        with g.inserting_before(outs[0]):
            new = g.call_module(path, (ext[0],))
        new.meta = dict(outs[0].meta)
        stack = outs[0].meta.get("nn_module_stack") or {}
        new.meta["nn_module_stack"] = {k: v for k, v in stack.items() if k != key}
        outs[0].replace_all_uses_with(new)
        for n in reversed(nodes):
            if not n.users:
                g.erase_node(n)
    for n in list(g.nodes):  # parameters only the raised layers used
        if n.op == "get_attr" and not n.users:
            g.erase_node(n)
    return sorted(set(kept))


def _attr(model: nn.Module, target: Any) -> Any:
    obj: Any = model
    for part in str(target).split("."):
        obj = getattr(obj, part, None)
    return obj


def _flat(n: fx.Node) -> tuple[list[Any], TreeSpec]:
    """A node's arguments by schema name (defaults filled) for ATen ops, else as given; flattened."""
    args: Any = (n.args, n.kwargs)
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        full = {}
        for i, a in enumerate(schema.arguments):
            if i < len(n.args) and not a.kwarg_only:
                full[a.name] = n.args[i]
            elif a.name in n.kwargs:
                full[a.name] = n.kwargs[a.name]
            elif a.has_default_value():
                full[a.name] = a.default_value
        args = full
    return tree_flatten(args)


def _merge_modes(eval_g: fx.Graph, train_g: fx.Graph, name: str) -> int:
    """Make train_g compute eval mode too: constants that differ read the owning module's `training` flag.
    Returns how many switches were made; TraceError where the graphs differ otherwise."""
    e_nodes, t_nodes = list(eval_g.nodes), list(train_g.nodes)
    index = {n: i for i, n in enumerate(e_nodes)} | {n: i for i, n in enumerate(t_nodes)}
    switches = 0
    for e, t in zip(e_nodes, t_nodes):
        if (e.op, e.target) != (t.op, t.target):
            raise _mode_error(name, t, f"'{e.name}' ({e.target}) in eval mode, '{t.name}' ({t.target}) in train mode")
        (ea, es), (ta, ts) = _flat(e), _flat(t)
        if es != ts or len(ea) != len(ta):
            raise _mode_error(name, t, f"'{t.name}' ({t.target}) has other arguments in train mode")
        changed = False
        for j, (x, y) in enumerate(zip(ea, ta)):
            if isinstance(x, fx.Node) or isinstance(y, fx.Node):
                if not (isinstance(x, fx.Node) and isinstance(y, fx.Node) and index[x] == index[y]):
                    raise _mode_error(name, t, f"'{t.name}' ({t.target}) takes other inputs in train mode")
            elif type(x) is not type(y) or x != y:
                with train_g.inserting_before(t):
                    ta[j] = _switch(train_g, t, x, y, name)
                changed, switches = True, switches + 1
        if changed:
            _set_flat(t, ta, ts)
    if len(e_nodes) != len(t_nodes):
        raise _mode_error(name, t_nodes[min(len(e_nodes), len(t_nodes)) - 1], "the graphs have different lengths")
    return switches


def _set_flat(n: fx.Node, leaves: list[Any], spec: TreeSpec) -> None:
    value = tree_unflatten(leaves, spec)
    if isinstance(value, dict):  # by schema name: back to positional + keyword-only
        schema = n.target._schema  # type: ignore[union-attr]
        n.args = tuple(value[a.name] for a in schema.arguments if not a.kwarg_only)
        n.kwargs = {a.name: value[a.name] for a in schema.arguments if a.kwarg_only}
    else:
        n.args, n.kwargs = value


def _switch(g: fx.Graph, at: fx.Node, eval_value: Any, train_value: Any, name: str) -> fx.Node:
    """An expression of the owning module's `training` flag giving `eval_value` in eval, `train_value` in train mode."""
    stack = _stack(at)
    path = stack[-1][1] if stack else ""
    flag = g.get_attr(f"{path}.training" if path else "training")
    if (eval_value, train_value) == (False, True):
        return flag
    if (eval_value, train_value) == (True, False):
        return g.call_function(operator.not_, (flag,))
    if isinstance(train_value, (int, float)) and not isinstance(train_value, bool) and eval_value == 0:
        return g.call_function(operator.mul, (flag, train_value))
    raise _mode_error(
        name, at, f"'{at.name}' ({at.target}) uses {train_value!r} in train mode and {eval_value!r} in eval mode"
    )


def _mode_error(name: str, at: fx.Node, why: str) -> TraceError:
    stack = _stack(at)
    where = f" in '{stack[-1][1]}'" if stack and stack[-1][1] else ""
    return TraceError(
        f"the exported train- and eval-mode graphs of {name} differ{where}: {why}",
        "trace one mode only is not supported yet; mark the module a leaf or capture with --capture fx",
    )


def _scopes(g: fx.Graph) -> None:
    for n in g.nodes:
        n.meta["gg_scope"] = tuple(p for _, p in _stack(n))


def _device_node(g: fx.Graph) -> fx.Node | None:
    first = next((n for n in g.nodes if n.op == "placeholder"), None)
    if first is None:
        return None
    last = [n for n in g.nodes if n.op == "placeholder"][-1]
    with g.inserting_after(last):
        return g.call_function(getattr, (first, "device"))


def _to_torch(g: fx.Graph) -> list[str]:
    """Rewrite ATen calls as torch / operator calls; returns the ATen ops left as they are."""
    device = _device_node(g)
    left = set()
    for n in list(g.nodes):
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            full = tree_unflatten(*_flat(n))
            done = to_torch(str(n.target), full, device)
            if done is None:
                left.add(str(n.target))
                continue
            op, target, args, kwargs = done
            with g.inserting_before(n):
                new = g.create_node(op, target, tuple(args), kwargs)
            new.meta = n.meta
            n.replace_all_uses_with(new)
            g.erase_node(n)
    if device is not None and not device.users:
        g.erase_node(device)
    return sorted(left)


def export_capture(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[fx.GraphModule, dict]:
    """Capture `model` on the example `inputs` (name → tensor, passed by keyword) with torch.export.

    Returns the GraphModule (parameters shared with `model`) and the capture report. Inputs are
    exported with every dimension dynamic where the model allows it (torch.export.Dim.AUTO).
    """
    name = type(model).__name__
    start = time.perf_counter()
    graphs = []
    extra: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    standins: dict[str, nn.Module | None] = {}  # path → the torch.nn layer a model's own layer behaves as
    for train in (False, True):
        ep = _export(model, inputs, train)
        g, extra = _lift(ep, model)
        kept = _raise_layers(g, model, standins)
        graphs.append(g)
    switches = _merge_modes(graphs[0], graphs[1], name)
    g = graphs[1]
    _scopes(g)
    aten_left = _to_torch(g)
    root: dict[str, Any] = dict(extra)
    for n in g.nodes:
        if n.op == "call_module":
            root[str(n.target)] = standins.get(str(n.target)) or model.get_submodule(str(n.target))
        elif n.op == "get_attr" and str(n.target) not in root:
            root[str(n.target)] = _attr(model, n.target)
    gm = fx.GraphModule(root, codegen.adopt(g), name)  # module paths reach the code through generated identifiers
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    gm.train(model.training)
    notes = [f"captured with torch.export (strict=False) in {time.perf_counter() - start:.2f} s"]
    if switches:
        notes.append(
            f"{switches} constants differ between train and eval mode (dropout): read from the owning module's "
            "training flag at run time"
        )
    raised = {p: m for p, m in standins.items() if m is not None and any(n.target == p for n in gm.graph.nodes)}
    if raised:
        notes.append(
            f"{len(raised)} layers of the model's own classes compute what a torch.nn layer computes and are "
            f"that layer in the graph: {_kinds(model, raised)}"
        )
    if kept:
        notes.append(f"layers kept as functions (not one tensor in and out): {', '.join(kept[:6])}")
    if aten_left:
        notes.append(f"ATen operations kept as they are: {', '.join(aten_left[:8])}")
    report = {
        "capture": "export",
        "mode_switches": switches,
        "standins": {p: type(m).__name__ for p, m in raised.items()},
        "layers_as_functions": kept,
        "aten_ops": aten_left,
        "notes": notes,
    }
    return gm, report


def _kinds(model: nn.Module, raised: dict[str, nn.Module]) -> str:
    """'Conv1D → Linear (weight transposed) ×4, LlamaRMSNorm → RMSNorm ×5'."""
    counts: dict[str, int] = {}
    for p, m in raised.items():
        own = model.get_submodule(p)
        flip = (
            " (weight transposed)" if isinstance(m, nn.Linear) and m.weight is not getattr(own, "weight", None) else ""
        )
        key = f"{type(own).__name__} → {type(m).__name__}{flip}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} ×{v}" for k, v in counts.items())


def with_ranges(model: nn.Module, spec: InputSpec) -> InputSpec:
    """Token-id inputs with their range fixed now, from the model's first nn.Embedding (a subclass too): the
    graph may hold no nn.Embedding (BART's scaled embedding is a function there), yet every later check
    must draw ids the model accepts."""
    emb = first_embedding(model)
    if emb is None:
        return spec
    return tuple(
        replace(t, high=int(emb.num_embeddings))
        if t.high is None
        and not DTYPES[t.dtype].is_floating_point
        and DTYPES[t.dtype] != torch.bool
        and not t.name.endswith("mask")
        and t.name != "token_type_ids"
        else t
        for t in spec
    )


def needs_export(spec: InputSpec) -> bool:
    return len(spec) > 1 or any(t.dtype != "float32" for t in spec)


def capture_by_export(model: nn.Module, spec: InputSpec | None, check: bool, notes: list[str]) -> fx.GraphModule:
    """Capture with torch.export (export_capture.py) on seeded example inputs, then check as a trace is checked.
    A bare shape's input is passed by its name, the forward's first parameter's (graph.inputs.named_for)."""
    if spec is None:
        raise InputError(
            f"capturing {type(model).__name__} with torch.export needs an example input",
            "give --input-shape (e.g. input_ids:1x16:int64), Python: trace(model, input_shape=...)",
        )
    batch = max(2, int(spec[0].shape[0]))  # a size-1 dimension would be fixed by export, not kept dynamic
    with _cache_off(model, notes):
        try:
            gm, report = export_capture(model, spec_inputs(model, spec, seed=0, batch=batch))
        except GraphgrowError:
            raise
        except Exception as e:  # what graphgrow does with the exported program, failing on a version it was not run on
            raise TraceError(
                f"capturing {type(model).__name__} failed after torch.export on {_versions()}: "
                f"{type(e).__name__}: {first_line(e)}",
                "graphgrow's tests run on torch 2.14 and transformers 5.24: try those, or --capture fx",
            ) from e
        report["notes"] = notes + report["notes"]
        report.update(mode="eval", auto_leaves={}, user_leaves=[], mode_reads=[], top_level_mode_dependent=False)
        gm.meta[META_KEY] = {"log": [], "trace": report}
        if check:
            from .fidelity import check_fidelity

            check_fidelity(model, gm, spec)
    store_shape(gm, spec)
    return gm


def _versions() -> str:
    import sys

    found = [f"torch {torch.__version__}"]
    if "transformers" in sys.modules:
        found.append(f"transformers {getattr(sys.modules['transformers'], '__version__', '?')}")
    return " and ".join(found)


@contextlib.contextmanager
def _cache_off(model: nn.Module, notes: list[str]) -> Iterator[None]:
    """A Hugging Face model's key/value cache off while it is captured and checked (torch.export cannot return a
    DynamicCache; a growth graph has no use for one), its setting restored after (as_native gives it back)."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    notes.append("captured with use_cache=False (the model's key/value cache is not part of its function)")
    try:
        yield
    finally:
        config.use_cache = True
