"""deepen's block=copy: a copy of one of the model's own layers, inserted into its stack as the identity.

The stack is a container of numbered layers (`model.layers.{i}`, `transformer.h.{i}`) whose children hold the same
parameters; a layer is the graph's nodes inside it (by call target or recorded scope), with one tensor of the
residual stream in and one out (analysis.stream). The copy is the layer's own module deep-copied (its attention,
RoPE, grouped heads, MLP kind, norms) and its nodes duplicated with their targets moved to the copy's path. The
copy's writers onto the stream — the output projections the stream analysis finds (o_proj, down_proj, GPT-2's
c_proj, …), weight and bias; where that analysis refuses the model (it refuses what it could not grow: Gemma's own
RMSNorm, OPT's offset position embedding), the Linear each residual branch comes from — are set to zero; a layer in
residual form (the stream passes through it only by sums `x + branch` and reshapes, every branch ending at a
writer) is then exactly the identity in eval and train mode (checked by running the copy: every branch it adds is
zero), and the zero projections get a gradient at once (each multiplies its layer's non-zero input).

The copy is registered under the next free index of the stack (`model.layers.{n}`), so every parameter keeps its
name (the optimiser's state, verification and diff go by names); the graph runs the layers in their new order, and
`as_native` numbers them in that order. `gm.meta["graphgrow"]["layer_copies"]` records which layer each copy came
from (its per-layer config entries, such as layer_types, follow it).

Refused, naming why: no stack of numbered layers with the same parameters; a layer that is not one tensor of the
stream in and one out; a stream that passes anything but residual sums inside the layer — a post-norm layer (BERT:
LayerNorm(x + sublayer(x)); a zeroed sublayer leaves LayerNorm(x), not x), for which block=transformer inserts a
pre-norm block instead; a branch that is not zero with the projections at zero.
"""

from __future__ import annotations

import copy
import operator
import re
from dataclasses import dataclass

import torch
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Rewrite
from graphgrow.rewrite import (
    Stream,
    example_input,
    find_node,
    find_stream,
    finish,
    input_spec_of,
    is_float_tensor,
    nodes_in_module,
    ops,
    param_count,
    pick_within_budget,
    replace_uses,
    tensor_or_feature_end,
    tensor_shape,
)

_NUMBERED = re.compile(r"^(?P<stack>.+)\.(?P<index>\d+)$")
COPIES_KEY = "layer_copies"  # graph metadata: copy's path → the path of the layer it was copied from


@dataclass
class Layer:
    path: str
    index: int
    nodes: list[fx.Node]  # graph order
    x_in: fx.Node  # the stream tensor it reads
    x_out: fx.Node  # the stream tensor it hands on
    writers: list[str]  # nodes of its writers onto the stream (output projections)
    params: list[tuple[str, int]]  # the writers' (parameter path, dimension along the stream)
    sums: list[tuple[fx.Node, fx.Node]]  # the residual sums along the stream, each with the branch it adds


@dataclass
class Stack:
    path: str
    layers: list[Layer]  # in the order the graph runs them


def _numbered_children(gm: fx.GraphModule) -> dict[str, dict[int, nn.Module]]:
    found: dict[str, dict[int, nn.Module]] = {}
    for path, m in gm.named_modules():
        match = _NUMBERED.match(path)
        if match and any(True for _ in m.parameters()):
            found.setdefault(match["stack"], {})[int(match["index"])] = m
    return found


def _repeated(children: dict[int, nn.Module]) -> bool:
    """Numbered 0..n-1 (copies may follow) and holding the same parameter names: a stack of one kind of layer."""
    names = [sorted(n for n, _ in m.named_parameters()) for _, m in sorted(children.items())]
    return sorted(children) == list(range(len(children))) and all(n == names[0] for n in names)


def find_stack(gm: fx.GraphModule, after: str | None = None) -> Stack:
    """The model's stack of repeated layers on its residual stream: the one `after` names a layer of (an encoder's or
    a decoder's), else the one with the most parameters."""
    stacks = {p: c for p, c in _numbered_children(gm).items() if _repeated(c)}
    if not stacks:
        raise NotApplicable(
            "block=copy copies one of the model's repeated layers, and the model has no stack of numbered layers "
            "holding the same parameters (such as model.layers.0, model.layers.1)",
            "use block=transformer (a new pre-norm block) or block=linear_relu / conv_bn_relu",
        )
    named = [p for p in stacks if after is not None and after.startswith(p + ".")]
    path = max(named or stacks, key=lambda p: sum(param_count(m) for m in stacks[p].values()))
    try:
        stream: Stream | None = find_stream(gm)
    except NotApplicable:
        # the stream analysis refuses what it could not grow (Gemma's own RMSNorm, OPT's offset position embedding);
        # a copy grows no stream: each layer's branches are then followed back to their projections (_branch_writer)
        stream = None
    layers = [_layer(gm, stream, f"{path}.{i}", i) for i in sorted(stacks[path])]
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    return Stack(path, sorted(layers, key=lambda layer: order[layer.nodes[0]]))


def _layer(gm: fx.GraphModule, stream: Stream | None, path: str, index: int) -> Layer:
    nodes = nodes_in_module(gm, path)
    members = set(nodes) | {n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith(path + ".")}
    for n in gm.graph.nodes:  # work on the layer's own values only (GPT-2's dropout p from its training flag)
        if n not in members and n.all_input_nodes and set(n.all_input_nodes) <= members and set(n.users) <= members:
            members.add(n)
    nodes = [n for n in gm.graph.nodes if n in members]
    outs = [n for n in nodes if any(u not in members for u in n.users)]

    def on_stream(a: fx.Node) -> bool:  # the stream's tensors; without the analysis, float tensors of its shape
        if stream is not None:
            return a.name in stream.axes
        return is_float_tensor(a) and len(outs) == 1 and tensor_shape(a) == tensor_shape(outs[0])

    ins = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members and on_stream(a)))
    if len(ins) != 1 or len(outs) != 1 or not on_stream(outs[0]):
        raise NotApplicable(
            f"layer {path} reads {len(ins)} tensors of the residual stream ({', '.join(a.name for a in ins)}) and "
            f"hands {len(outs)} on ({', '.join(o.name for o in outs)}): not one layer on the stream",
            "use block=transformer",
        )
    layer = Layer(path, index, nodes, ins[0], outs[0], [], [], [])
    layer.sums = _residual_form(gm, layer)
    if stream is not None:
        found = [w for w in stream.writers if find_node(gm, w.node) in members]
        odd = [w.node for w in found if w.what != "linear" or not w.params]
        writers = [(w.node, w.params) for w in found]
    else:
        writers = [_branch_writer(gm, layer, branch) for _, branch in layer.sums]
        odd = []
    if not writers or odd:
        raise NotApplicable(
            f"layer {path} writes the residual stream through "
            + (f"{', '.join(odd)}, not a Linear projection" if odd else "no Linear projection"),
            "use block=transformer",
        )
    layer.writers, layer.params = [w for w, _ in writers], [p for _, ps in writers for p in ps]
    return layer


def _branch_writer(gm: fx.GraphModule, layer: Layer, branch: fx.Node) -> tuple[str, list[tuple[str, int]]]:
    """The Linear a residual branch comes from, followed back through ops of one tensor input of the branch's shape
    (dropout, casts); whether zeroing it zeroes the branch is checked by running the copy (_check_identity)."""
    n, members = branch, set(layer.nodes)
    while n in members:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear):
            lin = gm.get_submodule(n.target)
            return n.name, [(f"{n.target}.weight", 0)] + ([(f"{n.target}.bias", 0)] if lin.bias is not None else [])
        tensors = [a for a in n.all_input_nodes if is_float_tensor(a)]
        if len(tensors) != 1 or tensor_shape(tensors[0]) != tensor_shape(n):
            break
        n = tensors[0]
    raise NotApplicable(
        f"layer {layer.path} adds '{branch.name}' to the stream, which does not come from a Linear projection "
        f"(followed back to '{n.name}')",
        "use block=transformer",
    )


def _is_sum(n: fx.Node, x: fx.Node) -> bool:
    """x + branch (or branch + x): the stream passing a residual sum."""
    is_add = (n.op == "call_function" and n.target in (operator.add, torch.add)) or (
        n.op == "call_method" and n.target == "add"
    )
    return is_add and x in n.args[:2] and tensor_shape(n) == tensor_shape(x)


def _residual_form(gm: fx.GraphModule, layer: Layer) -> list[tuple[fx.Node, fx.Node]]:
    """The stream goes from the layer's input to its output through residual sums (and reshapes) only: each (sum,
    branch)."""
    members = set(layer.nodes)
    x, sums = layer.x_in, []
    while x is not layer.x_out:
        found = [u for u in x.users if u in members and _is_sum(u, x)]
        views = [u for u in x.users if u in members and ops.op_name(u.target) in ops.RESHAPES and u.args[0] is x]
        if not found and len(views) == 1:  # the stream reshaped and back (OPT flattens the tokens around its MLP)
            x = views[0]
            continue
        if len(found) != 1:
            onward = [u for u in x.users if u in members and u.op == "call_module"]
            norms = [
                u.target
                for u in onward
                if isinstance(gm.get_submodule(u.target), (nn.LayerNorm, nn.RMSNorm)) and x is not layer.x_in
            ]
            why = (
                f"is post-norm: its stream passes {norms[0]} after the residual sum ('{x.name}'), and a norm of "
                "x + 0 is not x"
                if norms
                else f"does not pass the stream on from '{x.name}' by one residual sum"
            )
            raise NotApplicable(
                f"layer {layer.path} {why}: a copy with its output projections at zero would not be the identity",
                "use block=transformer (a pre-norm block, the identity where it is inserted)",
            )
        branch = next((a for a in found[0].args[:2] if a is not x), None)
        if not isinstance(branch, fx.Node):
            raise NotApplicable(f"layer {layer.path} adds no branch at '{found[0].name}'", "use block=transformer")
        sums.append((found[0], branch))
        x = found[0]
    return sums


def stack_places(stack: Stack) -> list[tuple[fx.Node, int]]:
    """(node, k): insert after the k-th layer in run order (k = -1: before the first), the last first."""
    return [(layer.x_out, k) for k, layer in reversed(list(enumerate(stack.layers)))] + [(stack.layers[0].x_in, -1)]


def layer_params(gm: fx.GraphModule, layer: Layer) -> int:
    return param_count(gm.get_submodule(layer.path))


def copy_candidates(gm: fx.GraphModule) -> list[Candidate]:
    try:
        stack = find_stack(gm)
    except NotApplicable:
        return []
    default, _, _ = copy_place(gm, stack, None)
    out = []
    for node, k in stack_places(stack):
        source = stack.layers[max(k, 0)]
        where = f"after {stack.layers[k].path}" if k >= 0 else f"before {source.path}"
        out.append(
            Candidate(
                {"after": stack.layers[k].path if k >= 0 else node.name},  # a layer by its path, as as_native names it
                f"{where}: a copy of {source.path}",
                layer_params(gm, source),
                node is default,
            )
        )
    return out


def copy_place(gm: fx.GraphModule, stack: Stack, after: str | None) -> tuple[fx.Node, int, str]:
    """The place (a stream tensor between two layers), its position in the stack, and why it was chosen."""
    places = stack_places(stack)
    if after is None:
        total = max(param_count(gm), 1)
        (node, k), over = pick_within_budget(places[:-1], lambda p: layer_params(gm, stack.layers[p[1]]), total)
        which = "after the last layer" if k == len(stack.layers) - 1 else "the latest layer within the budget"
        return node, k, f"{which}{over}"
    by_path = {layer.path: layer.x_out for layer in stack.layers}
    node = by_path.get(after) or find_node(gm, after) or tensor_or_feature_end(gm, after)[0]
    for n, k in places:
        if n is node:
            return n, k, "given"
    raise NotApplicable(
        f"block=copy puts a layer between two layers of {stack.path}, and '{after}' is not a layer's output "
        f"(places: {', '.join(n.name for n, _ in places)})",
        f"name a layer (e.g. {stack.layers[-1].path}) or one of those nodes",
    )


def insert_copy(gm: fx.GraphModule, after: str | None, source: int | None) -> Rewrite:
    """block=copy: a copy of layer `source` (default: the layer before the place) after `after`."""
    stack = find_stack(gm, after)
    at, k, chosen = copy_place(gm, stack, after)
    by_index = {layer.index: layer for layer in stack.layers}
    if source is not None and source not in by_index:
        raise NotApplicable(
            f"source={source}: {stack.path} has layers {sorted(by_index)}", f"give one of {sorted(by_index)}"
        )
    src = by_index[source] if source is not None else stack.layers[max(k, 0)]
    new_index = max(by_index) + 1
    new_path = f"{stack.path}.{new_index}"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchor = min(at.users, key=lambda u: order[u])  # the copy runs before anything that read the place
    members = set(src.nodes)
    late = [a for n in src.nodes for a in n.all_input_nodes if a not in members and order[a] >= order[anchor]]
    if late:
        raise NotApplicable(
            f"{src.path} reads '{late[0].name}', which the model computes after the place '{at.name}'",
            "copy a layer before the place (source= a layer that runs earlier)",
        )
    gm.get_submodule(stack.path).add_module(str(new_index), copy.deepcopy(gm.get_submodule(src.path)))

    def moved(path: str) -> str:
        return new_path + path[len(src.path) :] if path == src.path or path.startswith(src.path + ".") else path

    with torch.no_grad():  # the copy's output projections (its own tensors, from the deepcopy) start at zero
        for p, _ in src.params:
            gm.get_parameter(moved(p)).zero_()
    env: dict[fx.Node, fx.Node] = {src.x_in: at}
    with gm.graph.inserting_before(anchor):
        for n in src.nodes:
            new = gm.graph.node_copy(n, lambda a: env.get(a, a))
            if new.op in ("call_module", "get_attr"):
                new.target = moved(str(new.target))
            new.meta["gg_scope"] = tuple(moved(s) for s in n.meta.get("gg_scope", ()))
            stack_meta = n.meta.get("nn_module_stack")
            if stack_meta:
                new.meta["nn_module_stack"] = {moved(key): (moved(v[0]), *v[1:]) for key, v in stack_meta.items()}
            env[n] = new
    made = [env[n] for n in src.nodes]
    replace_uses(at, env[src.x_out], keep=made)
    finish(gm)
    _check_identity(gm, src, env)
    info = gm.meta["graphgrow"]
    info[COPIES_KEY] = {**info.get(COPIES_KEY, {}), new_path: src.path}
    shape = list(tensor_shape(at) or [])
    where = f"after {stack.layers[k].path}" if k >= 0 else f"before {stack.layers[0].path}"
    targets = {
        "after": f"{at.name} {shape}",
        "chosen": chosen,
        "block": (
            f"copy ({new_path}) of {src.path}, {where}: its output projections "
            f"{', '.join(sorted({moved(p) for p, _ in src.params}))} = 0"
        ),
    }
    rw = Rewrite(gm, targets)
    rw.notes.append(
        f"{new_path} runs at position {k + 2} of {len(stack.layers) + 1} in {stack.path}; "
        "as_native numbers the layers in the order they run"
    )
    return rw


def _check_identity(gm: fx.GraphModule, src: Layer, env: dict[fx.Node, fx.Node]) -> None:
    """Each branch the copy adds to the stream is zero on the example input (a clear refusal here, before
    verification): what reaches the stream must come through the zeroed projections."""
    if any(p.is_meta for p in gm.parameters()):
        return  # sized before it runs: verification runs it
    branches = [(env[s], env.get(b, b)) for s, b in src.sums]
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    was = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            x = example_input(gm, input_spec_of(gm), seed=0)
            interp.run(*(x.values() if isinstance(x, dict) else (x,)))
    finally:
        gm.train(was)
    for total, branch in branches:
        if torch.count_nonzero(interp.env[branch]):
            raise NotApplicable(
                f"the copy of {src.path} adds '{branch.name}' to the stream at '{total.name}', which is not zero "
                "with the output projections at zero",
                "use block=transformer",
            )
