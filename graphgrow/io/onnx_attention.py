"""scaled_dot_product_attention on more than four dims, for ONNX export.

The exporter's translation of scaled_dot_product_attention takes only 4-D query, key and value ("only 4D query,
key, and value are supported"), where PyTorch takes any number of leading dims: timm's Hiera attends over (batch,
heads, mask units, tokens, head size). Attention treats every index before its last three dims (heads, tokens,
channels) alike, so `four_d_attention` rewrites a copy of the graph before export: each call that may have more than
four dims runs as `any_rank_attention`, which flattens those leading dims into one, calls the same attention with the
same arguments and restores them. The numbers are the same; the equivalence check compares the export with the
original graph, so the rewrite is checked on every export.

No shape is read as a number: the leading sizes are read from the query inside the traced function (`q.shape[:-3]`,
symbolic where the export makes them dynamic), so a dynamic batch or sequence length stays dynamic. (A first version,
47afbe4, read them from the capture's metadata with int(), which fixed torch.export's symbolic sequence length in the
exported model: reverted in e5dceba.) A call whose rank the metadata records as four or fewer is left as it is; one
whose rank is not recorded (fx captures) runs as `any_rank_attention`, which at four dims or fewer is the same call.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from ..graph import ops

SDPA_NAME = "scaled_dot_product_attention"


def any_rank_attention(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """F.scaled_dot_product_attention(query, key, value, *args, **kwargs), computed on 4-D tensors where the inputs
    have more dims: the dims before the last three flattened into one (key and value expanded to the query's, a mask
    of more than three dims too), the output unflattened back. At four dims or fewer: the call itself."""
    rank = query.dim()
    if rank <= 4 or key.dim() != rank or value.dim() != rank:
        return F.scaled_dot_product_attention(query, key, value, *args, **kwargs)
    lead = query.shape[: rank - 3]  # symbolic where the export makes them dynamic: never read as numbers
    q, k, v = (t.expand(*lead, -1, -1, -1).flatten(0, rank - 4) for t in (query, key, value))
    args = tuple(_flat_mask(a, lead, rank) if i == 0 else a for i, a in enumerate(args))
    if "attn_mask" in kwargs:
        kwargs = {**kwargs, "attn_mask": _flat_mask(kwargs["attn_mask"], lead, rank)}
    return F.scaled_dot_product_attention(q, k, v, *args, **kwargs).unflatten(0, lead)


def _flat_mask(mask: Any, lead: Any, rank: int) -> Any:
    """A mask broadcast against (*lead, heads, L, S): as it is at three dims or fewer (it broadcasts against the
    flattened 4-D weights alike), else expanded to `lead` and flattened as the query is."""
    if not isinstance(mask, torch.Tensor) or mask.dim() <= 3:
        return mask
    mask = mask[(None,) * (rank - mask.dim())]  # aligned on the right, as broadcasting aligns it
    return mask.expand(*lead, -1, -1, -1).flatten(0, rank - 4)


def four_d_attention(gm: torch.nn.Module) -> torch.nn.Module:
    """`gm` itself when every attention call of its graph is recorded with four dims or fewer (or there is none),
    else a GraphModule sharing its modules and parameters where the others call `any_rank_attention`."""
    if not isinstance(gm, fx.GraphModule):
        return gm
    found = [n.name for n in gm.graph.nodes if _is_attention(n) and (_rank(n) or 5) > 4]
    if not found:
        return gm
    graph = copy.deepcopy(gm.graph)  # gm's own graph is not touched
    for n in graph.nodes:
        if n.name in found:
            n.target = any_rank_attention
    graph.lint()
    return fx.GraphModule(gm, graph)


def _is_attention(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    packet = getattr(n.target, "overloadpacket", None)  # an ATen overload (torch.export's graphs): its op's name
    return (packet.__name__ if packet is not None else ops.op_name(n.target)) == SDPA_NAME


def _rank(n: fx.Node) -> int | None:
    """The query's number of dims as the metadata records it (a length: no symbolic size is read), or None."""
    q = n.args[0] if n.args else n.kwargs.get("query")
    if not isinstance(q, fx.Node):
        return None
    for shape in (q.meta.get("gg_shape"), getattr(q.meta.get("val"), "shape", None)):
        if isinstance(shape, (tuple, torch.Size)):
            return len(shape)
    meta = q.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    return len(shape) if shape is not None else None
