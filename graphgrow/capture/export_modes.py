"""One graph for both modes from torch.export's eval- and train-mode programs (export_capture.py).

Published code branches on `self.training`: dropout's flag, attention's dropout_p (a constant that differs) and
work done in one mode only or differently in each — drop-path is the identity in eval mode and draws `rand` in
train mode; a Mamba mixer takes another scan in training. The two graphs are aligned as sequences (difflib on each
node's kind and target); the aligned nodes must read aligned inputs, and:

- a constant that differs becomes a run-time read of the owning module's `training` flag (dropout);
- a run of nodes that differs (a hunk: nodes in one graph with no partner in the other) is one value computed
  differently by mode: where an aligned node reads a hunk's value in one mode and another value in the other, that
  value becomes a ModeSwitch (io/mode_switch.py, the fx capture's mechanism) with the flag of the hunk's innermost
  module as its condition and each mode's work as a body (an empty body where a mode hands its input on). Bodies
  are tensor functions only: parameters they read are inputs of the switch, a submodule call in one mode only is
  refused, as is one-mode work nothing reads (it would shift the random draws).

Anything else that differs is refused, naming the module.
"""

from __future__ import annotations

import difflib
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..core.errors import TraceError


@dataclass
class PendingSwitch:
    """A switch call in the merged (train) graph, to become a ModeSwitch module at `path` once its bodies (fx graphs
    of ATen calls: eval's, then train's) are written as torch calls."""

    node: fx.Node
    path: str
    bodies: list[fx.Graph]


def _pending(*args: Any) -> Any:  # pragma: no cover - replaced by a ModeSwitch module before anything runs
    raise RuntimeError("a mode switch was not installed")


def stack(n: fx.Node) -> list[tuple[str, str]]:
    """(call key, module path) of the modules around a node, outermost first."""
    return [(k, v[0]) for k, v in (n.meta.get("nn_module_stack") or {}).items()]


def flat(n: fx.Node) -> tuple[list[Any], TreeSpec]:
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


def set_flat(n: fx.Node, leaves: list[Any], spec: TreeSpec) -> None:
    value = tree_unflatten(leaves, spec)
    if isinstance(value, dict):  # by schema name: back to positional + keyword-only
        schema = n.target._schema  # type: ignore[union-attr]
        n.args = tuple(value[a.name] for a in schema.arguments if not a.kwarg_only)
        n.kwargs = {a.name: value[a.name] for a in schema.arguments if a.kwarg_only}
    else:
        n.args, n.kwargs = value


def _key(n: fx.Node) -> tuple[str, str, tuple[str, ...]]:
    """What a node does and in which module: drop-path's multiply is not the layer scale's beside it."""
    return n.op, str(n.target), tuple(p for _, p in stack(n))


class _Merge:
    def __init__(self, eval_g: fx.Graph, train_g: fx.Graph, name: str):
        self.eval_g, self.train_g, self.name = eval_g, train_g, name
        e_nodes, t_nodes = list(eval_g.nodes), list(train_g.nodes)
        self.emap: dict[fx.Node, fx.Node] = {}  # eval node → its train partner
        self.pairs: list[tuple[fx.Node, fx.Node]] = []
        self.e_hunk: dict[fx.Node, int] = {}
        self.t_hunk: dict[fx.Node, int] = {}
        matcher = difflib.SequenceMatcher(None, [_key(n) for n in e_nodes], [_key(n) for n in t_nodes], autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                self.pairs += list(zip(e_nodes[i1:i2], t_nodes[j1:j2]))
            else:
                h = len({*self.e_hunk.values(), *self.t_hunk.values()})
                self.e_hunk.update({n: h for n in e_nodes[i1:i2]})
                self.t_hunk.update({n: h for n in t_nodes[j1:j2]})
        self.emap = dict(self.pairs)
        self.switches: list[PendingSwitch] = []
        self.made: dict[tuple[Any, Any], fx.Node] = {}
        self.claimed: set[fx.Node] = set()
        self.constants = 0

    def run(self) -> tuple[int, list[PendingSwitch]]:
        for e, t in self.pairs:
            if (e.op == "output" or t.op == "output") and not (e.op == t.op == "output"):
                raise self.error(t, "the graphs end differently")
            (ea, es), (ta, ts) = flat(e), flat(t)
            if es != ts or len(ea) != len(ta):
                raise self.error(t, f"'{t.name}' ({t.target}) has other arguments in train mode")
            changed = False
            for j, (x, y) in enumerate(zip(ea, ta)):
                if isinstance(x, fx.Node) or isinstance(y, fx.Node):
                    if isinstance(x, fx.Node) and self.emap.get(x) is y:
                        continue
                    ta[j] = self.value_switch(x, y, t)
                elif type(x) is not type(y) or x != y:
                    with self.train_g.inserting_before(t):
                        ta[j] = self.constant_switch(t, x, y)
                    self.constants += 1
                else:
                    continue
                changed = True
            if changed:
                set_flat(t, ta, ts)
        for n in [*self.e_hunk, *self.t_hunk]:  # random draws of one mode must all be in a switch's body
            if n not in self.claimed and _impure(n) and (n in self.e_hunk or n.users):
                raise self.error(n, f"'{n.name}' ({n.target}) is one-mode work nothing reads")
        for n in reversed(list(self.t_hunk)):  # the train work the switches took (pure sizes it read stay)
            if not n.users:
                if n not in self.claimed and _impure(n):
                    raise self.error(n, f"'{n.name}' ({n.target}) is one-mode work nothing reads")
                self.train_g.erase_node(n)
        return self.constants, self.switches

    def error(self, at: fx.Node, why: str) -> TraceError:
        s = stack(at)
        where = f" in '{s[-1][1]}'" if s and s[-1][1] else ""
        return TraceError(
            f"the exported train- and eval-mode graphs of {self.name} differ{where}: {why}",
            "mark the module a leaf or capture with --capture fx",
        )

    def flag(self, path: str) -> fx.Node:
        return self.train_g.get_attr(f"{path}.training" if path else "training")

    def constant_switch(self, at: fx.Node, eval_value: Any, train_value: Any) -> fx.Node:
        """An expression of the owning module's `training` flag: `eval_value` in eval, `train_value` in train mode."""
        s = stack(at)
        flag = self.flag(s[-1][1] if s else "")
        if (eval_value, train_value) == (False, True):
            return flag
        if (eval_value, train_value) == (True, False):
            return self.train_g.call_function(operator.not_, (flag,))
        if isinstance(train_value, (int, float)) and not isinstance(train_value, bool) and eval_value == 0:
            return self.train_g.call_function(operator.mul, (flag, train_value))
        raise self.error(at, f"'{at.name}' ({at.target}) uses {train_value!r} in train mode and {eval_value!r} in eval")

    def value_switch(self, x: Any, y: Any, at: fx.Node) -> fx.Node:
        """The switch giving `x` (an eval node) in eval and `y` (a train node) in train mode, read by `at`."""
        if (id(x), id(y)) in self.made:
            return self.made[(id(x), id(y))]
        hunks = {self.e_hunk.get(x), self.t_hunk.get(y)} - {None}
        if not hunks or len(hunks) > 1 or not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
            raise self.error(at, f"'{at.name}' ({at.target}) takes other inputs in train mode")
        h = hunks.pop()
        e_nodes = self.body_nodes(x, self.e_hunk, h)
        t_nodes = self.body_nodes(y, self.t_hunk, h)
        inputs: list[fx.Node] = []  # train-graph nodes the bodies read
        bodies = [self.body(e_nodes, x, self.to_train, inputs), self.body(t_nodes, y, lambda n: n, inputs)]
        sizes = _sizes_of_inputs(inputs)
        for body in bodies:  # placeholders for every input, in one order, before the work
            _place_inputs(body, inputs, sizes)
        inputs = [n for i, n in enumerate(inputs) if i not in sizes]
        scope = _common_scope([*e_nodes, *t_nodes] or [at])
        k = sum(1 for s in self.switches if s.path.rpartition("mode_switch_")[0].rstrip(".") == scope)
        path = f"{scope}.mode_switch_{k}" if scope else f"mode_switch_{k}"
        with self.train_g.inserting_before(at):
            node = self.train_g.create_node(
                "call_function", _pending, (self.flag(scope), *inputs), {}, name=path.replace(".", "_")
            )
        node.meta = dict(y.meta)
        self.switches.append(PendingSwitch(node, path, bodies))
        self.made[(id(x), id(y))] = node
        return node

    def body(self, nodes: list[fx.Node], value: fx.Node, to_train: Any, inputs: list[fx.Node]) -> fx.Graph:
        """One mode's work as a graph; what it reads from outside is added to `inputs` (as train-graph nodes)."""
        body = fx.Graph()
        env: dict[fx.Node, Any] = {}
        inside = set(nodes)

        def read(a: fx.Node) -> Any:
            if a in inside:
                return env[a]
            if a not in env:
                outer = to_train(a)
                if outer not in inputs:
                    inputs.append(outer)
                env[a] = _Later(inputs.index(outer))
            return env[a]

        for n in nodes:
            if n.op != "call_function":
                raise self.error(
                    n, f"the work it does in one mode only calls '{n.target}' (only tensor functions can switch)"
                )
            env[n] = body.node_copy(n, read)
            env[n].meta = dict(n.meta)
        body.output(read(value))
        return body

    def body_nodes(self, value: fx.Node, hunk: dict[fx.Node, int], h: int) -> list[fx.Node]:
        """The nodes of hunk `h` that `value` is computed from (parameters they read are inputs), in graph order."""
        if hunk.get(value) != h:
            return []  # this mode hands an input on
        seen: set[fx.Node] = set()
        todo = [value]
        while todo:
            n = todo.pop()
            if n in seen or hunk.get(n) != h or n.op == "get_attr":
                continue
            seen.add(n)
            todo += n.all_input_nodes
        if seen & self.claimed:
            shared = next(iter(seen & self.claimed))
            raise self.error(shared, f"two values that differ by mode share the step '{shared.name}'")
        self.claimed |= seen
        return [n for n in hunk if n in seen]

    def to_train(self, n: fx.Node) -> fx.Node:
        """The train-graph node standing for eval node `n` read by eval-mode work: its partner, or a parameter read
        again."""
        if n in self.emap:
            return self.emap[n]
        if n.op == "get_attr":
            first = next(m for m in self.train_g.nodes if m.op not in ("placeholder", "get_attr"))
            with self.train_g.inserting_before(first):
                new = self.train_g.get_attr(n.target)  # type: ignore[arg-type]
            new.meta = dict(n.meta)
            self.emap[n] = new
            return new
        raise self.error(n, f"'{n.name}' ({n.target}) feeds work of one mode from work of that mode only")


RANDOM = ("rand", "bernoulli", "normal", "uniform", "dropout", "exponential", "multinomial")


def _impure(n: fx.Node) -> bool:
    """A step whose dropping changes what the model does: a random draw (it shifts every later draw), a mutation."""
    name = str(n.target).removeprefix("aten.").split(".")[0]
    return n.op == "call_function" and (n.is_impure() or name.endswith("_") or any(w in name for w in RANDOM))


class _Later:
    """A body's input before its placeholders exist (they are made once every input of both bodies is known)."""

    def __init__(self, index: int):
        self.index = index


def _sizes_of_inputs(inputs: list[fx.Node]) -> dict[int, tuple[int, int]]:
    """Inputs that are sizes of a tensor input (the batch size a drop-path mask is drawn with, which the export
    reads once off the model's input): index → (that tensor input's index, its dimension). A body reads them off
    its own tensor input, so a switch takes tensors only (the coupling analysis probes it as one)."""
    found: dict[int, tuple[int, int]] = {}
    for i, n in enumerate(inputs):
        v = n.meta.get("val")
        if not isinstance(v, torch.SymInt):
            continue
        for j, t in enumerate(inputs):
            shape = getattr(t.meta.get("val"), "shape", None)
            d = next((d for d, s in enumerate(shape or ()) if str(s) == str(v)), None)
            if isinstance(t.meta.get("val"), torch.Tensor) and d is not None:
                found[i] = (j, d)
                break
    return found


def _place_inputs(body: fx.Graph, inputs: list[fx.Node], sizes: dict[int, tuple[int, int]]) -> None:
    kept = [i for i in range(len(inputs)) if i not in sizes]
    holders: dict[int, fx.Node] = {}
    with body.inserting_before(next(iter(body.nodes))):  # the output at least
        for k, i in enumerate(kept):
            holders[i] = body.placeholder(f"input_{k}")
            holders[i].meta = dict(inputs[i].meta)
        for i, (j, d) in sizes.items():
            holders[i] = body.call_function(torch.ops.aten.sym_size.int, (holders[j], d))
            holders[i].meta = dict(inputs[i].meta)
    for n in body.nodes:
        n.args = _resolve(n.args, holders)
        n.kwargs = _resolve(n.kwargs, holders)
    for i in sizes:  # a body that does not read the size (the identity)
        if not holders[i].users:
            body.erase_node(holders[i])


def _resolve(a: Any, holders: dict[int, fx.Node]) -> Any:
    if isinstance(a, _Later):
        return holders[a.index]
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(x, holders) for x in a)
    if isinstance(a, dict):
        return {k: _resolve(v, holders) for k, v in a.items()}
    return a


def _common_scope(nodes: list[fx.Node]) -> str:
    """The innermost module every node runs in ('' for the model itself)."""
    paths = [[p for _, p in stack(n)] for n in nodes]
    common: list[str] = []
    for level in zip(*paths):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return common[-1] if common else ""


def merge_modes(eval_g: fx.Graph, train_g: fx.Graph, name: str) -> tuple[int, list[PendingSwitch]]:
    """Make train_g compute eval mode too (module docstring). Returns how many constants read the flag and the
    switches made (their calls are in train_g); TraceError where the graphs differ otherwise."""
    return _Merge(eval_g, train_g, name).run()
