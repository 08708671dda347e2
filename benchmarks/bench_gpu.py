"""The deployment latency rows on a GPU: onnxruntime's CUDA provider against PyTorch CUDA.

Skipped (one row says why) unless torch sees a CUDA device and onnxruntime has a CUDA provider
that loads. Same models and growth as bench_fold (original, grown, grown-then-folded), batch 1,
224×224, float32. Both sides: TF32 off. onnxruntime: exhaustive cuDNN convolution algorithm
search, input and outputs bound to GPU memory (IO binding). PyTorch: cudnn.benchmark on, eager.
Median and minimum wall time per inference over ROUNDS interleaved rounds after warm-up,
synchronised; GFLOPS from graphgrow's FLOP count. Target: onnxruntime at least as fast as
PyTorch (PyTorch time ÷ onnxruntime time ≥ 1.0).

    python benchmarks/bench_gpu.py [--rounds 50] [--models resnet18,...]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fold import SHAPE, SPECS, grow_and_fold  # noqa: E402
from common import Row, model_rounds_main, ratio_row  # noqa: E402

import graphgrow as gg  # noqa: E402
from graphgrow.core.errors import RuntimeUnavailable  # noqa: E402
from graphgrow.graph.shapes import total_flops  # noqa: E402
from graphgrow.io.export import export_onnx  # noqa: E402
from graphgrow.io.runtime import cuda_bound_run, max_ir_version, open_session  # noqa: E402

SECTION = "GPU latency, batch 1 (ms)"


def skipped(why: str) -> list[Row]:
    return [Row(SECTION, "-", "skipped", float("nan"), float("nan"), note=why)]


def synced(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench(name: str, rounds: int, tmp: Path, progress) -> list[Row]:
    progress(f"{name}: grow and fold (GPU rows)")
    models = grow_and_fold(name, SPECS[name])
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).cuda()
    torch_runs, ort_runs, flops = {}, {}, {}
    for key, gm in models.items():
        progress(f"{name}: export {key} (GPU rows)")
        gg.annotate(gm, SHAPE)
        flops[key] = total_flops(gm)  # per example: batch 1
        path = tmp / f"{name}_{key}.onnx"
        export_onnx(gm, SHAPE, path, max_ir_version=max_ir_version())
        session = open_session(path, "cuda", tf32=False)
        ort_runs[key] = cuda_bound_run(session, x.data_ptr(), tuple(x.shape))
        module = gm.cuda().eval()
        torch_runs[key] = (lambda m: lambda: m(x))(module)
    times: dict[tuple[str, str], list[float]] = {(k, side): [] for k in models for side in ("torch", "ort")}
    with torch.no_grad():
        for k in models:  # warm-up: cuDNN autotuning on both sides
            for _ in range(5):
                torch_runs[k]()
                ort_runs[k]()
        progress(f"{name}: {rounds} interleaved rounds on the GPU")
        for _ in range(rounds):
            for k in models:
                times[(k, "torch")].append(1e3 * synced(torch_runs[k]))
                times[(k, "ort")].append(1e3 * synced(ort_runs[k]))
    rows = []
    for k in models:
        for side, label in (("ort", "onnxruntime CUDA"), ("torch", "PyTorch CUDA")):
            med = statistics.median(times[(k, side)])
            rows.append(
                Row(
                    SECTION,
                    name,
                    f"{k}: {label}",
                    med,
                    min(times[(k, side)]),
                    "ms",
                    note=f"{flops[k] / med / 1e6:.0f} GFLOPS",
                )
            )
        rows.append(
            ratio_row(
                "PyTorch CUDA ÷ onnxruntime CUDA",
                name,
                k,
                [t / o for t, o in zip(times[(k, "torch")], times[(k, "ort")])],
                1.0,
                at_least=True,
            )
        )
    return rows


def rows(models=tuple(SPECS), rounds: int = 50, progress=lambda _: None) -> list[Row]:
    if not torch.cuda.is_available():
        return skipped("no CUDA device here (torch.cuda.is_available() is False)")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        open_session(export_probe(), "cuda")
    except RuntimeUnavailable as e:
        return skipped(f"onnxruntime has no working CUDA provider: {e.message}")
    out: list[Row] = []
    with tempfile.TemporaryDirectory() as d:
        for name in models:
            out += bench(name, rounds, Path(d), progress)
    out.append(Row(SECTION, "-", "device", float("nan"), float("nan"), note=torch.cuda.get_device_name(0)))
    return out


def export_probe() -> bytes:
    """A tiny ONNX model, to see whether onnxruntime's CUDA provider really loads."""
    gm = gg.trace(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)), (1, 3, 8, 8))
    return export_onnx(gm, (1, 3, 8, 8)).SerializeToString()


if __name__ == "__main__":
    model_rounds_main(__doc__, rows, tuple(SPECS), 50)
