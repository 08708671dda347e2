"""init=gradmax for new units (zero outgoing weights): J = Σ_consumers ‖∂L/∂W_consumer[:, new]‖²_F on a batch.

One forward + backward collects what J needs: each aimed layer's input x, and the gradient g at each
consumer's output (fixed while the outgoing weights are zero). J at other rows then needs only the
consumers' new input channels: a forward that stops at the last consumer, and a product with g per
consumer (no second backward through the model).

Closed form (Evci et al. 2022, sec. 3): where a consumer's new input channels are s·(the aimed layer's
new pre-activations) — checked on the batch at the random rows and again at the answer, to 1e-4 — J is
Σ_units ‖M w‖² with M the (consumer weight column × fan_in) matrix E[g ⊗ x] (Linear → Linear, Conv2d →
Conv2d), and the top right singular vectors of the stacked M's are the best orthonormal rows. Elsewhere
(ReLU, train-mode BatchNorm, a residual sum of two new units, other layer pairs) the same SVD, as if
the path were linear, is the start of projected gradient ascent on the real J.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils._pytree import tree_map

from ..core.errors import NotApplicable
from .gradmax import STEPS, Data, GradMaxResult, ascend, kept_state, load_data, new_units, orthonormal, scalar_loss
from .widen import Layout

TOL = 1e-4  # a path is linear when ‖h − s·z‖ ≤ TOL · ‖h‖ on the batch
CHUNK = 1 << 25  # elements of an unfolded batch slice held at once (the closed form of a conv pair)


class _Stop(Exception):
    """Raised by the last consumer's hook: the rest of the forward is not needed."""


def _conv(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.conv._ConvNd)


def _new(m: nn.Module, h: torch.Tensor, cols: list[int]) -> torch.Tensor:
    return h[:, cols] if _conv(m) else h[..., cols]


def pre_activation(m: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Layer `m` with weight rows `w` and no bias (new biases are zero) on its input `x`."""
    return m._conv_forward(x, w, None) if _conv(m) else F.linear(x, w)  # type: ignore[operator]


def outgoing_grad(m: nn.Module, h_new: torch.Tensor, g: torch.Tensor, create_graph: bool) -> torch.Tensor:
    """∂L/∂W_m[:, new]: layer `m`'s weight gradient on the columns that read `h_new`, given g at its output."""
    k = h_new.shape[1] if _conv(m) else h_new.shape[-1]
    w = torch.zeros(
        (m.weight.shape[0], k) + tuple(m.weight.shape[2:]), dtype=h_new.dtype, device=h_new.device, requires_grad=True
    )
    with torch.enable_grad():
        y = pre_activation(m, h_new, w)
        return torch.autograd.grad((y * g).sum(), w, create_graph=create_graph)[0]


def unit_matrix(
    src: nn.Module, x: torch.Tensor, con: nn.Module, g: torch.Tensor, z_shape: torch.Size
) -> torch.Tensor | None:
    """M with ∂L/∂W_con[:, unit].flatten() = M · w_unit when `con` reads the unit's pre-activation directly;
    None for a pair it is not written for."""
    if isinstance(src, nn.Linear) and isinstance(con, nn.Linear):
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    if (
        not (isinstance(src, nn.Conv2d) and isinstance(con, nn.Conv2d))
        or isinstance(src.padding, str)
        or isinstance(con.padding, str)
        or src.padding_mode != "zeros"
        or con.padding_mode != "zeros"
    ):
        return None
    f1, (h1, w1), k2 = src.weight[0].numel(), z_shape[2:], con.kernel_size[0] * con.kernel_size[1]
    m = x.new_zeros(con.out_channels, f1 * k2)
    chunk = max(1, CHUNK // (f1 * (k2 * g[0, 0].numel() + h1 * w1)))
    for i in range(0, x.shape[0], chunk):
        xu = F.unfold(x[i : i + chunk], src.kernel_size, src.dilation, src.padding, src.stride)  # (b, f1, h1·w1)
        u = F.unfold(
            xu.reshape(-1, f1, h1, w1), con.kernel_size, con.dilation, con.padding, con.stride
        )  # (b, f1·k2, L2)
        m += torch.einsum("bol,bfl->of", g[i : i + chunk].flatten(2), u)
    return m.reshape(-1, f1, k2).permute(0, 2, 1).reshape(-1, f1)


def _region(gm: fx.GraphModule, rows: set[str], cols: set[str]) -> tuple[list[fx.Node], set[fx.Node]]:
    """(the nodes that depend on an aimed layer, in order, up to the last consumer; the nodes outside that
    they read): J at new rows needs only those. Empty when a layer is not a node of its own (in a leaf)."""
    if type(gm.graph._codegen) is not fx.graph.CodeGen:  # inputs flattened by a pytree codegen: run it whole
        return [], set()
    nodes = list(gm.graph.nodes)
    src = {n for n in nodes if n.op == "call_module" and n.target in rows}
    last = max((i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in cols), default=None)
    if last is None or {n.target for n in src} != rows:
        return [], set()
    down, region = set(src), []
    for n in nodes[: last + 1]:
        if n in down or any(a in down for a in n.all_input_nodes):
            down.add(n)
            region.append(n)
    keep = {a for n in region for a in n.all_input_nodes if a not in down and a.op != "get_attr"}
    return region, keep


class _Recorder(fx.Interpreter):
    """The whole forward, keeping (detached) the values of the nodes in `keep`."""

    def __init__(self, gm: fx.GraphModule, keep: set[fx.Node]):
        super().__init__(gm)
        self.keep, self.kept = keep, {}  # type: tuple[set[fx.Node], dict[fx.Node, Any]]

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.keep:
            self.kept[n] = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)
        return out


def top_right_singular(m: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k right singular vectors of `m` (as rows; fewer when its rank is lower), from the
    eigenvectors of the smaller Gram matrix (float64 for small ones): much cheaper than an SVD of a
    tall M and as exact for the top directions."""
    small = min(m.shape) <= 512
    m = m.double() if small else m.float()
    if m.shape[0] >= m.shape[1]:
        _, v = torch.linalg.eigh(m.T @ m)
        return v.flip(1)[:, :k].T
    e, u = torch.linalg.eigh(m @ m.T)
    e, u = e.flip(0)[:k], u.flip(1)[:, :k]
    keep = e > e[0].clamp_min(1e-30) * 1e-12  # directions with no singular value to speak of stay random
    v = m.T @ u[:, keep] / e[keep].sqrt()
    return v.T


class UnitAim:
    """J over the aimed rows on one batch: collect once, then cheap evaluations, the closed form, ascent."""

    def __init__(
        self,
        gm: fx.GraphModule,
        rows: dict[str, list[int]],
        full: dict[str, list[int]],
        cols: dict[str, list[int]],
        inputs: tuple,
        loss_fn: Callable[[Any], torch.Tensor],
    ):
        self.gm, self.rows, self.full, self.cols, self.loss_fn = gm, rows, full, cols, loss_fn
        device = next(gm.parameters()).device
        self.inputs = tuple(t.to(device) for t in inputs)
        self.mods = {p: gm.get_submodule(p) for p in {**rows, **cols}}
        self.weights = {p: self.mods[p].weight for p in rows}
        self.calls: int | None = None
        self.g: dict[str, list[torch.Tensor | None]] = {}
        self.region, self.keep = _region(gm, set(rows), set(cols))
        self.cache: dict[fx.Node, Any] = {}
        self.interp = fx.Interpreter(gm, garbage_collect_values=False)

    # --- forward passes -------------------------------------------------------------------------------

    def _forward(self, full: bool) -> tuple[Any, dict, dict, dict]:
        """(model output or None, each aimed layer's inputs, each consumer's inputs, outputs); without `full`
        the forward stops after the consumers' last call."""
        xs: dict[str, list] = {p: [] for p in self.rows}
        hs: dict[str, list] = {c: [] for c in self.cols}
        outs: dict[str, list] = {c: [] for c in self.cols}
        left = [None if full else self.calls]

        def on_out(c: str):
            def hook(m, a, o):
                outs[c].append(o)
                if left[0] is not None:
                    left[0] -= 1
                    if left[0] == 0:
                        raise _Stop

            return hook

        handles = [self.mods[p].register_forward_pre_hook(lambda m, a, p=p: xs[p].append(a[0])) for p in self.rows]
        handles += [self.mods[c].register_forward_pre_hook(lambda m, a, c=c: hs[c].append(a[0])) for c in self.cols]
        handles += [self.mods[c].register_forward_hook(on_out(c)) for c in self.cols]
        result = None
        try:
            if full:
                rec = _Recorder(self.gm, self.keep)
                result = rec.run(*self.inputs)
                self.cache = rec.kept
            elif self.region:
                self._run_region()
            else:
                self.gm(*self.inputs)
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
        return result, xs, hs, outs

    def _run_region(self) -> None:
        """Only the nodes downstream of the aimed layers, up to the last consumer: what lies before them
        does not change with the rows, and its values at the region's edge are kept from the collection."""
        it = self.interp
        # copies: an in-place op in the region must not change the kept values for the next evaluation
        it.env = {
            k: tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, v) for k, v in self.cache.items()
        }
        for n in self.region:
            for a in n.all_input_nodes:
                if a not in it.env and a.op == "get_attr":
                    it.env[a] = it.run_node(a)
            it.env[n] = it.run_node(n)
        it.env = {}

    def collect(self) -> tuple[float, dict, dict]:
        """J at the current rows; fixes g at each consumer's output. Also the inputs it saw."""
        result, xs, hs, outs = self._forward(full=True)
        loss = scalar_loss(self.loss_fn(result))
        flat = [o for c in self.cols for o in outs[c]]
        live = [o for o in flat if o.requires_grad]  # an output the new rows do not reach has no g to read
        got = dict(
            zip(
                map(id, live),
                torch.autograd.grad(loss, live, allow_unused=True)
                if live and loss.requires_grad
                else [None] * len(live),
            )
        )
        self.g = {c: [None if got.get(id(o)) is None else got[id(o)].detach() for o in outs[c]] for c in self.cols}
        self.calls = len(flat)
        if all(t is None for v in self.g.values() for t in v):
            raise NotApplicable(
                "the loss does not depend on the layers that read the new units on this batch",
                "grow a layer whose output reaches the loss, or check the data's loss_fn",
            )
        xs = {p: [x.detach() for x in v] for p, v in xs.items()}
        hs = {c: [h.detach() for h in v] for c, v in hs.items()}
        return float(self._j(hs, False)), xs, hs

    def _phis(self, hs: dict, create_graph: bool):
        for c, cols in self.cols.items():
            for i, (h, g) in enumerate(zip(hs[c], self.g[c])):
                if g is not None:
                    yield c, i, outgoing_grad(self.mods[c], _new(self.mods[c], h, cols), g, create_graph)

    def _j(self, hs: dict, create_graph: bool) -> torch.Tensor:
        return sum((phi.pow(2).sum() for _, _, phi in self._phis(hs, create_graph)), torch.zeros(()))

    def evaluate(self, theta: dict[str, torch.Tensor], grad: bool) -> tuple[float, dict[str, torch.Tensor]]:
        """J at rows `theta` (a forward up to the last consumer) and, with `grad`, its gradient on the rows."""
        self.set(theta)
        with torch.set_grad_enabled(grad):
            _, _, hs, _ = self._forward(full=False)
        j = self._j(hs, grad)
        if not grad:
            return float(j), {}
        if not j.requires_grad:
            return float(j), {p: torch.zeros_like(t) for p, t in theta.items()}
        gs = torch.autograd.grad(j, [self.weights[p] for p in self.rows], allow_unused=True)
        return float(j.detach()), {
            p: (torch.zeros_like(self.weights[p]) if g is None else g)[self.rows[p]].flatten(1)
            for p, g in zip(self.rows, gs)
        }

    def get(self) -> dict[str, torch.Tensor]:
        return {p: self.weights[p].detach()[r].flatten(1).clone() for p, r in self.rows.items()}

    def set(self, theta: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for p, t in theta.items():
                w = self.weights[p]
                w[self.rows[p]] = t.reshape((len(self.rows[p]),) + tuple(w.shape[1:])).to(w)

    # --- the closed form --------------------------------------------------------------------------------

    @torch.no_grad()
    def links(self, xs: dict, hs: dict) -> dict[tuple[str, int], tuple[str, float, bool] | None]:
        """For each consumer call: (aimed layer, s, exact) when its new input is s·(that layer's new
        pre-activations) (exact) or has their shape (linearised, s = 1); None otherwise."""
        z = {}
        for p in self.rows:
            m = self.mods[p]
            bias = getattr(m, "bias", None)
            if len(xs[p]) == 1 and (bias is None or not bias[self.full[p]].any()):
                z[p] = pre_activation(m, xs[p][0], self.weights[p].detach()[self.full[p]])
        found: dict[tuple[str, int], tuple[str, float, bool] | None] = {}
        for c, cols in self.cols.items():
            for i, h in enumerate(hs[c]):
                if self.g[c][i] is None:
                    continue
                hn, found[(c, i)] = _new(self.mods[c], h, cols), None
                for p, zp in z.items():
                    if zp.shape != hn.shape:
                        continue
                    s = float((hn * zp).sum() / zp.pow(2).sum().clamp_min(1e-30))
                    if float((hn - s * zp).norm()) <= TOL * float(hn.norm()) and s != 0:
                        found[(c, i)] = (p, s, True)
                        break
                    found[(c, i)] = (p, 1.0, False)
        return found

    def closed_form(self, xs: dict, links: dict, theta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The top right singular vectors of each aimed layer's stacked M (its first rows; the rest keep
        their random directions, made orthogonal to them); None where a layer has no M."""
        out = {}
        for p, r in self.rows.items():
            ms = []
            for (c, i), link in links.items():
                if link is None or link[0] != p:
                    continue
                x, z_shape = (
                    xs[p][0],
                    pre_activation(self.mods[p], xs[p][0][:1], self.weights[p].detach()[self.full[p]]).shape,
                )
                m = unit_matrix(self.mods[p], x, self.mods[c], self.g[c][i], z_shape[:1] + z_shape[1:])  # type: ignore[arg-type]
                if m is None:
                    return None
                ms.append(link[1] * m)
            if not ms:
                return None
            top = top_right_singular(torch.cat(ms), len(r)).to(theta[p].dtype)
            out[p] = orthonormal(torch.cat([top, theta[p][len(top) :]]))
        return out

    # --- the whole aim --------------------------------------------------------------------------------

    def run(self, steps: int) -> tuple[float, float, str]:
        """Aim the rows; (J at the random rows, J kept, how) and the best rows left in the model."""
        theta = {p: orthonormal(t) for p, t in self.get().items()}
        self.set(theta)
        first, xs, hs = self.collect()
        links = self.links(xs, hs)
        exact = (
            bool(links)
            and all(v is not None and v[2] for v in links.values())
            and {v[0] for v in links.values() if v is not None} == set(self.rows)
        )
        best, best_theta, method = first, theta, "ascent"
        # train-mode BatchNorm on the path rescales each unit by its batch spread: the linear model's SVD
        # aims at the wrong thing there (measured: below the random start), so ascent starts from random
        cand = None if not exact and self._batch_normalised() else self.closed_form(xs, links, theta)
        exact = exact and cand is not None  # a linear pair with no M written for it (Conv1d, …): ascent
        if cand is not None:
            if not exact:  # through ReLU the sign of a direction matters: the better of ±v, unit by unit
                cand = self._signed(cand)
            j, _ = self.evaluate(cand, False)
            if j >= best:
                best, best_theta = j, cand
            if exact:  # checked again at the answer: the path stayed linear there
                with torch.no_grad():
                    _, xs2, hs2, _ = self._forward(full=False)
                exact = all(v is not None and v[2] for v in self.links(xs2, hs2).values())
            method = "closed form (SVD)" if exact else "SVD start, then ascent"
        if not exact:
            best_theta, best, used = ascend(self.evaluate, best_theta, best, lambda p, t: orthonormal(t), steps)
            method += f", {used} ascent evaluations"
        self.set(best_theta)
        return first, best, method

    def _batch_normalised(self) -> bool:
        mods = (self.gm.get_submodule(n.target) for n in self.region if n.op == "call_module")
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in mods)

    def _signed(self, cand: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        gains = [self._unit_gains(cand), self._unit_gains({p: -t for p, t in cand.items()})]
        return {p: t * torch.where(gains[0][p] >= gains[1][p], 1.0, -1.0).to(t)[:, None] for p, t in cand.items()}

    def _unit_gains(self, theta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per aimed unit, ‖∂L/∂W_out[:, unit]‖² summed over the consumers that read it directly."""
        self.set(theta)
        with torch.no_grad():
            _, xs, hs, _ = self._forward(full=False)
        links = self.links(xs, hs)
        gains = {p: torch.zeros(len(r)) for p, r in self.rows.items()}
        for c, i, phi in self._phis(hs, False):
            link = links.get((c, i))
            if link is not None:
                k = len(self.rows[link[0]])
                gains[link[0]] += phi.transpose(0, 1).flatten(1).pow(2).sum(1)[:k].cpu()
        return gains


def gradmax_init(
    gm: fx.GraphModule,
    out_layouts: dict[str, Layout],
    in_layouts: dict[str, Layout],
    data: Data | None,
    steps: int = STEPS,
    pass_name: str = "grow_width",
) -> GradMaxResult | None:
    """Re-aim, in place, the incoming weights of the new units of a grown `gm` (outgoing weights zero).
    None on a meta-device model (the size check runs passes there: nothing to aim)."""
    if any(p.is_meta for p in gm.parameters()):
        return None
    rows, cols = new_units(gm, out_layouts, in_layouts)
    return aim_units(gm, rows, cols, data, steps, pass_name)


def aim_units(
    gm: fx.GraphModule,
    rows: dict[str, list[int]],
    cols: dict[str, list[int]],
    data: Data | None,
    steps: int = STEPS,
    pass_name: str = "grow_width",
) -> GradMaxResult | None:
    """Aim the rows `rows` (module path → row indices) at the batch's gradient on the columns `cols` of the
    layers that read them (zero now)."""
    if any(p.is_meta for p in gm.parameters()):
        return None
    start = time.perf_counter()
    if not rows or not cols:
        raise NotApplicable(
            f"{pass_name}(init=gradmax) found no new conv/Linear units read by a conv/Linear layer here",
            "use the default init for this place",
        )
    notes, full = [], {p: list(r) for p, r in rows.items()}
    for p in list(rows):
        fan_in = gm.get_submodule(p).weight[0].numel()
        if len(rows[p]) > fan_in:
            notes.append(
                f"{p}: only {fan_in} of its {len(rows[p])} new units can take orthonormal directions "
                "(its fan-in); the others keep random rows"
            )
            rows[p] = rows[p][:fan_in]
    inputs, loss_fn = load_data(data, pass_name)
    with kept_state(gm, set(f"{p}.weight" for p in rows)):
        first, best, method = UnitAim(gm, rows, full, cols, inputs, loss_fn).run(steps)
    units = sum(len(r) for r in rows.values())
    return GradMaxResult(first / units, best / units, units, time.perf_counter() - start, notes, method)
