"""graphgrow's metadata on a traced GraphModule: where it lives and how to read it.

Kept apart from trace.py so that what reads the metadata (fidelity, stages, passes' helpers)
does not depend on the tracer, and the tracer can call the fidelity check without a circle.
"""
from __future__ import annotations

from typing import Any

from torch import fx

from ..core.errors import InputError, TraceError
from .inputs import is_spec, parse_spec, records, Shape

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


def input_spec_of(gm: fx.GraphModule) -> Shape:
    """The example input a graph is checked on: its input spec (named inputs, dtypes) when it has one,
    else its one float input shape."""
    stored = graph_info(gm).get("inputs")
    return parse_spec(stored) if stored else input_shape_of(gm)


def store_shape(gm: fx.GraphModule, input_shape: Any) -> None:
    """Record the example input: a plain shape as `input_shape`; a spec as `inputs` (records) and its first shape."""
    info = gm.meta[META_KEY]
    if is_spec(input_shape):
        info["input_shape"] = list(input_shape[0].shape)  # the first input's shape: what older readers show
        info["inputs"] = records(input_shape)
    elif input_shape is not None:
        info["input_shape"] = [int(d) for d in input_shape]
