"""Places where a new contribution would be dead: tensors no gradient reaches from the model's output.

A growth that adds `gate · new(x)` at a tensor t (a branch beside a conv, its gate 0) trains only when the loss
has a gradient at t: the gate's first gradient is ⟨new(x), ∂L/∂t⟩. A zero factor after t — NF-ResNet's
zero-initialised gain on a block's last weight-standardised conv, a BatchNorm γ = 0, a zero layer scale — makes
∂L/∂t zero for every input, and the pass's trainability check then fails (exit 1). So a pass choosing a place by
itself skips such places, and one given such a place refuses it (exit 2), naming the zero factor.

One probe finds them all: a forward of a seeded example batch in eval mode (no dropout draws), a zero leaf added
to each tensor asked about (its gradient is the tensor's), then one backward of a random projection of every output.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils._pytree import tree_leaves

from ..graph import ops
from ..graph.graph_meta import input_spec_of
from ..graph.inputs import positional
from ..graph.shapes import example_input

MAX_LOOK = 64  # nodes after a place searched for the zero factor that blocks it (only for the reason's words)


def _zero_weights(gm: fx.GraphModule) -> list[torch.Tensor]:
    return [
        p
        for name, p in gm.named_parameters()
        if name.rpartition(".")[2] != "bias" and p.is_floating_point() and p.numel() and not p.detach().any()
    ]


def dead_places(gm: fx.GraphModule, nodes: list[fx.Node], seed: int = 0, zeros_moved: bool = False) -> dict[str, str]:
    """Node name → why, for each of `nodes` whose tensor gets no gradient from the model's output. The probe (a
    forward and a backward) runs only where a place can be dead: the model has an all-zero weight (a zero factor),
    or it keeps part of a tensor and drops the rest (a class-token head, x[:, 0]: what reaches only the dropped
    tokens — CoaT's last convolutional position encoding — is not in the output at all). `zeros_moved`: as after
    training's first step, the model's all-zero weights (a zero head, a zero gain) hold small seeded values in a copy
    the probe runs on: what is dead then is dead for training too, not only at initialisation."""
    zeros = _zero_weights(gm)
    if not zeros and not any(_selects(n) for n in gm.graph.nodes):
        return {}
    if zeros_moved and zeros:  # on a copy: a pass never touches its input, not even to put it back
        moved = copy.deepcopy(gm)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in _zero_weights(moved):
                p.copy_(1e-3 * torch.randn(p.shape, generator=g).to(p))
        wanted = {n.name for n in nodes}
        return _probe(moved, [n for n in moved.graph.nodes if n.name in wanted], seed)
    return _probe(gm, nodes, seed)


def _probe(gm: fx.GraphModule, nodes: list[fx.Node], seed: int) -> dict[str, str]:
    wanted = {n.name for n in nodes}
    leaves: dict[str, torch.Tensor] = {}

    class Cut(fx.Interpreter):
        def run_node(self, n: fx.Node):
            out = super().run_node(n)
            if n.name in wanted and isinstance(out, torch.Tensor) and out.is_floating_point():
                leaves[n.name] = torch.zeros_like(out, requires_grad=True)
                out = out + leaves[n.name]  # its gradient is the one at `out`; paths through `out` stay whole
            return out

    was = gm.training
    try:
        gm.eval()
        x = example_input(gm, input_spec_of(gm), seed=seed, batch=2)
        with torch.enable_grad():
            outs = [
                t for t in tree_leaves(Cut(gm).run(*positional(x))) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if not outs or not leaves:
                return {}
            g = torch.Generator(device=outs[0].device).manual_seed(seed)
            loss = sum((t * torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype)).sum() for t in outs)
            names = list(leaves)
            grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    finally:
        gm.train(was)
    by_name = {n.name: n for n in nodes}
    return {k: _why(gm, by_name[k]) for k, grad in zip(names, grads) if grad is None or not grad.any()}


_SELECT = {"select", "narrow", "take", "take_along_dim", "masked_select"} | ops.TABLE_READS


def _selects(n: fx.Node) -> bool:
    """Whether `n` keeps part of a tensor: indexing with slices (x[:, :1], x[:, 0]) or an int on a tensor, or a
    selecting op. A tuple's element picked by an int (split, unbind) is not: every part stays a tensor."""
    if n.op not in ("call_function", "call_method"):
        return False
    if n.target is operator.getitem and len(n.args) > 1:
        index, src = n.args[1], n.args[0]
        if isinstance(index, (slice, tuple)):
            return True
        return isinstance(index, int) and isinstance(src, fx.Node) and isinstance(src.meta.get("gg_shape"), tuple)
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name in _SELECT


def _why(gm: fx.GraphModule, n: fx.Node) -> str:
    zero = _zero_factor_after(gm, n)
    if zero is not None:
        return f"its output is multiplied by zero downstream ('{zero}' is all zeros), so no gradient reaches it"
    return (
        "no gradient reaches its output from the model's output on a random batch (the output may keep only "
        "part of what it reaches, e.g. a class token)"
    )


def _zero_factor_after(gm: fx.GraphModule, n: fx.Node) -> str | None:
    """The first all-zero parameter or buffer the computation after `n` reads (directly, through a computed weight
    such as a standardised conv's gain, or as a layer's own weight)."""
    seen, todo, looked = {n}, list(n.users), 0
    while todo and looked < MAX_LOOK:
        u = todo.pop(0)
        if u in seen:
            continue
        seen.add(u)
        looked += 1
        if u.op == "call_module":
            for name, p in gm.get_submodule(str(u.target)).named_parameters(recurse=False):
                if name != "bias" and p.is_floating_point() and p.numel() and not p.detach().any():
                    return f"{u.target}.{name}"
        for a in _factors(u):
            found = _zero_attr_above(gm, a)
            if found is not None:
                return found
        todo += list(u.users)
    return None


_MUL = ops.PRODUCT_FUNCTIONS | {operator.imul, "mul", "mul_"}  # x · y as a function, x *= y, x.mul(y), x.mul_(y)
_WEIGHTED = {F.linear, F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d}


def _factors(u: fx.Node) -> list[fx.Node]:
    """The inputs of `u` that multiply what flows through it (a product's operands, a layer call's weight), not
    an added bias."""
    if u.target in _MUL:
        return [a for a in u.args if isinstance(a, fx.Node)]
    if u.target in _WEIGHTED:
        w = u.args[1] if len(u.args) > 1 else u.kwargs.get("weight")
        return [w] if isinstance(w, fx.Node) else []
    return []


def _zero_attr_above(gm: fx.GraphModule, a: fx.Node, depth: int = 8) -> str | None:
    """An all-zero get_attr tensor that the side input `a` is computed from, when `a` reads parameters and constants
    only (a computed weight such as a standardised conv's gain · w / σ), not the data."""
    if a.op == "get_attr":
        t = _attr(gm, str(a.target))
        return (
            str(a.target)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not t.detach().any()
            else None
        )
    if depth == 0 or a.op not in ("call_function", "call_method") or not _from_parameters(a, depth):
        return None
    for b in a.all_input_nodes:
        found = _zero_attr_above(gm, b, depth - 1)
        if found is not None:
            return found
    return None


def _from_parameters(a: fx.Node, depth: int) -> bool:
    if a.op == "get_attr":
        return True
    if depth == 0 or a.op not in ("call_function", "call_method"):
        return False
    return all(_from_parameters(b, depth - 1) for b in a.all_input_nodes)


def _attr(gm: fx.GraphModule, target: str):
    owner, _, leaf = target.rpartition(".")
    try:
        return getattr(gm.get_submodule(owner) if owner else gm, leaf, None)
    except AttributeError:
        return None
