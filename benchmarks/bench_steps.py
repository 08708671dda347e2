"""What graphgrow's own steps cost on torchvision models (random weights, 1×3×224×224, one thread).

- per pass, default target: pass + verification ÷ one forward of the grown model at the
  verification batch (architecture.md §9, target ≤ 8). The model is traced first, as every job does;
  the trace's fidelity check leaves the reference outputs that verification compares against.
  The note counts what one pass runs on real tensors (counted once, outside the timed rounds):
  forwards of a traced model by mode and batch, and backward passes.
- graphgrow export (check and write included) ÷ a bare `torch.onnx.export` of the same
  GraphModule to a file with the same options (target ≤ 1.1).

    python benchmarks/bench_steps.py [model ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, print_table, ratio_row, timed  # noqa: E402

import graphgrow as gg  # noqa: E402
from graphgrow.graph.graph_meta import META_KEY  # noqa: E402
from graphgrow.graph.shapes import example_input  # noqa: E402
from graphgrow.io.export import INPUT_NAME, export_onnx  # noqa: E402
from graphgrow.verify.verify import BATCHES  # noqa: E402

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "vit_b_16")
PASSES = ("grow_width", "insert_adapter", "add_residual", "add_branch", "deepen")
SHAPE = (1, 3, 224, 224)


def traced(name: str) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    gm = gg.trace(getattr(torchvision.models, name)().eval(), SHAPE)
    gg.annotate(gm, SHAPE)
    return gm


def forward_seconds(gm: torch.nn.Module, x: torch.Tensor, repeat: int = 3) -> tuple[float, float]:
    """Fastest of `repeat` forwards: (CPU, wall) seconds."""
    with torch.no_grad():
        gm(x)
        runs = [timed(lambda: gm(x))[1:] for _ in range(repeat)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


class Forwards:
    """Counts what a pass runs on real tensors: forwards of traced models (calls and fx.Interpreter runs,
    meta-device size estimates left out; the batch of each) and backward passes."""

    def __enter__(self) -> Forwards:
        self.runs: list[tuple[str, int]] = []  # ("eval"/"train", batch)
        self.backwards = 0
        top = lambda m: isinstance(m, torch.fx.GraphModule) and META_KEY in m.meta  # noqa: E731
        self.saved = torch.fx.Interpreter.run, torch.Tensor.backward
        run, backward, counter = *self.saved, self

        def note(m, args) -> None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if top(m) and first is not None and not first.is_meta:
                counter.runs.append(("train" if m.training else "eval", int(first.shape[0])))

        def counted_run(interp, *args, **kwargs):
            note(interp.module, args)
            return run(interp, *args, **kwargs)

        def counted_backward(t, *args, **kwargs):
            counter.backwards += 1
            return backward(t, *args, **kwargs)

        self.hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: note(m, args))
        torch.fx.Interpreter.run, torch.Tensor.backward = counted_run, counted_backward
        return self

    def __exit__(self, *exc) -> None:
        self.hook.remove()
        torch.fx.Interpreter.run, torch.Tensor.backward = self.saved

    def __str__(self) -> str:
        shown = " ".join(f"{mode}@{b}" for mode, b in self.runs)
        return f"{len(self.runs)} forwards ({shown}) + {self.backwards} backward"


def pass_rows(name: str, gm: torch.fx.GraphModule, rounds: int, progress) -> list[Row]:
    x = example_input(gm, SHAPE, batch=BATCHES[0])
    rows = []
    for spec in PASSES:
        progress(f"{name}: {spec}")
        cpu, wall, fails = [], [], ""
        # once, outside the timed rounds (the hooks cost a little)
        with Forwards() as counted, contextlib.suppress(gg.GraphgrowError):
            gg.Pipeline.from_spec(spec).run(gm)
        for _ in range(rounds):
            try:
                result, c, w = timed(lambda spec=spec: gg.Pipeline.from_spec(spec).run(gm).results[0])
            except gg.GraphgrowError as e:
                fails = f"refused: {e.message[:80]}"
                break
            fc, fw = forward_seconds(result.gm.eval(), x)
            cpu.append(c / fc)
            wall.append(w / fw)
        if fails:
            rows.append(
                Row(
                    "pass + verification ÷ forward (b=2)",
                    name,
                    spec,
                    float("nan"),
                    float("nan"),
                    "×",
                    "≤ 8",
                    None,
                    fails,
                )
            )
            continue
        where = next(iter(result.targets.items()), ("", ""))
        note = f"wall {statistics.median(wall):.1f}×; {counted}; {where[0]}: {str(where[1])[:50]}"
        rows.append(ratio_row("pass + verification ÷ forward (b=2)", name, spec, cpu, 8, note=note))
    return rows


def bare_export(gm: torch.nn.Module, path: Path) -> None:
    """torch.onnx.export alone, with graphgrow's options (dynamo, dynamic batch, optimize), to a file."""
    x = example_input(gm, SHAPE, batch=2)
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            gm,
            (x,),
            str(path),
            dynamo=True,
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
            input_names=[INPUT_NAME],
            optimize=True,
            verbose=False,
            report=False,
        )


def export_row(name: str, gm: torch.fx.GraphModule, rounds: int, tmp: Path, progress) -> Row:
    progress(f"{name}: export")
    grown = gg.Pipeline.from_spec("add_residual").run(gm).gm.eval()
    ratios, cpu_ratios = [], []
    for _ in range(rounds):  # interleaved: bare, graphgrow
        _, bc, bw = timed(lambda: bare_export(grown, tmp / "bare.onnx"))
        _, gc, gw = timed(lambda: export_onnx(grown, SHAPE, tmp / "gg.onnx"))
        ratios.append(gw / bw)
        cpu_ratios.append(gc / bc)
    return ratio_row(
        "graphgrow export ÷ bare torch.onnx.export",
        name,
        "add_residual",
        ratios,
        1.1,
        note=f"bare {bw:.1f} s wall; CPU-time ratio {min(cpu_ratios):.2f}",
    )


def rows(models=MODELS, rounds: int = 3, export_rounds: int = 2, progress=lambda _: None) -> list[Row]:
    torch.set_num_threads(1)
    out: list[Row] = []
    with tempfile.TemporaryDirectory() as d:
        for name in models:
            gm = traced(name)
            out += pass_rows(name, gm, rounds, progress)
            out.append(export_row(name, gm, export_rounds, Path(d), progress))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print_table(rows(args.models, args.rounds, progress=lambda s: print(s, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
