"""Looking through containers: a call of a module that holds other modules becomes the nodes of its forward.

Passes insert their blocks as modules (an nn.Sequential branch, deepen's conv/BN/ReLU). Left as one call_module
node, such a block is opaque to every analysis that reads the graph (coupling, stages, defaults, fold, targets):
the channel groups it touches freeze. Inlined, the block is the same layers called one by one (`branch.1`,
`branch.2`, ...), which the analyses understand like any traced model's layers; the module tree, its parameter
names and a saved file's format stay as they were.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx, nn

from .graph_meta import scope_of


def is_container(m: nn.Module) -> bool:
    """A module built of other modules (a leaf layer such as Conv2d or BatchNorm has no children)."""
    return next(m.children(), None) is not None


def _trace(m: nn.Module) -> fx.Graph | None:
    """The forward of `m` as a graph of its children's calls, or None when fx cannot trace it or its traced code
    differs between train and eval mode (that forward branches on self.training: one graph cannot hold both)."""
    was = m.training
    graphs = []
    try:
        for mode in (False, True):
            m.train(mode)
            graphs.append(fx.Tracer().trace(m))
    except Exception:  # noqa: BLE001 (any tracing failure means: keep the call as it is)
        return None
    finally:
        m.train(was)
    code = [fx.GraphModule(m, g).code for g in graphs]
    return graphs[0] if code[0] == code[1] else None


def inline_call(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node] | None:
    """Replace the call_module `node` (a container) by the nodes of its forward, in place; returns the new nodes
    (None when it stays: not a container, not traceable, or called with arguments its forward does not bind)."""
    if node.op != "call_module" or not is_container(module := gm.get_submodule(str(node.target))):
        return None
    graph = _trace(module)
    if graph is None:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if node.kwargs or len(node.args) > len(placeholders) or any(not p.args for p in placeholders[len(node.args) :]):
        return None
    env: dict[fx.Node, object] = dict(zip(placeholders, node.args))
    env.update((p, p.args[0]) for p in placeholders[len(node.args) :])  # defaults of arguments not given
    prefix, scope = str(node.target), scope_of(node) + (str(node.target),)
    made: list[fx.Node] = []
    result: object = None
    with gm.graph.inserting_before(node):
        for n in graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.map_arg(n.args[0], env.__getitem__)
                break
            target = f"{prefix}.{n.target}" if n.op in ("call_module", "get_attr") else n.target
            new = gm.graph.create_node(
                n.op,
                target,
                fx.map_arg(n.args, env.__getitem__),
                fx.map_arg(n.kwargs, env.__getitem__),
                name=f"{prefix}_{n.name.lstrip('_')}".replace(".", "_"),
            )
            new.meta["gg_scope"] = scope
            env[n] = new
            made.append(new)
    if not isinstance(result, fx.Node):  # a container returning a tuple or a constant: keep the call
        for n in reversed(made):
            gm.graph.erase_node(n)
        return None
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    return made


def inline_containers(gm: fx.GraphModule, paths: Iterable[str]) -> list[str]:
    """Inline every call of the modules at `paths` (and below them) that is a traceable container, repeatedly
    (a container inside a container); returns the paths inlined. The caller recompiles (fx_edit.finish)."""
    roots = tuple(paths)
    done: list[str] = []
    changed = True
    while changed:
        changed = False
        for n in list(gm.graph.nodes):
            target = str(n.target)
            if (
                n.op == "call_module"
                and any(target == r or target.startswith(r + ".") for r in roots)
                and inline_call(gm, n) is not None
            ):
                done.append(target)
                changed = True
    return done
