"""nn.Module → torch.fx.GraphModule, with leaf modules for the parts fx cannot trace."""
from __future__ import annotations

from typing import Iterable, Sequence

from torch import fx, nn

from .errors import InputError, TraceError

META_KEY = "graphgrow"


class _Tracer(fx.Tracer):
    """Symbolic tracer that honours user leaves and remembers where it is."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves
        self.stack: list[tuple[str, str]] = []  # (module path, class name), innermost last

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.stack.append((self.path_of_module(m), type(m).__name__))
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()  # not reached on error: the failing module stays on top
        return out


def scope_of(node: fx.Node) -> tuple[str, ...]:
    """Module paths enclosing a node, outermost first (kept across save/load)."""
    return tuple(node.meta.get("gg_scope", ()))


def trace(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    leaves: Iterable[str] = (),
) -> fx.GraphModule:
    """Trace `model` into a GraphModule that graphgrow passes can rewrite.

    `leaves` are submodule paths kept as single opaque calls (use them for parts
    with data-dependent control flow). `input_shape` (e.g. (1, 3, 224, 224)) is the
    example input used for shape propagation and verification; it is stored in
    `gm.meta["graphgrow"]`. A GraphModule made by graphgrow is returned as is.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"expected a torch.nn.Module, got {type(model).__name__}")
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
        tracer = _Tracer(leaves)
        try:
            graph = tracer.trace(model)
        except Exception as e:  # fx raises many kinds; all mean "cannot trace"
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            where, cls = tracer.stack[-1] if tracer.stack else ("", type(model).__name__)
            if where:
                raise TraceError(
                    f"cannot trace submodule '{where}' ({cls}) of {type(model).__name__}: {reason}",
                    f"mark it as a leaf: --leaf {where} (Python: trace(model, leaves=['{where}']))",
                ) from e
            raise TraceError(
                f"cannot trace the top-level forward of {type(model).__name__}: {reason}",
                "fx needs forward() without data-dependent control flow; wrap such parts in submodules and mark them as leaves",
            ) from e
        for node in graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            node.meta["gg_scope"] = tuple(stack.keys())
        name = type(model).__name__
        gm = fx.GraphModule(tracer.root, graph, name)
        gm.meta[META_KEY] = {"input_shape": None, "log": []}
    info = gm.meta[META_KEY]
    if input_shape is not None:
        info["input_shape"] = [int(d) for d in input_shape]
    return gm


def graph_info(gm: fx.GraphModule) -> dict:
    """graphgrow's metadata on a traced module (input shape, mutation log)."""
    if META_KEY not in gm.meta:
        raise TraceError("this GraphModule was not made by graphgrow.trace", "call graphgrow.trace(model, input_shape) first")
    return gm.meta[META_KEY]


def input_shape_of(gm: fx.GraphModule) -> list[int]:
    shape = graph_info(gm).get("input_shape")
    if not shape:
        raise InputError(
            "the model has no example input shape",
            "pass input_shape to graphgrow.trace(...) or --input-shape N,C,H,W on the command line",
        )
    return list(shape)
