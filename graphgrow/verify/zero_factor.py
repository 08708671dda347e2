"""Trainability from the zero-factor structure: what the next SGD step would show, without taking it.

A new path starts as `Z · h(W, ...)` with its last factor Z = 0 (a Linear/conv weight, a
BatchNorm γ, a gate): at step 0, Z gets the gradient g_Z (non-zero when the path's input and
the gradient from the output both are) and W gets none, because it reaches W only through Z.
One SGD step moves Z to −η·g_Z; the gradient W then gets is, to first order in η, the gradient
of ⟨f(h; Z = −g_Z), δ⟩ (f: the zero factor's layer, δ: the gradient at its output at step 0)
carried back through h to W. That is one extra backward over the new path only, instead of a
second forward and backward of the whole model.

So during a step the input h and output of every zero factor that is still zero are kept (module
hooks; a gate parameter multiplied in the graph is found by node), and after that step's backward
the product is differentiated with respect to the new parameters still without a gradient: those
it reaches get the next step, as the SGD step would have shown. Those it does not reach (a
detached or zeroed path, a projection that cancels them) are left to the SGD steps, which still
decide. The same holds at a later step: a model whose own zero head blocks every gradient at
first (torchvision's ViT) trains everything from step 1, and the argument then saves the step
after the one at which the new zero factor first got a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..graph import ops
from ..graph.inputs import call, positional
from ..graph.layers import AverageMerge

_MUL = ops.PRODUCT_FUNCTIONS | {"mul"}  # x · y as a function or x.mul(y)


def new_region(t: torch.Tensor, old_shape) -> torch.Tensor:
    """Elements of a grown tensor outside the old shape's box (all of it for a new tensor)."""
    if old_shape is None or len(old_shape) != t.dim():
        return t
    mask = torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    for d, n in enumerate(old_shape):
        idx = [slice(None)] * t.dim()
        idx[d] = slice(n, None)
        mask[tuple(idx)] = True
    return t[mask]


def _moved(p: torch.Tensor, old_shape) -> torch.Tensor:
    """−grad on the new region of `p` (what an SGD step moves away from zero), zero on the old part."""
    g = p.grad.detach()
    if old_shape is None or len(old_shape) != g.dim():
        return -g
    keep = torch.ones(g.shape, dtype=torch.bool, device=g.device)
    keep[tuple(slice(0, n) for n in old_shape)] = False
    return torch.where(keep, -g, torch.zeros_like(g))


def _layer_probe(module: nn.Module, leaf: str) -> Callable[[list, torch.Tensor], torch.Tensor] | None:
    """f(args, moved zero factor) → the layer's output with the zero factor at its moved value (no bias)."""
    if leaf == "weight" and isinstance(module, nn.Linear):
        return lambda args, w: F.linear(args[0], w)
    if leaf == "weight" and isinstance(module, nn.modules.conv._ConvTransposeNd):  # (its _conv_forward is abstract)
        return lambda args, w: _transposed(module, args, w)
    if leaf == "weight" and isinstance(module, nn.modules.conv._ConvNd) and hasattr(module, "_conv_forward"):
        return lambda args, w: module._conv_forward(args[0], w, None)  # type: ignore[operator]
    if leaf == "weight" and isinstance(module, nn.modules.batchnorm._BatchNorm):
        return lambda args, w: F.batch_norm(args[0], None, None, w, None, True, 0.0, module.eps)
    if leaf == "gates" and isinstance(module, AverageMerge):
        return lambda args, w: sum(b * w[i] for i, b in enumerate(args[1:])) / len(args[1:])
    return None


def _transposed(m: Any, args: list, w: torch.Tensor) -> torch.Tensor:
    """A transposed convolution's output with weight `w` and no bias, at the output size its call asked for."""
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[w.dim() - 3]
    size = args[1] if len(args) > 1 else None
    pad = m._output_padding(args[0], size, m.stride, m.padding, m.kernel_size, w.dim() - 2, m.dilation)
    return conv(args[0], w, None, m.stride, m.padding, pad, m.groups, m.dilation)


class ZeroFactors:
    """Keeps what step 0 of the trainability check needs to argue step 1 (see the module docstring)."""

    def __init__(self, model: nn.Module, new_params: dict, now: dict[str, torch.Tensor], enabled: bool):
        self.model = model
        self.old_shapes = {name: old for name, (old, _) in new_params.items()}
        self.layers: dict[str, tuple[str, Callable]] = {}  # zero factor → (module path, probe)
        self.gates: dict[str, list[str]] = {}  # zero factor read by get_attr → the mul nodes it scales
        self.seen: dict[str, list[tuple[list, torch.Tensor]]] = {}  # module path or node name → (inputs, output)
        self.hooks: list = []
        if not enabled:
            return
        zero = [n for n in new_params if not new_region(now[n].detach(), self.old_shapes[n]).any()]  # still zero now
        nodes = list(getattr(getattr(model, "graph", None), "nodes", ()))
        for name in zero:
            path, _, leaf = name.rpartition(".")
            probe = _layer_probe(model.get_submodule(path), leaf) if path else None
            if probe is not None:
                self.layers[name] = (path, probe)
            muls = [
                u.name
                for n in nodes
                if n.op == "get_attr" and n.target == name
                for u in n.users
                if u.target in _MUL and len(u.args) == 2 and not u.kwargs
            ]
            if muls:
                self.gates[name] = muls

    def __enter__(self) -> ZeroFactors:
        for path in {p for p, _ in self.layers.values()}:
            self.hooks.append(self.model.get_submodule(path).register_forward_hook(self._keeper(path)))
        return self

    def _keeper(self, key: str):
        def keep(module, args, out):
            self._keep(key, list(args), out)

        return keep

    def _keep(self, key: str, args: list, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.retain_grad()
            self.seen.setdefault(key, []).append((args, out))

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()

    def forward(self, x: Any) -> Any:
        """The model's output on `x`; through an interpreter that keeps the gated products when gates are zero
        factors."""
        if not self.gates:
            return call(self.model, x)
        wanted = {m for muls in self.gates.values() for m in muls}
        zf = self

        class Keep(fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if n.name in wanted:
                    zf._keep(n.name, [self.env[a] if isinstance(a, fx.Node) else a for a in n.args], out)
                return out

        return Keep(self.model).run(*positional(x))

    @property
    def kept(self) -> bool:
        return bool(self.seen)

    def argue(self, params: dict[str, torch.Tensor], got: dict[str, int], step: int) -> dict[str, int]:
        """New parameters without a gradient yet that the next step would give one (to first order): name → step + 1.
        Zero factors count when they got their first gradient in this step."""
        waiting = [n for n in self.old_shapes if n not in got and params[n].requires_grad]
        terms: list[torch.Tensor] = []
        with torch.enable_grad():
            for name in [n for n in self.old_shapes if got.get(n) == step and params[n].grad is not None]:
                moved = _moved(params[name], self.old_shapes[name])
                if name in self.layers:
                    path, probe = self.layers[name]
                    terms += [
                        (probe(args, moved) * out.grad).sum()
                        for args, out in self.seen.get(path, [])
                        if out.grad is not None
                    ]
                for node in self.gates.get(name, []):
                    for args, out in self.seen.get(node, []):
                        other = next((a for a in args if isinstance(a, torch.Tensor) and a is not params[name]), None)
                        if other is not None and out.grad is not None:
                            terms.append((other * moved * out.grad).sum())
            terms = [t for t in terms if t.requires_grad]
            self.seen.clear()
            if not terms or not waiting:
                return {}
            grads = torch.autograd.grad(torch.stack(terms).sum(), [params[n] for n in waiting], allow_unused=True)
        return {
            n: step + 1
            for n, g in zip(waiting, grads)
            if g is not None and new_region(g, self.old_shapes[n]).abs().sum() > 0
        }
