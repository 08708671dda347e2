"""Real torchvision detection builders grown inside their largest capturable part (capture/parts.py), as the sweep
runs them: neither fx nor torch.export captures them whole (a loop over the images, NMS's data-dependent sizes).
Slow: a detection model built, run and captured."""

from __future__ import annotations

import pytest
import torch

from graphgrow.io.load import load_model
from graphgrow.jobs import workflow

pytestmark = pytest.mark.slow

FASTER = "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn(min_size=128, max_size=128)"
SSDLITE = "torchvision:ssdlite320_mobilenet_v3_large"


def _detections(model: torch.nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(3)
    model.eval()
    with torch.no_grad():
        out = model(torch.rand(1, 3, 128, 128))
    return [d[k] for d in out for k in sorted(d)]


def test_fasterrcnn_grows_inside_its_box_head_saved_whole_part_exported(tmp_path):
    out, onnx = tmp_path / "f.pt", tmp_path / "f.onnx"
    report = workflow.mutate(
        FASTER, ["grow_width"], out=str(out), onnx_out=str(onnx), check=True, input_shape="1,3,128,128"
    )
    part = report["part"]
    assert part["path"] == "roi_heads.box_head" and part["share"] > 0.5  # the largest part that captures
    assert "FasterRCNN" in part["why_whole_not_captured"]
    assert report["preservation"]["eval_ok"] and report["preservation"]["train_ok"]
    assert report["whole_check"]["passed"] and report["whole_check"]["part"]["values"] > 0
    assert report["equivalence"]["passed"]
    loaded = load_model(str(out))  # a zoo name: rebuilt without --trust
    assert loaded.kind == "graphgrow-part"
    head = loaded.module.get_submodule("roi_heads.box_head")
    assert isinstance(head, torch.fx.GraphModule) and head.get_submodule("fc6").out_features == 2048
    original = workflow.load_model(FASTER).module
    for a, b in zip(_detections(original), _detections(loaded.module), strict=True):
        torch.testing.assert_close(b, a)


def test_ssdlite_grows_inside_its_backbone_detections_kept(tmp_path):
    out = tmp_path / "s.pt"
    report = workflow.mutate(SSDLITE, ["add_residual"], out=str(out), input_shape="1,3,128,128")
    assert report["part"]["path"] == "backbone"
    assert report["whole_check"]["passed"] and report["whole_check"]["whole"]["values"] > 0  # SSD keeps its top boxes
    loaded = load_model(str(out))
    original = workflow.load_model(SSDLITE).module
    for a, b in zip(_detections(original), _detections(loaded.module), strict=True):
        torch.testing.assert_close(b, a)
