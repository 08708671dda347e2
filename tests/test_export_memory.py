"""--max-memory bounds the ONNX export and the onnxruntime check too (issue 27, item 5): refused before they run,
from the peaks measured per byte of weights (budget.EXPORT_PEAK, CHECK_PEAK)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from torch import nn

import graphgrow as gg
from graphgrow.analysis.budget import CHECK_PEAK, EXPORT_PEAK, NO_LIMIT, check_onnx_memory
from graphgrow.jobs.workflow import mutate

MIB = 1 << 20


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))  # 3.9 MiB of weights


def test_each_stage_is_sized_by_its_own_peak():
    m = wide_mlp()
    weights = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    limit = int(2 * weights)  # above the data-file export (1.1×), below one file (5×) and the check (2.3×)
    check_onnx_memory(m, True, False, limit)
    check_onnx_memory(m, None, False, limit)  # nothing to run
    with pytest.raises(
        gg.InputError, match=r"exporting it to ONNX \(one file\) would need about 19.\d MiB .*--external-data"
    ):
        check_onnx_memory(m, False, False, limit)
    with pytest.raises(gg.InputError, match=r"checking it in onnxruntime would need about 8.9 MiB"):
        check_onnx_memory(m, True, True, limit)
    check_onnx_memory(m, False, True, NO_LIMIT)
    assert EXPORT_PEAK[True] < CHECK_PEAK < EXPORT_PEAK[False]


@pytest.mark.slow  # a CLI process that exports: make test runs it, not the edit loop
def test_graphgrow_export_is_refused_before_it_writes_anything(tmp_path):
    src = tmp_path / "mlp.pt"
    torch.save(wide_mlp(), src)
    argv = ["export", str(src), "-o", str(tmp_path / "m.onnx"), "--input-shape", "1,1000", "--max-memory", "10M"]
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and "exporting it to ONNX (one file) would need about" in proc.stderr, proc.stderr
    assert "--external-data" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.pt"]
    proc = run_cli(*argv, "--external-data", cwd=tmp_path)  # 1.1× the weights fits in 10M
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m.onnx.data").is_file()


def test_mutate_sizes_the_grown_model_s_export_and_check_before_saving(tmp_path):
    src = tmp_path / "mlp.pt"
    torch.save(wide_mlp(), src)
    out, onnx = tmp_path / "g.pt", tmp_path / "g.onnx"
    with pytest.raises(gg.InputError, match=r"exporting it to ONNX \(one file\) would need about"):
        mutate(
            str(src),
            ["insert_adapter"],
            out=str(out),
            onnx_out=str(onnx),
            check=True,
            input_shape="1,1000",
            max_memory="16M",
        )
    assert not out.exists() and not onnx.exists()
    report = mutate(
        str(src),
        ["insert_adapter"],
        out=str(out),
        onnx_out=str(onnx),
        check=True,
        input_shape="1,1000",
        max_memory="64M",
    )
    assert report["equivalence"]["passed"] and out.is_file() and onnx.is_file()
