"""Three ways to initialise grown units, side by side on the same MLP (issue 26, item 3).

An MLP n_in → h → n_out (ReLU) trains, then its hidden layer grows h → 2h with
  zero     graphgrow's default: random incoming, zero outgoing weights (grow_width(init=zero))
  gradmax  graphgrow's grow_width(init=gradmax): incoming weights aimed from a batch, zero outgoing
  tiny     gromo's TINY (Verbockhaven et al. 2024): incoming weights = gromo's optimal added neurons
           (compute_optimal_updates, its TINY settings), scaled by gromo's normalize_optimal_updates
           ("match_extending_layer"), outgoing weights zero: the function is kept, as for the other two
  tiny0    gromo exactly as "amplitude 0": apply_change(scaling_factor=0) zeroes the incoming weights
           too, so the new ReLU units are dead (zero gradient on both sides) and never learn
  tinyls   gromo as its authors use it: TINY's α and ω at the amplitude γ gromo's line_search finds on
           the batch (apply_change(scaling_factor=γ)); the loss drops at growth: NOT function-preserving
TINY adds at most rank(S^-1/2 N) ≤ n_out units per event (1 on diabetes): further new units get today's
init (random in, zero out), as graphgrow's gradmax does past its fan-in.
And the same optimiser (SGD, lr 0.05, momentum 0.9, the same minibatches) trains on. Every growth keeps
the function: the largest output change over the training set is reported (and checked ≤ 1e-5).

Two tasks whose data ships with scikit-learn (nothing is downloaded): `digits` (8×8 digits, 64 → h → 10,
cross-entropy) and `diabetes` (10 standardised features → h → 1, squared error on the standardised
disease progression: a noisy regression, harder than digits). Three measurements:
  event     loss on the whole training set k = 1, 10, 100 steps after one growth event, over seeds
  schedule  h doubled every `every` steps (digits 8 → 64, diabetes 4 → 32), final training loss and
            test accuracy (digits) or test MSE (diabetes)
  cost      seconds of each data-driven step next to one forward + backward over its batch

    python examples/growth_init_compare.py            # 5 seeds, both tasks (a few minutes on one core)
    python examples/growth_init_compare.py --quick    # 2 seeds, short runs (seconds)
    python examples/growth_init_compare.py --plot docs/growth_init_compare.png
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg

INITS = ("zero", "gradmax", "tiny", "tiny0", "tinyls")
EXACT = INITS[:4]  # tinyls changes the function on purpose
LABELS = {
    "zero": "zero (today)",
    "gradmax": "gradmax",
    "tiny": "gromo TINY (α in, 0 out)",
    "tiny0": "gromo TINY, amplitude 0",
    "tinyls": "gromo TINY, line-searched γ (not exact)",
}
KS = (1, 10, 100)
MOMENTUM, MINIBATCH, STAT_BATCH = 0.9, 64, 256


@dataclass
class Task:
    name: str
    n_in: int
    n_out: int
    h: int  # hidden width before the (first) growth
    loss: Callable[..., torch.Tensor]  # loss(out, y, reduction="mean")
    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    metric: str  # "accuracy" or "MSE", on the test split
    lr: float = 0.05

    def score(self, m: nn.Module) -> float:
        x, y = self.test
        with torch.no_grad():
            out = m(x)
        return (out.argmax(1) == y).float().mean().item() if self.metric == "accuracy" else F.mse_loss(out, y).item()

    def batch(self) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """What init=gradmax reads (and gromo's statistics use): the first STAT_BATCH training rows."""
        x, y = self.train
        return x[:STAT_BATCH], lambda out: self.loss(out, y[:STAT_BATCH])


def _split(x: torch.Tensor, y: torch.Tensor, n_train: int) -> tuple[tuple, tuple]:
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def digits() -> Task:
    from sklearn.datasets import load_digits

    d = load_digits()
    train, test = _split(torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target), 1400)
    return Task("digits", 64, 10, 8, F.cross_entropy, train, test, "accuracy")


def diabetes() -> Task:
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.float32).unsqueeze(1)
    train, test = _split((x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std(), 340)
    return Task("diabetes", 10, 1, 4, F.mse_loss, train, test, "MSE", lr=0.01)  # 0.05: minibatch noise swamps growth


TASKS = {"digits": digits, "diabetes": diabetes}


def mlp(n_in: int, h: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, h), nn.ReLU(), nn.Linear(h, n_out))


def _from_weights(w0, b0, w2, b2) -> nn.Sequential:
    m = mlp(w0.shape[1], w0.shape[0], w2.shape[0])
    with torch.no_grad():
        for p, v in zip(m.parameters(), (w0, b0, w2, b2)):
            p.copy_(v)
    return m


def grow(task: Task, m: nn.Sequential, init: str, seed: int) -> tuple[nn.Sequential, dict]:
    """`m` with its hidden layer doubled by `init`; info: seconds of the data-driven step, new units."""
    if init in ("zero", "gradmax"):
        gm = gg.trace(m, input_shape=(1, task.n_in))
        p = gg.get_pass("grow_width")(target="0", factor=2, init=init, data=task.batch if init == "gradmax" else None)
        t = time.perf_counter()
        result = p(gm, seed=seed)
        info = {"pass_s": time.perf_counter() - t}
        said = re.search(r"in ([0-9.]+)s", str(result.targets.get("gradmax", "")))
        info["data_s"] = float(said.group(1)) if said else 0.0
        s = result.gm.state_dict()
        return _from_weights(s["0.weight"], s["0.bias"], s["2.weight"], s["2.bias"]), info
    return _grow_gromo(task, m, init, seed=seed)


def _grow_gromo(task: Task, m: nn.Sequential, init: str, seed: int) -> tuple[nn.Sequential, dict]:
    """gromo's TINY on a GrowingMLP holding `m`'s weights; the grown weights come back as a plain MLP."""
    from gromo.containers.growing_mlp import GrowingMLP

    h = m[0].out_features
    g = GrowingMLP(task.n_in, task.n_out, h, 1, activation=nn.ReLU())
    with torch.no_grad():
        for layer, src in ((g.layers[0], m[0]), (g.layers[1], m[2])):
            layer.layer.weight.copy_(src.weight)
            layer.layer.bias.copy_(src.bias)
    x, loss_fn = task.batch()
    t = time.perf_counter()
    with warnings.catch_warnings():  # gromo warns that a zero input-extension scale has no effect: intended here
        warnings.simplefilter("ignore")
        g.init_computation()
        g.zero_grad()
        (loss_fn(g(x)) * len(x)).backward()  # gromo's statistics expect a summed loss
        g.update_computation()
        top = g.layers[1]
        top.compute_optimal_updates(maximum_added_neurons=h, compute_delta=False)  # TINY's settings (gromo docs)
        g.reset_computation()
        got = int(top.eigenvalues_extension.shape[0])
        if init == "tiny0":
            top.apply_change(scaling_factor=0.0, extension_size=got)
        elif init == "tinyls":
            top.apply_change(scaling_factor=_line_search(g, x, loss_fn), extension_size=got)
        else:
            top.normalize_optimal_updates(normalization_type="match_extending_layer")
            top.apply_change(
                optimal_delta_scaling=0.0, input_extension_scaling=0.0, output_extension_scaling=1.0, extension_size=got
            )
        top.delete_update()
    info = {"data_s": time.perf_counter() - t, "units": got}
    w0, b0 = g.layers[0].layer.weight.detach(), g.layers[0].layer.bias.detach()
    w2, b2 = g.layers[1].layer.weight.detach(), g.layers[1].layer.bias.detach()
    if got < h:  # TINY keeps only significant directions: the rest get today's init (random in, zero out)
        extra = mlp(task.n_in, h - got, task.n_out)
        torch.manual_seed(seed)
        nn.init.kaiming_uniform_(extra[0].weight, a=5**0.5)
        w0, b0 = torch.cat([w0, extra[0].weight.detach()]), torch.cat([b0, torch.zeros(h - got)])
        w2 = torch.cat([w2, torch.zeros(task.n_out, h - got)], 1)
    return _from_weights(w0, b0, w2, b2), info


def _line_search(g, x: torch.Tensor, loss_fn) -> float:
    """gromo's amplitude: the γ of its line_search that minimises the batch loss of extended_forward."""
    from gromo.utils.utils import line_search

    def loss_at(gamma: float) -> float:
        g.set_scaling_factor(float(gamma))
        with torch.no_grad():
            return loss_fn(g.extended_forward(x)).item()

    return float(line_search(loss_at)[0])


def full_loss(task: Task, m: nn.Module) -> float:
    x, y = task.train
    with torch.no_grad():
        return task.loss(m(x), y).item()


def train(task: Task, m: nn.Module, steps: int, seed: int, curve: bool = False) -> list[float]:
    """`steps` SGD steps on seeded minibatches; the training-set loss after each step (curve) or the last."""
    x, y = task.train
    opt = torch.optim.SGD(m.parameters(), lr=task.lr, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        idx = torch.randint(0, len(y), (MINIBATCH,), generator=g)
        opt.zero_grad()
        task.loss(m(x[idx]), y[idx]).backward()
        opt.step()
        if curve or i == steps - 1:
            out.append(full_loss(task, m))
    return out


def new_gain(task: Task, m: nn.Sequential, old: int) -> float:
    """‖∂L/∂W_out[:, new]‖² per new unit on the training set: what GradMax maximises, what one SGD step on the
    new outgoing weights turns into a loss decrease (lr × gain per unit, to first order)."""
    x, y = task.train
    m.zero_grad()
    task.loss(m(x), y).backward()
    grad = m[2].weight.grad[:, old:]
    m.zero_grad()
    return grad.pow(2).sum().item() / grad.shape[1]


def max_change(task: Task, a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return (a(task.train[0]) - b(task.train[0])).abs().max().item()


def event(task: Task, seeds: int, ats: tuple[int, ...], after: int, inits: tuple[str, ...] = INITS) -> list[dict]:
    """One growth h → 2h after each of `ats` steps, then `after` steps; per seed and init: the curve around it."""
    rows = []
    for at in ats:
        for seed in range(seeds):
            torch.manual_seed(seed)
            base = mlp(task.n_in, task.h, task.n_out)
            before = train(task, base, at, seed + 1000, curve=True)
            for init in inits:
                grown, info = grow(task, base, init, seed)
                rows.append(
                    {
                        "task": task.name,
                        "h": task.h,
                        "at": at,
                        "seed": seed,
                        "init": init,
                        "pre": before,
                        "change": max_change(task, base, grown),
                        "gain": new_gain(task, grown, task.h),
                        "at0": full_loss(task, grown),
                        "curve": train(task, grown, after, seed, curve=True),
                        **info,
                    }
                )
    return rows


def schedule(task: Task, seeds: int, events: int, every: int, tail: int, inits: tuple[str, ...] = INITS) -> list[dict]:
    """h doubled `events` times, every `every` steps, then `tail` more steps: final loss and test score.
    Also the final architecture trained from the start for as many steps ("large")."""
    rows = []
    for seed in range(seeds):
        for init in inits + ("large",):
            torch.manual_seed(seed)
            h = task.h * 2**events if init == "large" else task.h
            m, changes, spent = mlp(task.n_in, h, task.n_out), [], 0.0
            for e in range(events + 1):
                train(task, m, every if e < events else tail, seed * 100 + e)
                if e < events and init != "large":
                    grown, info = grow(task, m, init, seed * 100 + e)
                    changes.append(max_change(task, m, grown))
                    spent += info["data_s"]
                    m = grown
            rows.append(
                {
                    "task": task.name,
                    "seed": seed,
                    "init": init,
                    "loss": full_loss(task, m),
                    "score": task.score(m),
                    "change": max(changes, default=0.0),
                    "data_s": spent,
                    "width": m[0].out_features,
                }
            )
    return rows


def step_cost(task: Task, h: int, rounds: int = 20) -> float:
    """Seconds of one forward + backward over the STAT_BATCH batch at width h (median of `rounds`)."""
    m = mlp(task.n_in, h, task.n_out)
    x, loss_fn = task.batch()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        m.zero_grad()
        loss_fn(m(x)).backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def data_cost(task: Task, inits: tuple[str, ...], rounds: int = 7) -> dict[str, float]:
    """Median seconds of each init's data-driven step on a trained model (after one warm-up call, which pays
    imports and first-call setup), and "fwd+bwd": one forward + backward over the same batch at width 2h."""
    torch.manual_seed(0)
    m = mlp(task.n_in, task.h, task.n_out)
    train(task, m, 50, 0)
    cost = {"fwd+bwd": step_cost(task, 2 * task.h)}
    for init in inits:
        if init != "zero":
            cost[init] = statistics.median([grow(task, m, init, i)[1]["data_s"] for i in range(rounds + 1)][1:])
    return cost


def pm(values: list[float]) -> str:
    """mean ± half-range (max − min)/2."""
    return f"{statistics.mean(values):.4f} ± {(max(values) - min(values)) / 2:.4f}"


def event_table(rows: list[dict]) -> list[str]:
    lines = [
        "| task | grown at step | init | loss before growth | just after | after 1 step | after 10 | after 100 "
        f"| below zero's at {len(rows[0]['curve'])} "
        "| gain per new unit | max output change |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, at in dict.fromkeys((r["task"], r["at"]) for r in rows):
        for init in dict.fromkeys(r["init"] for r in rows):
            mine = [r for r in rows if r["task"] == task and r["at"] == at and r["init"] == init]
            cells = [pm([r["curve"][k - 1] for r in mine]) if k <= len(mine[0]["curve"]) else "–" for k in KS]
            zero = {
                r["seed"]: r["curve"][-1] for r in rows if r["task"] == task and r["at"] == at and r["init"] == "zero"
            }
            wins = (
                f"{sum(r['curve'][-1] < zero[r['seed']] for r in mine)}/{len(mine)}" if zero and init != "zero" else "–"
            )
            lines.append(
                f"| {task} | {at} | {LABELS[init]} | {pm([r['pre'][-1] for r in mine])} | "
                f"{pm([r['at0'] for r in mine])} | {' | '.join(cells)} | {wins} | "
                f"{statistics.mean(r['gain'] for r in mine):.2e} | {max(r['change'] for r in mine):.1e} |"
            )
    return lines


def schedule_table(rows: list[dict], tasks: dict[str, Task]) -> list[str]:
    lines = [
        "| task | init | final width | final training loss | test metric | max output change |",
        "|---|---|---|---|---|---|",
    ]
    for task in dict.fromkeys(r["task"] for r in rows):
        for init in dict.fromkeys(r["init"] for r in rows):
            mine = [r for r in rows if r["task"] == task and r["init"] == init]
            label = "trained at the final width" if init == "large" else LABELS[init]
            lines.append(
                f"| {task} | {label} | {mine[0]['width']} | {pm([r['loss'] for r in mine])} | "
                f"{tasks[task].metric} {pm([r['score'] for r in mine])} | {max(r['change'] for r in mine):.1e} |"
            )
    return lines


def plot(rows: list[dict], path: str) -> None:
    """Loss vs step around the growth event, mean over seeds, one panel per task and growth step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["task"], r["at"]) for r in rows))
    cols = min(2, len(panels))
    fig, axes = plt.subplots(
        (len(panels) + cols - 1) // cols,
        cols,
        figsize=(5 * cols, 3.2 * ((len(panels) + cols - 1) // cols)),
        dpi=64,
        squeeze=False,
    )
    for ax, (task, at) in zip(axes.flat, panels):
        for init in dict.fromkeys(r["init"] for r in rows):
            mine = [r for r in rows if r["task"] == task and r["at"] == at and r["init"] == init]
            pre = [statistics.mean(v) for v in zip(*(r["pre"] for r in mine))]
            post = [statistics.mean(v) for v in zip(*([r["at0"]] + r["curve"] for r in mine))]  # from just after growth
            n = min(len(pre), 50)
            ax.plot(range(-n + 1, 1), pre[-n:], color="grey", lw=1)
            ax.plot(range(len(post)), post, label=LABELS[init], lw=1.2)
        ax.axvline(0, color="black", ls=":", lw=0.8)
        ax.set_title(
            f"{task}: hidden {mine[0]['h']} → {2 * mine[0]['h']} at step {at}, mean of {len(mine)} seeds", fontsize=9
        )
        ax.set(xlabel="steps after growth", ylabel="training-set loss", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def available_inits() -> tuple[str, ...]:
    """All four when gromo is installed (pip install gromo); else graphgrow's two."""
    try:
        import gromo  # noqa: F401
    except ImportError:
        return INITS[:2]
    return INITS


def run(
    quick: bool = False, seeds: int = 5, tasks: str = "digits,diabetes", inits: tuple[str, ...] | None = None
) -> dict:
    """The three measurements: {"event": rows, "schedule": rows, "cost": {task: seconds}, "tasks": {name: Task}}."""
    inits = inits or available_inits()
    seeds = 2 if quick else seeds
    chosen = {n: TASKS[n]() for n in tasks.split(",")}
    ev, sc = [], []
    for task in chosen.values():
        ev += event(task, seeds, (20,) if quick else (50, 300), 10 if quick else 100, inits)
        sc += schedule(task, seeds, 3, 10 if quick else 200, 10 if quick else 400, inits)
    rounds = 2 if quick else 7
    return {
        "event": ev,
        "schedule": sc,
        "tasks": chosen,
        "cost": {n: data_cost(t, inits, rounds) for n, t in chosen.items()},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds, short runs")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--tasks", default="digits,diabetes")
    ap.add_argument("--plot", default="", help="write the loss-around-growth plot (png) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if len(available_inits()) < len(INITS):
        print("gromo is not installed (pip install gromo): its TINY rows are left out\n")
    out = run(args.quick, args.seeds, args.tasks)
    print("\n".join(event_table(out["event"])), "\n")
    print("\n".join(schedule_table(out["schedule"], out["tasks"])), "\n")
    for name, cost in out["cost"].items():
        base = cost["fwd+bwd"]
        print(
            f"{name}: one forward + backward over {STAT_BATCH} rows at h = {2 * out['tasks'][name].h}: "
            f"{base * 1e3:.2f} ms; "
            "data-driven step: "
            + ", ".join(f"{LABELS[i]} {s * 1e3:.1f} ms ({s / base:.0f}×)" for i, s in cost.items() if i in LABELS)
        )
    if args.plot:
        plot(out["event"], args.plot)


if __name__ == "__main__":
    main()
