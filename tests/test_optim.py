"""carry_optimizer: momentum, Adam moments and step counts survive a growth event."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphgrow as gg

SHAPE = (1, 3, 8, 8)
OPTIMISERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    # no bias before the BatchNorm: its gradient is rounding noise, which Adam would normalise into real steps
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def step(m: nn.Module, opt: torch.optim.Optimizer) -> float:
    x, y = data()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def loss_of(m: nn.Module) -> float:
    x, y = data()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(m(x), y))


@pytest.mark.parametrize("kind", list(OPTIMISERS))
def test_carried_state_continues_the_old_models_training(kind):
    make = OPTIMISERS[kind]
    gm = gg.trace(model().train(), SHAPE)
    opt = make(gm.parameters())
    for _ in range(5):  # momentum / moments / step counts build up
        step(gm, opt)
    twin = copy.deepcopy(gm)  # the same training without growth
    twin_opt = make(twin.parameters())
    twin_opt.load_state_dict(opt.state_dict())

    grown = gg.Pipeline.from_spec("grow_width").run(gm).gm
    fresh_model = copy.deepcopy(grown)
    carried = gg.carry_optimizer(opt, gm, grown)
    fresh = make(fresh_model.parameters())
    assert loss_of(grown) == pytest.approx(loss_of(twin), abs=1e-6)  # growth itself changes nothing

    step(twin, twin_opt)
    step(grown, carried)
    step(fresh_model, fresh)
    # every old parameter moves exactly as it would have without growth (its old region, for grown tensors)
    old_shapes = dict(twin.named_parameters())
    far = 0.0
    for name, p in grown.named_parameters():
        if name not in old_shapes:
            continue
        box = tuple(slice(0, s) for s in old_shapes[name].shape)
        torch.testing.assert_close(p.detach()[box], old_shapes[name].detach(), rtol=1e-5, atol=1e-6)
        far = max(
            far,
            float((dict(fresh_model.named_parameters())[name].detach()[box] - old_shapes[name].detach()).abs().max()),
        )
    assert far > 1e-4  # a fresh optimiser takes a different step: the jump the helper removes
    # the grown tensors' new slices start with zero state, new parameters with none
    # before that step: grown tensors' new slices had zero state, the old region the old state
    grown2 = gg.Pipeline.from_spec("grow_width").run(twin).gm
    state = gg.carry_optimizer(twin_opt, twin, grown2).state
    widened = 0
    for name, p in grown2.named_parameters():
        old_p = dict(twin.named_parameters()).get(name)
        for key, value in state.get(p, {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            box = tuple(slice(0, n) for n in old_p.shape)
            assert torch.equal(value[box], twin_opt.state[old_p][key])
            if value.shape != old_p.shape:
                widened += 1
                rest = torch.ones_like(value, dtype=torch.bool)
                rest[box] = False
                assert bool((value[rest] == 0).all())
    assert widened > 0


def test_groups_and_settings_are_kept_and_new_parameters_join_the_first_group():
    gm = gg.trace(model().train(), SHAPE)
    head = [p for n, p in gm.named_parameters() if n.startswith("7.")]
    body = [p for n, p in gm.named_parameters() if not n.startswith("7.")]
    opt = torch.optim.SGD(
        [{"params": body, "lr": 0.1}, {"params": head, "lr": 0.01, "weight_decay": 0.5}], lr=0.1, momentum=0.9
    )
    step(gm, opt)
    grown = gg.Pipeline.from_spec("insert_adapter").run(gm).gm
    carried = gg.carry_optimizer(opt, gm, grown)
    assert [g["lr"] for g in carried.param_groups] == [0.1, 0.01]
    assert carried.param_groups[1]["weight_decay"] == 0.5
    names = {id(p): n for n, p in grown.named_parameters()}
    assert sorted(names[id(p)] for p in carried.param_groups[1]["params"]) == ["7.bias", "7.weight"]
    new = set(names.values()) - {n for n, _ in gm.named_parameters()}
    assert new and new <= {names[id(p)] for p in carried.param_groups[0]["params"]}
    assert sum(len(g["params"]) for g in carried.param_groups) == len(names)


def test_an_optimiser_of_another_model_is_refused():
    gm = gg.trace(model(), SHAPE)
    other = torch.optim.SGD(model().parameters(), lr=0.1)
    grown = gg.Pipeline.from_spec("insert_adapter").run(gm).gm
    with pytest.raises(gg.InputError, match="not in the old model"):
        gg.carry_optimizer(other, gm, grown)
