"""Small torch.fx editing helpers: copy, resolve names, add modules, parameters and nodes.

Pass authors import them from graphgrow.rewrite (the public API), not from here."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import NotApplicable, ValidationError
from ..core.names import to_identifier
from .graph_meta import scope_of


@dataclass
class Rewrite:
    """What a pass function returns: the new module, the targets it chose, notes for people."""

    gm: fx.GraphModule
    targets: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    changed: bool = True
    exact: bool = True  # False: the pass changes the function on purpose; verification reports, not refuses
    eval_only: bool = False  # True: a deployment transform, exact in eval mode only (the result is left in eval mode)


def begin(gm: fx.GraphModule, generator: torch.Generator | None) -> tuple[fx.GraphModule, torch.Generator]:
    """How a pass function starts: a copy to edit (the input is never touched) and the generator for
    new weights (seed 0 when the caller gives none)."""
    return copy_graph_module(gm), generator or torch.Generator().manual_seed(0)


def factory_kwargs(gm: fx.GraphModule, node: fx.Node | None = None) -> dict[str, Any]:
    """device= and dtype= for new layers: the model's device, the node's dtype (float32 when unknown)."""
    dtype = (node.meta.get("gg_dtype") if node is not None else None) or torch.float32
    return {"device": next(gm.parameters(), torch.zeros(())).device, "dtype": dtype}


_SHARING: contextvars.ContextVar[bool] = contextvars.ContextVar("graphgrow_share_parameters", default=False)


@contextlib.contextmanager
def sharing_parameters(on: bool = True) -> Iterator[None]:
    """Within it, copy_graph_module shares parameter storage with the model it copies (Pass(..., share=True), and a
    Pipeline between its own intermediate models): a pass then costs the bytes of what it adds or rebuilds, not a
    copy of the whole model."""
    token = _SHARING.set(on)
    try:
        yield
    finally:
        _SHARING.reset(token)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy to edit: graph, modules, buffers and meta deep-copied; parameters deep-copied too, or, inside
    sharing_parameters(), new Parameter objects over the same storage. The original is never touched.

    Shared storage is safe because passes replace the parameters they change (widen, stream) and write in place
    only into tensors they created: an in-place write into a shared one bumps the input's version counter
    (detach() shares it), which Pass's untouched-input check refuses. Buffers stay copies: train-mode forwards
    (verification, gradmax) update BatchNorm statistics in place."""
    memo: dict[int, Any] = {}
    share = _SHARING.get()
    tensors = [*gm.parameters(), *gm.buffers()]
    keys = [t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t) for t in tensors]
    storages = collections.Counter(keys)
    for t, key in zip(tensors, keys):
        # a tensor alone in its storage and of a plain type is copied with one clone (deepcopy takes ~10 operators a
        # tensor); tensors that share a storage are left to deepcopy, which keeps them sharing in the copy
        if isinstance(t, nn.Parameter) and share:
            memo[id(t)] = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
        elif type(t) not in (torch.Tensor, nn.Parameter) or (storages[key] > 1 and t.untyped_storage().nbytes()):
            continue
        elif isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
        else:
            memo[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
    new = copy.deepcopy(gm, memo)
    new.meta = copy.deepcopy(gm.meta)
    _out_of_place(new)
    return new


def _out_of_place(gm: fx.GraphModule) -> None:
    """In the copy, in-place layers (ReLU(inplace=True), F.relu(..., inplace=True)) compute out of place.

    A pass that reads a tensor which an in-place op later overwrites (a skip starting at
    the input of an in-place ReLU) would otherwise see the overwritten values, while the
    report names the value before the op; the function does not change either way.
    """
    for m in gm.modules():
        if getattr(m, "inplace", None) is True:
            m.inplace = False  # type: ignore[assignment]
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.kwargs.get("inplace") is True:
            n.kwargs = {**n.kwargs, "inplace": False}
    gm.recompile()


def tensor_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The shape recorded by shapes.annotate, when the node's output is one tensor."""
    s = node.meta.get("gg_shape")
    return s if isinstance(s, tuple) else None


def is_float_tensor(node: fx.Node) -> bool:
    """A node computing one floating-point tensor (the output node is not one: it only returns)."""
    if node.op == "output":
        return False
    dt = node.meta.get("gg_dtype")
    return tensor_shape(node) is not None and dt is not None and dt.is_floating_point


def find_node(gm: fx.GraphModule, name: str) -> fx.Node | None:
    node: fx.Node
    for node in gm.graph.nodes:
        if node.name == name:
            return node
    return None


def nodes_in_module(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    """Nodes traced inside the submodule at `path` (by call target or recorded scope)."""
    inside = []
    prefix = path + "."
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_module" and (n.target == path or n.target.startswith(prefix)) or path in scope_of(n):
            inside.append(n)
    return inside


def module_boundary(gm: fx.GraphModule, path: str) -> tuple[fx.Node, fx.Node]:
    """The tensor entering and the tensor leaving the submodule at `path`.

    Raises NotApplicable when the module has no nodes, or more than one tensor in or out.
    """
    inside = nodes_in_module(gm, path)
    if not inside:
        raise NotApplicable(
            f"module '{path}' has no nodes in the traced graph",
            "pick a module that runs in forward(); see `graphgrow inspect` for node names",
        )
    members = set(inside)
    inputs: list[fx.Node] = []
    for n in inside:
        for a in n.all_input_nodes:
            if a not in members and a.op != "get_attr" and a not in inputs:
                inputs.append(a)
    outputs = [n for n in inside if any(u not in members for u in n.users)]
    if len(inputs) != 1 or len(outputs) != 1:
        raise NotApplicable(
            f"module '{path}' takes {len(inputs)} tensors in and gives {len(outputs)} out "
            f"({', '.join(a.name for a in inputs)} → {', '.join(o.name for o in outputs)})",
            "name nodes instead of the module (graphgrow inspect lists them)",
        )
    return inputs[0], outputs[0]


def resolve_tensor(gm: fx.GraphModule, ref: str, role: str) -> fx.Node:
    """Turn a user's reference into a node.

    A node name (`layer1_0_relu`) means that node's output. A module path (`layer1`)
    means the module's input when role is "in" and its output when role is "out".
    """
    node = find_node(gm, ref)
    if node is not None:
        return node
    if ref in dict(gm.named_modules()) and ref != "":
        tin, tout = module_boundary(gm, ref)
        return tin if role == "in" else tout
    close = [n.name for n in gm.graph.nodes if ref.replace(".", "_") in n.name][:5]
    hint = f"did you mean {', '.join(close)}?" if close else "run `graphgrow inspect MODEL` to list node names"
    raise NotApplicable(f"no node or module named '{ref}'", hint)


def unique_attr(gm: nn.Module, base: str) -> str:
    """A top-level attribute name on gm not yet used: base, base_1, base_2, ..."""
    base = to_identifier(base)  # names graphgrow adds must read back from its own files (names.py)
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def add_module(gm: fx.GraphModule, base: str, module: nn.Module) -> str:
    """Register `module` under a fresh top-level name and return that name."""
    name = unique_attr(gm, base)
    gm.add_module(name, module)
    return name


def add_parameter(gm: fx.GraphModule, base: str, value: torch.Tensor) -> str:
    name = unique_attr(gm, base)
    gm.register_parameter(name, nn.Parameter(value))
    return name


def inserting_after(node: fx.Node) -> AbstractContextManager[None]:
    """Insert new nodes after `node`, in creation order.

    (fx's Graph.inserting_after puts each new node directly after `node`, which
    reverses a sequence of inserts.)
    """
    return node.graph.inserting_before(node.next)


def replace_uses(old: fx.Node, new: fx.Node, keep: Iterable[fx.Node] = ()) -> None:
    """Point every user of `old` at `new`, except the nodes in `keep` (the new subgraph)."""
    keep = set(keep)
    old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in keep)


def set_scope(nodes: Iterable[fx.Node], like: fx.Node) -> None:
    """New nodes inherit the module scope of the node they were inserted beside."""
    for n in nodes:
        n.meta["gg_scope"] = scope_of(like)


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Lint, drop unused modules and recompile after an edit."""
    gm.graph.lint()
    last = next(iter(reversed(gm.graph.nodes)))
    if last.op != "output":
        raise ValidationError(
            f"node '{last.name}' was inserted after the graph's output", "this is a bug in the pass; please report it"
        )
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def new_parameters(old: nn.Module, new: nn.Module) -> dict[str, tuple[torch.Size | None, torch.Size]]:
    """Parameters of `new` that `old` lacks or that grew: name → (old shape, new shape).

    A parameter that only shrank (a branch removed from a merge) holds nothing new.
    """
    before = {n: p.shape for n, p in old.named_parameters()}

    def grew(name: str, shape: torch.Size) -> bool:
        was = before.get(name)
        return was is None or len(was) != len(shape) or any(a > b for a, b in zip(shape, was))

    return {n: (before.get(n), p.shape) for n, p in new.named_parameters() if grew(n, p.shape)}


def upstream_parameters(old: fx.GraphModule, new: fx.GraphModule, grown: dict[str, Any]) -> list[str]:
    """The old parameters nearest upstream of what the pass added or rebuilt, along the data path.

    When the gradient reaches these at insertion, it reaches the new parts' inputs
    too, so a new contribution that still gets none is dead.
    """
    old_names = {n.name for n in old.graph.nodes}
    old_params = {n for n, _ in old.named_parameters()}

    def params_of(n: fx.Node) -> list[str]:
        if n.op == "call_module":
            return [f"{n.target}.{p}" for p, _ in new.get_submodule(n.target).named_parameters()]
        return [str(n.target)] if n.op == "get_attr" else []

    touched = {n for n in new.graph.nodes if n.name not in old_names or any(p in grown for p in params_of(n))}
    found: set[str] = set()
    seen: set[fx.Node] = set()
    todo = [a for t in touched for a in t.all_input_nodes if a not in touched]
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        mine = [p for p in params_of(a) if p in old_params]
        if mine:
            found.update(mine)  # the nearest parameterised ancestor on this path: stop here
        else:
            todo.extend(x for x in a.all_input_nodes if x not in touched)
    return sorted(found)


def computed_from(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it is computed from."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def from_input(node: fx.Node) -> bool:
    """Whether `node` is computed from a model input, not from parameters and constants alone. The walk of
    computed_from, stopping at the first input it meets: analyses ask this of most elementwise ops' operands."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def reads_flag(node: fx.Node) -> bool:
    """Whether `node` is computed from a module's `training` flag (a get_attr of it, as graphgrow traces them)."""
    return any(n.op == "get_attr" and str(n.target).split(".")[-1] == "training" for n in computed_from(node))
