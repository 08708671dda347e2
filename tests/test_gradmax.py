"""init=gradmax (issue 26): new units aimed from a batch keep the function, learn, and get a larger
gradient than random ones; `targets --data` ranks a starved layer first; places it cannot aim say so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from graphgrow.passes.grow_width import GrowWidth
from torch import nn

import graphgrow as gg
from graphgrow.cli import main
from graphgrow.core.errors import InputError, NotApplicable, SpecError
from graphgrow.rewrite.gain import rank_by_gain


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


def _batch(shape: tuple, classes: int, seed: int = 0):
    """Inputs with a learnable signal: labels from a fixed random projection of the input."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((128,) + shape, generator=g)
    y = (x.flatten(1) @ torch.randn(x[0].numel(), classes, generator=g)).argmax(1)
    return lambda: (x, lambda out: F.cross_entropy(out, y))


def _traced(m: nn.Module, shape: tuple):
    gm = gg.trace(m, input_shape=(1,) + shape)
    gg.annotate(gm, (1,) + shape)
    return gm.train()


def _outgoing_grad(gm, data, consumer: str, old: int) -> float:
    """‖∂L/∂W_consumer[:, new]‖² measured on the grown model itself (train mode, as in training)."""
    x, loss_fn = data()
    gm.train()
    loss_fn(gm(x)).backward()
    return float(gm.get_submodule(consumer).weight.grad[:, old:].pow(2).sum())


def test_gradmax_keeps_the_function_and_every_new_parameter_learns():
    gm = _traced(_cnn(), (3, 8, 8))
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    r = GrowWidth(target="0", init="gradmax", data=_batch((3, 8, 8), 5))(gm)
    assert r.preservation.eval.rel_err <= 1e-5 and r.preservation.train.rel_err <= 1e-5
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in before.items())  # input untouched, BN stats too
    assert all(torch.equal(b, before[k]) for k, b in r.gm.named_buffers() if k in before and b.shape == before[k].shape)
    assert all(p.requires_grad for p in r.gm.parameters())
    new_rows = r.gm.get_submodule("0").weight[4:].flatten(1)
    assert torch.allclose(new_rows @ new_rows.T, torch.eye(4), atol=1e-5)  # the amplitude rule: orthonormal rows
    assert r.gm.get_submodule("3").weight[:, 4:].abs().max() == 0  # outgoing weights start at zero
    assert "gradmax" in r.targets and r.targets["gain"] > 0
    adapter = GrowWidth(target="3", mode="adapter", init="gradmax", data=_batch((3, 8, 8), 5))(gm)  # verified too
    assert adapter.targets["gain"] > 0 and adapter.preservation.train.rel_err <= 1e-5


def test_gradmax_gives_a_larger_outgoing_gradient_than_random_incoming_weights():
    gm, data = _traced(_cnn(), (3, 8, 8)), _batch((3, 8, 8), 5)
    aimed = _outgoing_grad(GrowWidth(target="0", init="gradmax", data=data)(gm).gm, data, "3", 4)
    randoms = [
        _outgoing_grad(GrowWidth(target="0")(gm, verify_result=False, seed=s).gm, data, "3", 4) for s in range(3)
    ]
    assert aimed > 1.5 * max(randoms), (aimed, randoms)


def test_on_a_linear_path_gradmax_is_the_closed_form():
    """Linear → Linear: the best k orthonormal rows give Σ top-k σ² of E[g xᵀ] (Evci et al., eq. 6)."""
    torch.manual_seed(0)
    gm = _traced(nn.Sequential(nn.Linear(12, 6), nn.Linear(6, 5)), (12,))
    data = _batch((12,), 5)
    x, loss_fn = data()
    out = gm(x).detach().requires_grad_(True)
    loss_fn(out).backward()
    sigma = torch.linalg.svdvals(out.grad.T @ x)
    for k in (1, 3):
        r = GrowWidth(target="0", to=6 + k, init="gradmax", data=data)(gm)
        assert r.targets["gain"] * k == pytest.approx(float(sigma[:k].pow(2).sum()), rel=1e-3)


def test_the_ranking_puts_a_starved_layer_first():
    torch.manual_seed(0)
    starved = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2), nn.ReLU(), nn.Linear(2, 10)
    )  # the 2-unit layer starves a 10-class task
    gm = _traced(starved, (16,))
    p = GrowWidth()
    ranked = rank_by_gain(gm, p, p.candidates(gm), _batch((16,), 10))
    assert [c.args["target"] for c, _, _ in ranked][0] == "4"
    assert ranked[0][1] > 5 * ranked[1][1]


def test_refusals_say_what_to_do():
    gm = _traced(_cnn(), (3, 8, 8))
    with pytest.raises(NotApplicable, match="none was given"):
        GrowWidth(init="gradmax")(gm)
    with pytest.raises(InputError, match="not \\(inputs, loss_fn\\)"):
        GrowWidth(init="gradmax", data=lambda: torch.zeros(1))(gm)
    with pytest.raises(NotApplicable, match="cannot be ranked by gain"):
        rank_by_gain(gm, gg.get_pass("add_residual")(), [], _batch((3, 8, 8), 5))
    with pytest.raises(SpecError, match="no argument 'init'"):
        gg.Pipeline.from_spec("add_residual(init=gradmax)")


def test_cli_targets_ranks_by_gain_and_mutate_refuses_data_without_gradmax():
    runner = CliRunner()
    model = ["examples.digits_task:model", "--input-shape", "1,1,8,8"]
    res = runner.invoke(
        main, ["targets", *model, "--pass", "grow_width", "--data", "examples.digits_task:batch", "--json"]
    )
    assert res.exit_code == 0, res.output
    import json

    found = json.loads(res.output)["candidates"]
    gains = [c["gain"] for c in found]
    assert len(gains) == 2 and all(g > 0 for g in gains) and gains == sorted(gains, reverse=True)
    res = runner.invoke(
        main, ["mutate", *model, "--pass", "grow_width", "--data", "examples.digits_task:batch", "--dry-run"]
    )
    assert res.exit_code == 2 and "init=gradmax" in res.output
