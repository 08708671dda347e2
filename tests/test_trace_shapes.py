"""Tracing (leaves, TraceError) and shapes (annotation, params/FLOPs, two batch sizes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.graph.shapes import total_flops, validate_batch_sizes


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # fx cannot trace a branch on a tensor's value
            return x * 2
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Sequential(nn.ReLU(), DataDependent())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_trace_error_names_the_submodule_and_suggests_a_leaf():
    with pytest.raises(gg.TraceError) as e:
        gg.trace(Net(), auto_leaves=False)
    assert "cannot trace submodule 'block.1' (DataDependent) of Net" in e.value.message
    assert "--leaf block.1" in e.value.hint


def test_leaf_modules_make_it_traceable_and_still_growable():
    gm = gg.trace(Net(), (1, 3, 8, 8), leaves=["block.1"])
    assert any(n.op == "call_module" and n.target == "block.1" for n in gm.graph.nodes)
    r = gg.Pipeline.from_spec("add_residual").run(gm)
    assert r.results[0].preservation.eval.ok


def test_unknown_leaf_is_an_error():
    with pytest.raises(gg.TraceError, match="no submodule named 'blok'"):
        gg.trace(Net(), leaves=["blok"])


def test_annotate_records_shapes_params_and_flops(cnn):
    gm = gg.trace(cnn, (1, 3, 32, 32))
    gg.annotate(gm, (1, 3, 32, 32))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["_0"].meta["gg_shape"] == (1, 32, 32, 32)
    assert nodes["_0"].meta["gg_params"] == 3 * 32 * 9 + 32
    assert nodes["_0"].meta["gg_flops"] == 2 * 3 * 9 * 32 * 32 * 32  # 2·MACs per example
    assert nodes["_11"].meta["gg_flops"] == 2 * 128 * 10
    assert total_flops(gm) == sum(n.meta["gg_flops"] for n in gm.graph.nodes) > 0


class BakedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).reshape(2, -1)  # right only at batch 2


def test_two_batch_sizes_catch_a_baked_batch_size():
    gm = gg.trace(BakedBatch(), (2, 4))
    with pytest.raises(gg.ValidationError, match=r"model output has shape \(2, 6\) for batch 3"):
        validate_batch_sizes(gm, (2, 4))


class BakedInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).reshape(2, -1).sum(0, keepdim=True).expand(x.shape[0], -1)[:, :4]


def test_a_baked_batch_inside_the_graph_is_caught_by_the_shared_examples():
    gm = gg.trace(BakedInside(), (2, 4))
    with pytest.raises(gg.ValidationError, match="influence each other"):
        validate_batch_sizes(gm, (2, 4))


def test_output_must_keep_the_batch_first():
    class Sum(nn.Module):
        def forward(self, x):
            return x.sum(0)

    with pytest.raises(gg.ValidationError, match="the first dimension must be the batch"):
        validate_batch_sizes(gg.trace(Sum(), (2, 4)), (2, 4))


class Routed(nn.Module):
    """Two experts, each example routed by the sign of its first feature: a mixture of experts' split, its sizes
    read from the data (`.item()`), so they change with the examples, not in proportion to the batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        to_b = (x[:, 0] > 0).long()
        order = torch.argsort(to_b, stable=True)
        n_b = to_b.sum().item()
        a_in, b_in = x[order].split([x.shape[0] - n_b, n_b])
        out = torch.cat([self.a(a_in), self.b(b_in)])
        return torch.zeros_like(out).index_copy(0, order, out)


def test_sizes_read_from_the_data_may_change_between_the_batches():
    gm = gg.trace(Routed(), (2, 4))
    validate_batch_sizes(gm, (2, 4))  # was: node 'split' has shape [(1, 4), (1, 4)] at batch 2 but [(2, 4), (1, 4)]
