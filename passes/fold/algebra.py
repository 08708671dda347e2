"""The algebra of forms: compose two maps (outer ∘ inner), add two maps of one tensor (a ± b, kernels
aligned), and re-associate a sum so that terms reading the same tensor meet first."""

from __future__ import annotations

import math
import operator

import torch
from graphgrow.passes.fold.form import Form, add_bias, to_groups  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.graph import ADD, SITE, SUB  # noqa: TID251 (the fold package's own module)
from torch import fx

from graphgrow.rewrite import tensor_shape


def compose(outer: Form, inner: Form) -> Form | None:
    """outer ∘ inner, when that is one layer of the same kind without a larger kernel."""
    if outer.kind != inner.kind or outer.in_channels != inner.out_channels:
        return None
    if outer.kind == "linear":
        w = outer.weight @ inner.weight
        b = add_bias(outer.weight @ inner.bias if inner.bias is not None else None, outer.bias)
        return Form("linear", inner.src, w, b)
    if outer.pointwise:
        # out[o] = Σ_c P[o, c] · inner[c]: keep inner's geometry; a diagonal P keeps its groups
        diag = outer.groups == outer.out_channels == outer.in_channels
        if diag:
            scale = outer.weight.reshape(-1)
            w = inner.weight * scale.reshape(-1, 1, 1, 1)
            groups = inner.groups
        else:
            p = outer.dense()[:, :, 0, 0]
            w = torch.einsum("oc,cikl->oikl", p, inner.dense())
            groups = 1
            scale = None
        inner_b = inner.bias
        if inner_b is not None:
            inner_b = inner_b * scale if diag else outer.dense()[:, :, 0, 0] @ inner_b
        return Form("conv", inner.src, w, add_bias(inner_b, outer.bias), groups, inner.stride, inner.padding)
    if inner.pointwise and (inner.bias is None or outer.padding == (0, 0)):
        # zero padding of outer would pad inner's output, not inner's input: only exact without inner's bias
        diag = inner.groups == inner.out_channels == inner.in_channels
        if diag:
            scale = inner.weight.reshape(-1)
            cin_g = outer.weight.shape[1]
            idx = torch.arange(outer.out_channels) // (outer.out_channels // outer.groups) * cin_g
            cols = idx.reshape(-1, 1) + torch.arange(cin_g).reshape(1, -1)
            w = outer.weight * scale[cols].reshape(*cols.shape, 1, 1)
            groups = outer.groups
        else:
            w = torch.einsum("ockl,ci->oikl", outer.dense(), inner.dense()[:, :, 0, 0])
            groups = 1
        b = outer.bias
        if inner.bias is not None:
            b = add_bias(outer.dense().sum((2, 3)) @ inner.bias, b)
        return Form("conv", inner.src, w, b, groups, outer.stride, outer.padding)
    return None


def sum_forms(a: Form, b: Form, sign: float, out_shape) -> Form | None:
    """a + sign·b as one layer, when both read the same tensor with the same stride."""
    if a.kind != b.kind or a.src is not b.src or a.out_channels != b.out_channels or a.in_channels != b.in_channels:
        return None
    if a.kind == "linear":
        return Form(
            "linear", a.src, a.weight + sign * b.weight, add_bias(a.bias, None if b.bias is None else sign * b.bias)
        )
    if a.stride != b.stride:
        return None
    # output o reads input rows o·s − p … o·s − p + k − 1: align the two windows
    (ka, kb), (pa, pb) = ((a.weight.shape[2], b.weight.shape[2]), (a.padding[0], b.padding[0]))
    (la, lb), (qa, qb) = ((a.weight.shape[3], b.weight.shape[3]), (a.padding[1], b.padding[1]))
    ph, pw = max(pa, pb), max(qa, qb)
    kh, kw = max(ka - pa, kb - pb) + ph, max(la - qa, lb - qb) + pw
    src_shape = tensor_shape(a.src)
    if src_shape is None:
        return None
    h = (src_shape[2] + 2 * ph - kh) // a.stride[0] + 1
    wd = (src_shape[3] + 2 * pw - kw) // a.stride[1] + 1
    if (h, wd) != tuple(out_shape[2:]) or kh > src_shape[2] + 2 * ph or kw > src_shape[3] + 2 * pw:
        return None
    groups = math.gcd(a.groups, b.groups)
    w = a.weight.new_zeros((a.out_channels, a.in_channels // groups, kh, kw))
    for f, s, p, q in ((a, 1.0, pa, qa), (b, sign, pb, qb)):
        fw = to_groups(f, groups)
        oh, ow = ph - p, pw - q
        w[:, :, oh : oh + fw.shape[2], ow : ow + fw.shape[3]] += s * fw
    bias = add_bias(a.bias, None if b.bias is None else sign * b.bias)
    return Form("conv", a.src, w, bias, groups, a.stride, (ph, pw))


def is_sum(n: fx.Node) -> bool:
    """An add or subtract of two tensors of the output's shape."""
    return (
        n.op == "call_function"
        and n.target in ADD + SUB
        and len(n.args) == 2
        and not n.kwargs
        and all(isinstance(a, fx.Node) for a in n.args)
        and tensor_shape(n.args[0]) == tensor_shape(n.args[1]) == tensor_shape(n)
    )


def _terms(n: fx.Node, sign: float, out: list) -> None:
    """The signed terms of a tree of same-shape adds/subtracts whose inner nodes have one user."""
    for i, a in enumerate(n.args):
        s = sign * (-1.0 if i == 1 and n.target in SUB else 1.0)
        if is_sum(a) and len(a.users) == 1:
            _terms(a, s, out)
        else:
            out.append((a, s))


def reassociate(gm: fx.GraphModule, forms: dict[fx.Node, Form]) -> int:
    """Rebuild sums so that terms reading the same tensor are added first: (a + c) + b for a + b + c
    when a and c are maps of one tensor (`forms`: the analysis's forms). The pairwise merge then folds them."""
    count = 0
    for n in list(gm.graph.nodes):
        if not is_sum(n) or any(is_sum(u) and len(n.users) == 1 for u in n.users):
            continue
        terms: list = []
        _terms(n, 1.0, terms)
        if len(terms) < 3:
            continue

        def key(t: fx.Node) -> fx.Node:
            return forms[t].src if t in forms and len(t.users) == 1 else t

        keys = [key(t) for t, _ in terms]
        sizes = {k: sum(1 for x in keys if x is k) for k in keys}
        order = sorted(range(len(terms)), key=lambda i: (-sizes[keys[i]], keys.index(keys[i]), terms[i][1] < 0, i))
        if order == list(range(len(terms))) or sizes[keys[order[0]]] < 2:
            continue
        ordered = [terms[i] for i in order]
        with gm.graph.inserting_before(n):
            acc, sign = ordered[0]
            if sign < 0:
                acc = gm.graph.call_function(operator.neg, (acc,))
            for t, s in ordered[1:]:
                acc = gm.graph.call_function(operator.add if s > 0 else operator.sub, (acc, t))
                acc.meta.update({k: v for k, v in n.meta.items() if k in ("gg_scope", SITE)})
        n.replace_all_uses_with(acc)
        count += 1
    return count
