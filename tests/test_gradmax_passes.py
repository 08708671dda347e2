"""init=gradmax beyond grow_width (issue 26, item 1): insert_adapter (widening), add_branch and deepen keep the
function (eval and train), every new parameter learns, and the gradient on the zero last factor is at least what
the default init gives on the same batch; places with nothing to aim at say so. Also the closed form's cost
path: an exactly linear pair is solved without ascent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.core.errors import NotApplicable
from graphgrow.graph.inputs import parse_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


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


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))


class _Tokens(nn.Module):
    """Embedding → a residual mixer → LayerNorm → a head, mean over tokens: a token stream to deepen."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.norm, self.head = (
            nn.Embedding(20, 16),
            nn.Linear(16, 16),
            nn.LayerNorm(16),
            nn.Linear(16, 5),
        )

    def forward(self, ids):
        h = self.embed(ids)
        h = h + torch.relu(self.mix(h))
        return self.head(self.norm(h)).mean(1)


def _batch(x: torch.Tensor, classes: int, seed: int = 0):
    """Labels with a learnable signal: a fixed random projection of the input."""
    g = torch.Generator().manual_seed(seed)
    y = (x.flatten(1).float() @ torch.randn(x[0].numel(), classes, generator=g)).argmax(1)
    return lambda: (x, lambda out: F.cross_entropy(out, y))


def _traced(m: nn.Module, spec: str):
    shape = parse_spec(spec) if ":" in spec else tuple(int(d) for d in spec.split("x"))
    gm = gg.trace(m, input_shape=shape)
    return gm.train()


def _zero_factor_grad(gm, data, name: str, cols: slice | None = None) -> float:
    """‖∂L/∂(zero last factor)‖² on the grown model itself, train mode (as in training)."""
    x, loss_fn = data()
    gm.train()
    gm.zero_grad(set_to_none=True)
    loss_fn(gm(x)).backward()
    p = gm.get_parameter(name)
    g = p.grad if cols is None else p.grad[:, cols]
    return float(g.pow(2).sum())


g = torch.Generator().manual_seed(1)
IMAGES = torch.randn(64, 3, 8, 8, generator=g)
ROWS = torch.randn(128, 12, generator=g)
IDS = torch.randint(0, 20, (64, 8), generator=g)

# (pass, its arguments, model, input spec, batch, the zero last factor's parameter, its zero columns)
CASES = {
    "insert_adapter": (
        "insert_adapter",
        {"after": "3", "out_channels": 12},
        _cnn,
        "1x3x8x8",
        IMAGES,
        "8.weight",
        slice(8, 12),
    ),
    "add_branch": ("add_branch", {"at": "3"}, _cnn, "1x3x8x8", IMAGES, "merge.gates", None),
    "deepen_conv": ("deepen", {"after": "0"}, _cnn, "1x3x8x8", IMAGES, "deepen_conv_bn_relu_gate", None),
    "deepen_linear": ("deepen", {"after": "2"}, _mlp, "1x12", ROWS, "deepen_linear_relu_gate", None),
    "deepen_transformer": (
        "deepen",
        {"after": "add_1", "block": "transformer", "attention": "bidirectional"},
        _Tokens,
        "ids:1x8:int64",
        IDS,
        "deepen_transformer.fc2.weight",
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradmax_keeps_the_function_learns_and_beats_the_default_init(case):
    name, args, build, spec, x, factor, cols = CASES[case]
    gm, data = _traced(build(), spec), _batch(x, 5)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    r = gg.get_pass(name)(**args, init="gradmax", data=data)(gm)  # verified: exact in eval and train, learns
    assert r.preservation.eval.rel_err <= 1e-5 and r.preservation.train.rel_err <= 1e-5
    assert all(torch.equal(v, gm.state_dict()[k]) for k, v in before.items())  # the input model untouched
    assert all(p.requires_grad for p in r.gm.parameters())
    assert "gradmax" in r.targets and r.targets["gain"] > 0
    zero = gm.get_parameter(factor) if factor in dict(gm.named_parameters()) else None
    assert zero is None or cols is not None or zero.abs().max() == 0
    aimed = _zero_factor_grad(r.gm, data, factor, cols)
    default = [
        _zero_factor_grad(gg.get_pass(name)(**args)(gm, verify_result=False, seed=s).gm, data, factor, cols)
        for s in range(3)
    ]
    assert aimed >= max(default), (aimed, default)


def test_deepen_linear_relu_keeps_its_opposite_pairs():
    gm, data = _traced(_mlp(), "1x12"), _batch(ROWS, 5)
    w = gg.get_pass("deepen")(after="2", init="gradmax", data=data)(gm).gm.get_submodule("deepen_linear_relu.0").weight
    assert torch.equal(w[8:16], -w[:8])  # one of each pair active for any input, as with the default init


def test_an_exactly_linear_pair_takes_the_closed_form_without_ascent():
    """Linear → Linear: J is ‖M w‖², so the SVD is the answer and no ascent step runs; the gradient matches it."""
    torch.manual_seed(0)
    gm = _traced(nn.Sequential(nn.Linear(12, 6), nn.Linear(6, 5)), "1x12")
    data = _batch(ROWS, 5)
    r = gg.get_pass("grow_width")(target="0", to=9, init="gradmax", data=data)(gm)
    assert "closed form" in r.targets["gradmax"] and "ascent" not in r.targets["gradmax"]
    x, loss_fn = data()
    out = gm(x).detach().requires_grad_(True)
    loss_fn(out).backward()
    sigma = torch.linalg.svdvals(out.grad.T @ x)
    assert r.targets["gain"] * 3 == pytest.approx(float(sigma[:3].pow(2).sum()), rel=1e-3)


def test_conv_pair_closed_form_matches_the_measured_gradient():
    """Conv2d → eval-mode BatchNorm → Conv2d is linear in the new rows: closed form, and the gain it reports is
    the gradient measured on the grown model."""
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 5),
    )
    gm, data = _traced(m, "1x3x8x8").eval(), _batch(IMAGES, 5)
    r = gg.get_pass("grow_width")(target="0", to=7, init="gradmax", data=data).apply(
        gm, torch.Generator().manual_seed(0)
    )
    assert "closed form" in r.targets["gradmax"] and "ascent" not in r.targets["gradmax"]
    x, loss_fn = data()
    grown = r.gm.eval()
    loss_fn(grown(x)).backward()
    measured = float(grown.get_submodule("2").weight.grad[:, 4:].pow(2).sum()) / 3
    assert measured == pytest.approx(r.targets["gain"], rel=1e-3)


def test_places_with_nothing_to_aim_say_so():
    gm, data = _traced(_cnn(), "1x3x8x8"), _batch(IMAGES, 5)
    with pytest.raises(NotApplicable, match="adds none"):
        gg.get_pass("insert_adapter")(after="3", init="gradmax", data=data)(gm)
    with pytest.raises(gg.SpecError, match="one branch at a time"):  # refused with the arguments, before any model
        gg.get_pass("add_branch")(at="3", count=2, init="gradmax", data=data)
    same_width = _traced(
        nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(256, 5)
        ),
        "1x3x8x8",
    )
    with pytest.raises(NotApplicable, match="has none"):  # a max-pool branch between equal widths has no weights
        gg.get_pass("add_branch")(at="2", op="maxpool3x3", init="gradmax", data=data)(same_width)
    with pytest.raises(NotApplicable, match="none was given"):
        gg.get_pass("deepen")(init="gradmax")(gm)
