"""init=gradmax behind a zero gate (add_branch, deepen): J = (∂L/∂gate)² on a batch, over the new block's
first dense layer.

With the gate at 0 the block's output b does not change the function, and ∂L/∂gate = ⟨G, b⟩ with G the
gradient at the gated sum (fixed while the gate is 0). One forward + backward (with the graph of the
gate's gradient, to read G off it) collects G and the block's input; J at other weights then needs only
the block itself, run on that input.

Closed form: where b is linear in the aimed weights W (a conv then an eval-mode BatchNorm, ReLU before
the conv: add_branch's conv ops in eval mode), ∂L/∂gate = ⟨M, W⟩ with M = ∂⟨G, b⟩/∂W, and the best W of
the amplitude rule is M's polar factor (its SVD U Vᵀ, von Neumann) — checked on the batch. Elsewhere
(train-mode BatchNorm, ReLU after the conv) that is the start of projected gradient ascent on the real J.

Amplitude rule: W keeps the Frobenius norm the default init drew and gets equal, orthogonal rows (the
polar factor's), so the data chooses directions only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ..core.errors import NotApplicable
from .gradmax import Data, GradMaxResult, ascend, is_dense, kept_state, load_data, scalar_loss

TOL = 1e-4


@dataclass
class GatedBlock:
    """A new block behind a zero gate: its module, the gate (parameter path and index, None for a scalar),
    the dense layer to aim (module path) and, for paired units (deepen's linear_relu), (row, its negated
    copy) pairs kept tied."""

    module: str
    gate: str
    index: int | None
    layer: str
    tied: list[tuple[int, int]] = field(default_factory=list)


def first_dense(gm: fx.GraphModule, block: str) -> str | None:
    """The module path of the first Linear/ungrouped conv inside `block`, if any."""
    for name, m in gm.get_submodule(block).named_modules():
        if name and is_dense(m):
            return f"{block}.{name}"
    return None


def polar(w: torch.Tensor, norm: float) -> torch.Tensor:
    """U Vᵀ of `w` (equal orthogonal rows, or columns when it has more rows than columns) at Frobenius `norm`."""
    u, _, vh = torch.linalg.svd(w.double(), full_matrices=False)
    p = u @ vh
    return (p * (norm / p.norm().clamp_min(1e-30))).to(w.dtype)


class GateAim:
    """J = Σ_blocks (∂L/∂gate)² over the blocks' aimed rows on one batch: collect once, then the blocks alone."""

    def __init__(self, gm: fx.GraphModule, blocks: list[GatedBlock], inputs: tuple, loss_fn: Any):
        self.gm, self.blocks, self.loss_fn = gm, blocks, loss_fn
        device = next(gm.parameters()).device
        self.inputs = tuple(t.to(device) for t in inputs)
        self.weights = {b.layer: gm.get_submodule(b.layer).weight for b in blocks}
        self.rows = {
            b.layer: [r for r in range(self.weights[b.layer].shape[0]) if r not in {d for d, _ in b.tied}]
            for b in blocks
        }
        self.args: dict[str, tuple] = {}
        self.G: dict[str, torch.Tensor] = {}

    def collect(self) -> None:
        args: dict[str, list] = {b.module: [] for b in self.blocks}
        outs: dict[str, list] = {b.module: [] for b in self.blocks}
        mods = {b.module: self.gm.get_submodule(b.module) for b in self.blocks}
        hs = [mods[k].register_forward_pre_hook(lambda m, a, k=k: args[k].append(a)) for k in mods]
        hs += [mods[k].register_forward_hook(lambda m, a, o, k=k: outs[k].append(o)) for k in mods]
        try:
            loss = scalar_loss(self.loss_fn(self.gm(*self.inputs)))
        finally:
            for h in hs:
                h.remove()
        if any(len(v) != 1 for v in outs.values()):
            raise NotApplicable(
                "init=gradmax aims a block the forward runs once; this one runs "
                f"{sorted({len(v) for v in outs.values()})} times",
                "use init=zero here",
            )
        gates = {b.gate: self.gm.get_parameter(b.gate) for b in self.blocks}
        dgate = dict(zip(gates, torch.autograd.grad(loss, list(gates.values()), create_graph=True)))
        for b in self.blocks:
            d = dgate[b.gate] if b.index is None else dgate[b.gate][b.index]
            g = (
                torch.autograd.grad(d, outs[b.module][0], retain_graph=True, allow_unused=True)[0]
                if d.requires_grad
                else None
            )
            if g is None or not bool(g.any()):
                raise NotApplicable(
                    f"the loss does not depend on the gate of '{b.module}' on this batch",
                    "check the data's loss_fn, or use init=zero",
                )
            self.G[b.module] = g.detach()
            self.args[b.module] = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[b.module][0])

    def phi(self, b: GatedBlock) -> torch.Tensor:
        """∂L/∂gate at the block's current weights: ⟨G, block(input)⟩."""
        return (self.gm.get_submodule(b.module)(*self.args[b.module]) * self.G[b.module]).sum()

    def evaluate(self, theta: dict[str, torch.Tensor], grad: bool) -> tuple[float, dict[str, torch.Tensor]]:
        self.set(theta)
        with torch.set_grad_enabled(grad):
            j = sum((self.phi(b).pow(2) for b in self.blocks), torch.zeros(()))
        if not grad:
            return float(j), {}
        gs = torch.autograd.grad(j, [self.weights[b.layer] for b in self.blocks], allow_unused=True)
        return float(j.detach()), {b.layer: self._rows_grad(b, g) for b, g in zip(self.blocks, gs)}

    def _rows_grad(self, b: GatedBlock, g: torch.Tensor | None) -> torch.Tensor:
        """The gradient on the aimed rows; a tied row's gradient flows back negated to its source row."""
        g = torch.zeros_like(self.weights[b.layer]) if g is None else g.clone()
        for dst, src in b.tied:
            g[src] -= g[dst]
        return g[self.rows[b.layer]].flatten(1)

    def get(self) -> dict[str, torch.Tensor]:
        return {p: self.weights[p].detach()[r].flatten(1).clone() for p, r in self.rows.items()}

    def set(self, theta: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for b in self.blocks:
                w = self.weights[b.layer]
                w[self.rows[b.layer]] = theta[b.layer].reshape((len(self.rows[b.layer]),) + tuple(w.shape[1:])).to(w)
                for dst, src in b.tied:
                    w[dst] = -w[src]

    def slopes(self) -> dict[str, torch.Tensor]:
        """M = ∂(∂L/∂gate)/∂W on the aimed rows, block by block, at the current weights."""
        with torch.enable_grad():
            gs = [torch.autograd.grad(self.phi(b), self.weights[b.layer], allow_unused=True)[0] for b in self.blocks]
        return {b.layer: self._rows_grad(b, g) for b, g in zip(self.blocks, gs)}

    def run(self, steps: int) -> tuple[float, float, str]:
        """Aim the layers; (J at the default init, J kept, how), the best weights left in the model."""
        theta0 = self.get()
        norms = {p: float(t.norm()) for p, t in theta0.items()}
        self.collect()
        first, _ = self.evaluate(theta0, False)
        m = self.slopes()
        cands = [{p: polar(s * t, norms[p]) for p, t in m.items()} for s in (1.0, -1.0)]
        j, cand = max(((self.evaluate(c, False)[0], c) for c in cands), key=lambda jc: jc[0])
        self.set(cand)
        exact = all(
            abs(float(self.phi(b).detach()) - float((m[b.layer] * cand[b.layer]).sum()))
            <= TOL * float(m[b.layer].norm() * cand[b.layer].norm())
            for b in self.blocks
        )
        best, best_theta = (j, cand) if j >= first else (first, theta0)
        method = "closed form (polar factor)"
        if not exact:
            best_theta, best, used = ascend(self.evaluate, best_theta, best, lambda p, t: polar(t, norms[p]), steps)
            method = f"polar-factor start, then ascent, {used} ascent evaluations"
        self.set(best_theta)
        return first, best, method


def aim_gates(
    gm: fx.GraphModule, blocks: list[GatedBlock], data: Data | None, pass_name: str, steps: int = 12
) -> GradMaxResult | None:
    """Aim each block's first dense layer so the gradient on its zero gate is largest on the batch."""
    if any(p.is_meta for p in gm.parameters()):
        return None
    start = time.perf_counter()
    inputs, loss_fn = load_data(data, pass_name)
    trainable = {b.gate for b in blocks} | {f"{b.layer}.weight" for b in blocks}
    with kept_state(gm, trainable):
        first, best, method = GateAim(gm, blocks, inputs, loss_fn).run(steps)
    n = len(blocks)
    return GradMaxResult(
        first / n, best / n, n, time.perf_counter() - start, [], method, "(∂L/∂gate)² per block", "new block(s)"
    )


def check_aimable(gm: fx.GraphModule, module: str, what: str) -> str:
    """The first dense layer of a new block, or NotApplicable saying there is nothing to aim."""
    layer = first_dense(gm, module)
    if layer is None:
        kind = type(gm.get_submodule(module)).__name__
        raise NotApplicable(
            f"init=gradmax aims the first conv/Linear of the new {what}, and this one ({kind}) has none",
            "use init=zero here, or an op with a conv (conv3x3, sepconv3x3, ...)",
        )
    return layer
