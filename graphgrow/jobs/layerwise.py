"""Growth one layer at a time: the passes planned once on the model's structure, then applied to "windows" — the
same model with one layer of its stack left in — so that no step holds more than the parts outside the stack and one
layer's tensors. Shared by the sharded job (fsdp_layers.py: the layers' tensors are gathered from their shards) and,
by its interface, by anything else that fetches a layer's tensors from elsewhere (a checkpoint read from disk).

A model fits when it has one stack of repeated layers (numbered children `model.layers.{i}` with the same parameter
names) on one chain: every layer reads the previous layer's single output (the stream) and the graph reads only the
last layer's output. Then:

- `Layers.find(gm)`: the stack, each layer's nodes and its stream input and output;
- `Layers.window(gm, keep)`: a copy of the graph with every other layer cut out (the stream passed straight on), so
  the copy is the model with the stack shortened to `keep` (None: no layer): the embeddings, final norm and head
  still run, so a pass and its verification work on it as on any model. Parameters are shared, not copied;
- `plan(meta_gm, passes, seed)`: the passes run once without verification on the structure (parameters on the meta
  device): the grown architecture (graph, modules, metadata) and the parameters whose shape changes or that are new;
  from those, which windows must grow (a layer with a changed or new tensor under its path; the parts outside the
  stack: the window with no layer). Each window is then planned too, on the meta device: the passes must change
  exactly what the plan changes inside it (names and shapes) — once per distinct layer (`layer_key`: identical
  layers plan alike; each grown window is still checked against the plan when it runs). A pass whose choice
  depends on the whole model — grow_width's default target, picked within a budget of the model's size — may choose
  otherwise in a window: then the model does not fit (`NotLayerwise`) and the caller grows the whole model instead;
- the windows grow with a seed of their own (`window_seed`: the agreed seed and the layer's path), each verified as
  the pass verifies any model (eval and train mode, trainability), and the caller maps the grown tensors back by
  name (`Plan.owner`): a layer's from its window, the parts outside the stack from the window with no layer (or, when
  no pass changes them, the old values).

Growth rules are per tensor and local (new units' incoming weights drawn, outgoing zero; norms rescaled), so the
windows compose into a model that computes what the old one did; the caller checks that too on the whole model
(fsdp_layers.py compares old and grown outputs in eval and train mode). The tensors the windows draw differ from
those of one pass over the whole model with the same seed (other draws): the result is the same growth, not the same
random numbers. The mutation log records `layerwise` so a replay knows.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import GraphgrowError, InputError
from ..graph.fx_edit import nodes_in_module, tensor_shape
from ..rewrite.pass_base import Pass
from .pipeline import Pipeline

_NUMBERED = re.compile(r"^(?P<stack>.+)\.(?P<index>\d+)$")


class NotLayerwise(InputError):
    """The model (or the growth asked of it) cannot be grown window by window: the whole model must be."""


@dataclass
class Layer:
    path: str
    nodes: list[fx.Node]  # graph order
    x_in: fx.Node  # the stream tensor it reads
    x_out: fx.Node  # the one tensor it hands on


@dataclass
class Layers:
    """A traced model's stack of repeated layers, in the order the graph runs them."""

    stack: str
    layers: list[Layer]

    @property
    def paths(self) -> list[str]:
        return [layer.path for layer in self.layers]

    @classmethod
    def find(cls, gm: fx.GraphModule) -> Layers:
        stacks: dict[str, dict[int, nn.Module]] = {}
        for path, m in gm.named_modules():
            match = _NUMBERED.match(path)
            if match and any(True for _ in m.parameters()):
                stacks.setdefault(match["stack"], {})[int(match["index"])] = m
        repeated = {p: c for p, c in stacks.items() if _repeated(c)}
        if not repeated:
            raise NotLayerwise(
                "the model has no stack of numbered layers holding the same parameters (model.layers.0, .1, …)",
                "it grows as a whole",
            )
        path = max(repeated, key=lambda p: sum(q.numel() for m in repeated[p].values() for q in m.parameters()))
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        members = [_members(gm, f"{path}.{i}") for i in sorted(repeated[path])]
        if not all(members):
            raise NotLayerwise(f"a layer of {path} has no nodes in the graph", "it grows as a whole")
        members.sort(key=lambda ms: order[ms[0]])
        layers = []
        for nodes in members:
            name = _path_of(nodes, path)
            inside = set(nodes)
            outs = [n for n in nodes if any(u not in inside for u in n.users)]
            if len(outs) != 1:
                raise NotLayerwise(f"layer {name} does not hand one tensor on ({len(outs)})", "it grows as a whole")
            layers.append(Layer(name, nodes, outs[0], outs[0]))
        for k, layer in enumerate(layers):
            reads = _reads(layer)
            if k > 0:
                if layers[k - 1].x_out not in reads:
                    raise NotLayerwise(
                        f"layer {layer.path} does not read {layers[k - 1].path}'s output: the stack is not one chain",
                        "it grows as a whole",
                    )
                layer.x_in = layers[k - 1].x_out
            else:
                later = _reads(layers[1]) if len(layers) > 1 else set()
                own = [a for a in reads if a not in later and _same_shape(a, layer.x_out)]
                if len(own) != 1:
                    raise NotLayerwise(
                        f"the stream into {layer.path} is not one tensor ({', '.join(a.name for a in own)})",
                        "it grows as a whole",
                    )
                layer.x_in = own[0]
        for layer in layers[:-1]:
            users = [u for u in layer.x_out.users if u not in set(_next(layers, layer).nodes)]
            if users:
                raise NotLayerwise(
                    f"{layer.path}'s output is read outside the next layer ({users[0].name})", "it grows as a whole"
                )
        return cls(path, layers)

    def window(self, gm: fx.GraphModule, keep: str | None) -> fx.GraphModule:
        """`gm` with every layer of the stack but `keep` cut out (None: all of them): a new GraphModule over the same
        parameter and buffer objects, with `gm`'s metadata (copied)."""
        graph = copy.deepcopy(gm.graph)  # node names are kept: map this stack's nodes to the copy's by name
        nodes = {n.name: n for n in graph.nodes}
        for layer in reversed(self.layers):
            if layer.path == keep:
                continue
            out, x_in = nodes[layer.x_out.name], nodes[layer.x_in.name]
            out.replace_all_uses_with(x_in)
            for n in reversed(layer.nodes):
                graph.erase_node(nodes[n.name])
        holder = nn.Module()
        for name, child in gm.named_children():
            holder.add_module(name, child)
        for name, p in gm._parameters.items():
            holder.register_parameter(name, p)
        for name, b in gm._buffers.items():
            holder.register_buffer(name, b, name not in gm._non_persistent_buffers_set)
        win = fx.GraphModule(holder, graph, class_name=type(gm).__name__)  # keeps only what the graph uses
        win.meta = copy.deepcopy(gm.meta)
        win.train(gm.training)
        return win

    def owner(self, name: str) -> str | None:
        """The layer a parameter or buffer name belongs to (None: outside the stack)."""
        for path in self.paths:
            if name.startswith(path + "."):
                return path
        return None


def _repeated(children: dict[int, nn.Module]) -> bool:
    names = [sorted(n for n, _ in m.named_parameters()) for _, m in sorted(children.items())]
    return sorted(children) == list(range(len(children))) and all(n == names[0] for n in names)


def _members(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    """The layer's nodes: traced inside it, its get_attrs, and nodes computed only from and for them."""
    inside = set(nodes_in_module(gm, path))
    inside |= {n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith(path + ".")}
    for n in gm.graph.nodes:
        if n not in inside and n.all_input_nodes and set(n.all_input_nodes) <= inside and set(n.users) <= inside:
            inside.add(n)
    return [n for n in gm.graph.nodes if n in inside]


def _path_of(nodes: list[fx.Node], stack: str) -> str:
    for n in nodes:
        if n.op in ("call_module", "get_attr"):
            match = re.match(re.escape(stack) + r"\.(\d+)(\.|$)", str(n.target))
            if match:
                return f"{stack}.{match[1]}"
    raise NotLayerwise(f"a layer of {stack} calls no module of its own", "it grows as a whole")


def _reads(layer: Layer) -> set[fx.Node]:
    inside = set(layer.nodes)
    return {a for n in layer.nodes for a in n.all_input_nodes if a not in inside}


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    sa = _shape(a)
    return sa is not None and sa == _shape(b)


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    """The node's shape: graphgrow's annotation, else the tracer's (torch.export and make_fx record `val`)."""
    found = tensor_shape(n)
    if found is None:
        val = n.meta.get("val", n.meta.get("tensor_meta"))
        found = tuple(val.shape) if isinstance(getattr(val, "shape", None), torch.Size) else None
    return found


def _next(layers: list[Layer], layer: Layer) -> Layer:
    return layers[layers.index(layer) + 1]


def window_seed(seed: int, path: str | None) -> int:
    """The seed a window grows with: from the agreed seed and the layer's path ("" for the window with no layer), so a
    layer draws the same numbers whatever the stack's length."""
    h = hashlib.sha256(f"{seed}|{path or ''}".encode()).digest()
    return int.from_bytes(h[:8], "big") % 2**63


OUTSIDE = ""  # the window with no layer of the stack; also the owner of every tensor outside the stack


@dataclass
class Plan:
    """The growth planned on the structure."""

    gm: fx.GraphModule  # the grown architecture, its tensors on the meta device
    layers: Layers  # the old model's stack
    shapes: dict[str, torch.Size]  # every grown parameter and buffer → its shape
    changed: set[str]  # names whose shape changed, or that are new
    runs: list[str] = field(default_factory=list)  # the windows to grow (layer paths; OUTSIDE: the one with no layer)
    outside_from: str | None = None  # the window whose tensors outside the stack are taken (None: no pass changes them)
    grown_layers: Layers | None = None  # the grown architecture's stack (its windows: what each window must become)

    def owner(self, name: str) -> str:
        return self.layers.owner(name) or OUTSIDE


def _tensors(gm: nn.Module) -> dict[str, torch.Size]:
    return {**{n: p.shape for n, p in gm.named_parameters()}, **{n: b.shape for n, b in gm.named_buffers()}}


def plan(meta: fx.GraphModule, passes: Sequence[Pass], seed: int) -> Plan:
    """Plan growth on `meta` (the old model with its tensors on the meta device; not changed): the grown architecture,
    the windows to grow, each checked on the meta device to change what the plan changes inside it. The tensors outside
    the stack (and new modules there, such as deepen's block) come from the first window that grows them as the plan
    does: a layer's window that grows anyway, the last layer's, then the one with no layer. Raises NotLayerwise when the
    model or the growth does not fit (module docstring)."""
    layers = Layers.find(meta)
    try:
        grown = Pipeline(list(passes), verify=False, seed=seed).run(meta).gm
    except GraphgrowError as e:
        raise NotLayerwise(f"planning on the meta device failed: {e}", "it grows as a whole") from e
    old, new = _tensors(meta), _tensors(grown)
    changed = {n for n, s in new.items() if old.get(n) != s}
    result = Plan(grown, layers, new, changed, grown_layers=Layers.find(grown))
    owners = {result.owner(n) for n in changed}
    result.runs = [p for p in layers.paths if p in owners]
    if OUTSIDE in owners:
        why: dict[str, str] = {}
        for run in dict.fromkeys([*result.runs, layers.paths[-1], OUTSIDE]):
            found = _disagreement(result, meta, run, passes, seed, outside=True)
            if found is None:
                result.outside_from = run
                break
            why[run] = found
        else:
            raise NotLayerwise(
                "no window grows the parts outside the stack as the whole model does: "
                + "; ".join(f"{k or 'no layer'}: {v}" for k, v in why.items()),
                "it grows as a whole",
            )
        if result.outside_from not in result.runs:
            result.runs.append(result.outside_from)
    alike: set[tuple] = set()  # layers whose window was planned: what they are, what the plan makes of them
    for run in result.runs:
        key = layer_key(meta, layers, run, result.shapes) if run else None
        if run != result.outside_from and (key is None or key not in alike):
            found = _disagreement(result, meta, run, passes, seed, outside=False)
            if found is not None:
                raise NotLayerwise(f"in the window of {run} {found}", "name the target explicitly, or grow as a whole")
        alike.add(key)
    return result


def layer_key(meta: fx.GraphModule, layers: Layers, path: str, planned: dict[str, torch.Size]) -> tuple:
    """A layer as its window's growth sees it, its own path written out: its nodes (operation, target, arguments:
    the layer's nodes by position, the stream it reads as such, other nodes by name), the modules it calls (their
    repr: sizes, eps, …), its tensors' shapes and dtypes, and the shapes the plan gives it. The rest of a window is
    the same for every layer, so two layers with the same key plan alike: the second window is not planned again (the
    passes decide from structure, and the grown window is checked against the plan's graph and shapes anyway when it
    runs, see `_checked`)."""
    layer = next(x for x in layers.layers if x.path == path)
    index = {n: i for i, n in enumerate(layer.nodes)}
    modules = dict(meta.named_modules())

    def rel(target: Any) -> str:
        return str(target).removeprefix(path + ".")

    def norm(a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: f"%{index[n]}" if n in index else "%stream" if n is layer.x_in else n.name)  # type: ignore[arg-type,return-value]

    nodes = tuple(
        (n.op, rel(n.target), repr(norm(n.args)), repr(norm(n.kwargs)), repr(modules.get(str(n.target), "")))
        for n in layer.nodes
    )
    mine = {n: t for n, t in _tensors_typed(meta).items() if n.startswith(path + ".")}
    return (
        nodes,
        tuple(sorted((rel(n), tuple(s), d) for n, (s, d) in mine.items())),
        tuple(sorted((rel(n), tuple(s)) for n, s in planned.items() if n.startswith(path + "."))),
    )


def _tensors_typed(gm: nn.Module) -> dict[str, tuple[torch.Size, str]]:
    return {n: (t.shape, str(t.dtype)) for n, t in (*gm.named_parameters(), *gm.named_buffers())}


def _disagreement(
    p: Plan, meta: fx.GraphModule, run: str, passes: Sequence[Pass], seed: int, outside: bool
) -> str | None:
    """Why the growth of `run`'s window (on the meta device) is not the plan's there; None when it is."""
    win = p.layers.window(meta, run or None)
    try:
        grown = Pipeline(list(passes), verify=False, seed=window_seed(seed, run)).run(win).gm
    except GraphgrowError as e:
        return f"the growth does not apply: {e}"
    return mismatched(p, run, _tensors(win), _tensors(grown), outside)


def mismatched(
    p: Plan, run: str, before: dict[str, torch.Size], after: dict[str, torch.Size], outside: bool
) -> str | None:
    """The first tensor a window's growth treats otherwise than the plan (None: it agrees): in the window's layer, and
    outside the stack when `outside`, the same names with the same shapes."""
    owners = {run, OUTSIDE} if outside else {run}
    mine = {n: s for n, s in after.items() if p.owner(n) in owners}
    want = {n: s for n, s in p.shapes.items() if p.owner(n) in owners}
    for name in sorted(set(mine) | set(want)):
        if mine.get(name) != want.get(name):
            was, got, planned = (tuple(d.get(name, ())) for d in (before, mine, want))
            return (
                f"the growth makes {name} {got} (from {was}), the whole model's growth {planned} (a choice made "
                "for the whole model, e.g. a default target or size)"
            )
    return None


def meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm`'s structure with every parameter and buffer on the meta device (ties kept; `gm` is not changed)."""
    memo: dict[int, torch.Tensor] = {id(b): b.to("meta") for b in gm.buffers()}
    memo.update({id(p): nn.Parameter(p.detach().to("meta"), p.requires_grad) for p in gm.parameters()})
    return copy.deepcopy(gm, memo=memo)


Fetch = Callable[[str], torch.Tensor]  # an old tensor's full value by name (a collective in a sharded job: same order)
GrowWindow = Callable[[fx.GraphModule, int], fx.GraphModule]  # a window and its seed → the grown window


def grow_parts(
    p: Plan, meta: fx.GraphModule, fetch: Fetch, grow: GrowWindow, seed: int
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The grown tensors part by part: (layer path, its tensors by name) for each layer in the order the graph runs
    them, then (OUTSIDE, the tensors outside the stack, new ones included). A layer no pass changes is its old tensors.
    Holds the old tensors outside the stack (every window runs them), the grown ones when a window provides them, and
    one layer's old and grown tensors; `fetch` is asked for each old tensor once, in an order every rank shares."""
    names = list(_tensors(meta))
    outside_old = {n: fetch(n) for n in names if p.owner(n) == OUTSIDE}
    outside_new: dict[str, torch.Tensor] | None = None
    if p.outside_from == OUTSIDE:
        win = _materialized(p.layers.window(meta, None), outside_old)
        grown = _checked(p, OUTSIDE, grow(win, window_seed(seed, OUTSIDE)))
        outside_new = _part(p, grown, OUTSIDE)
        _release(win, grown)
    for path in p.layers.paths:
        old = {n: fetch(n) for n in names if p.owner(n) == path}
        if path not in p.runs:
            yield path, old
            continue
        win = _materialized(p.layers.window(meta, path), {**outside_old, **old})
        del old
        grown = _checked(p, path, grow(win, window_seed(seed, path)))
        if p.outside_from == path:
            outside_new = _part(p, grown, OUTSIDE)
        part = _part(p, grown, path)
        _release(win, grown)
        yield path, part
        del part
    yield OUTSIDE, outside_new if outside_new is not None else outside_old


def _checked(p: Plan, run: str, grown: fx.GraphModule) -> fx.GraphModule:
    """A grown window whose graph is the plan's graph cut to that window: a decision the passes took from the values
    (deepen probes whether attention is causal; on the meta device it cannot) agrees with the planned one."""
    assert p.grown_layers is not None
    if signature(grown) != signature(p.grown_layers.window(p.gm, run or None)):
        raise NotLayerwise(
            f"the window of {run or 'the parts outside the stack'} grew another graph than planned on the meta device "
            "(a choice the passes make from the weights)",
            "grow the whole model",
        )
    return grown


def signature(gm: fx.GraphModule) -> list[tuple]:
    """The graph's operations with their arguments, nodes named by position (names differ between graphs)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: f"%{index[n]}")  # type: ignore[arg-type,return-value]

    return [(n.op, str(n.target), repr(norm(n.args)), repr(norm(n.kwargs))) for n in gm.graph.nodes]


def _release(*models: nn.Module) -> None:
    """Drop the windows' hold on their tensors now: a GraphModule sits in reference cycles (its graph, the passes'
    results), so it goes only at the next full garbage collection, with a layer's tensors still in it; a full
    collection costs about half a second in a process that imported torch."""
    for gm in models:
        for m in gm.modules():
            m._parameters.clear()
            m._buffers.clear()


def _part(p: Plan, gm: fx.GraphModule, owner: str) -> dict[str, torch.Tensor]:
    """A grown window's tensors of one part, checked against the plan (names and shapes)."""
    found = {n: t for n, t in (*gm.named_parameters(), *gm.named_buffers()) if p.owner(n) == owner}
    want = {n for n, _ in p.shapes.items() if p.owner(n) == owner}
    wrong = sorted(n for n in found.keys() | want if n not in found or n not in want or found[n].shape != p.shapes[n])
    if wrong:
        raise NotLayerwise(
            f"the window of {owner or 'the parts outside the stack'} grew {wrong[0]} otherwise than planned",
            "grow the whole model",
        )
    return {n: t.detach() for n, t in found.items()}


def _materialized(win: fx.GraphModule, values: dict[str, torch.Tensor]) -> fx.GraphModule:
    """A window on the meta device made real: a copy of its structure with `values` (by name) as its tensors."""
    real = copy.deepcopy(win)  # on the meta device: no memory; the plan's structure is not touched
    fill(real, values)
    return real


def fill(gm: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Put `values` (by name) in as `gm`'s parameters (new Parameter objects; tied parameters stay tied) and buffers."""
    modules = dict(gm.named_modules())
    params: dict[int, nn.Parameter] = {}
    for name, value in values.items():
        path, _, attr = name.rpartition(".")
        m = modules[path]
        if attr in m._parameters and m._parameters[attr] is not None:
            old = m._parameters[attr]
            assert old is not None
            if id(old) not in params:
                params[id(old)] = nn.Parameter(value, old.requires_grad)
            m._parameters[attr] = params[id(old)]
        elif attr in m._buffers:
            m._buffers[attr] = value
        else:
            raise KeyError(name)


def grow_plain(gm: fx.GraphModule, passes: Sequence[Pass], seed: int, verify: bool = True) -> fx.GraphModule:
    """The layer-by-layer growth of an unsharded model (what a sharded job computes, done in one process): each window
    grows with its pipeline (verified when `verify`), the grown tensors go into the planned architecture. `gm` is not
    changed; the result holds new tensors only where growth made them."""
    meta = meta_copy(gm)
    p = plan(meta, passes, seed)
    own = dict((*gm.named_parameters(), *gm.named_buffers()))
    out = copy.deepcopy(p.gm)
    for _, tensors in grow_parts(
        p, meta, own.__getitem__, lambda w, s: Pipeline(list(passes), verify=verify, seed=s).run(w).gm, seed
    ):
        fill(out, tensors)
    return mark_log(out, len(passes))


def mark_log(gm: fx.GraphModule, steps: int) -> fx.GraphModule:
    """The last `steps` entries of the mutation log say the growth went window by window (a replay in memory gives the
    same architecture; the new units' random values differ)."""
    log = gm.meta.get("graphgrow", {}).get("log", [])
    for entry in log[len(log) - steps :]:
        entry["layerwise"] = True
    return gm
