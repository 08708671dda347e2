"""The example input shape: parsed and bounded when given, inferred from the model when it can tell.

A model's graph is traced and checked at one example shape (N, C, H, W …); graphgrow's own files
remember it, a first Linear fixes it, and a first conv followed by Flatten → Linear fixes the
image size. A model that takes any size says so instead of graphgrow making one up.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import InputError
from ..graph.inputs import InputSpec, TensorSpec, first_input_name, named_for, parse_spec, plain_spec

MAX_INPUT_ELEMENTS = 1 << 26  # 256 MiB of float32 for one example input; verification makes a few more
MAX_SIDE = 1 << 16


def parse_input_shape(text: str | Sequence[int] | None) -> list[int] | None:
    """'1,3,224,224' (or 1x3x224x224) → [1, 3, 224, 224]; InputError on anything else."""
    if text is None:
        return None
    if isinstance(text, str):
        parts = [p for p in re.split(r"[,\s]+|(?<=\d)[x×](?=\d)", text.strip()) if p]
        try:
            dims = [int(p) for p in parts]
        except ValueError:
            raise InputError(
                f"--input-shape {text[:80]!r} is not a list of integers", "write it as N,C,H,W, e.g. 1,3,224,224"
            ) from None
    else:
        dims = [int(d) for d in text]
    if not dims or any(d <= 0 for d in dims) or len(dims) > 8:
        raise InputError(
            f"--input-shape {str(text)[:80]!r} is not a valid shape (positive sizes, 1 to 8 dims)", "e.g. 1,3,224,224"
        )
    if dims[0] > 4096 or any(d > MAX_SIDE for d in dims) or torch.Size(dims).numel() > MAX_INPUT_ELEMENTS:
        raise InputError(
            f"input shape {str(text)[:80]!r} is too large for an example input "
            f"(at most {MAX_INPUT_ELEMENTS:,} elements, {MAX_SIDE:,} per dimension)",
            "use batch 1 and the real image size",
        )
    return dims


def parse_example_input(value: Any, model: Any = None) -> InputSpec | None:
    """Any description of the example input → an input spec (graph.inputs), None when none is given.

    Accepted: a bare shape (ints, or text `1,3,224,224` / `1x3x224x224`: one float32 input passed positionally);
    spec text with a `:` (`input_ids:1x16:int64`); a TensorSpec or a tuple of them; a dict name → TensorSpec, shape,
    (shape, dtype) or example tensor; stored records; an example tensor (its shape and dtype, as a bare shape's
    spec: the model's one positional input) or a tuple of them (named after the forward's parameters, in order).
    Example tensors give shapes and dtypes only: the checks draw their own seeded values. With `model`, a bare
    shape's input is named after the forward's first parameter (else `x`). InputError on anything else."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        if len(value) == 1:
            one = parse_spec({first_input_name(model) if model is not None else "x": value[0]})[0]
            return plain_spec(one.shape, one.name, one.dtype)
        names = _forward_names(model, len(value))
        return parse_spec(dict(zip(names, value)))
    if isinstance(value, str) and ":" not in value:
        spec = plain_spec(parse_input_shape(value) or [])
    elif isinstance(value, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        spec = plain_spec(parse_input_shape(value) or [])  # the bounds of a bare shape (parse_input_shape)
    elif isinstance(value, (dict, str, TensorSpec, list, tuple)):
        spec = parse_spec(value)  # TensorSpecs, dicts, spec text, stored records; InputError on anything else
    else:
        raise InputError(
            f"cannot read an example input from {type(value).__name__} {str(value)[:60]}",
            "give a shape [N, C, H, W], a TensorSpec or a tuple of them, a dict name → shape / "
            "(shape, dtype) / TensorSpec / tensor, or example tensors",
        )
    return named_for(model, spec) if model is not None else spec


def _forward_names(model: Any, count: int) -> list[str]:
    """The names of `count` example tensors passed in order: the forward's first `count` parameters."""
    import inspect

    try:
        params = [
            p
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError, AttributeError):
        params = []
    if len(params) < count:
        raise InputError(
            f"{count} example tensors given, but the forward names {len(params)} positional inputs",
            "pass a dict name → tensor",
        )
    return [p.name for p in params[:count]]


def infer_input_shape(gm: fx.GraphModule) -> tuple[list[int] | None, str]:
    """The example input shape when the model itself fixes it, with how it was found.

    A first Linear fixes (1, in_features). A first conv fixes the channels; a
    Flatten → Linear with no adaptive pooling before it fixes the spatial size,
    found by a binary search over square sizes on the meta device (no compute).
    A model that accepts any size (global pooling) has no one shape: (None, why).
    """
    require_single_input(gm)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    first = next((u for u in placeholder.users if u.op == "call_module"), None)
    layer = gm.get_submodule(first.target) if first is not None else None
    if isinstance(layer, nn.Linear):
        return [1, layer.in_features], f"from the first layer {first.target}: Linear({layer.in_features}→…)"
    if not isinstance(layer, nn.modules.conv._ConvNd):
        return None, "the first layer does not fix the input shape"
    dims = layer.weight.dim() - 2
    channels = layer.in_channels
    flat_linear = _flatten_then_linear(gm)
    if flat_linear is None:
        return None, f"{first.target} ({type(layer).__name__}, {channels} channels) takes any image size"
    flat, lin = flat_linear
    want = gm.get_submodule(lin.target).in_features
    meta = copy.deepcopy(gm).to("meta").eval()

    def flat_size(side: int) -> int | None:
        return _meta_numel(meta, flat.name, [1, channels] + [side] * dims)

    def first_side(at_least: int) -> int:  # smallest side whose flattened size reaches `at_least`
        lo, hi = 1, 4096
        while lo < hi:
            mid = (lo + hi) // 2
            n = flat_size(mid)
            if n is None or n < at_least:
                lo = mid + 1
            else:
                hi = mid
        return lo

    where = f"the Linear {lin.target} after {flat.name} takes {want} features"
    smallest = first_side(want)
    if flat_size(smallest) != want:
        return None, f"{where}, which no square input gives"
    largest = first_side(want + 1) - 1
    side = "×".join([str(largest)] * dims)
    if largest != smallest:
        # Strided layers round down, so several sizes fit; the largest is the one every stride divides evenly.
        return [1, channels] + [largest] * dims, (
            f"{where}; square sides {smallest} to {largest} all give that, "
            f"using {side}, which strides divide evenly (--input-shape to choose)"
        )
    return [1, channels] + [largest] * dims, f"{where}, which only a square {side} input gives"


def _flatten_then_linear(gm: fx.GraphModule):
    """The first (flatten node, Linear node) pair, unless adaptive pooling comes before it."""
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(
            gm.get_submodule(n.target),
            (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool3d),
        ):
            return None
        if n.op == "call_function" and "adaptive" in getattr(n.target, "__name__", ""):
            return None
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear):
            src = n.args[0] if n.args else None
            is_flat = isinstance(src, fx.Node) and (
                (src.op == "call_module" and isinstance(gm.get_submodule(src.target), nn.Flatten))
                or (src.op == "call_function" and src.target is torch.flatten)
                or (src.op == "call_method" and src.target in ("flatten", "view", "reshape"))
            )
            return (src, n) if is_flat else None
    return None


def _meta_numel(meta: fx.GraphModule, node_name: str, shape: list[int]) -> int | None:
    """numel of a node's output for an input of `shape`, running `meta` (a meta-device copy): no compute."""
    seen: dict = {}

    class Stop(Exception):
        pass

    class Probe(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.name == node_name:
                seen["numel"] = out.numel()
                raise Stop
            return out

    try:
        Probe(meta).run(torch.empty(shape, device="meta"))
    except Stop:
        return seen["numel"]
    except Exception:
        return None
    return None


def require_single_input(gm: fx.GraphModule) -> None:
    """Refuse models with several inputs clearly, also when the shape was given."""
    count = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if count != 1:
        raise InputError(
            f"the model takes {count} inputs; graphgrow supports one input tensor for now",
            "wrap the model so that forward takes a single tensor",
        )
