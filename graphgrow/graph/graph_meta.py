"""graphgrow's metadata on a traced GraphModule: where it lives and how to read it.

Kept apart from trace.py so that what reads the metadata (fidelity, stages, passes' helpers)
does not depend on the tracer, and the tracer can call the fidelity check without a circle.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from ..core.errors import InputError, TraceError
from .inputs import InputSpec, first_shape, named_for, parse_spec, plain_spec, records

META_KEY = "graphgrow"


def scope_of(node: fx.Node) -> tuple[str, ...]:
    """Module paths enclosing a node, outermost first (kept across save/load)."""
    return tuple(node.meta.get("gg_scope", ()))


def trace_report(gm: fx.GraphModule) -> dict[str, Any]:
    """What tracing did: automatic leaves and why, the mode, notes (empty for older files)."""
    return dict(graph_info(gm).get("trace") or {})


def graph_info(gm: fx.GraphModule) -> dict[str, Any]:
    """graphgrow's metadata on a traced module (input shape, mutation log)."""
    if META_KEY not in gm.meta:
        raise TraceError(
            "this GraphModule was not made by graphgrow.trace", "call graphgrow.trace(model, input_shape) first"
        )
    info: dict[str, Any] = gm.meta[META_KEY]
    return info


def input_shape_of(gm: fx.GraphModule) -> list[int]:
    """The (first) input's shape of the example input a graph was traced with."""
    return first_shape(input_spec_of(gm))


def input_spec_of(gm: fx.GraphModule) -> InputSpec:
    """The example input a graph is checked on, as its input spec: the stored `inputs` records, or, in a file
    written before they were the one key, its `input_shape` (a bare shape, named after the graph's first input)."""
    info = graph_info(gm)
    if info.get("inputs"):
        return parse_spec(info["inputs"])
    if info.get("input_shape"):
        return named_for(gm, plain_spec(info["input_shape"]))
    raise InputError(
        "the model has no example input shape",
        "pass input_shape to graphgrow.trace(...) or --input-shape N,C,H,W on the command line",
    )


def store_shape(gm: fx.GraphModule, spec: InputSpec | None) -> None:
    """Record the example input as the one metadata key `inputs` (its records; older files' `input_shape` is
    dropped: input_spec_of reads either)."""
    if spec is None:
        return
    info = gm.meta[META_KEY]
    info.pop("input_shape", None)
    info["inputs"] = records(spec)
