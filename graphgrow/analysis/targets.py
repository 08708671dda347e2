"""Where a pass can apply: a Candidate place, and the default targets passes share (where the feature extractor
starts and ends)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import fx, nn

from ..core.errors import NotApplicable
from ..graph.fx_edit import is_float_tensor, resolve_tensor, tensor_shape
from .axes import assign_channel_axes, node_axis
from .deployed import deployed_nodes, deployed_outputs


@dataclass
class Candidate:
    """A place a pass can apply: the arguments that pick it, the place in words, what it would add."""

    args: dict[str, str]
    where: str
    params: int  # parameters it would add (an estimate before running the pass)
    default: bool = False  # the place the pass picks when no target is given

    def spec(self, name: str) -> str:
        return f"{name}({','.join(f'{k}={v}' for k, v in self.args.items())})" if self.args else name


_GLOBAL_POOL_MODULES = (nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_GLOBAL_POOL_FUNCTIONS = (F.adaptive_avg_pool1d, F.adaptive_max_pool1d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d)


def is_feature_map(n: fx.Node) -> bool:
    """A conv layout: (N, C, H, W), or (N, C, L) where the channels are at dim 1 (a Conv1d's output)."""
    s = tensor_shape(n)
    return s is not None and (len(s) == 4 or (len(s) == 3 and node_axis(n) == 1))


def is_global_pool(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A node that collapses a feature map's spatial dimensions (pooling, flatten, mean, reshape)."""
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if src is None or not is_feature_map(src) or all(d == 1 for d in tensor_shape(src)[2:]):
        return False
    rank = len(tensor_shape(src))
    out = tensor_shape(n)
    if n.op == "call_module" and isinstance(gm.get_submodule(n.target), _GLOBAL_POOL_MODULES):
        return True
    if n.op == "call_function" and n.target in _GLOBAL_POOL_FUNCTIONS:
        return True
    if n.op in ("call_function", "call_method") and out is not None and len(out) < rank:
        return True
    return out is not None and len(out) == rank and all(d == 1 for d in out[2:])


def _is_head_pool(pool: fx.Node) -> bool:
    """A pooling that ends the backbone: nothing after it comes back to the pooled map's shape.

    Squeeze-excitation pools too, but its gate multiplies the map again (same shape downstream);
    a channels-last head (permute → LayerNorm → permute on the pooled map) never does.
    """
    src = pool.args[0]
    shape = tensor_shape(src)
    seen, todo = set(), list(pool.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if tensor_shape(n) == shape:
            return False
        todo.extend(n.users)
    return True


def feature_span(gm: fx.GraphModule) -> tuple[fx.Node, fx.Node, str]:
    """The feature extractor: first 4-D tensor → the last 4-D tensor before global pooling.

    Without 4-D tensors: the model input → the output's tensor. Only what the deployed function
    computes counts (not a train-only auxiliary head). Returns (start, end, why).
    """
    deployed = deployed_nodes(gm)
    four_d = [n for n in gm.graph.nodes if n in deployed and is_float_tensor(n) and len(tensor_shape(n)) == 4]
    if four_d:
        pools = [n for n in gm.graph.nodes if n in deployed and is_global_pool(gm, n) and _is_head_pool(n)]
        end = pools[0].args[0] if pools else four_d[-1]
        why = (
            "first 4-D tensor → the backbone's last 4-D feature map (before the head's global pooling/flatten)"
            if pools
            else "first → last 4-D tensor"
        )
        return four_d[0], end, why
    floats = [n for n in gm.graph.nodes if n in deployed and is_float_tensor(n)]
    outputs = [a for a in deployed_outputs(gm) if is_float_tensor(a)]
    if not floats or not outputs:
        raise NotApplicable("the model has no floating-point tensors to connect", "give start=... and end=...")
    return floats[0], outputs[0], "model input → output (no 4-D features)"


def tensor_or_feature_end(gm: fx.GraphModule, ref: str | None) -> tuple[fx.Node, str]:
    """The node a user named (its output), or by default the end of the feature extractor."""
    assign_channel_axes(gm)  # where the named tensor keeps its channels (a Conv1d's at dim 1)
    if ref is None:
        _, node, _ = feature_span(gm)
        return node, "last 4-D feature map before global pooling (or the model's output tensor)"
    return resolve_tensor(gm, ref, "out"), "given"
