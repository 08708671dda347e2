"""How graph-side costs scale with graph size: synthetic residual chains of about 1,000, 4,000 and
12,000 fx nodes (tiny 1×1 convs on a 4×4 map, so tensor arithmetic is negligible and what is
measured is graphgrow's own work), time per node of trace (with its fidelity check), one pass
(deepen, default target) and that pass's verification. architecture.md §9's target: the per-node cost at
12,000 nodes within 1.5× of that at 1,000.

And the other way (issue 27): small models at 32×32, as growth during training meets them —
seconds of trace + fidelity check and of one verified pass (every built-in pass at its default
target) through the API, torch's default thread count (target ≤ 2 s each). The DARTS networks of
examples/darts_net.py (traced in train mode, as examples/darts_growth.py does) and a CIFAR
ResNet-20. Warm: one pass runs first, so the process's one-time imports are not counted (the
first FLOP count imports torch._dynamo, about 2 s here).

And at scale (issue 27): a decoder-only transformer of 125 M, 350 M and 1 B parameters (scale_decoder.py) grown by
deepen, grow_width and grow_hidden through trace, each pass and its verification, the graphgrow file, the ONNX
export and the onnxruntime check, one process per size: seconds per stage, and peak resident memory as a multiple of
the grown model's weight bytes beside graphgrow's estimate (targets: ≤ 3× for pass + verification + save, ≤ 4× with
the export), with Pipeline(share=True) as `graphgrow mutate` runs (--copy-input: without). A size whose process
passes --limit-gib (default 16) of resident memory is stopped, and its row says so.

    python benchmarks/bench_scale.py [--nodes 1000,4000,12000] [--small-only] [--decoder 125m,350m,1b] [--decoder-only]
                                     [--copy-input] [--limit-gib 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, print_table, ratio_row  # noqa: E402
from graphgrow.passes.deepen import deepen  # noqa: E402

import graphgrow as gg  # noqa: E402
from graphgrow.verify.verify import verify  # noqa: E402


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.conv(x))


def chain(nodes: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(4) for _ in range(max(1, nodes // 3))])  # 3 nodes per block
    with torch.no_grad():  # small residual branches, so thousands of blocks neither explode nor vanish
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_(1.0 / len(model))
                m.bias.zero_()
    return model


def measure(nodes: int) -> dict:
    model = chain(nodes).eval()
    shape = (1, 4, 4, 4)
    t = time.perf_counter()
    gm = gg.trace(model, shape)
    gg.annotate(gm, shape)
    t_trace = time.perf_counter() - t
    n = len(gm.graph.nodes)
    t = time.perf_counter()
    rw = deepen(gm)
    gg.annotate(rw.gm, shape)
    t_pass = time.perf_counter() - t
    t = time.perf_counter()
    verify(gm, rw.gm, shape)
    t_verify = time.perf_counter() - t
    return {
        "nodes": n,
        "trace_s": t_trace,
        "pass_s": t_pass,
        "verify_s": t_verify,
        "trace_us_per_node": 1e6 * t_trace / n,
        "pass_us_per_node": 1e6 * t_pass / n,
        "verify_us_per_node": 1e6 * t_verify / n,
    }


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + self.short(x))


def resnet20() -> nn.Module:
    """He et al.'s CIFAR ResNet-20: 3 stages of 3 basic blocks, 16/32/64 channels (0.27 M parameters)."""
    torch.manual_seed(0)
    blocks, cin = [], 16
    for i, c in enumerate((16, 32, 64)):
        for j in range(3):
            blocks.append(_Basic(cin, c, 2 if i and not j else 1))
            cin = c
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        *blocks,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def small_models() -> dict:
    """name → (build, trace mode)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import darts_net as dn

    return {
        "DARTS 5 cells C=8": (lambda: dn.small_darts(seed=0), "train"),
        "DARTS 8 cells C=16": (lambda: dn.NetworkCIFAR(C=16, layers=8), "train"),
        "ResNet-20 (CIFAR)": (lambda: resnet20().eval(), "eval"),
    }


SMALL_PASSES = ("grow_width", "insert_adapter", "add_residual", "add_branch", "deepen")
DARTS_EVENTS = (
    "grow_width(target=cells.1.preprocess1.1)",
    "add_branch(op=sepconv3x3,at=cells_2__ops_0_1_3)",
    "grow_width(target=cells.2._ops.2.1.2)",
    "deepen(after=cells_2__ops_0_1_3)",
)  # examples/darts_growth.py


def small_rows(rounds: int = 3, progress=lambda _: None) -> list[Row]:
    """Seconds of trace + fidelity and of one verified pass on small models at 32×32 (target ≤ 2 s)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # what a user's process has (other sections set one thread)
    out = []
    try:
        for name, (build, mode) in small_models().items():
            progress(f"small model: {name}")
            model = build()
            params = sum(p.numel() for p in model.parameters())
            times, gm = [], None
            for _ in range(rounds):
                t = time.perf_counter()
                gm = gg.trace(model, (2, 3, 32, 32), mode=mode)
                times.append(time.perf_counter() - t)
            out.append(_seconds_row(name, "trace + fidelity", times, f"{params / 1e6:.2f} M parameters, {mode} mode"))
            _try(lambda gm=gm: gg.Pipeline.from_spec("insert_adapter").run(gm))  # warm-up: one-time imports
            for spec in SMALL_PASSES + (DARTS_EVENTS if name == "DARTS 5 cells C=8" else ()):
                times, refused = [], ""
                for _ in range(rounds):
                    t = time.perf_counter()
                    refused = _try(lambda spec=spec, gm=gm: gg.Pipeline.from_spec(spec).run(gm))
                    times.append(time.perf_counter() - t)
                out.append(_seconds_row(name, f"verified {spec}", times, refused))
    finally:
        torch.set_num_threads(saved)
    return out


def _try(fn) -> str:
    try:
        fn()
    except gg.GraphgrowError as e:
        return f"refused: {e.message[:70]}"
    return ""


def _seconds_row(model: str, measure: str, times: list[float], note: str) -> Row:
    med = statistics.median(times)
    return Row(
        "small models at 32×32 (s, API, default threads)", model, measure, med, min(times), "s", "≤ 2", med <= 2, note
    )


DECODER_SECTION = "decoder at scale: s per stage; peak memory ÷ grown weights"
PASS_STAGES = (": pass", ": verification", "save")


def decoder_rows(
    sizes=("125m", "350m", "1b"),
    progress=lambda _: None,
    limit_gib: float = 16.0,
    share_input: bool = True,
    out_dir: Path | None = None,
) -> list[Row]:
    """The scale rows: one subprocess per size (scale_decoder.py), so each measures its own peak and a size that does
    not fit ends alone. `share_input`: Pipeline(share=True), as `graphgrow mutate` runs (without it the 1 B decoder
    does not fit in 16 GiB: docs/performance.md)."""
    import tempfile

    out: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gg_scale_") as tmp:
        for size in sizes:
            progress(f"decoder {size} (a process of its own)")
            cmd = [
                sys.executable,
                str(Path(__file__).with_name("scale_decoder.py")),
                size,
                str(out_dir or tmp),
                "--limit-gib",
                str(limit_gib),
            ] + (["--share-input"] if share_input else [])
            proc = _run_watched(cmd, int(limit_gib * 2**30))
            for line in proc.stderr.splitlines():
                if line.startswith("decoder "):
                    progress(line)
            if proc.returncode != 0:
                last = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
                out.append(
                    Row(
                        DECODER_SECTION,
                        f"decoder {size}",
                        "did not complete",
                        float("nan"),
                        float("nan"),
                        note=f"exit {proc.returncode}: {' | '.join(last)[-300:]}",
                    )
                )
                continue
            out += rows_of_run(
                size + ("" if share_input else ", input copied"), json.loads(proc.stdout.splitlines()[-1])
            )
    return out


RESERVE = 3 << 30  # bytes the machine keeps available: a decoder run is stopped first, before the kernel's OOM killer


def _available() -> int:
    """MemAvailable of this machine (Linux), or a large number where it cannot be read."""
    try:
        return next(
            int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemAvailable:")
        )
    except (OSError, StopIteration):
        return 1 << 62


def _run_watched(cmd: list[str], limit: int) -> subprocess.CompletedProcess:
    """Run `cmd`, killing it when its resident memory passes `limit` bytes (checked from this process: a thread inside
    the child cannot run while a C++ call holds the GIL, and the ONNX export of a 1 B model rose 10 GiB that way)."""
    import tempfile
    import time

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        note = ""
        while proc.poll() is None:
            try:
                rss = next(
                    int(line.split()[1]) * 1024
                    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
            except (OSError, StopIteration):
                rss = 0
            available = _available()
            if rss > limit or available < RESERVE:
                proc.kill()
                note = (
                    f"stopped: resident memory {rss / 2**30:.1f} GiB passed the limit {limit / 2**30:.1f} GiB\n"
                    if rss > limit
                    else f"stopped at {rss / 2**30:.1f} GiB resident: the machine had "
                    f"{available / 2**30:.1f} GiB left (other processes run beside it)\n"
                )
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read() + note)


def rows_of_run(size: str, run: dict) -> list[Row]:
    """Rows of one size's stages (scale_decoder.main's JSON): seconds, peak and estimate in the note; two target
    rows."""
    facts, stages = run["facts"], run["stages"]
    grown = facts["grown_bytes"]
    model = f"decoder {size} ({facts['params_before'] / 1e6:,.0f} M → {facts['params_after'] / 1e6:,.0f} M)"
    out = []
    for s in stages:
        est = f"; graphgrow's estimate {s['estimate'] / grown:.2f}×" if s.get("estimate") else ""
        failed = f"; {s['note']}" if s.get("note") else ""
        out.append(
            Row(
                DECODER_SECTION,
                model,
                s["name"],
                s["seconds"],
                s["seconds"],
                "s",
                note=f"peak {s['peak'] / grown:.2f}× ({s['peak'] / 2**30:.2f} GiB){est}{failed}",
            )
        )
    passes = [s["peak"] / grown for s in stages if any(k in s["name"] for k in PASS_STAGES)]
    if passes:
        out.append(
            ratio_row(
                DECODER_SECTION,
                model,
                "peak: passes + verification + save",
                [max(passes)],
                3,
                note=f"grown weights {grown / 2**30:.2f} GiB",
            )
        )
    export = [s["peak"] / grown for s in stages if "ONNX" in s["name"] or "onnxruntime" in s["name"]]
    if export:
        out.append(ratio_row(DECODER_SECTION, model, "peak: ONNX export + onnxruntime check", [max(export)], 4))
    return out


def rows(
    sizes=(1000, 4000, 12000),
    progress=lambda _: None,
    small: bool = True,
    decoder: tuple[str, ...] = ("125m", "350m", "1b"),
) -> list[Row]:
    torch.set_num_threads(1)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))  # deep Sequential copies recurse per level
    measure(300)  # warm-up: first-call costs (imports, caches) are not per-node costs
    runs = []
    for n in sizes:
        progress(f"residual chain of {n:,} nodes")
        runs.append(measure(int(n)))
    out = []
    for r in runs:
        for key in ("trace", "pass", "verify"):
            out.append(
                Row(
                    "graph-side µs per fx node",
                    f"chain of {r['nodes']:,} nodes",
                    key,
                    r[f"{key}_us_per_node"],
                    r[f"{key}_us_per_node"],
                    "µs",
                    note=f"{r[f'{key}_s']:.2f} s in all",
                )
            )
    first, last = runs[0], runs[-1]
    for key in ("trace", "pass", "verify"):
        out.append(
            ratio_row(
                "per-node cost, largest ÷ smallest chain",
                f"{last['nodes']:,} ÷ {first['nodes']:,} nodes",
                key,
                [last[f"{key}_us_per_node"] / first[f"{key}_us_per_node"]],
                1.5,
            )
        )
    return out + (small_rows(progress=progress) if small else []) + decoder_rows(decoder, progress)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,4000,12000")
    ap.add_argument("--small-only", action="store_true", help="only the small models at 32×32")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the small-model rows")
    ap.add_argument("--decoder", default="125m,350m,1b", help="decoder sizes (125m, 350m, 1b, tiny; empty: none)")
    ap.add_argument("--decoder-only", action="store_true", help="only the decoder rows")
    ap.add_argument("--limit-gib", type=float, default=16.0, help="stop a decoder size past this resident memory")
    ap.add_argument("--copy-input", action="store_true", help="Pipeline(share=False): the input's weights copied")
    args = ap.parse_args()
    progress = lambda s: print(s, file=sys.stderr)  # noqa: E731
    decoder = tuple(d for d in args.decoder.split(",") if d)
    if args.decoder_only:
        print_table(decoder_rows(decoder, progress, args.limit_gib, not args.copy_input))
    elif args.small_only:
        print_table(small_rows(args.rounds, progress))
    else:
        print_table(rows([int(n) for n in args.nodes.split(",")], progress=progress, decoder=decoder))


if __name__ == "__main__":
    main()
