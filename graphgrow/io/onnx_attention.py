"""scaled_dot_product_attention on more than four dims, for ONNX export.

The exporter's translation of scaled_dot_product_attention takes only 4-D query, key and value ("only 4D query,
key, and value are supported"), where PyTorch takes any number of leading dims: timm's Hiera attends over (batch,
heads, mask units, tokens, head size). Attention treats every leading index alike, so `four_d_attention` rewrites a
copy of the graph before export: the leading dims are flattened into one before the call and restored after it. The
numbers are the same; the equivalence check compares the export with the original graph, so the rewrite is checked
on every export. A call whose query, key and value differ in their leading dims, or whose mask has more than two
dims (it would need the same flattening), is left as it is (the exporter's error stays).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from ..core.state import training_mode
from ..graph import ops
from ..graph.fx_edit import tensor_shape
from ..graph.inputs import ExampleInput
from ..graph.shapes import example_input, run_recording


def four_d_attention(gm: torch.nn.Module, input_shape: ExampleInput) -> torch.nn.Module:
    """`gm` itself when no attention call has more than four dims, else a GraphModule sharing its modules and
    parameters where each such call runs on its leading dims flattened into one. Shapes come from the nodes'
    metadata, or from one run on the example input where they have none."""
    if not isinstance(gm, fx.GraphModule):
        return gm
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and _name(n) == "scaled_dot_product_attention"]
    if not calls:
        return gm
    shapes = {}
    if any(_shape(a) is None for n in calls for a in n.args[:3]):
        with training_mode(gm, False):
            shapes = run_recording(gm, example_input(gm, input_shape, seed=0, batch=2)).shapes
    found = [n for n in calls if _flattenable(n, shapes)]
    if not found:
        return gm
    graph = copy.deepcopy(gm.graph)
    mapping = {n.name: n for n in graph.nodes}
    for old in found:
        n = mapping[old.name]
        shape = _shape(n.args[0], shapes)
        assert shape is not None  # _flattenable checked it
        last = len(shape) - 4  # dims 0..last become one
        with graph.inserting_before(n):
            q, k, v = (graph.call_function(torch.flatten, (a, 0, last)) for a in n.args[:3])
            att = graph.call_function(F.scaled_dot_product_attention, (q, k, v, *n.args[3:]), dict(n.kwargs))
            out = graph.call_function(torch.unflatten, (att, 0, (-1, *shape[1 : last + 1])))
        out.meta = dict(n.meta)
        n.replace_all_uses_with(out)
        graph.erase_node(n)
    graph.lint()
    return fx.GraphModule(gm, graph)


def _name(n: fx.Node) -> str:
    packet = getattr(n.target, "overloadpacket", None)  # an ATen overload (torch.export's graphs): its op's name
    return packet.__name__ if packet is not None else ops.op_name(n.target)


def _shape(n: object, shapes: dict[str, Any] | None = None) -> tuple[int, ...] | None:
    if not isinstance(n, fx.Node):
        return None
    shape = tensor_shape(n)
    if shape is None and hasattr(n.meta.get("val"), "shape"):
        shape = tuple(n.meta["val"].shape)
    if shape is None and isinstance((shapes or {}).get(n.name), tuple):
        shape = (shapes or {})[n.name]
    return tuple(int(d) for d in shape) if shape is not None else None


def _flattenable(n: fx.Node, shapes: dict[str, Any]) -> bool:
    if len(n.args) < 3:
        return False
    q, k, v = (_shape(a, shapes) for a in n.args[:3])
    if q is None or k is None or v is None or len(q) <= 4 or not len(q) == len(k) == len(v):
        return False
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    mask_shape = _shape(mask, shapes) if mask is not None else ()
    return q[:-3] == k[:-3] == v[:-3] and mask_shape is not None and len(mask_shape) <= 2
