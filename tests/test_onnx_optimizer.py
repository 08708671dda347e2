"""The exporter's optimizer, as graphgrow runs it (graphgrow/io/onnx_optimizer.py): a constant-folding rule that
fails declines instead of failing the export (issue 39: torchvision raft_small's export failed with "'NoneType'
object has no attribute 'ndim'": onnxscript's SplitToSequence fold on a chunk size known only at run time, from
RAFT's two frames run as one batch and chunked apart). The export then agrees with PyTorch on onnxruntime, and the
optimizer's tables are as they were after it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.io.export import export_onnx
from graphgrow.io.runtime import open_session
from graphgrow.verify.equivalence import check_equivalence

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class PairInOneBatch(nn.Module):
    """Two frames through one conv as one batch, then apart again (`how`: chunk, split by the batch, tensor_split)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, image1, image2):
        f = self.conv(torch.cat([image1, image2], 0))
        if self.how == "chunk":
            a, b = torch.chunk(f, 2, dim=0)
        elif self.how == "split by the first batch":
            a, b = f.split(image1.shape[0], dim=0)
        else:
            a, b = torch.tensor_split(f, 2, dim=0)
        return a * b + a


SPEC = "image1:float32[1,3,8,8],image2:float32[1,3,8,8]"


@pytest.mark.parametrize("how", ["chunk", "split by the first batch", "tensor_split"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_batch_made_by_concatenation_and_split_apart_exports(how, capture):
    from onnxscript.optimizer import _constant_folding as folding

    before = {k: [e.function for e in v] for k, v in folding.registry.op_evaluators.items()}
    gm = gg.trace(PairInOneBatch(how), input_shape=SPEC, capture=capture)
    proto = export_onnx(gm, SPEC)
    report = check_equivalence(gm, open_session(proto.SerializeToString(), "cpu"), SPEC)
    assert report.passed, report
    after = {k: [e.function for e in v] for k, v in folding.registry.op_evaluators.items()}
    assert after == before  # restored: the guard lives only for the export


class ClampedTwice(nn.Module):
    """One tensor clipped before each of three Linears (Gemma 4's vision encoder before q, k and v), with infinite
    bounds held in buffers; `how`: torch.clamp, Tensor.clamp by keyword, torch.minimum over torch.maximum."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("lo", torch.tensor(float("-inf")))
        self.register_buffer("hi", torch.tensor(float("inf")))

    def clip(self, x):
        if self.how == "torch.clamp":
            return torch.clamp(x, self.lo, self.hi)
        if self.how == "Tensor.clamp":
            return x.clamp(min=self.lo, max=self.hi)
        return torch.minimum(torch.maximum(x, self.lo), self.hi)

    def forward(self, x):
        x = x * 2
        return self.q(self.clip(x)) + self.k(self.clip(x)) * self.v(self.clip(x))


@pytest.mark.parametrize("how", ["torch.clamp", "Tensor.clamp", "torch.minimum of torch.maximum"])
@pytest.mark.parametrize("capture", ["fx", "export"])
def test_one_tensor_clipped_several_times_exports(how, capture):
    """The optimizer's Clip rewrites name each bound after the clipped tensor: three clips of one tensor made three
    constants of one name, and the ONNX checker refused the graph ("Nodes in a graph must be topologically sorted")."""
    gm = gg.trace(ClampedTwice(how), input_shape=(2, 4, 8), capture=capture)
    proto = export_onnx(gm, (2, 4, 8))
    names = [i.name for i in proto.graph.initializer]
    assert len(names) == len(set(names))
    report = check_equivalence(gm, open_session(proto.SerializeToString(), "cpu"), (2, 4, 8))
    assert report.passed, report
