"""Merge the traces of every path through a block's mode branches into one graph with run-time switches.

A forward that branches on `self.training` (`if self.training and drop_prob > 0: h = drop_path(h,
drop_prob)`, timm's `if drop_prob == 0. or not training: return x`) cannot be traced once.
trace.py traces the whole model once per path instead: inside the blocks being merged, every
Python branch on a flag or on a live number attribute is answered by a policy and recorded with
its *site* (the conditions asked one after another with no tensor work between them, as in
`a and b` or `a or not b`). The first trace answers every condition True; each trace reveals the
conditions a site asks, and every answer not yet tried is traced next (`unexplored`), so each
site's whole decision tree is covered — a few traces, since all sites are explored at once.

Merging: the tensor work of all traces is aligned node by node with the first trace's (the same
Python ran, so shared work has the same operations in the same order). Work present in every
trace is the skeleton; what lies between two skeleton nodes belongs to the site asked just before
it. Where a skeleton node reads a value that differs between paths, a ModeSwitch computes it:
one small body per path (that path's work, or the identity), chosen at run time by the site's
conditions, which the merged graph computes from the flags and numbers (pure and cheap). In-place
work on a skeleton tensor (`x.div_(keep); x.mul_(mask)`) runs on a clone inside the body and
later readers read the switch: the same values, draws and order, without mutating a tensor
another path reads. What this cannot express — one-mode work calling a submodule, work whose
result nothing reads, paths that differ in how many times they branch — raises MergeError naming
the block, and trace.py keeps that block a leaf with the reason.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from ..graph import ops
from ..io.mode_switch import ModeSwitch
from .makers import describe
from .mode_paths import Condition, MergeError, Path, Policy
from .regions import ancestors_in as _ancestors_in
from .regions import outside_inputs as _outside_inputs
from .regions import pure as _pure


@dataclass
class Switch:
    node: fx.Node  # placeholder call in the merged graph, turned into a call_module by install()
    path: str
    module: ModeSwitch


def _pending_switch(*args: Any) -> Any:  # pragma: no cover - replaced by install() before anything runs
    raise RuntimeError("a mode switch was not installed")


# --- one trace, cut into skeleton, parts and sites -----------------------------------------------


@dataclass
class _Site:
    conditions: list[Condition]
    nodes: list[fx.Node] = field(default_factory=list)  # the work this trace did after the site's conditions

    @property
    def path(self) -> Path:
        return tuple(c.answer for c in self.conditions)


@dataclass
class _Trace:
    graph: fx.Graph
    work: list[fx.Node]
    to_ref: dict[fx.Node, fx.Node]  # aligned work node → the first trace's node
    gaps: list[list[_Site]] = field(default_factory=list)  # per gap between skeleton nodes (gap i ends at skeleton[i])


def _work(graph: fx.Graph, values: set[fx.Node]) -> list[fx.Node]:
    """The graph's tensor work: every node but flag/number reads and arithmetic on them (pure and
    cheap, so the merged graph computes those wherever they are needed, on every path), and queries of a tensor's
    metadata that nothing reads (LeViT's cache key `str(x.device)`: Python read it, no tensor depends on it)."""
    return [n for n in graph.nodes if n not in values and (n.users or not _metadata_query(n))]


def _metadata_query(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target is getattr:
        return len(n.args) > 1 and n.args[1] in ops.TENSOR_ATTRIBUTES
    return n.op == "call_method" and n.target in ops.SHAPE_METHODS


def _key(n: fx.Node) -> tuple[str, str]:
    target = n.target if isinstance(n.target, str) else getattr(n.target, "__qualname__", str(n.target))
    if n.op == "get_attr" and re.fullmatch(r"_tensor_constant\d+", target):
        target = "_tensor_constant"  # fx numbers each trace's constants afresh: the same constant, another name
    return n.op, target


def _aligned(ref: list[fx.Node], other: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Node of `other` → the node of `ref` it aligns with (same operation, same place in the order)."""
    matcher = difflib.SequenceMatcher(None, [_key(n) for n in ref], [_key(n) for n in other], autojunk=False)
    pairs: dict[fx.Node, fx.Node] = {}
    for i, j, size in matcher.get_matching_blocks():
        for k in range(size):
            pairs[other[j + k]] = ref[i + k]
    return pairs


def _cut(t: _Trace, conditions: list[Condition], skeleton: list[fx.Node]) -> None:
    """Split the trace's non-skeleton work into gaps (before each skeleton node) and each gap into sites."""
    bones = set(skeleton)
    on_skeleton = {n for n in t.work if t.to_ref.get(n) in bones}
    by_after: dict[fx.Node | None, list[Condition]] = {}
    for c in conditions:
        by_after.setdefault(c.after, []).append(c)
    gap: list[_Site] = []
    pending: list[fx.Node] = []
    _open_sites(gap, by_after.get(None, []))
    for n in t.work:
        if n in on_skeleton:
            _assign(gap, pending)
            t.gaps.append(gap)
            gap, pending = [], []
            _open_sites(gap, by_after.get(n, []))
            continue
        pending.append(n)
        _open_sites(gap, by_after.get(n, []), pending)
    _assign(gap, pending)
    t.gaps.append(gap)


def _open_sites(gap: list[_Site], conds: list[Condition], pending: list[fx.Node] | None = None) -> None:
    """Conditions asked right after a node join the gap's one site (an `if` nested in another's work adds its
    answers to the path); work seen before them belongs to the site so far."""
    if not conds:
        return
    if pending:
        _assign(gap, pending)
        pending.clear()
    if not gap:
        gap.append(_Site([]))
    gap[0].conditions.extend(sorted(conds, key=lambda c: (c.site, c.position)))


def _assign(gap: list[_Site], pending: list[fx.Node]) -> None:
    if not pending:
        return
    if not gap:
        raise MergeError(
            _scope(pending[0]), f"{_named(pending[0])} runs on one path only but no condition comes before it"
        )
    gap[-1].nodes.extend(pending)


def _named(n: fx.Node) -> str:
    """A node as a merge failure names it: its name and the model's line that made it."""
    return f"'{n.name}'{_at(n)}"


def _at(n: fx.Node) -> str:
    where = n.meta.get("gg_source")
    return f" at {describe(where)}" if where else ""


def _scope(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack), "") if stack else ""


# --- in-place work on skeleton tensors -----------------------------------------------------------

_VIEWS = ops.MAY_ALIAS


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


def _is_in_place(n: fx.Node) -> bool:
    name = _name(n)
    return (
        n.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__")
    ) or n.kwargs.get("inplace") is True


def _may_alias(n: fx.Node) -> bool:
    return n.op in ("placeholder", "get_attr") or _name(n) in _VIEWS or any(_name(u) in _VIEWS for u in n.users)


def _clone_mutated(graph: fx.Graph, site: _Site, where: str) -> None:
    """In-place work of a site on a tensor from outside it runs on a clone; every later reader of the
    tensor reads the last in-place step instead (the same object at run time, now also in the graph)."""
    for n in list(site.nodes):
        if not _is_in_place(n):
            continue
        if n.op != "call_method" or not n.args or not isinstance(n.args[0], fx.Node):
            raise MergeError(where, f"{_named(n)} works in place on one path only")
        x = n.args[0]
        if x not in site.nodes:
            if _may_alias(x):
                raise MergeError(
                    where, f"{_named(n)} works in place on '{x.name}', which may share memory with another tensor"
                )
            with graph.inserting_before(n):
                clone = graph.call_method("clone", (x,))
            clone.meta = dict(n.meta)
            site.nodes.insert(site.nodes.index(n), clone)
            n.replace_input_with(x, clone)
        order = {m: i for i, m in enumerate(graph.nodes)}
        for user in list(x.users):
            if user is not n and order[user] > order[n]:
                user.replace_input_with(x, n)


# --- the merge -----------------------------------------------------------------------------------


def merge(traces: dict[Policy, tuple[fx.Graph, Any]]) -> tuple[fx.Graph, list[Switch]]:
    """One graph computing every path, from {policy: (graph, tracer)}; the () trace (all True) is the reference."""
    ref_graph, ref_tracer = traces[()]
    ref_work = _work(ref_graph, ref_tracer.values)
    found: dict[Policy, _Trace] = {}
    for key, (graph, tracer) in traces.items():
        work = _work(graph, tracer.values)
        found[key] = _Trace(graph, work, {n: n for n in work} if key == () else _aligned(ref_work, work))
    reached = [set(t.to_ref.values()) for t in found.values()]
    skeleton = [r for r in ref_work if all(r in seen for seen in reached)]
    bones = set(skeleton)
    for key, t in found.items():
        t.to_ref = {n: r for n, r in t.to_ref.items() if r in bones}
        _cut(t, traces[key][1].conditions, skeleton)
    counts = {len(t.gaps) for t in found.values()}
    if counts != {len(skeleton) + 1}:
        conds = traces[()][1].conditions
        raise MergeError(conds[0].reader if conds else "", "its paths do not share the same skeleton of work")
    for t in found.values():
        before = set(t.work)
        for gap in t.gaps:
            for site in gap:
                _clone_mutated(t.graph, site, site.conditions[0].reader)
        added = {n for gap in t.gaps for site in gap for n in site.nodes} - before
        t.work = [n for n in t.graph.nodes if n in before or n in added]
    return _Builder(found, skeleton).build()


class _Builder:
    def __init__(self, found: dict[Policy, _Trace], skeleton: list[fx.Node]):
        self.found, self.skeleton = found, skeleton
        self.from_ref = {key: {r: n for n, r in t.to_ref.items()} for key, t in found.items()}
        self.merged = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}  # reference skeleton node → merged node
        self.values: dict[Any, fx.Node] = {}  # structural key of a flag/number value → merged node
        self.switches: list[Switch] = []
        self.counters: dict[str, int] = {}
        self.claimed: set[fx.Node] = set()
        self.work_sets = {key: set(t.work) for key, t in found.items()}

    def build(self) -> tuple[fx.Graph, list[Switch]]:
        # first pass: which values differ between paths (switch requests); second: the graph, each
        # gap's switches emitted before the skeleton node that ends it, in the order their work ran
        self.requests: dict[tuple[int, tuple], tuple[int, int, int]] = {}  # (gap, per-trace values) → place
        self.outputs: dict[tuple[int, tuple], fx.Node] = {}
        self.collecting = True
        for i, r in enumerate(self.skeleton):
            self._args(r, [self._read(key, r) for key in self.found], i)
        self.collecting = False
        for i, r in enumerate(self.skeleton):
            for request in sorted(
                (q for q, loc in self.requests.items() if loc[0] == i), key=self.requests.__getitem__
            ):
                self.outputs[request] = self._switch_output(request)
            args, kwargs = self._args(r, [self._read(key, r) for key in self.found], i)
            node = self.merged.create_node(r.op, r.target, args, kwargs, name=r.name)
            node.meta = dict(r.meta)
            self.env[r] = node
        leftover = [
            n for t in self.found.values() for gap in t.gaps for s in gap for n in s.nodes if n not in self.claimed
        ]
        if leftover:
            raise MergeError(
                _scope(leftover[0]),
                f"work it does on one path only ({_named(leftover[0])}) has no result the rest of the forward reads",
            )
        self.merged.lint()
        return self.merged, self.switches

    # what each trace's copy of skeleton node r reads, per argument
    def _read(self, key: Policy, r: fx.Node) -> fx.Node:
        return self.from_ref[key][r]

    def _args(self, r: fx.Node, reads: list[fx.Node], gap: int) -> tuple[Any, Any]:
        keys = list(self.found)

        def walk(ref_arg: Any, others: list[Any]) -> Any:
            if isinstance(ref_arg, fx.Node) or any(isinstance(o, fx.Node) for o in others):
                return self._value_read(dict(zip(keys, others)), r, gap)
            if isinstance(ref_arg, (list, tuple)):
                if not all(isinstance(o, (list, tuple)) and len(o) == len(ref_arg) for o in others):
                    raise MergeError(_scope(r), f"{_named(r)} reads differently shaped arguments on different paths")
                out = [walk(a, [o[i] for o in others]) for i, a in enumerate(ref_arg)]
                return tuple(out) if isinstance(ref_arg, tuple) else out
            if isinstance(ref_arg, dict):
                return {
                    k: walk(v, [o.get(k) if isinstance(o, dict) else None for o in others]) for k, v in ref_arg.items()
                }
            if isinstance(ref_arg, slice):
                parts = [
                    walk(getattr(ref_arg, a), [getattr(o, a, None) for o in others]) for a in ("start", "stop", "step")
                ]
                return slice(*parts)
            if any(o != ref_arg or type(o) is not type(ref_arg) for o in others):
                return self._value_read(dict(zip(keys, others)), r, gap)  # a number chosen by the branch
            return ref_arg

        return walk(r.args, [n.args for n in reads]), walk(r.kwargs, [n.kwargs for n in reads])

    def _value_read(self, per_trace: dict[Policy, Any], r: fx.Node, gap: int) -> Any:
        """The merged value of an argument of skeleton node `r`: a skeleton node, a flag/number value, or
        the output of a switch (one path's work, or a number a branch chooses: `p if self.training else 0.`)."""
        if all(isinstance(v, fx.Node) for v in per_trace.values()):
            mapped = {k: self.found[k].to_ref.get(v) for k, v in per_trace.items()}
            if all(m is not None for m in mapped.values()) and len(set(mapped.values())) == 1:
                return None if self.collecting else self.env[next(iter(mapped.values()))]
            if all(self._is_value(k, v) for k, v in per_trace.items()):
                if self.collecting:
                    return None
                copies = {self._copy_value(k, v) for k, v in per_trace.items()}
                if len(copies) == 1:
                    return copies.pop()
        elif not all(
            type(v) in (bool, int, float, type(None)) or (isinstance(v, fx.Node) and self._is_value(k, v))
            for k, v in per_trace.items()
        ):
            raise MergeError(
                self._gap_reader(gap) or _scope(r), f"{_named(r)} reads a tensor on one path and a constant on another"
            )
        request = (gap, tuple(per_trace.values()))
        if self.collecting:
            if request not in self.requests:
                self.requests[request] = self._order(per_trace, gap, r)
            return None
        return self.outputs[request]

    def _gap_reader(self, gap: int) -> str:
        """The module whose branch governs a gap (the reader of its first condition on any path)."""
        return next(
            (
                site.conditions[0].reader
                for t in self.found.values()
                if gap < len(t.gaps)
                for site in t.gaps[gap]
                if site.conditions
            ),
            "",
        )

    def _order(self, per_trace: dict[Policy, Any], gap: int, r: fx.Node) -> tuple[int, int, int]:
        """(gap, site, position of the first work in the reference trace) of a value that differs between paths."""
        sites = {
            loc for k, v in per_trace.items() if isinstance(v, fx.Node) and (loc := self._site_of(k, v)) is not None
        }
        if not sites and all(len(t.gaps[gap]) == 1 for t in self.found.values()):
            sites = {(gap, 0)}  # a choice between values, made by the one branch before its reader
        if len(sites) != 1:
            raise MergeError(
                self._gap_reader(gap) or _scope(r),
                "a value differs between paths in a way that is not "
                "one branch's work (several branches in a row, or "
                "work read past its branch)",
            )
        g, s = sites.pop()
        order = {n: i for i, n in enumerate(self.found[()].work)}
        ref_site = self.found[()].gaps[g][s] if s < len(self.found[()].gaps[g]) else None
        ref_value = per_trace[()]
        first = (
            min((order[n] for n in _ancestors_in(ref_value, ref_site.nodes)), default=len(order))
            if ref_site and isinstance(ref_value, fx.Node)
            else -1
        )
        return g, s, first

    def _is_value(self, key: Policy, n: fx.Node) -> bool:
        return n not in self.work_sets[key]

    def _copy_value(self, key: Policy, n: fx.Node) -> fx.Node:
        """A flag/number value (or a condition) in the merged graph, shared by structure across traces."""
        skey = self._structure(key, n)
        if skey not in self.values:
            if not self._is_value(key, n):
                mapped = self.found[key].to_ref.get(n)
                if mapped is None:
                    raise MergeError(_scope(n), f"{_named(n)} is read outside the path it runs on")
                return self.env[mapped]
            for a in n.all_input_nodes:
                self._copy_value(key, a)
            node = self.merged.node_copy(n, lambda a: self._copy_value(key, a))
            self.values[skey] = node
        return self.values[skey]

    def _structure(self, key: Policy, n: Any) -> Any:
        if isinstance(n, fx.Node):
            if not self._is_value(key, n):
                return ("work", self.found[key].to_ref.get(n, n).name)
            return (n.op, _key(n)[1], self._structure(key, n.args), self._structure(key, tuple(n.kwargs.items())))
        if isinstance(n, (list, tuple)):
            return tuple(self._structure(key, x) for x in n)
        return repr(n)

    # --- switches ---------------------------------------------------------------------------
    def _site_of(self, key: Policy, n: fx.Node) -> tuple[int, int] | None:
        for g, gap in enumerate(self.found[key].gaps):
            for s, site in enumerate(gap):
                if n in site.nodes:
                    return g, s
        return None

    def _switch_output(self, request: tuple[int, tuple]) -> fx.Node:
        g, s, _ = self.requests[request]
        per_trace = dict(zip(self.found, request[1]))
        if any(len(t.gaps[g]) <= s for t in self.found.values()):
            raise MergeError(self._gap_reader(g), "its paths branch a different number of times")
        site_per_trace = {k: t.gaps[g][s] for k, t in self.found.items()}
        where = site_per_trace[()].conditions[0].reader
        paths: dict[Path, Policy] = {}  # path at this site → the first trace that took it
        for k, site in site_per_trace.items():
            paths.setdefault(site.path, k)
        inputs: list[fx.Node] = []  # merged nodes the bodies read
        conditions: list[fx.Node] = []
        table: list[list[tuple[int, bool]]] = []
        chosen: list[tuple[list[fx.Node], fx.Node, dict[fx.Node, fx.Node]]] = []
        for k in site_per_trace:
            # Traces that took the same path here did the same work (a policy for an `if` that joined an earlier
            # chain — a nested `if` asked right after another — changes nothing): the first one's work is the body,
            # the others' is accounted for by it.
            site, value = site_per_trace[k], per_trace[k]
            nodes = (
                [n for n in site.nodes if n in _ancestors_in(value, site.nodes)] if isinstance(value, fx.Node) else []
            )
            shared = [n for n in nodes if n in self.claimed and not _pure(n)]
            if shared:  # two switches would each run it: random draws or in-place steps twice
                raise MergeError(where, f"two values it computes on one path share the step {_named(shared[0])}")
            self.claimed.update(nodes)
            if paths[site.path] != k:
                continue
            outside = (
                {x: self._copy_value(k, x) for x in _outside_inputs(nodes, value)} if isinstance(value, fx.Node) else {}
            )
            inputs += [m for m in outside.values() if m not in inputs]
            chosen.append((nodes, value, outside))
            row = []
            for c in site.conditions:
                cond = self._copy_value(k, c.node)
                if cond not in conditions:
                    conditions.append(cond)
                row.append((conditions.index(cond), c.answer))
            table.append(row)
        bodies = [_body(nodes, value, inputs, outside, where) for nodes, value, outside in chosen]
        n = self.counters[where] = self.counters.get(where, -1) + 1
        node = self.merged.create_node(
            "call_function",
            _pending_switch,
            (*conditions, *inputs),
            {},
            name=f"{where.replace('.', '_')}_mode_switch_{n}",
        )
        node.meta = dict(next((v.meta for v in per_trace.values() if isinstance(v, fx.Node)), {}))
        self.switches.append(Switch(node, f"{where}.mode_switch_{n}", ModeSwitch(len(conditions), table, bodies)))
        return node


def _body(
    nodes: list[fx.Node], value: Any, inputs: list[fx.Node], outside: dict[fx.Node, fx.Node], where: str
) -> list[dict]:
    """One path's work as a stand-alone graph over the switch's inputs (merged nodes), as stored records."""
    from ..io.serialize import node_records  # the one format for graphs kept as data

    graph = fx.Graph()
    placeholders = {m: graph.placeholder(f"input_{i}") for i, m in enumerate(inputs)}
    env: dict[fx.Node, fx.Node] = {x: placeholders[m] for x, m in outside.items()}
    for n in nodes:
        if n.op not in ("call_function", "call_method"):
            raise MergeError(
                where,
                f"the work it does on one path only uses '{n.target}'{_at(n)} (only tensor functions and "
                "methods can be switched, not submodules or parameters)",
            )
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[value] if isinstance(value, fx.Node) else value)
    return node_records(graph)


def install(gm: fx.GraphModule, switches: list[Switch]) -> None:
    """Put the switch modules into the traced GraphModule and turn their calls into module calls."""
    for s in switches:
        s.module.load_bodies(trusted=True)  # made here from the traced model, not read from a file
        gm.add_submodule(s.path, s.module)
        s.node.op, s.node.target = "call_module", s.path
    if switches:
        gm.recompile()
