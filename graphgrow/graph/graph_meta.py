"""graphgrow's metadata on a traced GraphModule: where it lives and how to read it.

Kept apart from trace.py so that what reads the metadata (fidelity, stages, passes' helpers)
does not depend on the tracer, and the tracer can call the fidelity check without a circle.
"""
from __future__ import annotations

from torch import fx

from ..core.errors import InputError, TraceError

META_KEY = "graphgrow"


def scope_of(node: fx.Node) -> tuple[str, ...]:
    """Module paths enclosing a node, outermost first (kept across save/load)."""
    return tuple(node.meta.get("gg_scope", ()))


def trace_report(gm: fx.GraphModule) -> dict:
    """What tracing did: automatic leaves and why, the mode, notes (empty for older files)."""
    return dict(graph_info(gm).get("trace") or {})


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
