"""The scale benchmark's stage code (benchmarks/scale_decoder.py, issue 27 item 1) at a tiny size: every stage runs
(trace, each pass and its verification, the graphgrow file, the ONNX export, the onnxruntime check), the grown model
is what the pipeline says, and bench_scale turns the stages into rows with their targets."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale  # noqa: E402
import scale_decoder as sd  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale")
    stages, facts = sd.run("tiny", out)
    return out, stages, facts


def test_every_stage_runs_and_the_files_are_written(tiny_run):
    out, stages, facts = tiny_run
    names = [s.name for s in stages]
    assert names == [
        "build (random weights)",
        "trace + fidelity",
        "deepen: pass",
        "deepen: verification",
        "grow_width: pass",
        "grow_width: verification",
        "grow_hidden: pass",
        "grow_hidden: verification",
        "save (graphgrow file)",
        "ONNX export (external data)",
        "onnxruntime check",
    ]
    assert not [s for s in stages if s.note], [s.note for s in stages if s.note]  # no stage failed
    assert all(s.seconds > 0 and s.peak >= 0 for s in stages)
    assert all(s.estimate and s.estimate > 0 for s in stages if ":" in s.name)  # graphgrow's estimate beside each pass
    assert all((out / f"decoder_tiny.{ext}").stat().st_size > 0 for ext in ("pt", "onnx", "onnx.data"))
    assert facts["params_before"] == sum(p.numel() for p in sd.decoder("tiny").parameters())
    assert facts["params_after"] > facts["params_before"]
    assert facts["grown_bytes"] == 4 * facts["params_after"]  # float32, no buffers


def test_the_grown_file_is_the_pipeline_s_model(tiny_run):
    import graphgrow as gg

    out, _, _ = tiny_run
    loaded = gg.load_model(out / "decoder_tiny.pt")
    gm, d = loaded.module, sd.SIZES["tiny"][0]
    assert gm.get_submodule("blocks.0.mlp.fc1").out_features == 6 * d  # grow_width(to=6d)
    assert gm.get_submodule("embed").embedding_dim == d + d // 16  # grow_hidden(to=d + d/16)
    assert [e["pass"] for e in loaded.log] == ["deepen", "grow_width", "grow_hidden"]


def test_rows_carry_the_stages_and_the_targets(tiny_run):
    _, stages, facts = tiny_run
    rows = bench_scale.rows_of_run("tiny", {"facts": facts, "stages": [vars(s) for s in stages]})
    assert [r.measure for r in rows[: len(stages)]] == [s.name for s in stages]
    assert all(r.unit == "s" and "peak" in r.note for r in rows[: len(stages)])
    targets = {r.measure: r for r in rows[len(stages) :]}
    assert set(targets) == {"peak: passes + verification + save", "peak: ONNX export + onnxruntime check"}
    assert targets["peak: passes + verification + save"].target == "≤ 3"
    assert targets["peak: ONNX export + onnxruntime check"].target == "≤ 4"
    assert all(not math.isnan(r.median) for r in rows)


def test_peak_reads_this_process():
    peak = sd.Peak()
    peak.reset()
    before = peak.high()
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched
    x.add_(1)
    assert peak.high() - before >= 48 << 20
