"""What growth costs at deployment, and what fold gives back: onnxruntime latency of the original,
the grown and the grown-then-folded model, measured side by side.

Linear-only growth (branches: conv3x3, identity, average pooling; 1×1 adapters; an adapter-mode
widening) with trained-looking gates and BatchNorm statistics: folded ÷ original, target ≤ 1.02,
and the optimised op histogram equal to the original's. Capacity growth (grow_width's default, a
whole channel group doubled): folded ÷ the same architecture built directly (the folded graph with
freshly initialised layers), target ≤ 1.02. onnxruntime CPU provider, all graph optimisations, one
intra-op thread, batch 1, 224×224, PyTorch eager with one thread beside it; rounds interleave the
models; median and minimum CPU time per inference (wall time in the note). The last row is the
peak memory of one `graphgrow mutate … --onnx --check` process.

    python benchmarks/bench_fold.py [--rounds 20] [--models resnet18,mobilenet_v2]
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, model_rounds_main, ratio_row, timed  # noqa: E402
from conftest import randomize_bn, trained_looking  # noqa: E402

import graphgrow as gg  # noqa: E402
from graphgrow.io.export import export_onnx  # noqa: E402
from graphgrow.io.runtime import max_ir_version, open_session, optimized_op_counts  # noqa: E402

SPECS = {
    "resnet18": "add_branch(op=conv3x3),add_branch(op=identity),add_branch(op=avgpool3x3),insert_adapter,"
    "grow_width(target=layer2.0.conv1,to=160,mode=adapter)",
    "resnet50": "add_branch(at=layer4.2.conv2,op=conv3x3),add_branch(at=layer4.2.conv2,op=identity),"
    "add_branch(at=layer4.2.conv2,op=avgpool3x3),insert_adapter,grow_width(target=layer2.0.conv1,to=160,mode=adapter)",
    "mobilenet_v2": "add_branch(at=features.17.conv.1.0,op=avgpool3x3),add_branch(at=features.17.conv.1.0,op=identity),"
    "insert_adapter,grow_width(target=features.18.0,to=1400,mode=adapter)",
    "vit_b_16": "insert_adapter,grow_width(target=encoder.layers.encoder_layer_0.mlp.0,to=3200,mode=adapter),"
    "insert_adapter(after=encoder_layers_encoder_layer_5_ln_2)",
}
SHAPE = (1, 3, 224, 224)
SECTION = "onnxruntime CPU latency, batch 1 (ms)"


def built_directly(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same architecture at the same size, every layer freshly initialised (what training from scratch deploys)."""
    fresh = copy.deepcopy(gm)
    torch.manual_seed(1)
    for m in fresh.modules():
        if hasattr(m, "reset_parameters") and m is not fresh:
            m.reset_parameters()
    return randomize_bn(fresh, 6).eval()


def grow_and_fold(
    name: str, spec: str, capacity: bool = False, report: dict | None = None
) -> dict[str, torch.fx.GraphModule]:
    """{reference, grown, folded}: the reference is the original, or for capacity growth the folded
    architecture built directly. Random weights; gates and BatchNorm statistics look trained."""
    model = randomize_bn(getattr(torchvision.models, name)(), 5).eval()
    original = gg.trace(model, SHAPE)
    grown = trained_looking(gg.Pipeline.from_spec(spec).run(original).gm)
    folded = gg.fold(grown)
    if report is not None:
        report["targets"] = folded.targets
    reference = built_directly(folded.gm) if capacity else original
    return {"built directly" if capacity else "original": reference, "grown": grown, "folded": folded.gm}


def bench(name: str, spec: str, rounds: int, tmp: Path, capacity: bool = False, progress=lambda _: None) -> list[Row]:
    """Rows for one model: latency of reference / grown / folded on onnxruntime (CPU and wall time per
    inference), folded ÷ reference, whether the folded model runs the reference's kernels, ORT ÷ eager."""
    progress(f"{name}: grow and fold ({'capacity' if capacity else 'linear only'})")
    ref_name = "built directly" if capacity else "original"
    folded: dict = {}
    models = grow_and_fold(name, spec, capacity, folded)
    sessions, counts, modules = {}, {}, {}
    for key, gm in models.items():
        progress(f"{name}: export {key}")
        path = tmp / f"{name}_{key}.onnx"
        export_onnx(gm, SHAPE, path, max_ir_version=max_ir_version())
        sessions[key] = open_session(path, "cpu", threads=1)
        counts[key] = optimized_op_counts(str(path))
        modules[key] = gm.eval()
    xt = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    x = xt.numpy()
    for k, sess in sessions.items():
        for _ in range(2):
            sess.run(x)
            with torch.no_grad():
                modules[k](xt)
    ort_cpu: dict[str, list[float]] = {k: [] for k in sessions}
    ort_wall: dict[str, list[float]] = {k: [] for k in sessions}
    eager_cpu: dict[str, list[float]] = {k: [] for k in sessions}
    progress(f"{name}: {rounds} interleaved rounds")
    with torch.no_grad():
        for _ in range(rounds):
            for k, sess in sessions.items():
                _, c, w = timed(lambda sess=sess: sess.run(x))
                ort_cpu[k].append(1e3 * c)
                ort_wall[k].append(1e3 * w)
                eager_cpu[k].append(1e3 * timed(lambda k=k: modules[k](xt))[1])
    kind = "capacity growth" if capacity else "linear-only growth"
    rows = [
        Row(
            SECTION,
            name,
            f"{k} ({kind})" if k != ref_name else k,
            statistics.median(v),
            min(v),
            "ms CPU",
            note=f"wall {statistics.median(ort_wall[k]):.1f} ms; "
            f"{sum(p.numel() for p in modules[k].parameters()):,} params",
        )
        for k, v in ort_cpu.items()
    ]
    ratios = [f / r for f, r in zip(ort_cpu["folded"], ort_cpu[ref_name])]
    rows.append(
        ratio_row(
            "folded ÷ reference (onnxruntime CPU time)",
            name,
            f"{kind} vs {ref_name}",
            ratios,
            1.02,
            note=f"fold: {len(folded['targets'].get('folded') or [])} sites folded, "
            f"{len(folded['targets'].get('kept') or [])} kept",
        )
    )
    same = counts["folded"] == counts[ref_name]
    rows.append(
        Row(
            "same kernels after onnxruntime's fusions",
            name,
            f"{kind}: folded vs {ref_name}",
            float(same),
            float(same),
            "bool",
            "= 1",
            same,
            "op histogram of the optimised graph",
        )
    )
    for k in sessions:
        rows.append(
            ratio_row(
                "onnxruntime ÷ PyTorch eager (CPU time)",
                name,
                k,
                [o / e for o, e in zip(ort_cpu[k], eager_cpu[k])],
                None,
            )
        )
    return rows


def mutate_peak_memory(tmp: Path) -> tuple[float, float]:
    """(seconds, peak resident MiB) of one `graphgrow mutate` process on resnet18 at 224² with --onnx --check.

    Measured from a small intermediate process: a child forked straight from this (large) process would
    count this process's pages as its own until it execs."""
    exe = Path(sys.executable).with_name("graphgrow")
    cmd = [
        str(exe),
        "mutate",
        "torchvision.models:resnet18",
        "--pass",
        "grow_width",
        "--input-shape",
        "1,3,224,224",
        "-o",
        str(tmp / "m.pt"),
        "--onnx",
        str(tmp / "m.onnx"),
        "--check",
    ]
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1]) / 1024


def memory_row(tmp: Path) -> Row:
    seconds, mib = mutate_peak_memory(tmp)
    return Row(
        "peak memory of graphgrow mutate",
        "resnet18",
        "grow_width --onnx --check, 224²",
        mib,
        mib,
        "MiB",
        note=f"{seconds:.1f} s wall, one process",
    )


def rows(models=tuple(SPECS), rounds: int = 20, progress=lambda _: None) -> list[Row]:
    torch.set_num_threads(1)
    out: list[Row] = []
    with tempfile.TemporaryDirectory() as d:
        for name in models:
            out += bench(name, SPECS[name], rounds, Path(d), progress=progress)
        out += bench("resnet18", "grow_width", rounds, Path(d), capacity=True, progress=progress)
        progress("graphgrow mutate in a child process")
        out.append(memory_row(Path(d)))
    return out


if __name__ == "__main__":
    model_rounds_main(__doc__, rows, tuple(SPECS), 20)
