"""ONNX node names trace back to the model: `module.path/OpType`, unique, so Netron shows the model's own layers."""
from __future__ import annotations

import graphgrow as gg
from conftest import small_cnn


def test_onnx_nodes_are_named_after_their_modules():
    gm = gg.trace(small_cnn().eval(), input_shape=(1, 3, 16, 16))
    grown = gg.Pipeline.from_spec("add_residual").run(gm).gm
    names = [n.name for n in gg.export_onnx(grown, [1, 3, 16, 16]).graph.node]
    assert len(set(names)) == len(names)
    assert "residual_downsample.1/Conv" in names and "11/Gemm" in names  # the skip's conv+BN, the classifier
    assert all("/" in n for n in names)
