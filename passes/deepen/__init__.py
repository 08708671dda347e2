"""deepen: a new block after a node, in residual form x + g·block(x) with a scalar gate g = 0.

block=conv_bn_relu (feature maps (N, C, H, W), or (N, C, L) of a Conv1d stack): a 3×3 (or 3) conv
(same channels) → BatchNorm → ReLU.
block=linear_relu ((N, F) features, (N, T, F) tokens): Linear (same features) → ReLU, its units in
pairs with opposite weights, so that some are active for any input.
block=transformer (a token stream (N, T, C)): a whole pre-norm transformer block, exact without a gate
(its output projections start at zero); see below.
The gate is the zero last factor: exact in eval and train mode (an identity-
initialised BatchNorm would be off by eps in eval and not the identity in train
mode), the gate learns at once and the block's layers after one step.
init=gradmax: the block's first layer is aimed from a batch (`data`) so the gradient on the zero gate is
largest (linear_relu keeps its ± pairs); block=transformer aims v and fc1 at the gradient on the zero
proj and fc2 (graphgrow.rewrite.gradmax).

block=transformer: a whole pre-norm transformer block on a token stream (N, T, C), as the identity.

    h = x + proj(attention(norm1(x)))        out = h + fc2(act(fc1(norm2(h))))

proj (the attention's output projection) and fc2 (the MLP's down projection) start at zero, weight and bias,
so out == x exactly, in eval and train mode (the block has no dropout). They learn at once; norm1, q, k, v,
norm2 and fc1 learn from the next step. The block is written into the graph as torch layers and functions
(nn.Linear, nn.LayerNorm or nn.RMSNorm, nn.GELU, F.scaled_dot_product_attention), so every later pass,
the graphgrow file and the ONNX export see ordinary layers.

Read from the model by the analyses grow_hidden and grow_heads trust: from the residual stream (find_stream) the
norm type and eps of its first norm (LayerNorm with biases on the block's Linears, or RMSNorm without biases, as LLaMA
has them) and the MLP width F of a reader C → F paired with a Linear writer F → C (else 4·C); the head count of the
model's first attention over width C (find_attentions; else the largest divisor of C at most C // 64, at least 1).
Where an analysis refuses, the model's modules of width C and its attention's query shapes are read instead.
The MLP is a plain GELU MLP, the attention has as many key/value heads as query heads and no key bias
(a key bias never gets a gradient: softmax ignores it).

Causality (attention=auto): the model's stream at the place is probed — the example input is run twice,
differing only at the last sequence position of each token-aligned input; if no earlier position of the
stream changes, the model is causal there (GPT-2, LLaMA) and so is the new block, else it attends both
ways (BERT). Where no input is aligned with the stream's tokens (pixels), the masks the model's own
scaled_dot_product_attention calls get at run time decide: all open → both ways (ViT), all causal → causal;
otherwise (or with no attention to read) the pass refuses with the reason: say attention=causal|bidirectional.
The block does not read the model's attention mask (padding): it attends over all T positions.
In a post-norm model (BERT) the block is still pre-norm and exactly the identity where it is inserted.

block=copy: a copy of one of the model's own layers (model.layers.N: its attention, RoPE, grouped heads, MLP) with
the output projections the stream analysis finds at zero, inserted into its stack as the identity, so that as_native
gives the same class with one more layer (layer_copy.py has the story).

The package: __init__ (the pass, the gated conv_bn_relu and linear_relu blocks), transformer (block=transformer:
its places, what the model tells, causality, the block), layer_copy (block=copy: the stack, the copy, its place).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from graphgrow.passes.deepen.layer_copy import (  # noqa: TID251 (the deepen package's own module)
    copy_candidates,
    insert_copy,
)
from graphgrow.passes.deepen.transformer import (  # noqa: TID251 (the deepen package's own module)
    candidates,
    default_place,
    insert_block,
    transformer_place,
)
from torch import fx, nn

from graphgrow import Candidate, NotApplicable, Pass, Rewrite, arg
from graphgrow.rewrite import (
    ADDS_PARAMETERS,
    GatedBlock,
    add_module,
    add_parameter,
    aim_gates,
    aim_units,
    begin,
    conv_dims,
    default_point,
    factory_kwargs,
    finish,
    inline_containers,
    inserting_after,
    is_float_tensor,
    kaiming_,
    load_data,
    pass_function,
    replace_uses,
    set_scope,
    stage_end_candidates,
    tensor_or_feature_end,
    tensor_shape,
)

Block = Literal["auto", "conv_bn_relu", "linear_relu", "transformer", "copy"]


# a conv_bn_relu block per layout, by the spatial dims of the map (analysis.axes.conv_dims): a Conv1d's (N, C, L),
# an image's (N, C, H, W), a video's (N, C, T, H, W)
_CONV_BN: dict[int, tuple[type[nn.Module], type[nn.Module]]] = {
    1: (nn.Conv1d, nn.BatchNorm1d),
    2: (nn.Conv2d, nn.BatchNorm2d),
    3: (nn.Conv3d, nn.BatchNorm3d),
}


@pass_function  # the arguments' defaults and allowed values: Deepen's declaration
def deepen(
    gm: fx.GraphModule,
    after: str | None,
    block: Block,
    attention: Literal["auto", "causal", "bidirectional"],
    init: Literal["zero", "gradmax"],
    data,
    source: int | None,
    generator: torch.Generator | None = None,
) -> Rewrite:
    """Insert `x + g·block(x)` (g = 0) after `after` (default: the last feature map before global pooling).
    init=gradmax: `data` is a callable (or `package.module:function`) returning (inputs, loss_fn)."""
    if init == "gradmax" and data is None:
        load_data(None, "deepen")  # refused before any work: gradmax needs a batch
    original = gm
    gm, generator = begin(gm, generator)
    if block == "copy":
        return insert_copy(gm, after, source)
    fallback = None
    if block == "auto" and transformer_place(gm, after):
        # a transformer's token stream grows by a transformer block: a gated Linear-ReLU there would be a foreign
        # block in the stack (its ReLU units could then only be copied when the stream grows)
        try:
            node, chosen = tensor_or_feature_end(gm, after) if after is not None else default_place(gm)
            rw, root = insert_block(gm, node, chosen, attention, generator)
            return _aimed(rw, root, init, data)
        except NotApplicable as e:
            fallback = f"block=auto: no transformer block here ({e.message}), a linear_relu block instead"
            gm, generator = begin(original, generator)
    if block == "transformer":
        node, chosen = tensor_or_feature_end(gm, after) if after is not None else default_place(gm)
        rw, root = insert_block(gm, node, chosen, attention, generator)
        return _aimed(rw, root, init, data)
    node, chosen = (
        tensor_or_feature_end(gm, after) if after is not None else default_point(gm, lambda n: block_params(n, block))
    )
    shape = tensor_shape(node)
    if not is_float_tensor(node) or len(shape) < 2:
        raise NotApplicable(
            f"'{node.name}' (shape {node.meta.get('gg_shape')}) is not a feature tensor",
            "pick a node with a (N, C, …) tensor",
        )
    dims = conv_dims(node)
    if block == "auto":
        block = "conv_bn_relu" if dims in _CONV_BN else "linear_relu"
    kw = factory_kwargs(gm, node)
    if block == "conv_bn_relu":
        if dims not in _CONV_BN:
            raise NotApplicable(
                f"conv_bn_relu needs a feature map (N, C, H, W), (N, C, L) or (N, C, D, H, W); '{node.name}' is "
                f"{list(shape)}" + (" with its channels last" if dims is None else ""),
                "use block=linear_relu",
            )
        c = shape[1]
        conv_class, norm_class = _CONV_BN[dims]
        conv = conv_class(c, c, 3, padding=1, bias=False, **kw)
        kaiming_(conv.weight, generator)
        module = nn.Sequential(conv, norm_class(c, **kw), nn.ReLU())
    elif block == "linear_relu":
        if len(shape) not in (2, 3) or dims is not None:
            raise NotApplicable(
                f"linear_relu needs (N, F) or (N, T, F) features (channels last); '{node.name}' is {list(shape)}"
                + (" with its channels at dim 1 (a conv's feature map)" if dims else ""),
                "use block=conv_bn_relu",
            )
        lin = nn.Linear(shape[-1], shape[-1], **kw)
        kaiming_(lin.weight, generator)
        with torch.no_grad():
            # Units in pairs with opposite weights: one of each pair is active for any input,
            # so the ReLU can never silence the whole block (and the gate always learns).
            half = shape[-1] // 2
            lin.weight[half : 2 * half] = -lin.weight[:half]
            lin.bias.zero_()
        module = nn.Sequential(lin, nn.ReLU())
    else:
        raise NotApplicable(f"unknown block '{block}'", "use conv_bn_relu, linear_relu or transformer")
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
    rw = Rewrite(finish(gm), targets)
    if init == "gradmax":
        half = shape[-1] // 2 if block == "linear_relu" else 0
        ties = [(half + i, i) for i in range(half)]  # linear_relu's pairs stay opposite
        _report(rw, aim_gates(rw.gm, [GatedBlock(name, gate, None, f"{name}.0", ties)], data, "deepen"))
    if inline_containers(rw.gm, [name]):  # after the aim, which hooks the block module: its layers as graph nodes
        finish(rw.gm)
    if fallback:
        rw.notes.append(fallback)
    return rw


def _aimed(rw: Rewrite, root: str, init: str, data) -> Rewrite:
    """block=transformer (at module path `root`) with init=gradmax: v and fc1 aimed at the gradient on the zero proj
    and fc2."""
    if init == "gradmax":
        mods = {k: rw.gm.get_submodule(f"{root}.{k}") for k in ("v", "fc1", "proj", "fc2")}
        rows = {f"{root}.{k}": list(range(mods[k].out_features)) for k in ("v", "fc1")}
        cols = {f"{root}.{k}": list(range(mods[k].in_features)) for k in ("proj", "fc2")}
        _report(rw, aim_units(rw.gm, rows, cols, data, pass_name="deepen"))
    return rw


def _report(rw: Rewrite, aimed) -> None:
    if aimed is not None:
        rw.targets["gradmax"], rw.targets["gain"] = aimed.describe(), float(f"{aimed.gain:.4g}")
        rw.notes.extend(aimed.notes)


def block_params(node: fx.Node, block: str) -> int:
    """Parameters a block after `node` adds (a 3, 3×3 or 3×3×3 conv + BatchNorm on maps, Linear on features, and the
    gate)."""
    shape = tensor_shape(node) or ()
    if len(shape) < 2:
        return 0
    dims = conv_dims(node)
    if block == "conv_bn_relu" or (block == "auto" and dims in _CONV_BN):
        return shape[1] * shape[1] * 3 ** (dims or 2) + 2 * shape[1] + 1
    return shape[-1] * shape[-1] + shape[-1] + 1


@dataclass(frozen=True)
class Deepen(Pass):
    """Insert a block in residual form x + g·block(x) with a zero gate: exact in eval and train mode."""

    name: ClassVar[str] = "deepen"
    function = deepen
    ensures = (ADDS_PARAMETERS,)
    after: str | None = arg(
        None, "node name or module path (its output); default: the latest stage end within the budget"
    )
    block: Block = arg(
        "auto",
        "auto: transformer on a transformer's token stream, conv_bn_relu for feature maps (N,C,H,W, "
        "a Conv1d's N,C,L or a video's N,C,T,H,W), linear_relu otherwise; "
        "transformer: a pre-norm attention + MLP block on a token stream (N,T,C), no gate; "
        "copy: a copy of the model's own layer (model.layers.N) with its output projections at zero",
    )
    attention: Literal["auto", "causal", "bidirectional"] = arg(
        "auto", "block=transformer: auto probes whether the stream is causal at the place (refuses when it cannot tell)"
    )
    init: Literal["zero", "gradmax"] = arg(
        "zero",
        "zero: random block behind the zero gate (transformer: zero proj, fc2); "
        "gradmax: the first layer aimed from `data`",
    )
    data: str | None = arg(
        None, "with init=gradmax: package.module:function returning (inputs, loss_fn); CLI: --data", names_code=True
    )
    source: int | None = arg(
        None, "block=copy: the index of the layer to copy (default: the layer before the place)", low=0
    )

    def conflict(self) -> tuple[str, str, str] | None:
        if self.source is not None and self.block != "copy":
            return "source", "source= names the layer block=copy copies", "add block=copy, or leave source out"
        if self.block == "copy" and self.init != "zero":
            return (
                "init",
                "block=copy starts as the identity through its own zero output projections; init=gradmax aims a "
                "block behind a gate or inserted by graphgrow",
                "use init=zero with block=copy",
            )
        return None

    def candidates(self, gm: fx.GraphModule) -> list[Candidate]:
        """The end of each backbone stage, the last first (block=transformer: each block's output on the token
        stream)."""
        if self.block == "copy":
            return copy_candidates(gm)
        if self.block == "transformer" or (self.block == "auto" and transformer_place(gm, None)):
            return candidates(gm)
        return stage_end_candidates(gm, lambda n: block_params(n, self.block))
