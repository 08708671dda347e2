"""grow_heads refusals that state an impossibility are classed so by the sweep report (issue 39: the timm target counts
runs verified or refused for a stated impossibility). The messages are the ones graphgrow writes, taken from small
models, not copied: a query/key norm over the head size (nn.LayerNorm per head, a norm written out with rsqrt, a
BatchNorm after a conv projection) forbids a new head size — "cannot grow exactly", impossible by construction; a norm
over every head's output together forbids new heads too; an attention whose query no projection makes (a learned
query over the states: depth attention) has no heads to add — no place. Before, the three head-size refusals and the
learned query were classed "other".
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphgrow as gg
from tests.test_grow_heads import QKNorm
from tests.test_heads_conv import ConvAttention
from tests.test_heads_dataflow import OutputNorm, WrittenOutNorm
from tests.test_heads_depth import DepthMix

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from sweep_report import reason_class  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _refusal(model: nn.Module, shape: tuple, **args) -> str:
    gm = gg.trace(model, input_shape=shape)
    with pytest.raises(gg.NotApplicable) as refused:
        gg.get_pass("grow_heads")(**args)(gm)
    return str(refused.value)


@pytest.mark.parametrize(
    ("model", "shape", "args"),
    [
        (QKNorm, (1, 5, 8), {"head_dim": 8}),  # nn.LayerNorm over each head's query and key
        (lambda: WrittenOutNorm("rsqrt"), (1, 5, 16), {"head_dim": 6}),  # x · rsqrt(mean(x²) + eps) per head
        (lambda: OutputNorm("rsqrt"), (1, 5, 16), {}),  # over every head's output together: no new heads either
    ],
    ids=["layernorm", "written_out", "over_all_heads"],
)
def test_a_norm_that_forbids_the_growth_is_a_stated_impossibility(model, shape, args):
    torch.manual_seed(0)
    message = _refusal(model(), shape, **args)
    assert "cannot grow exactly" in message, message
    assert reason_class(message) == "impossible by construction", message


def test_a_batchnorm_over_a_growing_head_size_is_a_stated_impossibility():
    torch.manual_seed(0)
    message = _refusal(ConvAttention("conv+bn"), (2, 16, 3, 4), head_dim=12)
    assert "normalised back" in message and reason_class(message) == "impossible by construction", message


@pytest.mark.parametrize("spelling", ["sdpa", "eager"])
def test_a_learned_query_over_the_states_has_no_place_for_heads(spelling):
    message = _refusal(DepthMix(spelling, heads=False), (1, 5, 16), heads=6)
    assert "no heads to add" in message and reason_class(message) == "no place", message
