"""ONNX node names trace back to the model: `module.path/OpType`, unique, so Netron shows the model's own layers."""

from __future__ import annotations

from conftest import small_cnn

import graphgrow as gg


def test_onnx_nodes_are_named_after_their_modules():
    gm = gg.trace(small_cnn().eval(), input_shape=(1, 3, 16, 16))
    grown = gg.Pipeline.from_spec("add_residual").run(gm).gm
    names = [n.name for n in gg.export_onnx(grown, [1, 3, 16, 16]).graph.node]
    assert len(set(names)) == len(names)
    assert "residual_downsample.1/Conv" in names and "11/Gemm" in names  # the skip's conv+BN, the classifier
    assert all("/" in n for n in names)


def test_a_failing_check_names_the_first_diverging_node(tmp_path):
    """A deliberately broken ONNX file (one conv's weights scaled) is caught, and the report names that conv."""
    import json

    import onnx
    import torch
    from conftest import run_cli
    from onnx import numpy_helper

    model = tmp_path / "m.pt"
    torch.save(small_cnn().eval(), model)
    proc = run_cli("export", str(model), "-o", str(tmp_path / "m.onnx"), "--input-shape", "1,3,16,16")
    assert proc.returncode == 0, proc.stderr
    proto = onnx.load(str(tmp_path / "m.onnx"))
    target = next(n for n in proto.graph.node if n.name == "4/Conv")  # the second conv (BatchNorm folded in)
    init = next(i for i in proto.graph.initializer if i.name == target.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1.5, init.name))
    onnx.save(proto, str(tmp_path / "broken.onnx"))
    proc = run_cli("check", str(tmp_path / "broken.onnx"), str(model), "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["first_divergence"]["node"] == "4/Conv" and report["first_divergence"]["module"] == "4"
    proc = run_cli("check", str(tmp_path / "m.onnx"), str(model), "--json")
    assert proc.returncode == 0 and "first_divergence" not in json.loads(proc.stdout)


def test_inspect_summary_is_one_row_per_module():
    import torchvision

    from graphgrow.jobs.workflow import module_summary

    gm = gg.trace(torchvision.models.resnet18().eval(), input_shape=(1, 3, 64, 64))
    gg.annotate(gm, (1, 3, 64, 64))  # shapes, parameters and FLOPs per node, as the CLI's open_model does
    top = module_summary(gm, depth=1)
    assert [r["module"] for r in top] == [
        "conv1",
        "bn1",
        "relu",
        "maxpool",
        "layer1",
        "layer2",
        "layer3",
        "layer4",
        "avgpool",
        "flatten",
        "fc",
    ]
    assert sum(r["params"] for r in top) == sum(p.numel() for p in gm.parameters())
    assert next(r for r in top if r["module"] == "layer4")["shape"] == (1, 512, 2, 2)
    assert len(module_summary(gm, depth=2)) > len(top)


def test_mutate_draws_the_change_and_diff_reports_it(tmp_path):
    import json

    import torch
    from conftest import run_cli

    model = tmp_path / "m.pt"
    torch.save(small_cnn().eval(), model)
    proc = run_cli(
        "mutate",
        str(model),
        "--pass",
        "add_residual,grow_width",
        "--input-shape",
        "1,3,16,16",
        "--diagram",
        str(tmp_path / "change.svg"),
        "-o",
        str(tmp_path / "g.pt"),
    )
    assert proc.returncode == 0, proc.stderr
    svg = (tmp_path / "change.svg").read_text()
    assert svg.startswith("<?xml") and "residual_downsample" in svg and "unchanged" in svg
    proc = run_cli("diff", str(model), str(tmp_path / "g.pt"), "--json", "--diagram", str(tmp_path / "d.png"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passes"] == ["add_residual", "grow_width"]
    assert any(a.startswith("residual_downsample.0") for a in report["added"]) and report["rebuilt"]
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    other = tmp_path / "other.pt"
    assert (
        run_cli("mutate", str(model), "--pass", "deepen", "--input-shape", "1,3,16,16", "-o", str(other)).returncode
        == 0
    )
    proc = run_cli("diff", str(tmp_path / "g.pt"), str(other))
    assert proc.returncode == 2 and "not of one lineage" in proc.stderr


def test_a_dry_run_draws_the_preview_and_writes_no_model(tmp_path):
    import os
    import stat

    import torch
    from conftest import run_cli

    model = tmp_path / "m.pt"
    torch.save(small_cnn().eval(), model)
    proc = run_cli(
        "mutate",
        str(model),
        "--pass",
        "deepen",
        "--input-shape",
        "1,3,16,16",
        "--dry-run",
        "--diagram",
        str(tmp_path / "preview.svg"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt", "preview.svg"]  # no model, no temp file left
    assert "dry run: no model written" in proc.stdout and "wrote " in proc.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "preview.svg").stat().st_mode) == 0o666 & ~umask  # like every other output
