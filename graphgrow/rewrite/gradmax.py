"""GradMax (Evci et al., ICLR 2022): incoming weights of new units chosen from the data.

New units enter with zero outgoing weights (or behind a zero gate), so the function is unchanged whatever
their incoming weights are; GradMax picks those so the gradient on the zero last factor is as large as
possible on a batch: the first SGD step then lowers the loss the most (first order: by lr · ‖∂L/∂W_out‖²).

Two objectives share this machinery:
- new units (grow_width, insert_adapter, deepen's transformer block; gradmax_units.py): J = Σ_consumers
  ‖∂L/∂W_consumer[:, new]‖²_F. Where each consumer reads the new units' pre-activations through a linear
  path (Linear → Linear, conv → conv, eval-mode BatchNorm of the new channels, dropout in eval), J is
  ‖M W_newᵀ‖² with M = E[g xᵀ] and the top right singular vectors of M are exact (the paper's closed
  form): one forward + backward to collect the layer's input and the gradient at the consumers' outputs,
  one SVD. Through ReLU or train-mode BatchNorm the closed form (as if the path were linear) is the start
  of projected gradient ascent on the real J (the paper's GradMax-Opt);
- a zero gate (add_branch, deepen; gradmax_gate.py): J = (∂L/∂gate)², the first dense layer of the new
  block aimed.

Amplitude rule: the new rows of each layer are orthonormal (unit L2 norm each), which is the expected
norm of a row of the default init (kaiming-uniform with bound √(3/fan_in): E‖w‖² = fan_in · 1/fan_in = 1).
Only min(new units, fan_in) rows can be orthonormal; further units keep their random rows (said in a note).
New biases stay zero; BatchNorm and depthwise rows of the new channels keep their defaults. Running
statistics and the global RNG are restored: aiming changes nothing but the aimed rows. The best of the
random start and every candidate is kept, so J never ends below the random start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..core.errors import InputError, NotApplicable
from ..core.user_code import calling, guarded
from .widen import Layout

Data = str | Callable[[], Any]  # "package.module:function" or the function: () -> (inputs, loss_fn)
STEPS = 12  # most ascent steps where the closed form is not exact (each about one forward + backward)
DATA_HINT = (
    "give data=package.module:function (CLI: --data) returning (inputs, loss_fn): a batch of model inputs "
    "and a function of the model's output returning the scalar loss"
)


@dataclass
class GradMaxResult:
    """What the data-driven init did: J per new unit before (random rows) and after, how, how long, notes."""

    gain_random: float
    gain: float
    units: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    method: str = "ascent"
    what: str = "‖∂L/∂W_out‖² per unit"
    noun: str = "new unit(s)"

    def describe(self) -> str:
        return (
            f"{self.units} {self.noun} aimed at the batch's gradient ({self.method}): {self.what} "
            f"{self.gain_random:.3g} (random) → {self.gain:.3g}, in {self.seconds:.3f}s"
        )


def load_data(data: Data | None, pass_name: str = "grow_width") -> tuple[tuple, Callable[[Any], torch.Tensor]]:
    """(model inputs as a tuple, loss_fn) from a callable or a `package.module:function` name."""
    if data is None:
        raise NotApplicable(f"{pass_name}(init=gradmax) chooses new weights from data, and none was given", DATA_HINT)
    what = f"the data function {data}" if isinstance(data, str) else f"the data function {_name_of(data)}"
    if isinstance(data, str):
        from ..io.factory import import_object

        data = import_object(data, role="data function")
    with calling(what, DATA_HINT):  # the user's code: its prints go to stderr, a sys.exit there is an error
        got = data()
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and callable(got[1])):
        raise InputError(f"the data function returned {type(got).__name__}, not (inputs, loss_fn)", DATA_HINT)
    inputs, loss_fn = got
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise InputError("the data function's inputs are not a tensor or a tuple of tensors", DATA_HINT)
    return inputs, guarded(loss_fn, f"the loss_fn of {what.removeprefix('the ')}", DATA_HINT)


def _name_of(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def scalar_loss(loss: Any) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise InputError("the data's loss_fn did not return a scalar tensor", DATA_HINT)
    return loss


def is_dense(m: nn.Module) -> bool:
    """A Linear or an ungrouped conv (not transposed): a layer whose rows GradMax can aim."""
    return isinstance(m, nn.Linear) or (
        isinstance(m, nn.modules.conv._ConvNd) and m.groups == 1 and not isinstance(m, nn.modules.conv._ConvTransposeNd)
    )


def new_units(
    gm: fx.GraphModule, out_layouts: dict[str, Layout], in_layouts: dict[str, Layout]
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(module path → new rows) of the conv/Linear layers that got fresh output units, and
    (module path → new columns) of the layers that read them (their outgoing weights)."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def dense(name: str) -> bool:
        n = nodes.get(name)
        return n is not None and n.op == "call_module" and is_dense(gm.get_submodule(n.target))

    rows = {
        str(nodes[k].target): [s for s, src in zip(v.new_slots, v.src) if src is None]
        for k, v in out_layouts.items()
        if dense(k)
    }
    cols = {str(nodes[k].target): list(v.new_slots) for k, v in in_layouts.items() if dense(k)}
    return {k: v for k, v in rows.items() if v}, {k: v for k, v in cols.items() if v}


def orthonormal(theta: torch.Tensor) -> torch.Tensor:
    """Rows made orthonormal (k ≤ d), keeping the subspace and each row's sign (Gram-Schmidt order: the
    first rows keep their directions)."""
    q, r = torch.linalg.qr(theta.T.double())
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return (q * signs).T.to(theta.dtype)


@contextmanager
def kept_state(gm: fx.GraphModule, trainable: set[str] | None = None) -> Iterator[None]:
    """While aiming: gradients only where asked (None: every parameter), the global RNG forked, and on the
    way out every buffer (train-mode BatchNorm statistics) and requires_grad flag as they were."""
    buffers = {k: b.clone() for k, b in gm.named_buffers()}
    flags = {p: w.requires_grad for p, w in gm.named_parameters()}
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            for p, w in gm.named_parameters():
                w.requires_grad_(trainable is None or p in trainable)
            yield
    finally:
        with torch.no_grad():
            for k, b in gm.named_buffers():
                b.copy_(buffers[k])
        for p, w in gm.named_parameters():
            w.requires_grad_(flags[p])


def ascend(
    evaluate: Callable[[dict[str, torch.Tensor], bool], tuple[float, dict[str, torch.Tensor]]],
    theta: dict[str, torch.Tensor],
    j: float,
    project: Callable[[str, torch.Tensor], torch.Tensor],
    steps: int = STEPS,
    rtol: float = 1e-3,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """Projected gradient ascent on J from `theta` (J = `j` there): (best rows, best J, evaluations).
    `evaluate(theta, True)` returns J and its gradient on each layer's rows; a step that lowers J halves
    the step length; two steps in a row that raise J by less than `rtol` stop early, as does a step
    length below 1/32."""
    best, best_theta, eta, stalls, used = j, theta, 4.0, 0, 0
    _, grad = evaluate(theta, True)
    used += 1
    for _ in range(steps):
        step = {p: theta[p] + eta * grad[p] * theta[p].norm() / grad[p].norm().clamp_min(1e-30) for p in theta}
        trial = {p: project(p, t) for p, t in step.items()}
        jt, g = evaluate(trial, True)
        used += 1
        if jt > best:
            stalls = stalls + 1 if jt < best * (1 + rtol) else 0
            best, best_theta, theta, grad = jt, trial, trial, g
        else:
            eta /= 2  # overshot: a shorter step from the best point
        if stalls >= 2 or eta < 1 / 32:
            break
    return best_theta, best, used


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


def adapter_layouts(
    gm: fx.GraphModule, target: str, adapter: str, old: int, count: int
) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """The same for mode=adapter: the target's new rows, read by the adapter's new columns."""
    from .widen import Insertion, make_layout

    layout = make_layout(old, [Insertion(old, count, [None] * count)])
    by_target = {str(n.target): n.name for n in gm.graph.nodes if n.op == "call_module"}
    return {by_target[target]: layout}, {by_target[adapter]: layout}
