"""Population-based growth search on scikit-learn's digits, on Ray Tune, on this machine.

Three runs of the same small CNN (examples/digits_task.py) for the same number of epochs:
  1. the growth search: PBT whose explore step grows the worse trials by one move
     (grow_width, deepen, add_residual, add_branch or nothing) and perturbs the learning rate;
  2. the control: the same PBT with the no-op as its only move (learning rate search alone),
     so what growth adds is visible apart from what PBT's learning-rate search adds;
  3. the un-grown model trained at the starting learning rate.
Prints the lineage of the best model, the three results and the peak memory of the process
tree (driver, Ray, workers); writes a PNG of the population (metric per trial over time,
growths and exploits marked) with the un-grown model's curve for comparison.

    python examples/search_digits.py [--population 8] [--rounds 12] [--epochs-per-round 2] [--seeds 3] \\
        [--out search_population.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits_task as task  # noqa: E402

import graphgrow as gg  # noqa: E402
from graphgrow.rewrite import param_count  # noqa: E402
from graphgrow.search import MutationSpace, SearchOptions, search  # noqa: E402
from graphgrow.search.plot import plot_population  # noqa: E402

MOVES = "grow_width(factor=2);deepen;add_residual;add_branch;noop"
MAX_PARAMS = 20_000  # the budget: about 40× the starting 450 parameters


def tree_rss(root: int) -> int:
    """Resident bytes of process `root` and all its descendants (Linux /proc; 0 elsewhere)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


class PeakMemory:
    """Peak resident memory of this process and all its descendants (Ray's processes and workers)."""

    def __init__(self, every: float = 0.5):
        self.every, self.peak = every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(os.getpid()))
            self._stop.wait(self.every)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def baseline(epochs: int, lr: float) -> list[dict]:
    """The un-grown model trained for `epochs` at `lr` (the same optimiser as the trials)."""
    model = gg.trace(task.model(), input_shape=task.INPUT_SHAPE)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    rows = []
    for epoch in range(epochs):
        torch.manual_seed(epoch)
        task.train_epoch(model, opt)
        rows.append({"epoch": epoch + 1, **task.evaluate(model)})
    return rows


def final(result) -> dict:
    rows = result.history[result.best_trial]
    return {
        "val_loss": result.best_value,
        "val_acc": rows[-1].get("val_acc"),
        "params": int(rows[-1]["params"]),
        "seconds": round(result.seconds, 1),
    }


def run(
    population: int,
    rounds: int,
    epochs_per_round: int,
    out: Path,
    storage: Path,
    seeds: int = 1,
    lr: float = 0.05,
    num_cpus: int = 2,
    log=print,
) -> dict:
    """The growth search and the learning-rate-only control for each seed, the un-grown baseline, the plot (seed 0)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    gm = gg.trace(task.model(), input_shape=task.INPUT_SHAPE)
    epochs = rounds * epochs_per_round
    base = baseline(epochs, lr)
    runs: dict[str, list] = {"growth": [], "control": []}
    with PeakMemory() as memory:
        for seed in range(seeds):
            for label, moves in (("growth", MOVES), ("control", "noop")):
                log(f"--- seed {seed}, {label}: PBT with moves {moves!r}")
                options = SearchOptions(
                    population=population,
                    rounds=rounds,
                    epochs_per_round=epochs_per_round,
                    metric="val_loss",
                    mode="min",
                    lr=lr,
                    storage_path=str(storage),
                    name=f"{label}-{seed}",
                    num_cpus=num_cpus,
                    seed=seed,
                )
                runs[label].append(
                    search(
                        gm, task.train_epoch, task.evaluate, MutationSpace.parse(moves, MAX_PARAMS), options, say=log
                    )
                )
    grown = runs["growth"][0]
    plot_population(
        grown.history,
        "val_loss",
        out,
        baseline=[r["val_loss"] for r in base],
        title=f"digits: population-based growth ({population} trials, {epochs} epochs; dashed: not grown)",
    )
    summary = {
        "growth_search": [final(r) for r in runs["growth"]],
        "lr_search_only": [final(r) for r in runs["control"]],
        "not_grown": {"val_loss": base[-1]["val_loss"], "val_acc": base[-1]["val_acc"], "params": param_count(gm)},
        "lineage": [
            {"pass": e["pass"], "args": e["args"], "seed": e["seed"], "params_after": e["params_after"]}
            for e in grown.lineage
        ],
        "growths_in_population": [
            sum("grow:" in str(row.get("event")) for rows in r.history.values() for row in rows) for r in runs["growth"]
        ],
        "best_model": str(grown.best_path),
        "original": str(grown.original_path),
        "plot": str(out),
        "peak_memory_mib": round(memory.peak / 2**20),
        "epochs": epochs,
        "population": population,
    }
    log(f"lineage of the best model of seed 0 (replay: graphgrow replay {grown.original_path} {grown.best_path}):")
    for i, e in enumerate(summary["lineage"], 1):
        log(
            f"  {i}. {e['pass']}({','.join(f'{k}={v}' for k, v in e['args'].items() if v is not None)}) "
            f"seed {e['seed']} → {e['params_after']:,} parameters"
        )
    if not summary["lineage"]:
        log("  (none: the best trial kept the original architecture)")
    for label in ("growth_search", "lr_search_only"):
        for seed, r in enumerate(summary[label]):
            log(
                f"{label:>15} (seed {seed}): best val_loss {r['val_loss']:.4f}, val_acc {r['val_acc']:.3f}, "
                f"{r['params']:,} parameters, {r['seconds']:.0f} s"
            )
    nb = summary["not_grown"]
    log(
        f"{'not_grown':>15}: val_loss {nb['val_loss']:.4f}, val_acc {nb['val_acc']:.3f}, {nb['params']:,} parameters "
        f"(one run at lr {lr})"
    )
    log(
        f"growth events in the population: {summary['growths_in_population']}; peak memory of all processes "
        f"{summary['peak_memory_mib']:,} MiB; plot: {out}"
    )
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--population", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--epochs-per-round", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3, help="repeat the search and its control with seeds 0 … N−1")
    ap.add_argument("--out", type=Path, default=Path("search_population.png"))
    ap.add_argument("--storage", type=Path, help="where Tune keeps the runs (default: a new temporary folder)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    args = ap.parse_args(argv)
    storage = args.storage or Path(tempfile.mkdtemp(prefix="graphgrow-search-"))
    start = time.perf_counter()
    summary = run(args.population, args.rounds, args.epochs_per_round, args.out, storage, args.seeds)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(f"done in {summary['seconds']:.0f} s; runs kept under {storage}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
