"""The linear form: a node that is a linear map of one tensor `src`, written as one conv (weight in grouped
layout) or one Linear, in float64, with the nodes it would replace and what they cost. Constructors for
the simple forms (a per-channel scale, the identity) and the weight-layout helpers live here too."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import fx

from graphgrow.rewrite import tensor_shape


@dataclass
class Form:
    kind: str  # "conv" | "linear"
    src: fx.Node
    weight: torch.Tensor  # conv: (out, in/groups, kh, kw); linear: (out, in); float64
    bias: torch.Tensor | None
    groups: int = 1
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    nodes: set = field(default_factory=set)  # the nodes this form replaces
    macs: int = 0  # multiply-adds per example of the replaced nodes
    params: int = 0  # parameters of the replaced layers
    weighted: list = field(default_factory=list)  # module paths of the conv/Linear layers inside

    @property
    def pointwise(self) -> bool:
        return self.kind == "linear" or (
            self.weight.shape[2:] == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0)
        )

    @property
    def out_channels(self) -> int:
        return self.weight.shape[0]

    @property
    def in_channels(self) -> int:
        return self.weight.shape[1] * self.groups

    def dense(self) -> torch.Tensor:
        """Weight with groups = 1."""
        if self.groups == 1:
            return self.weight
        return regroup(self.weight, self.groups, 1)

    def size(self) -> int:
        """Parameters of this form as one layer."""
        return self.weight.numel() + (self.out_channels if self.bias is not None else 0)

    def cost(self, out_shape: tuple[int, ...]) -> int:
        """Multiply-adds per example of this form as one layer."""
        per_out = self.weight[0].numel()
        return numel(out_shape) * per_out


def numel(shape: tuple[int, ...]) -> int:
    """Elements per example."""
    return math.prod(shape[1:]) if shape else 0


def regroup(w: torch.Tensor, groups: int, to: int) -> torch.Tensor:
    """Re-lay a grouped conv weight from `groups` to `to` groups (`to` divides `groups`)."""
    out, in_g = w.shape[:2]
    cin = in_g * groups
    og, ig_new = out // groups, cin // to
    new = w.new_zeros((out, ig_new, *w.shape[2:]))
    per = groups // to
    for gi in range(groups):
        rows = slice(gi * og, (gi + 1) * og)
        col = (gi % per) * in_g
        new[rows, col : col + in_g] = w[rows]
    return new


def to_groups(f: Form, g: int) -> torch.Tensor:
    return f.weight if f.groups == g else regroup(f.weight, f.groups, g)


def pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def add_bias(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


def diag_form(kind: str, src: fx.Node, scale: torch.Tensor, shift: torch.Tensor | None) -> Form:
    """y = scale·x + shift per channel."""
    c = scale.numel()
    w = scale.reshape(c, 1, 1, 1) if kind == "conv" else torch.diag(scale)
    return Form(kind, src, w, shift, groups=c if kind == "conv" else 1)


def kind_of(n: fx.Node) -> str | None:
    """The form kind of a node's output: "conv" for a floating NCHW tensor, "linear" for (N, C) or (N, T, C), else
    None."""
    s = tensor_shape(n)
    dt = n.meta.get("gg_dtype")
    if s is None or dt is None or not dt.is_floating_point:
        return None
    return "conv" if len(s) == 4 else ("linear" if len(s) in (2, 3) else None)


def identity_form(kind: str, x: fx.Node) -> Form | None:
    """x itself, as a form of x."""
    s = tensor_shape(x)
    if s is None or kind_of(x) != kind:
        return None
    c = s[1] if kind == "conv" else s[-1]
    return diag_form(kind, x, torch.ones(c, dtype=torch.float64), None)
