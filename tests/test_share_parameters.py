"""Parameters a pass does not touch are shared, not copied (issue 27, item 2): between a pipeline's own intermediate
models always, with the caller's model when asked (Pipeline(share=True)); the input stays untouched either way, and a
pass that writes into a shared tensor in place is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import mlp

import graphgrow as gg
from graphgrow.graph.fx_edit import Rewrite
from graphgrow.rewrite import copy_graph_module

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@dataclass(frozen=True)
class _WritesShared(gg.Pass):
    """Copies its input (sharing, when asked) and scales an old weight of the copy in place: forbidden."""

    name: ClassVar[str] = "test_writes_shared"
    grows: ClassVar[bool] = False

    def apply(self, gm, generator):
        gm = copy_graph_module(gm)
        with torch.no_grad():
            next(gm.parameters()).mul_(1.0)
        return Rewrite(gm)


def _gm():
    torch.manual_seed(0)
    return gg.trace(mlp(), (1, 20))


def _state(gm) -> dict:
    return {k: (v.clone(), v._version) for k, v in gm.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("share", [False, True])
def test_untouched_parameters_are_shared_and_the_input_stays_as_it_was(share):
    gm = _gm()
    before = _state(gm)
    result = gg.Pipeline.from_spec("deepen,add_residual", share=share).run(gm)
    first, last = result.results[0].gm, result.gm
    ptr = lambda m: {k: p.data_ptr() for k, p in m.named_parameters()}  # noqa: E731
    shared_with_input = set(ptr(gm).items()) & set(ptr(last).items())
    assert bool(shared_with_input) == share  # the caller's weights: only when asked
    assert set(ptr(first).items()) & set(ptr(last).items())  # the pipeline's own intermediate model: always
    assert all(p is not q for p in gm.parameters() for q in last.parameters())  # never the same Parameter object
    after = gm.state_dict(keep_vars=True)
    for k, (value, version) in before.items():  # not written, not even written back (verification's SGD steps replace)
        assert torch.equal(after[k], value) and after[k]._version == version, k


def test_a_pass_writing_into_a_shared_tensor_is_refused():
    gm = _gm()
    with pytest.raises(gg.ValidationError, match="modified its input model"):
        _WritesShared()(gm, share=True)


def test_sharing_saves_the_memory_of_a_copy():
    """The grown model's new bytes with sharing: only what the pass added."""
    gm = _gm()
    result = gg.get_pass("deepen")()(gm, share=True)
    old = {p.data_ptr() for p in gm.parameters()}
    new_bytes = sum(p.numel() * p.element_size() for p in result.gm.parameters() if p.data_ptr() not in old)
    added = sum(p.numel() * p.element_size() for p in result.gm.parameters()) - sum(
        p.numel() * p.element_size() for p in gm.parameters()
    )
    assert new_bytes == added > 0
