"""ATen operations of an exported program written back as the torch / operator calls fx tracing gives.

graphgrow's coupling rules, its file allow-list and people reading a graph know `operator.add`,
`torch.transpose` and `x.view(...)`, not `aten.add.Tensor`. Each entry takes the op's arguments
by schema name (defaults filled) and returns (op kind, target, args, kwargs), or None to keep the
ATen call. Device constants the export baked in (arange(..., device=cpu)) become the device of the
first input at run time, so the graph follows the model to another device; `.to(device, dtype)`
keeps only the dtype (graphgrow runs a model on one device).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# no-ops of the export (checks, aliases): an input stands for them, or they go
DROPPED = frozenset(
    {
        "aten._assert_tensor_metadata.default",
        "aten.alias.default",
        "aten.contiguous.default",
        "aten._assert_scalar.default",
        "aten.sym_constrain_range_for_size.default",
    }
)

Call = tuple[str, Any, list, dict]
_BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "div": operator.truediv,
    "__and__": operator.and_,
    "__or__": operator.or_,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "bitwise_and": operator.and_,
    "bitwise_or": operator.or_,
}
_UNARY = {
    "neg": torch.neg,
    "rsqrt": torch.rsqrt,
    "sqrt": torch.sqrt,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "exp": torch.exp,
    "log": torch.log,
    "sin": torch.sin,
    "cos": torch.cos,
    "abs": torch.abs,
    "relu": torch.relu,
    "erf": torch.erf,
    "floor": torch.floor,
    "silu": F.silu,
}


def _fn(target: Any, *args: Any, **kwargs: Any) -> Call:
    return "call_function", target, list(args), kwargs


def _method(name: str, *args: Any, **kwargs: Any) -> Call:
    return "call_method", name, list(args), kwargs


def _binary(op: str, a: dict) -> Call | None:
    if a.get("alpha", 1) != 1 or a.get("rounding_mode") is not None:
        return None
    return _fn(_BINARY[op], a["self"], a["other"])


def _slice(a: dict) -> Call | None:
    dim = a["dim"]
    if not isinstance(dim, int) or dim < 0:
        return None
    index = (slice(None),) * dim + (slice(a["start"], a["end"], a["step"] if a["step"] != 1 else None),)
    return _fn(operator.getitem, a["self"], index)


def _factory(target: Any, a: dict, device: Any, *names: str) -> Call:
    kwargs = {"dtype": a.get("dtype")} if a.get("dtype") is not None else {}
    if device is not None:
        kwargs["device"] = device
    return _fn(target, *(a[n] for n in names), **kwargs)


_TABLE: dict[str, Callable[[dict, Any], Call | None]] = {
    "aten.linear.default": lambda a, d: _fn(F.linear, a["input"], a["weight"], a["bias"]),
    "aten.embedding.default": lambda a, d: _fn(
        F.embedding, a["indices"], a["weight"], a["padding_idx"] if a["padding_idx"] >= 0 else None
    ),
    "aten.layer_norm.default": lambda a, d: _fn(
        F.layer_norm, a["input"], a["normalized_shape"], a["weight"], a["bias"], a["eps"]
    ),
    "aten.gelu.default": lambda a, d: _fn(
        F.gelu, a["self"], **({"approximate": a["approximate"]} if a["approximate"] != "none" else {})
    ),
    "aten.dropout.default": lambda a, d: _fn(F.dropout, a["input"], a["p"], a["train"]),
    "aten.scaled_dot_product_attention.default": lambda a, d: _fn(
        F.scaled_dot_product_attention,
        a["query"],
        a["key"],
        a["value"],
        a["attn_mask"],
        a["dropout_p"],
        a["is_causal"],
        scale=a["scale"],
        enable_gqa=a["enable_gqa"],
    ),
    "aten.softmax.int": lambda a, d: _fn(
        torch.softmax, a["self"], a["dim"], **({"dtype": a["dtype"]} if a["dtype"] else {})
    ),
    "aten.transpose.int": lambda a, d: _fn(torch.transpose, a["self"], a["dim0"], a["dim1"]),
    "aten.permute.default": lambda a, d: _fn(torch.permute, a["self"], a["dims"]),
    "aten.unsqueeze.default": lambda a, d: _fn(torch.unsqueeze, a["self"], a["dim"]),
    "aten.squeeze.dim": lambda a, d: _fn(torch.squeeze, a["self"], a["dim"]),
    # a reshape: contiguous() is dropped (export records it in one mode only), so a view may meet a transposed
    # tensor (nn.MultiheadAttention's heads); the values are the same
    "aten.view.default": lambda a, d: _method("reshape", a["self"], a["size"]),
    "aten.reshape.default": lambda a, d: _method("reshape", a["self"], a["shape"]),
    "aten.expand.default": lambda a, d: _method("expand", a["self"], a["size"]),
    "aten.flatten.using_ints": lambda a, d: _fn(torch.flatten, a["self"], a["start_dim"], a["end_dim"]),
    "aten.unflatten.int": lambda a, d: _fn(torch.unflatten, a["self"], a["dim"], a["sizes"]),
    "aten.matmul.default": lambda a, d: _fn(operator.matmul, a["self"], a["other"]),
    "aten.addmm.default": lambda a, d: (
        _fn(torch.addmm, a["self"], a["mat1"], a["mat2"]) if a["beta"] == 1 and a["alpha"] == 1 else None
    ),
    "aten.cat.default": lambda a, d: _fn(torch.cat, a["tensors"], a["dim"]),
    "aten.stack.default": lambda a, d: _fn(torch.stack, a["tensors"], a["dim"]),
    "aten.slice.Tensor": lambda a, d: _slice(a),
    "aten.select.int": lambda a, d: _fn(torch.select, a["self"], a["dim"], a["index"]),
    "aten.index.Tensor": lambda a, d: _fn(
        operator.getitem, a["self"], tuple(slice(None) if i is None else i for i in a["indices"])
    ),
    "aten.split.Tensor": lambda a, d: _fn(torch.split, a["self"], a["split_size"], a["dim"]),
    "aten.split_with_sizes.default": lambda a, d: _fn(torch.split, a["self"], a["split_sizes"], a["dim"]),
    "aten.chunk.default": lambda a, d: _fn(torch.chunk, a["self"], a["chunks"], a["dim"]),
    "aten.mean.dim": lambda a, d: _fn(torch.mean, a["self"], a["dim"], a["keepdim"]) if a["dtype"] is None else None,
    "aten.sum.dim_IntList": lambda a, d: (
        _fn(torch.sum, a["self"], a["dim"], a["keepdim"]) if a["dtype"] is None else None
    ),
    "aten.pow.Tensor_Scalar": lambda a, d: _fn(torch.pow, a["self"], a["exponent"]),
    "aten.cumsum.default": lambda a, d: _fn(torch.cumsum, a["self"], a["dim"]) if a["dtype"] is None else None,
    "aten.diff.default": lambda a, d: _fn(torch.diff, a["self"], a["n"], a["dim"], a["prepend"], a["append"]),
    "aten.gather.default": lambda a, d: _fn(torch.gather, a["self"], a["dim"], a["index"]),
    "aten.masked_fill.Scalar": lambda a, d: _fn(torch.masked_fill, a["self"], a["mask"], a["value"]),
    "aten.where.self": lambda a, d: _fn(torch.where, a["condition"], a["self"], a["other"]),
    "aten.tril.default": lambda a, d: _fn(torch.tril, a["self"], a["diagonal"]),
    "aten.triu.default": lambda a, d: _fn(torch.triu, a["self"], a["diagonal"]),
    "aten.conv1d.default": lambda a, d: _fn(
        F.conv1d, a["input"], a["weight"], a["bias"], a["stride"], a["padding"], a["dilation"], a["groups"]
    ),
    "aten.conv2d.default": lambda a, d: _fn(
        F.conv2d, a["input"], a["weight"], a["bias"], a["stride"], a["padding"], a["dilation"], a["groups"]
    ),
    # padding (TF-style "same" padding computed from the input's size, baked in by export): F.pad as fx shows it
    "aten.pad.default": lambda a, d: _fn(F.pad, a["self"], a["pad"], a["mode"], a["value"]),
    "aten.constant_pad_nd.default": lambda a, d: _fn(F.pad, a["self"], a["pad"], "constant", a["value"]),
    "aten.sym_size.int": lambda a, d: _method("size", a["self"], a["dim"]),
    "aten.to.dtype": lambda a, d: _method("to", a["self"], a["dtype"]),
    "aten.to.device": lambda a, d: _method("to", a["self"], a["dtype"]),
    "aten.to.dtype_layout": lambda a, d: (
        _method("to", a["self"], a["dtype"]) if a["dtype"] is not None else _method("clone", a["self"])
    ),
    "aten.new_ones.default": lambda a, d: _method(
        "new_ones", a["self"], a["size"], **({"dtype": a["dtype"]} if a["dtype"] is not None else {})
    ),
    "aten.new_zeros.default": lambda a, d: _method(
        "new_zeros", a["self"], a["size"], **({"dtype": a["dtype"]} if a["dtype"] is not None else {})
    ),
    "aten.arange.default": lambda a, d: _factory(torch.arange, a, d, "end"),
    "aten.arange.start": lambda a, d: _factory(torch.arange, a, d, "start", "end"),
    "aten.arange.start_step": lambda a, d: _factory(torch.arange, a, d, "start", "end", "step"),
    "aten.full.default": lambda a, d: _factory(torch.full, a, d, "size", "fill_value"),
    "aten.ones.default": lambda a, d: _factory(torch.ones, a, d, "size"),
    "aten.zeros.default": lambda a, d: _factory(torch.zeros, a, d, "size"),
    "aten.new_empty.default": lambda a, d: _method(
        "new_empty", a["self"], a["size"], **({"dtype": a["dtype"]} if a["dtype"] is not None else {})
    ),
    "aten.bernoulli_.float": lambda a, d: _method("bernoulli_", a["self"], a["p"]),  # a drop-path mask, in place
    "aten.detach.default": lambda a, d: _method("detach", a["self"]),  # the outputs of a no_grad block
    "aten.rand.default": lambda a, d: _factory(torch.rand, a, d, "size"),  # drop-path's draw, on the input's device
    "aten.randn.default": lambda a, d: _factory(torch.randn, a, d, "size"),
}


def to_torch(op: str, args: dict, device: Any) -> Call | None:
    """(kind, target, args, kwargs) of the torch call that computes ATen `op` on `args` (by schema name), or None."""
    packet, _, overload = op.rpartition(".")
    base = packet.removeprefix("aten.")
    if base in _BINARY and overload in ("Tensor", "Scalar"):
        return _binary(base, args)
    if base in _UNARY and overload == "default":
        return _fn(_UNARY[base], args["self"])
    entry = _TABLE.get(op)
    return entry(args, device) if entry is not None else None
