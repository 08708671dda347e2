"""nn.Module → GraphModule through torch.export, for models symbolic tracing cannot take (issue 22).

transformers 5 dropped its fx tracer (its models are written for `torch.export(strict=False)`): the exported ATen
graph takes parameters as inputs, and graphgrow works on fx graphs of module calls, so the program is turned back:

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
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..core import codegen
from ..core.errors import GraphgrowError, InputError, TraceError, first_line
from ..graph.graph_meta import META_KEY, store_shape
from ..graph.inputs import DTYPES, InputSpec, first_embedding, fixed_dims, spec_inputs
from ..graph.lean_meta import lean_tensor_meta
from .aten_table import DROPPED, to_torch
from .data_dependent import export_refusal, exporting
from .export_modes import RANDOM, PendingSwitch, flat, merge_modes, set_flat, stack
from .mode_probe import first_call, same_in_both_modes
from .self_writes import self_write_refusal
from .standins import standin, tied_parameters

_SKIP_RAISE = (nn.MultiheadAttention,)


def _raisable(m: nn.Module) -> bool:
    """A torch.nn layer whose forward is one computation graphgrow's passes know as a module."""
    return (
        type(m).__module__.startswith("torch.nn.modules.")
        and not any(True for _ in m.children())
        and not isinstance(m, _SKIP_RAISE)
    )


def _export(model: nn.Module, inputs: dict[str, torch.Tensor], train: bool, fixed: Mapping[str, set[int]]):
    was = model.training
    auto, static = torch.export.Dim.AUTO, torch.export.Dim.STATIC
    dims = {k: {d: static if d in fixed.get(k, ()) else auto for d in range(v.dim())} for k, v in inputs.items()}
    try:
        model.train(train)
        with exporting(), lean_tensor_meta():  # distributions' value checks off (data_dependent.py); lean_meta.py
            return torch.export.export(model, (), dict(inputs), dynamic_shapes=dims, strict=False)
    except Exception as e:
        if (refusal := self_write_refusal(model, inputs) if train else None) is not None:
            raise refusal from e  # the model's own reason, not torch.export's message about it
        raise export_refusal(model, e, train) from e  # a guard on a data-dependent value said in graphgrow's words
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
            if _inlined(g, ep.graph_module, n, env):
                continue
            env[n] = g.node_copy(n, lambda a: env[a])
        env[n].meta = dict(n.meta)
    for n in list(g.nodes):
        if n.op == "call_function" and (str(n.target) in DROPPED or _same_dtype_to(n)):
            if n.users and n.args:  # a no-op view (alias, contiguous): its input instead
                n.replace_all_uses_with(n.args[0])
            if not n.users:
                g.erase_node(n)
    return g, extra


def _inlined(g: fx.Graph, owner: nn.Module, n: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """Copy `n` into `g` unless it is part of a `with torch.no_grad():` block (CPM-Ant's position buckets), which
    the export keeps as a higher-order op calling a graph of its own: that graph is copied in its place (its
    outputs detached where gradients were off: the same values, no gradient through them) and the tuple it
    returned is read by index. True when `n` was handled so."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    if n.op == "get_attr" and isinstance(getattr(owner, str(n.target), None), fx.GraphModule):
        return True  # a block's graph: copied where it is called
    if n.op == "call_function" and n.target is operator.getitem and isinstance(env.get(n.args[0]), tuple):  # type: ignore[arg-type]
        env[n] = env[n.args[0]][n.args[1]]  # type: ignore[index]
        return True
    if hop is None or n.op != "call_function" or n.target is not hop:
        return False
    enabled, body, *inputs = n.args
    sub: fx.GraphModule = getattr(owner, str(body.target))  # type: ignore[union-attr]
    inner: dict[fx.Node, Any] = {}
    feed = iter(inputs)
    for m in sub.graph.nodes:
        if m.op == "placeholder":
            inner[m] = env[next(feed)]  # type: ignore[index]
        elif m.op == "output":
            outs = m.args[0]
        elif not _inlined(g, sub, m, inner):
            inner[m] = g.node_copy(m, lambda a: inner[a])
            inner[m].meta = dict(m.meta)
    values = []
    for o in outs if isinstance(outs, (tuple, list)) else (outs,):
        v = inner[o] if isinstance(o, fx.Node) else o
        if not enabled and isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor):
            meta = v.meta
            v = g.call_function(torch.ops.aten.detach.default, (v,))
            v.meta = dict(meta)
        values.append(v)
    env[n] = tuple(values)
    return True


def _same_dtype_to(n: fx.Node) -> bool:
    """`x.to(dtype)` where x already has that dtype: x itself (eager returns it), so a layer's upcast of its
    input (an RMSNorm's `.to(float32)`) does not make later readers of x look like readers of the layer."""
    if str(n.target) != "aten.to.dtype" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    before, after = n.args[0].meta.get("val"), n.meta.get("val")
    return isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype


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
        for key, path in stack(n):
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
        around = outs[0].meta.get("nn_module_stack") or {}
        new.meta["nn_module_stack"] = {k: v for k, v in around.items() if k != key}
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


def _scopes(g: fx.Graph) -> None:
    for n in g.nodes:
        n.meta["gg_scope"] = tuple(p for _, p in stack(n))


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
            full = tree_unflatten(*flat(n))
            done = to_torch(str(n.target), full, device)
            if done is None:
                left.add(str(n.target))
                if device is not None and isinstance(full, dict) and isinstance(full.get("device"), torch.device):
                    full["device"] = device  # a factory the table does not know (eye): on the input's device
                    set_flat(n, *tree_flatten(full))
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


def export_capture(
    model: nn.Module, inputs: dict[str, torch.Tensor], fixed: Mapping[str, set[int]] | None = None
) -> tuple[fx.GraphModule, dict]:
    """Capture `model` on the example `inputs` (name → tensor, passed by keyword) with torch.export.

    Returns the GraphModule (parameters shared with `model`) and the capture report. Inputs are
    exported with every dimension dynamic where the model allows it (torch.export.Dim.AUTO), except the
    dimensions `fixed` names per input (fixed_dims: an image's size), kept at the example's size.
    """
    fixed = fixed or {}
    name = type(model).__name__
    start = time.perf_counter()
    graphs = []
    extra: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    standins: dict[str, nn.Module | None] = {}  # path → the torch.nn layer a model's own layer behaves as
    once = same_in_both_modes(model, inputs)  # then a train-mode export is the eval graph again (mode_probe.py)
    for train in (False,) if once else (False, True):
        ep = _export(model, inputs, train, fixed)
        g, extra = _lift(ep, model)
        kept = _raise_layers(g, model, standins)
        graphs.append(g)
    switches, pending = (0, []) if once else merge_modes(graphs[0], graphs[1], name)
    g = graphs[-1]
    _scopes(g)
    aten_left = _to_torch(g)
    root: dict[str, Any] = dict(extra)
    for s in pending:
        root[s.path] = _mode_switch(s)
    for n in g.nodes:
        if n.op == "call_module" and str(n.target) in root:
            continue
        if n.op == "call_module":
            root[str(n.target)] = standins.get(str(n.target)) or model.get_submodule(str(n.target))
        elif n.op == "get_attr" and str(n.target) not in root:
            root[str(n.target)] = _attr(model, n.target)
    gm = fx.GraphModule(root, codegen.adopt(g), name)  # module paths reach the code through generated identifiers
    _drop_dead_code(gm)
    gm.graph.lint()
    gm.recompile()
    gm.train(model.training)
    notes = [f"captured with torch.export (strict=False) in {time.perf_counter() - start:.2f} s"]
    if once:
        notes.append("exported once for both modes: the forward makes the same torch calls in train and eval mode")
    if switches:
        notes.append(
            f"{switches} constants differ between train and eval mode (dropout): read from the owning module's "
            "training flag at run time"
        )
    if pending:
        notes.append(
            f"{len(pending)} values are computed differently in train and eval mode (drop-path, a mode's own "
            f"path): mode switches at {', '.join(s.path for s in pending[:4])}"
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
        "merged_blocks": [s.path for s in pending],
        "standins": {p: type(m).__name__ for p, m in raised.items()},
        "layers_as_functions": kept,
        "aten_ops": aten_left,
        "notes": notes,
    }
    return gm, report


def _mode_switch(s: PendingSwitch) -> nn.Module:
    """The ModeSwitch module a pending switch's call becomes: the flag picks the eval body or the train body, each
    written as torch calls and kept as node records (a file holds them as data, as the fx capture's switches)."""
    from ..io.mode_switch import ModeSwitch
    from ..io.serialize import node_records

    records = []
    for body in s.bodies:
        _to_torch(body)
        records.append(node_records(body))
    module = ModeSwitch(1, [[(0, False)], [(0, True)]], records)
    module.load_bodies(trusted=True)  # made here from the exported model, not read from a file
    s.node.op, s.node.target = "call_module", s.path
    return module


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
        inputs = spec_inputs(model, spec, seed=0, batch=batch)
        first_call(model, inputs)
        try:
            gm, report = export_capture(model, inputs, fixed_dims(spec))
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


def _drop_dead_code(gm: fx.GraphModule) -> None:
    """Work nothing reads is dropped, except a random draw that another kept draw follows: dropping it would shift
    the later draw's numbers in train mode (CanineForSequenceClassification classifies from the pooled token, but
    its final character encoder's unused dropouts draw before the classifier's dropout does)."""
    g = gm.graph
    live: set[fx.Node] = set()
    todo = [n for n in g.nodes if n.op == "output" or n.is_impure()]
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo += n.all_input_nodes
    kept: set[fx.Node] = set()
    for n in reversed(g.nodes):
        if _draws(gm, n) and (n in live or kept):
            kept.add(n)
    g.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or n in kept)


def _draws(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A dropout layer, or a torch function drawing random numbers (the ATen ops are torch calls by now)."""
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), nn.modules.dropout._DropoutNd)
    name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
    return any(w in name for w in RANDOM)


def _versions() -> str:
    import sys

    found = [f"torch {torch.__version__}"]
    if "transformers" in sys.modules:
        found.append(f"transformers {getattr(sys.modules['transformers'], '__version__', '?')}")
    return " and ".join(found)


@contextlib.contextmanager
def _cache_off(model: nn.Module, notes: list[str]) -> Iterator[None]:
    """A Hugging Face model's key/value cache off while it is captured and checked (torch.export cannot return a
    DynamicCache; a growth graph has no use for one), its setting restored after (as_native gives it back). Every
    config its modules hold, not only the top one: a vision-language model's language model reads its own text
    config's use_cache (Gemma 3, GOT-OCR2: 'Found DynamicCache in output' with the top one off)."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    if not configs:
        yield
        return
    for config in configs.values():
        config.use_cache = False
    notes.append("captured with use_cache=False (the model's key/value cache is not part of its function)")
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True
