"""The search's move chooser aimed by the data (issue 26): `policy="gain"` grows the place with the largest
first-order gain, so a starved layer is grown first; the uniform default draws as before; bad policies,
missing data and bad data functions are refused before a search starts. No Ray."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrow as gg
from graphgrow.capture.trace import graph_info
from graphgrow.core.errors import InputError
from graphgrow.search import Move, MutationSpace

STARVED = "4"  # the 2-unit layer before a 10-class head


def _starved():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2), nn.ReLU(), nn.Linear(2, 10)
    )
    gm = gg.trace(m, input_shape=(1, 16))
    gg.annotate(gm, (1, 16))
    return gm


def _data():
    """A batch with a learnable signal: labels from a fixed random projection of the input."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g)
    y = (x @ torch.randn(16, 10, generator=g)).argmax(1)
    return x, lambda out: F.cross_entropy(out, y)


@pytest.fixture(scope="module")
def gm():
    return _starved()


def _target(spec: str) -> str:
    return spec.split("target=")[1].split(",")[0].rstrip(")")


def _placed(space: MutationSpace, gm, seed: int, spec: str = "grow_width") -> str:
    """The place the worker resolves for a move (without applying it)."""
    p, _ = space._place(gm, Move("m", spec, seed), 0)
    return str(p.target)


def test_policy_gain_grows_the_starved_layer_first(gm):
    uniform, aimed = MutationSpace.parse("grow_width"), MutationSpace.parse("grow_width", policy="gain", data=_data)
    assert _placed(uniform, gm, 1) != STARVED  # without the policy, this seed grows another place: the test can fail
    grown, outcome = aimed.apply(gm, Move("g", "grow_width", 1))
    assert outcome.grew and _target(outcome.spec) == STARVED, outcome
    assert outcome.gain is not None and outcome.gain > 0 and outcome.to_json()["gain"] == outcome.gain
    assert grown.get_submodule(STARVED).out_features > 2
    x = torch.randn(8, 16)
    with torch.no_grad():  # still exact: the gain policy only chooses the place
        torch.testing.assert_close(grown.eval()(x), gm.eval()(x), rtol=1e-5, atol=1e-6)


def test_policy_gain_sample_draws_in_proportion_to_the_gain(gm, monkeypatch):
    import graphgrow.search.space as space_module

    gains = {"0": 0.1, "2": 0.1, STARVED: 0.8}  # canned: the proportions are what is tested, not GradMax
    monkeypatch.setattr(
        space_module,
        "rank_by_gain",
        lambda gm, p, places, data, seed=0: sorted(
            [(c, gains[c.args["target"]], None) for c in places], key=lambda r: -r[1]
        ),
    )
    sample, best = (MutationSpace.parse("grow_width", policy=p, data=_data) for p in ("gain-sample", "gain"))
    picks = Counter(_placed(sample, gm, s) for s in range(150))
    assert 0.7 < picks[STARVED] / 150 < 0.9 and picks["0"] > 5 and picks["2"] > 5, picks
    assert {_placed(best, gm, s) for s in range(20)} == {STARVED}
    assert [_placed(sample, gm, s) for s in range(5)] == [_placed(sample, gm, s) for s in range(5)]  # seeded


def test_the_uniform_default_draws_as_before(gm):
    space = MutationSpace.parse("grow_width;deepen")
    assert space.policy == "uniform" and space.data is None
    places = [c.args["target"] for c in gg.get_pass("grow_width")().candidates(gm)]
    for s in range(6):
        _, outcome = space.apply(gm, Move(f"m{s}", "grow_width", s))
        assert outcome.gain is None and _target(outcome.spec) == random.Random(s).choice(places)


def test_passes_without_a_gain_keep_the_uniform_draw(gm):
    plain = MutationSpace.parse("grow_width;deepen")
    aimed = MutationSpace.parse("grow_width;deepen", policy="gain", data=_data)
    for s in range(3):
        a, b = plain.apply(gm, Move("m", "deepen", s))[1], aimed.apply(gm, Move("m", "deepen", s))[1]
        assert a.spec == b.spec and b.gain is None


def test_gradmax_moves_read_the_space_data(gm):
    space = MutationSpace.parse("grow_width(init=gradmax)", data=_data)
    grown, outcome = space.apply(gm, Move("m", "grow_width(init=gradmax)", 0))
    assert outcome.grew and f"data={__name__}:_data" in outcome.spec, outcome
    assert graph_info(grown)["log"][-1]["args"]["data"] == f"{__name__}:_data"  # the log names it, for replay


@pytest.mark.parametrize(
    "kwargs, moves, message",
    [
        ({"policy": "best"}, "grow_width", "unknown search policy 'best'.*gain-sample"),
        ({"policy": "gain"}, "grow_width", "no data was given"),
        ({"policy": "gain", "data": _data}, "add_residual;noop", "none of these moves has one"),
        ({"data": _data}, "grow_width;deepen", "neither is here"),
        ({}, "grow_width(init=gradmax)", "no data was given"),
    ],
)
def test_bad_policies_and_missing_data_are_refused_when_built(kwargs, moves, message):
    with pytest.raises(InputError, match=message):
        MutationSpace.parse(moves, **kwargs)


def test_a_bad_data_function_is_refused_before_the_search_writes_anything(gm, tmp_path):
    from graphgrow.search.runner import SearchOptions, search

    space = MutationSpace.parse("grow_width", policy="gain", data=lambda: torch.zeros(3))
    with pytest.raises(InputError, match="not \\(inputs, loss_fn\\)"):
        search(gm, lambda m, o: None, lambda m: 0.0, space, SearchOptions(storage_path=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_cli_policy_is_checked_before_ray(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from conftest import ROOT

    import graphgrow.search.job as job
    from graphgrow.cli import main

    monkeypatch.setattr(job, "_require_ray", lambda: pytest.fail("Ray was reached"))
    monkeypatch.chdir(ROOT)
    base = [
        "search",
        "examples.digits_task:model",
        "--train",
        "examples.digits_task:train_epoch",
        "--eval",
        "examples.digits_task:evaluate",
        "--mutations",
        "grow_width;deepen",
        "--storage-path",
        str(tmp_path),
    ]
    res = CliRunner().invoke(main, [*base, "--policy", "best"])
    assert res.exit_code == 2 and "'best' is not one of 'uniform', 'gain', 'gain-sample'" in res.output, res.output
    res = CliRunner().invoke(main, [*base, "--policy", "gain"])
    assert res.exit_code == 2 and "no data was given" in res.output and "--data" in res.output, res.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_search_on_ray_grows_where_the_gain_says(tmp_path):
    """The space's data function travels to the workers (by value) and every growth records its gain."""
    import os
    import sys

    ray = pytest.importorskip("ray")
    from conftest import ROOT

    from graphgrow.search import SearchOptions, search

    sys.path.insert(0, str(ROOT / "examples"))
    import digits_task as task

    os.environ["RAY_AUTH_MODE"] = "disabled"
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        space = MutationSpace.parse("grow_width", policy="gain", data=task.batch)
        lines: list[str] = []
        result = search(
            gg.trace(task.model(), input_shape=task.INPUT_SHAPE),
            task.train_epoch,
            task.evaluate,
            space,
            SearchOptions(population=4, rounds=4, storage_path=str(tmp_path), name="aimed", seed=1),
            say=lines.append,
        )
    finally:
        if started:
            ray.shutdown()
    grew = [ln for ln in lines if " grew " in ln]
    assert grew and all(" at gain " in ln for ln in grew), lines  # ranked on the worker, from the shipped function
    assert all(m["gain"] > 0 for m in result.moves if m["grew"]), result.moves
