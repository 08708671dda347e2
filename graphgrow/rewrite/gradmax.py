"""GradMax (Evci et al., ICLR 2022): incoming weights of new units chosen from the data.

New units enter with zero outgoing weights, so the function is unchanged whatever their incoming weights
are; GradMax picks those so the gradient on the zero outgoing weights is as large as possible on a batch:
the first SGD step then lowers the loss the most (first order: by lr · ‖∂L/∂W_out_new‖²).

How, for any layer pair growth touches (conv or Linear, BatchNorm/activations/residual adds between):
the objective J(W_in) = Σ_consumers ‖∂L/∂W_consumer[:, new]‖²_F is computed through autograd on the real
grown model (the gradient at each consumer's output is fixed: it does not depend on W_in while the
outgoing weights are zero), and maximised by projected gradient ascent from the random init: each step
moves the new rows along ∇J, then re-orthonormalises them. For a linear path this is subspace iteration
and converges to GradMax's closed form, the top right singular vectors of E[g xᵀ]; through ReLU or
BatchNorm it is the paper's GradMax-Opt. The best iterate is kept, so J never ends below the random start.

Amplitude rule: the new rows of each layer are orthonormal (unit L2 norm each), which is the expected
norm of a row of the default init (kaiming-uniform with bound √(3/fan_in): E‖w‖² = fan_in · 1/fan_in = 1).
Only min(new units, fan_in) rows can be orthonormal; further units keep their random rows (said in a note).
New biases stay zero; BatchNorm and depthwise rows of the new channels keep their defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
from torch import fx, nn

from ..core.errors import InputError, NotApplicable
from .widen import Layout

Data = Union[str, Callable[[], Any]]  # "package.module:function" or the function: () -> (inputs, loss_fn)
STEPS = 12  # ascent steps (each about one forward and one backward over the batch)
DATA_HINT = ("give data=package.module:function (CLI: --data) returning (inputs, loss_fn): a batch of model inputs "
             "and a function of the model's output returning the scalar loss")


@dataclass
class GradMaxResult:
    """What the data-driven init did: J before (random rows) and after, per new unit, and notes."""

    gain_random: float
    gain: float
    units: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"{self.units} new unit(s) aimed at the batch's gradient: ‖∂L/∂W_out‖² per unit "
                f"{self.gain_random:.3g} (random) → {self.gain:.3g}, in {self.seconds:.2f}s")


def load_data(data: Data | None, pass_name: str = "grow_width") -> tuple[tuple, Callable[[Any], torch.Tensor]]:
    """(model inputs as a tuple, loss_fn) from a callable or a `package.module:function` name."""
    if data is None:
        raise NotApplicable(f"{pass_name}(init=gradmax) chooses new weights from data, and none was given", DATA_HINT)
    if isinstance(data, str):
        from ..io.factory import import_object

        data = import_object(data)
    got = data()
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and callable(got[1])):
        raise InputError(f"the data function returned {type(got).__name__}, not (inputs, loss_fn)", DATA_HINT)
    inputs, loss_fn = got
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise InputError("the data function's inputs are not a tensor or a tuple of tensors", DATA_HINT)
    return inputs, loss_fn


def new_units(gm: fx.GraphModule, out_layouts: dict[str, Layout], in_layouts: dict[str, Layout]
              ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(module path → new rows) of the conv/Linear layers that got fresh output units, and
    (module path → new columns) of the layers that read them (their outgoing weights)."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def dense(name: str) -> bool:
        n = nodes.get(name)
        if n is None or n.op != "call_module":
            return False
        m = gm.get_submodule(n.target)
        return isinstance(m, nn.Linear) or (isinstance(m, nn.modules.conv._ConvNd) and m.groups == 1)

    rows = {str(nodes[k].target): [s for s, src in zip(v.new_slots, v.src) if src is None]
            for k, v in out_layouts.items() if dense(k)}
    cols = {str(nodes[k].target): list(v.new_slots) for k, v in in_layouts.items() if dense(k)}
    return {k: v for k, v in rows.items() if v}, {k: v for k, v in cols.items() if v}


def _orthonormal(theta: torch.Tensor) -> torch.Tensor:
    """Rows made orthonormal (k ≤ d), keeping the subspace and each row's sign."""
    q, r = torch.linalg.qr(theta.T.double())
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return (q * signs).T.to(theta.dtype)


class _Objective:
    """J(new rows) on the batch: the squared gradient norm on the consumers' new (zero) columns."""

    def __init__(self, gm: fx.GraphModule, rows: dict[str, list[int]], cols: dict[str, list[int]], data: Data):
        self.gm, self.rows, self.cols = gm, rows, cols
        device = next(gm.parameters()).device
        inputs, self.loss_fn = load_data(data)
        self.inputs = tuple(t.to(device) for t in inputs)
        self.weights = {p: gm.get_submodule(p).weight for p in {**rows, **cols}}
        self.grad_out: dict[str, list[torch.Tensor]] | None = None

    def __call__(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """J and its gradient on each source's new rows (flattened: k × fan_in)."""
        outs: dict[str, list[torch.Tensor]] = {p: [] for p in self.cols}
        hooks = [self.gm.get_submodule(p).register_forward_hook(lambda m, a, o, p=p: outs[p].append(o))
                 for p in self.cols]
        try:
            result = self.gm(*self.inputs)
        finally:
            for h in hooks:
                h.remove()
        if self.grad_out is None:  # fixed while the outgoing weights are zero: computed once
            loss = self.loss_fn(result)
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise InputError("the data's loss_fn did not return a scalar tensor", DATA_HINT)
            flat = [o for p in self.cols for o in outs[p]]
            grads = torch.autograd.grad(loss, flat, retain_graph=True, allow_unused=True)
            it = iter(grads)
            self.grad_out = {p: [next(it) for _ in outs[p]] for p in self.cols}
        j = torch.zeros((), device=self.inputs[0].device)
        for p, cols in self.cols.items():
            pairs = [(o, g) for o, g in zip(outs[p], self.grad_out[p]) if g is not None]
            if not pairs:
                continue
            s = sum((o * g.detach()).sum() for o, g in pairs)
            gw = torch.autograd.grad(s, self.weights[p], create_graph=True)[0]
            j = j + gw[:, cols].pow(2).sum()
        if not j.requires_grad:
            raise NotApplicable("the loss does not depend on the layers that read the new units on this batch",
                                "grow a layer whose output reaches the loss, or check the data's loss_fn")
        grads = torch.autograd.grad(j, [self.weights[p] for p in self.rows])
        return j.detach(), {p: g[self.rows[p]].flatten(1) for p, g in zip(self.rows, grads)}

    def get(self) -> dict[str, torch.Tensor]:
        return {p: self.weights[p].detach()[r].flatten(1).clone() for p, r in self.rows.items()}

    def set(self, theta: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for p, t in theta.items():
                w = self.weights[p]
                w[self.rows[p]] = t.reshape((len(self.rows[p]),) + tuple(w.shape[1:]))


def gradmax_init(gm: fx.GraphModule, out_layouts: dict[str, Layout], in_layouts: dict[str, Layout],
                 data: Data | None, steps: int = STEPS) -> GradMaxResult | None:
    """Re-aim, in place, the incoming weights of the new units of a grown `gm` (outgoing weights zero).
    None on a meta-device model (the size check runs passes there: nothing to aim)."""
    import time

    if any(p.is_meta for p in gm.parameters()):
        return None
    start = time.perf_counter()
    rows, cols = new_units(gm, out_layouts, in_layouts)
    if not rows or not cols:
        raise NotApplicable("init=gradmax found no new conv/Linear units read by a conv/Linear layer here",
                            "use init=zero for this place")
    notes = []
    fan_in = {p: gm.get_submodule(p).weight[0].numel() for p in rows}
    for p in list(rows):
        if len(rows[p]) > fan_in[p]:
            notes.append(f"{p}: only {fan_in[p]} of its {len(rows[p])} new units can take orthonormal directions "
                         "(its fan-in); the others keep random rows")
            rows[p] = rows[p][:fan_in[p]]
    buffers = {k: b.clone() for k, b in gm.named_buffers()}  # train-mode BatchNorm must not move its statistics
    flags = {p: w.requires_grad for p, w in gm.named_parameters()}
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            for w in gm.parameters():
                w.requires_grad_(True)
            best, first = _ascend(_Objective(gm, rows, cols, data), steps)
    finally:
        with torch.no_grad():
            for k, b in gm.named_buffers():
                b.copy_(buffers[k])
        for p, w in gm.named_parameters():
            w.requires_grad_(flags[p])
    units = sum(len(r) for r in rows.values())
    return GradMaxResult(first / units, best / units, units, time.perf_counter() - start, notes)


def _ascend(obj: _Objective, steps: int) -> tuple[float, float]:
    """Projected gradient ascent on J over orthonormal rows; the best iterate is left in the model.
    Returns (best J, J of the orthonormalised random start)."""
    theta = {p: _orthonormal(t) for p, t in obj.get().items()}
    obj.set(theta)
    j, grad = obj()
    first = best = float(j)
    best_theta, eta = theta, 4.0
    for _ in range(steps):
        step = {p: theta[p] + eta * grad[p] * theta[p].norm() / grad[p].norm().clamp_min(1e-30) for p in theta}
        trial = {p: _orthonormal(t) for p, t in step.items()}
        obj.set(trial)
        j, g = obj()
        if float(j) > best:
            best, best_theta, theta, grad = float(j), trial, trial, g
        else:
            eta /= 2  # overshot: a shorter step from the best point
    obj.set(best_theta)
    return best, first


def group_layouts(coupling, gid: int, count: int) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """(node → output layout, node → input layout) of growing group `gid` by `count` fresh channels: the
    same plan widen.grow_group follows."""
    from .widen import make_layout, plan_growth

    plan = plan_growth(coupling, gid, count)
    outs: dict[str, Layout] = {}
    ins: dict[str, Layout] = {}
    for g, insertions in plan.items():
        grp = coupling.groups[g]
        layout = make_layout(grp.size, insertions)
        outs.update({n: layout for n in grp.sources + grp.channelwise})
        ins.update({n: layout for n in grp.consumers})
    return outs, ins


def adapter_layouts(gm: fx.GraphModule, target: str, adapter: str, old: int, count: int
                    ) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """The same for mode=adapter: the target's new rows, read by the adapter's new columns."""
    from .widen import Insertion, make_layout

    layout = make_layout(old, [Insertion(old, count, [None] * count)])
    by_target = {str(n.target): n.name for n in gm.graph.nodes if n.op == "call_module"}
    return {by_target[target]: layout}, {by_target[adapter]: layout}
