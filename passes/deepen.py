"""deepen: a new block after a node, in residual form x + g·block(x) with a scalar gate g = 0.

block=conv_bn_relu (feature maps (N, C, H, W), or (N, C, L) of a Conv1d stack): a 3×3 (or 3) conv
(same channels) → BatchNorm → ReLU.
block=linear_relu ((N, F) features, (N, T, F) tokens): Linear (same features) → ReLU, its units in
pairs with opposite weights, so that some are active for any input.
The gate is the zero last factor: exact in eval and train mode (an identity-
initialised BatchNorm would be off by eps in eval and not the identity in train
mode), the gate learns at once and the block's layers after one step.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import fx, nn

from graphgrow import arg, Candidate, NotApplicable, Pass, Rewrite
from graphgrow.rewrite import (
    add_module, add_parameter, begin, conv_dims, default_point, factory_kwargs, finish, inserting_after,
    is_float_tensor, kaiming_, replace_uses, set_scope, stage_end_candidates, tensor_or_feature_end,
    tensor_shape,
)



def deepen(gm: fx.GraphModule, after: str | None = None, block: Literal["auto", "conv_bn_relu", "linear_relu"] = "auto",
           generator: torch.Generator | None = None) -> Rewrite:
    """Insert `x + g·block(x)` (g = 0) after `after` (default: the last feature map before global pooling)."""
    gm, generator = begin(gm, generator)
    node, chosen = tensor_or_feature_end(gm, after) if after is not None else default_point(gm, lambda n: block_params(n, block))
    shape = tensor_shape(node)
    if not is_float_tensor(node) or len(shape) < 2:
        raise NotApplicable(f"'{node.name}' (shape {node.meta.get('gg_shape')}) is not a feature tensor", "pick a node with a (N, C, …) tensor")
    dims = conv_dims(node)
    if block == "auto":
        block = "conv_bn_relu" if dims in (1, 2) else "linear_relu"
    kw = factory_kwargs(gm, node)
    if block == "conv_bn_relu":
        if dims not in (1, 2):
            raise NotApplicable(f"conv_bn_relu needs a feature map (N, C, H, W) or (N, C, L); '{node.name}' is {list(shape)}"
                                + (" with its channels last" if dims is None else ""), "use block=linear_relu")
        c = shape[1]
        conv = (nn.Conv2d if dims == 2 else nn.Conv1d)(c, c, 3, padding=1, bias=False, **kw)
        kaiming_(conv.weight, generator)
        module = nn.Sequential(conv, (nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d)(c, **kw), nn.ReLU())
    elif block == "linear_relu":
        if len(shape) not in (2, 3) or dims is not None:
            raise NotApplicable(f"linear_relu needs (N, F) or (N, T, F) features (channels last); '{node.name}' is {list(shape)}"
                                + (" with its channels at dim 1 (a conv's feature map)" if dims else ""), "use block=conv_bn_relu")
        lin = nn.Linear(shape[-1], shape[-1], **kw)
        kaiming_(lin.weight, generator)
        with torch.no_grad():
            # Units in pairs with opposite weights: one of each pair is active for any input,
            # so the ReLU can never silence the whole block (and the gate always learns).
            half = shape[-1] // 2
            lin.weight[half:2 * half] = -lin.weight[:half]
            lin.bias.zero_()
        module = nn.Sequential(lin, nn.ReLU())
    else:
        raise NotApplicable(f"unknown block '{block}'", "use conv_bn_relu or linear_relu")
    name = add_module(gm, f"deepen_{block}", module)
    gate = add_parameter(gm, f"{name}_gate", torch.zeros((), **kw))
    graph = gm.graph
    with inserting_after(node):
        b = graph.call_module(name, (node,))
        g = graph.get_attr(gate)
        scaled = graph.call_function(operator.mul, (b, g))
        out = graph.call_function(operator.add, (node, scaled))
    replace_uses(node, out, keep=[b, scaled, out])
    set_scope([b, g, scaled, out], node)
    targets = {"after": f"{node.name} {list(shape)}", "chosen": chosen, "block": f"{block} ({name}), gate {gate} = 0"}
    return Rewrite(finish(gm), targets)


def block_params(node: fx.Node, block: str) -> int:
    """Parameters a block after `node` adds (a 3×3 or 3 conv + BatchNorm on maps, Linear on features, and the gate)."""
    shape = tensor_shape(node) or ()
    if len(shape) < 2:
        return 0
    dims = conv_dims(node)
    if block == "conv_bn_relu" or (block == "auto" and dims in (1, 2)):
        return shape[1] * shape[1] * 3 ** (dims or 2) + 2 * shape[1] + 1
    return shape[-1] * shape[-1] + shape[-1] + 1


@dataclass(frozen=True)
class Deepen(Pass):
    """Insert a block in residual form x + g·block(x) with a zero gate: exact in eval and train mode."""

    name: ClassVar[str] = "deepen"
    function = deepen
    after: str | None = arg(None, "node name or module path (its output); default: the latest stage end within the budget")
    block: Literal["auto", "conv_bn_relu", "linear_relu"] = arg("auto", "auto: conv_bn_relu for feature maps (N,C,H,W or a Conv1d's N,C,L), linear_relu otherwise")

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """The end of each backbone stage, the last first."""
        return stage_end_candidates(gm, lambda n: block_params(n, self.block))
