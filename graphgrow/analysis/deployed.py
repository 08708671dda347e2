"""What the deployed function computes: the part of a graph that is not train-only.

A top-level forward that branches on `self.training` (an auxiliary head, a train-only loss
term) traced in train mode holds work that the deployed (eval-mode) function never does. The
tracer then traces the eval-mode code too and records the module paths only the train-mode
code uses (`train_only_modules` in the trace report, kept in saved files). A node is train-only
when it belongs to such a module, or when everything it computes from is train-only (a
`view` of an auxiliary head's output). The deployed part is every node a deployed output (one
that is not train-only) needs, less the train-only nodes; pass defaults only pick places there.

A graph without that record (traced in eval mode, a forward that never branches on the mode,
or a file from an older graphgrow) counts everything that reaches an output as deployed: which
output the deployed function returns cannot be told from the train-mode graph alone (the first
output is not always it), so nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx

from ..graph.graph_meta import scope_of, trace_report


def _with_prefixes(path: str) -> set[str]:
    parts = path.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def used_paths(graph: fx.Graph) -> set[str]:
    """Module and attribute paths a graph uses (called modules, fetched attributes, the modules
    enclosing each node), with every enclosing path."""
    used: set[str] = set()
    for n in graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        paths = [*scope_of(n), *stack.keys()]
        if n.op in ("call_module", "get_attr"):
            paths.append(str(n.target))
        for p in paths:
            if p:
                used |= _with_prefixes(str(p))
    return used


def train_only_modules(train: fx.Graph, eval_graph: Callable[[], fx.Graph | set[str]]) -> list[str] | None:
    """Outermost module paths the train-mode graph uses and the eval-mode one (`eval_graph()`, or the
    paths it uses) does not; None when the eval-mode code cannot be traced (then nothing is known). A
    path counts only when no path under it is used in eval mode, so everything under a listed path is
    train-only."""
    try:
        got = eval_graph()
        deployed = got if isinstance(got, set) else used_paths(got)
    except Exception:  # noqa: BLE001 - the eval-mode code failing to trace only means "unknown" here
        return None
    only = used_paths(train) - deployed
    return sorted(p for p in only if p.rpartition(".")[0] not in only)


def _recorded(gm: fx.GraphModule) -> set[str]:
    """The train-only module paths the trace recorded (a file is untrusted: anything else reads as none)."""
    paths = trace_report(gm).get("train_only_modules")
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        return set()
    return set(paths)


def train_only_note(gm: fx.GraphModule, how: str) -> str:
    """For a refusal's way out: which train-only modules a default left out, and `how` to name one anyway."""
    paths = sorted(_recorded(gm))
    if not paths:
        return ""
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return f"; train-only {shown} (not in the deployed model) is never a default place: {how} to grow it anyway"


def _in_module(n: fx.Node, paths: set[str]) -> bool:
    owners = [*scope_of(n), *([str(n.target)] if n.op in ("call_module", "get_attr") else [])]
    return any(_with_prefixes(p) & paths for p in owners)


def train_only_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes the deployed (eval-mode) function never runs: in a recorded train-only module, or
    computed only from train-only values (parameters aside)."""
    paths = _recorded(gm)
    if not paths:
        return set()
    found: set[fx.Node] = set()
    for n in gm.graph.nodes:  # topological order: a node's inputs are decided before it
        data = [a for a in n.all_input_nodes if a.op != "get_attr"]
        if n.op == "output":
            continue
        if _in_module(n, paths) or (n.op != "placeholder" and data and all(a in found for a in data)):
            found.add(n)
    return found


def deployed_outputs(gm: fx.GraphModule, train_only: set[fx.Node] | None = None) -> list[fx.Node]:
    """The output values the deployed function returns, in output order."""
    train_only = train_only_nodes(gm) if train_only is None else train_only
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [a for a in output.all_input_nodes if a not in train_only]


def deployed_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Every node a deployed output needs, train-only nodes excepted: where pass defaults may grow."""
    train_only = train_only_nodes(gm)
    seen: set[fx.Node] = set()
    todo = deployed_outputs(gm, train_only)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen - train_only
