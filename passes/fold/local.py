"""The form of one node as a function of its own input: conv, Linear, BatchNorm (module or F.batch_norm),
average pooling with count_include_pad, a scalar multiple; None when the node is not a linear map of one tensor."""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from graphgrow.passes.fold.form import Form, diag_form, kind_of, numel, pair  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.graph import MUL, module_of, scalar_operand  # noqa: TID251 (the fold package's own module)
from torch import fx, nn

from graphgrow.rewrite import tensor_shape


def conv_form(m: nn.Conv2d, src: fx.Node, path: str, out_shape) -> Form | None:
    if type(m).forward is not nn.Conv2d.forward or m.padding_mode != "zeros":
        return None
    k = m.kernel_size
    pad: tuple[int, int]
    if isinstance(m.padding, str):
        if m.padding == "valid":
            pad = (0, 0)
        elif m.stride == (1, 1) and all(d * (kk - 1) % 2 == 0 for d, kk in zip(m.dilation, k)):
            pad = pair([d * (kk - 1) // 2 for d, kk in zip(m.dilation, k)])
        else:
            return None
    else:
        pad = pair(m.padding)
    w = m.weight.detach().double()
    if m.dilation != (1, 1):  # a dilated kernel is a larger kernel with holes
        dh, dw = m.dilation
        big = w.new_zeros((*w.shape[:2], dh * (k[0] - 1) + 1, dw * (k[1] - 1) + 1))
        big[:, :, ::dh, ::dw] = w
        w = big
    bias = m.bias.detach().double() if m.bias is not None else None
    macs = numel(out_shape) * m.weight[0].numel()
    params = sum(p.numel() for p in m.parameters())
    return Form("conv", src, w, bias, m.groups, tuple(m.stride), pad, macs=macs, params=params, weighted=[path])


def _bn_affine(
    mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BatchNorm as y = scale·x + shift per channel, in float64."""
    scale = 1.0 / torch.sqrt(var.detach().double() + eps)
    shift = -mean.detach().double() * scale
    if weight is not None:
        scale, shift = scale * weight.detach().double(), shift * weight.detach().double()
    if bias is not None:
        shift = shift + bias.detach().double()
    return scale, shift


def _bn_form(m: nn.Module, src: fx.Node, kind: str) -> Form | None:
    bn_type = nn.BatchNorm2d if kind == "conv" else nn.BatchNorm1d
    if (
        not isinstance(m, bn_type) or type(m).forward is not bn_type.forward
    ):  # a subclass with its own forward adds more
        return None
    if m.running_mean is None or m.running_var is None:
        return None
    return diag_form(kind, src, *_bn_affine(m.running_mean, m.running_var, m.weight, m.bias, m.eps))


def local_form(gm: fx.GraphModule, n: fx.Node) -> Form | None:
    """The form of `n` as a function of its own input, or None when it is not a linear map of one tensor."""
    kind = kind_of(n)
    if kind is None:
        return None
    shape = tensor_shape(n)
    if n.op == "call_module":
        if len(n.args) != 1 or n.kwargs or not isinstance(n.args[0], fx.Node):
            return None
        src, m = n.args[0], module_of(gm, n)
        if kind == "conv" and isinstance(m, nn.Conv2d):
            return conv_form(m, src, str(n.target), shape)
        if kind == "linear" and type(m) is nn.Linear:
            w = m.weight.detach().double()
            b = m.bias.detach().double() if m.bias is not None else None
            return Form(
                "linear",
                src,
                w,
                b,
                macs=numel(shape) * m.in_features,
                params=sum(p.numel() for p in m.parameters()),
                weighted=[str(n.target)],
            )
        if (
            isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))
            and tensor_shape(src) == shape
            and (kind == "conv" or len(shape) == 2)
        ):
            f = _bn_form(m, src, kind)
            if f is not None:
                f.macs, f.params = numel(shape), 2 * shape[1]
            return f
        if (
            kind == "conv"
            and type(m) is nn.AvgPool2d
            and m.count_include_pad
            and not m.ceil_mode
            and m.divisor_override is None
        ):
            k = pair(m.kernel_size)
            c = shape[1]
            w = torch.full((c, 1, *k), 1.0 / (k[0] * k[1]), dtype=torch.float64)
            return Form(
                "conv",
                src,
                w,
                None,
                c,
                pair(m.stride or m.kernel_size),
                pair(m.padding),
                macs=numel(shape) * k[0] * k[1],
            )
        return None
    if n.op == "call_function" and n.target is F.batch_norm:
        return _functional_bn_form(gm, n, kind, shape)
    scaled = _scalar_multiple(n, shape)
    if scaled is None:
        return None
    c, x = scaled
    f = diag_form(kind, x, torch.full((shape[1] if kind == "conv" else shape[-1],), c, dtype=torch.float64), None)
    f.macs = numel(shape)
    return f


def _scalar_multiple(n: fx.Node, shape) -> tuple[float, fx.Node] | None:
    """(c, x) when `n` computes c·x for a number c (x·c, c·x, x/c, −x) with x of the output's shape."""
    if n.op != "call_function" or n.kwargs:
        return None
    if n.target in (operator.neg, torch.neg) and isinstance(n.args[0], fx.Node):
        c, x = -1.0, n.args[0]
    elif n.target in MUL + (operator.truediv, torch.div) and (s := scalar_operand(n)) is not None:
        if n.target not in MUL and n.args[0] is not s[1]:
            return None  # c / x is not linear
        c, x = (s[0] if n.target in MUL else 1.0 / s[0]), s[1]
    else:
        return None
    return (c, x) if math.isfinite(c) and tensor_shape(x) == shape else None


_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _functional_bn_form(gm: fx.GraphModule, n: fx.Node, kind: str, shape) -> Form | None:
    """F.batch_norm in eval mode (how BatchNorm subclasses with a fused activation call it) on stored tensors."""
    args = dict(zip(_BN_ARGS, n.args))
    args.update(n.kwargs)
    if args.get("training", False) is not False or not isinstance(args.get("input"), fx.Node):
        return None
    tensors = {}
    for key in ("running_mean", "running_var", "weight", "bias"):
        a = args.get(key)
        if a is None and key in ("weight", "bias"):
            continue
        if not isinstance(a, fx.Node) or a.op != "get_attr":
            return None
        tensors[key] = _attr(gm, str(a.target))
    src = args["input"]
    if tensor_shape(src) != shape or (kind == "linear" and len(shape) != 2):
        return None
    scale, shift = _bn_affine(
        tensors["running_mean"],
        tensors["running_var"],
        tensors.get("weight"),
        tensors.get("bias"),
        float(args.get("eps", 1e-5)),
    )
    f = diag_form(kind, src, scale, shift)
    f.macs, f.params = numel(shape), 2 * scale.numel()
    return f


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)
