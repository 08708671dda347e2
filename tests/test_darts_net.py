"""The DARTS-style evaluation network in examples/darts_net.py (issue 25's test bed): built from the paper's
description, it must behave as the paper's network does before graphgrow is asked to grow it."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import darts_net as dn  # noqa: E402


def _train_out(model, p: float, seed: int = 0) -> torch.Tensor:
    model.train()
    model.drop_path_prob = p
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        return dn.split_output(model(x))[0]


@pytest.mark.parametrize("genotype", list(dn.GENOTYPES))
def test_the_network_runs_in_both_modes_and_its_drop_path_schedule_is_live(genotype):
    model = dn.small_darts(genotype=dn.GENOTYPES[genotype])
    model.eval()
    logits, aux = dn.split_output(model(torch.randn(2, 3, 32, 32)))
    assert logits.shape == (2, 10) and aux is None
    model.train()
    logits, aux = dn.split_output(model(torch.randn(2, 3, 32, 32)))
    assert aux is not None and aux.shape == (2, 10)
    assert torch.equal(_train_out(model, 0.3), _train_out(model, 0.3))  # seeded: repeatable
    assert not torch.equal(_train_out(model, 0.0), _train_out(model, 0.3))  # the schedule changes the function


def test_in_place_and_out_of_place_drop_path_draw_alike():
    x = torch.randn(4, 3, 5, 5)
    torch.manual_seed(7)
    a = dn.drop_path(x.clone(), 0.4)
    torch.manual_seed(7)
    b = dn.drop_path_outofplace(x, 0.4)
    assert torch.equal(a, b) and not torch.equal(a, x)


def test_the_paper_sized_network_has_the_papers_size():
    """DARTS (second order) on CIFAR-10: 3.3M parameters at C=36, 20 cells (auxiliary head not counted)."""
    with torch.device("meta"):
        model = dn.NetworkCIFAR(C=36, layers=20)
    assert 3.25e6 < dn.count_parameters(model) < 3.45e6


def test_a_malformed_genotype_is_refused():
    bad = dn.Genotype(
        normal=[("sep_conv_3x3", 5)] * 2,
        normal_concat=[2],
        reduce=dn.DARTS_V2.reduce,
        reduce_concat=dn.DARTS_V2.reduce_concat,
    )
    with pytest.raises(ValueError):
        dn.small_darts(genotype=bad)
