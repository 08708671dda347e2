"""The memory limit on a pass as it runs (core/allocation.py): each allocation is sized before it happens."""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

import graphgrow as gg
from graphgrow.analysis.budget import Limits, pass_allocations
from graphgrow.core.allocation import AllocationGuard, MemoryLimitExceeded, requested_bytes
from graphgrow.rewrite import Rewrite, begin
from graphgrow.rewrite.pass_base import Pass

MIB = 1 << 20


def test_an_allocation_past_the_limit_is_refused_before_it_happens():
    guard = AllocationGuard(MIB)
    with guard:
        small = torch.zeros(1000)
        with pytest.raises(MemoryLimitExceeded, match="would allocate 4,000,000 bytes"):
            torch.ones(1_000_000)
    assert guard.refusal is not None and guard.live == small.untyped_storage().nbytes() == 4000
    assert guard.peak == 4000  # the refused megabytes were never counted as held


def test_what_is_freed_stops_counting():
    guard = AllocationGuard(MIB)
    with guard:
        for _ in range(50):  # 50 × 400 kB, never more than one alive at a time
            t = torch.randn(100_000)
            del t
    assert guard.refusal is None and guard.live == 0 and 400_000 <= guard.peak < MIB


def test_views_and_in_place_operations_allocate_nothing_and_resize_grows():
    x = torch.zeros(10, 10)
    assert requested_bytes(torch.ops.aten.view.default, (x, [100]), {}) == 0
    assert requested_bytes(torch.ops.aten.add_.Tensor, (x, x), {}) == 0
    assert requested_bytes(torch.ops.aten.mul.Tensor, (x, torch.zeros(3, 1, 10)), {}) == 3 * 10 * 10 * 4
    assert requested_bytes(torch.ops.aten.mul.Tensor, (torch.zeros(4, dtype=torch.bool), 0.5), {}) == 16  # float result
    assert requested_bytes(torch.ops.aten.cat.default, ([x, x],), {}) == 800
    assert requested_bytes(torch.ops.aten.empty.memory_format, ([5, 5],), {"dtype": torch.float64}) == 200
    guard = AllocationGuard(MIB)
    with guard:
        y = torch.zeros(10)
        with pytest.raises(MemoryLimitExceeded):
            y.resize_(1_000_000)
        y.resize_(1000)
    assert guard.live == 4000


def test_an_operator_whose_output_depends_on_the_data_is_counted_after_it_runs():
    x = torch.arange(100) % 2
    assert requested_bytes(torch.ops.aten.nonzero.default, (x,), {}) is None
    guard = AllocationGuard(MIB)
    with guard:
        nz = x.nonzero()
    assert guard.live == nz.untyped_storage().nbytes() == 50 * 8


@dataclass(frozen=True)
class HugeLayer(Pass):
    """Appends a 100,000 × 100,000 linear layer (40 GB), swallowing whatever goes wrong on the way."""

    name: ClassVar[str] = "huge_layer"

    def apply(self, gm, generator):
        new, _ = begin(gm, generator)
        with contextlib.suppress(Exception):  # a pass that tries alternatives: the refusal must still stand
            new.add_module("huge", nn.Linear(100_000, 100_000))
        return Rewrite(new)


def test_a_pass_that_would_allocate_past_the_limit_is_refused_before_it_does(cnn):
    gm = gg.trace(cnn, (1, 3, 32, 32))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(
        gg.NotApplicable,
        match=r"huge_layer would hold more than 8.0 GiB beyond the model's own weights "
        r"while it runs \(it asked for 37.3 GiB more with",
    ):
        HugeLayer()(gm)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 512 * 1024  # KiB: nothing near 40 GB was touched
    with (
        pytest.raises(gg.NotApplicable, match="would hold more than 1.0 MiB"),
        pass_allocations("p", Limits(max_memory=MIB)),
    ):
        torch.zeros(MIB)


def test_the_guard_counts_a_real_pass_and_the_check_after_it_sizes_the_grown_model(cnn):
    gm = gg.trace(cnn, (1, 3, 32, 32))
    weights = sum(t.numel() * t.element_size() for t in [*gm.parameters(), *gm.buffers()])
    grow_width = gg.get_pass("grow_width")()
    guard = AllocationGuard(1 << 40)
    with guard:
        grown = grow_width.apply(gm, torch.Generator().manual_seed(0)).gm
    assert guard.peak >= weights  # the pass copies the model (no sharing) and grows a layer
    assert sum(p.numel() for p in grown.parameters()) > sum(p.numel() for p in gm.parameters())
    # verification needs room for the grown model's activations and gradients too: a limit just above what the pass
    # itself held refuses the grown model after the pass, before verification allocates
    with pytest.raises(gg.NotApplicable, match=r"grow_width would need about .* beyond the model's own weights"):
        grow_width(gm, limits=Limits(max_memory=guard.peak + 1))
    assert grow_width(gm).preservation is not None


def test_operators_returning_no_tensor_and_common_ones_are_sized_without_the_meta_device():
    from graphgrow.core.allocation import _kind

    aten = torch.ops.aten
    x = torch.zeros(6, 4)
    assert _kind(aten.allclose.default) == "alias"  # a bool: nothing held (its meta decomposition cost ~2 ms a call)
    assert requested_bytes(aten.index_select.default, (x, 0, torch.tensor([0, 2, 2])), {}) == 3 * 4 * 4
    assert requested_bytes(aten.cat.default, ([x, torch.zeros(0)],), {}) == 96
    assert requested_bytes(aten.randperm.default, (10,), {}) == 80
    assert requested_bytes(aten.arange.default, (2.5,), {}) == 3 * 4  # a float end: sized on the meta device
