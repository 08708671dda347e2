"""Rule family (moves): a per-position layer just before the classifier moves into the classifier's
Linear — a 1×1 conv before global average pooling, a per-token Linear before a token select (x[:, 0])."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from graphgrow.passes.fold.graph import module_of  # noqa: TID251 (the fold package's own module)
from graphgrow.passes.fold.local import conv_form  # noqa: TID251 (the fold package's own module)
from torch import fx, nn

from graphgrow.rewrite import set_module, tensor_shape


def fold_gap_adapters(gm: fx.GraphModule) -> list[str]:
    """Linear ∘ flatten ∘ global-average-pool ∘ 1×1 conv = Linear' ∘ flatten ∘ pool: the conv moves into the Linear."""
    done = []
    for lin in list(gm.graph.nodes):
        m = module_of(gm, lin)
        if type(m) is not nn.Linear or not isinstance(lin.args[0], fx.Node):
            continue
        flat = lin.args[0]
        if not (len(flat.users) == 1 and _is_flatten(gm, flat) and isinstance(flat.args[0], fx.Node)):
            continue
        pool = flat.args[0]
        if not (len(pool.users) == 1 and _is_global_pool(gm, pool) and isinstance(pool.args[0], fx.Node)):
            continue
        conv_node = pool.args[0]
        conv = module_of(gm, conv_node)
        shape = tensor_shape(conv_node)
        if not isinstance(conv, nn.Conv2d) or len(conv_node.users) != 1 or shape is None:
            continue
        f = conv_form(conv, conv_node.args[0], str(conv_node.target), shape)
        if f is None or not f.pointwise:
            continue
        a = f.dense()[:, :, 0, 0]
        w = m.weight.detach().double() @ a
        b = m.bias.detach().double() if m.bias is not None else torch.zeros(m.out_features, dtype=torch.float64)
        if f.bias is not None:
            b = b + m.weight.detach().double() @ f.bias
        new = nn.Linear(a.shape[1], m.out_features, bias=True, dtype=m.weight.dtype, device=m.weight.device)
        with torch.no_grad():
            new.weight.copy_(w)
            new.bias.copy_(b)
        set_module(gm, str(lin.target), new.train(m.training))
        pool.args = (conv_node.args[0], *pool.args[1:])
        gm.graph.erase_node(conv_node)
        done.append(f"{conv_node.target} (1×1 conv before global pooling) → {lin.target}")
    return done


def fold_select_adapters(gm: fx.GraphModule) -> list[str]:
    """Linear ∘ token select ∘ Linear (per token) = Linear' ∘ select: a per-token layer commutes with picking
    tokens (x[:, 0] before a ViT head), so it moves into the Linear after the select."""
    done = []
    for lin in list(gm.graph.nodes):
        m = module_of(gm, lin)
        sel = lin.args[0] if lin.args else None
        if type(m) is not nn.Linear or not isinstance(sel, fx.Node) or len(sel.users) != 1:
            continue
        if not (sel.op == "call_function" and sel.target is operator.getitem and isinstance(sel.args[0], fx.Node)):
            continue
        ad_node, index = sel.args[0], sel.args[1]
        shape = tensor_shape(ad_node)
        ad = module_of(gm, ad_node)
        if type(ad) is not nn.Linear or len(ad_node.users) != 1 or shape is None or len(shape) != 3:
            continue
        # the index may pick tokens and the batch, never features: at most two entries, no Ellipsis
        entries = index if isinstance(index, tuple) else (index,)
        if len(entries) > 2 or any(e is Ellipsis or isinstance(e, fx.Node) for e in entries):
            continue
        w = m.weight.detach().double() @ ad.weight.detach().double()
        b = m.bias.detach().double() if m.bias is not None else torch.zeros(m.out_features, dtype=torch.float64)
        if ad.bias is not None:
            b = b + m.weight.detach().double() @ ad.bias.detach().double()
        new = nn.Linear(ad.in_features, m.out_features, bias=True, dtype=m.weight.dtype, device=m.weight.device)
        with torch.no_grad():
            new.weight.copy_(w)
            new.bias.copy_(b)
        set_module(gm, str(lin.target), new.train(m.training))
        sel.args = (ad_node.args[0], index)
        gm.graph.erase_node(ad_node)
        done.append(f"{ad_node.target} (per-token Linear before a token select) → {lin.target}")
    return done


def _is_flatten(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return type(module_of(gm, n)) is nn.Flatten
    return (n.op == "call_function" and n.target is torch.flatten) or (n.op == "call_method" and n.target == "flatten")


def _is_global_pool(gm: fx.GraphModule, n: fx.Node) -> bool:
    s = tensor_shape(n)
    if s is None or len(s) != 4 or s[2:] != (1, 1):
        return False
    if n.op == "call_module":
        return type(module_of(gm, n)) is nn.AdaptiveAvgPool2d
    return n.op == "call_function" and n.target is F.adaptive_avg_pool2d
