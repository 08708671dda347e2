"""MutationSpace: parsing, the driver's choice, the worker's deterministic application. No Ray."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import small_cnn

import graphgrow as gg
from graphgrow.graph.shapes import param_count
from graphgrow.search import NOOP, Move, MutationSpace, applied_moves


@pytest.fixture(scope="module")
def gm():
    return gg.trace(small_cnn().eval(), input_shape=(1, 3, 32, 32))


def test_parse_weights_and_noop():
    space = MutationSpace.parse("grow_width(factor=2)*2; deepen ;noop*0.5", max_params=10**6)
    assert space.moves == [("grow_width(factor=2)", 2.0), ("deepen", 1.0), (NOOP, 0.5)]
    assert space.max_params == 10**6


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty move"),
        ("deepen;;noop", "empty move"),
        ("deepen*x", "is not a number"),
        ("deepen*0", "weight"),
        ("deepen*-1", "weight"),
        ("no_such_pass", "no_such_pass"),
        ("deepen(depth=2)", "no argument"),
        ("deepen,add_residual", "one pass per move"),
    ],
)
def test_bad_spaces_are_refused_when_built(text, message):
    with pytest.raises(gg.SpecError, match=message):
        MutationSpace.parse(text)


def test_choice_is_reproducible_and_follows_the_weights():
    space = MutationSpace.parse("deepen*9;noop")
    a = [space.choose(random.Random(3)) for _ in range(2)]
    assert a[0] == a[1]
    rng = random.Random(0)
    moves = [space.choose(rng) for _ in range(400)]
    assert len({m.id for m in moves}) == 400  # a fresh id every time
    share = sum(m.spec == "deepen" for m in moves) / len(moves)
    assert 0.83 < share < 0.97


def test_move_round_trips_through_a_config():
    move = Move("abc", "deepen", 7)
    assert Move.from_config(move.to_config()) == move
    assert Move.from_config(None) is None


def test_noop_keeps_the_model(gm):
    same, outcome = MutationSpace.parse("noop").apply(gm, Move("m1", NOOP, 0))
    assert same is gm and not outcome.grew and outcome.reason == "no-op"


def test_a_move_is_applied_deterministically_and_recorded_in_the_log(gm):
    space = MutationSpace.parse("add_residual")
    x = torch.randn(4, 3, 32, 32)
    one, a = space.apply(gm, Move("m1", "add_residual", 11))
    two, b = space.apply(gm, Move("m2", "add_residual", 11))
    assert a.grew and b.grew and a.spec == b.spec and "start=" in a.spec  # the place was resolved, and named
    for k, v in one.state_dict().items():
        assert torch.equal(v, two.state_dict()[k]), k
    with torch.no_grad():
        torch.testing.assert_close(one.eval()(x), gm.eval()(x), rtol=1e-5, atol=1e-6)
    assert applied_moves(one) == {"m1"} and applied_moves(gm) == set()
    assert a.params_after == param_count(one) > a.params_before == param_count(gm)


def test_the_seed_picks_among_the_places(gm):
    space = MutationSpace.parse("add_residual")
    specs = {space.apply(gm, Move(f"m{s}", "add_residual", s))[1].spec for s in range(8)}
    assert len(specs) >= 2


def test_a_place_named_in_the_spec_is_kept(gm):
    space = MutationSpace.parse("grow_width(target=3,factor=2)")
    _, outcome = space.apply(gm, Move("m", "grow_width(target=3,factor=2)", 5))
    assert outcome.grew and "target=3" in outcome.spec


def test_the_budget_skips_moves_that_do_not_fit(gm):
    params = param_count(gm)
    space = MutationSpace.parse("deepen", max_params=params + 10)  # no deepen fits in 10 parameters
    same, outcome = space.apply(gm, Move("m", "deepen", 1))
    assert same is gm and not outcome.grew and "budget" in outcome.reason
    full = MutationSpace.parse("deepen", max_params=params)
    assert "budget" in full.apply(gm, Move("m", "deepen", 1))[1].reason


def test_a_move_that_cannot_apply_is_skipped_with_its_reason():
    mlp = gg.trace(torch.nn.Sequential(torch.nn.Linear(4, 3)), input_shape=(2, 4))
    space = MutationSpace.parse("add_branch")
    same, outcome = space.apply(mlp, Move("m", "add_branch", 0))
    assert same is mlp and not outcome.grew and outcome.reason.startswith("NotApplicable")


def test_a_trial_checkpoint_keeps_the_optimiser_state_by_name(tmp_path):
    """A grown model read back from its file lists its parameters in graph order, not the order
    the optimiser saw them in: the state must follow the names (found by the search demo)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    import digits_task as task

    from graphgrow.search.trial import (
        TrialSetup,
        TrialState,
        grow,
        model_bytes,
        read_state,
        restore_optimizer,
        write_state,
    )

    gm = gg.trace(task.model(), input_shape=task.INPUT_SHAPE)
    setup = TrialSetup(
        model_bytes(gm), task.train_epoch, task.evaluate, "val_loss", MutationSpace.parse("deepen;add_branch")
    )
    state = TrialState(gm)
    opt = torch.optim.SGD(state.model.parameters(), lr=0.05, momentum=0.9)
    task.train_epoch(state.model, opt)
    for i, spec in enumerate(["deepen", "add_branch"]):
        opt, record = grow(setup, state, opt, Move(f"m{i}", spec, i), "t")
        assert record["grew"] and record["metric_after"] == pytest.approx(record["metric_before"], rel=1e-6)
        task.train_epoch(state.model, opt)
        folder = tmp_path / str(i)
        folder.mkdir()
        write_state(folder, state, opt)
        back = read_state(folder)
        restored = restore_optimizer(setup, back.model, back.optimizer_state)
        theirs = dict(state.model.named_parameters())
        for name, p in back.model.named_parameters():
            assert torch.equal(restored.state[p]["momentum_buffer"], opt.state[theirs[name]]["momentum_buffer"]), name
        task.train_epoch(back.model, restored)  # shapes line up: the step runs
        assert back.seen == state.seen and [m["id"] for m in back.moves] == [f"m{j}" for j in range(i + 1)]


def _cli(*args):
    from click.testing import CliRunner

    from graphgrow.cli import main

    return CliRunner().invoke(
        main,
        [
            "search",
            "examples.digits_task:model",
            "--train",
            "examples.digits_task:train_epoch",
            "--eval",
            "examples.digits_task:evaluate",
            *args,
        ],
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mutations", "deepen;no_such_pass"], "no_such_pass"),
        (["--mutations", "deepen*zero"], "not a number"),
        (["--mutations", "deepen", "--max-params", "lots"], "not a size"),
        (["--mutations", "deepen", "--train", "examples.digits_task:no_such_function"], "no callable"),
    ],
)
def test_search_refuses_bad_input_before_starting_ray(args, message, monkeypatch, tmp_path):
    pytest.importorskip("ray")
    from conftest import ROOT

    monkeypatch.chdir(ROOT)
    result = _cli(*args, "--storage-path", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_resume_without_a_search_says_so(monkeypatch, tmp_path):
    pytest.importorskip("ray")
    from conftest import ROOT

    monkeypatch.chdir(ROOT)
    result = _cli("--mutations", "deepen", "--storage-path", str(tmp_path), "--resume", "--trust")
    assert result.exit_code == 2 and "nothing to resume" in result.output, result.output
    result = _cli("--mutations", "deepen", "--storage-path", str(tmp_path), "--resume")  # Tune's pickles: --trust first
    assert result.exit_code == 2 and "a pickle in that folder would run code" in result.output, result.output


@pytest.mark.parametrize(
    "name, message",
    [
        ("../../x", "is a path"),
        ("a/b", "is a path"),
        ("a\\b", "is a path"),
        ("..", "is not a folder name"),
        (".", "is not a folder name"),
        ("", "is not a folder name"),
        ("-x", "starts with '-'"),
        (".hidden", "starts with '.'"),
        ("x\x00y", "is a path"),
        ("a\nb", "control characters"),
        (" x", "space"),
        ("x" * 300, "longer than 200 bytes"),
    ],
)
def test_a_search_name_must_be_one_folder_name(name, message, monkeypatch, tmp_path):
    """--name becomes a folder under --storage-path: `../../x` once wrote outside it. Refused before Ray
    (or any import of it), before the model is opened, with nothing written anywhere."""
    from conftest import ROOT

    import graphgrow.search.job as job

    monkeypatch.setattr(job, "_require_ray", lambda: pytest.fail("Ray was reached"))
    monkeypatch.chdir(ROOT)
    storage = tmp_path / "a" / "b"
    result = _cli("--mutations", "deepen", "--storage-path", str(storage), "--name", name)
    assert result.exit_code == 2, result.output
    assert f"--name {name[:80]!r}" in result.output and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # not the storage, not ../../x


def test_search_outputs_are_checked_before_ray(monkeypatch, tmp_path):
    from conftest import ROOT

    import graphgrow.search.job as job

    monkeypatch.setattr(job, "_require_ray", lambda: pytest.fail("Ray was reached"))
    monkeypatch.chdir(ROOT)
    result = _cli("--mutations", "deepen", "--storage-path", str(tmp_path), "--plot", str(tmp_path / "p.txt"))
    assert result.exit_code == 2 and "cannot draw the plot to a .txt file" in result.output, result.output
    result = _cli("--mutations", "deepen", "--storage-path", str(tmp_path), "-o", str(tmp_path / "no" / "best.pt"))
    assert result.exit_code == 2 and "does not exist" in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_cannot_be_written_is_a_save_error(tmp_path, monkeypatch, gm):
    """A full disk under a trial is exit 2 naming the file, not an internal error (torch.save says RuntimeError)."""
    import errno
    import os

    import graphgrow.search.trial as trial
    from graphgrow.search.runner import SearchOptions, _collect

    def full(obj, f, *a, **k):
        if hasattr(f, "write"):
            f.write(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(gg.SaveError, match=r"cannot write .*model.pt: No space left on device"):
        trial.write_state(tmp_path, trial.TrialState(gm), opt)
    assert list(tmp_path.iterdir()) == []  # the model's staging file went too
    monkeypatch.undo()
    monkeypatch.setattr(trial, "torch_save", full)
    with pytest.raises(gg.SaveError, match=r"cannot write .*trainer.pt: No space left on device"):
        trial.write_state(tmp_path, trial.TrialState(gm), opt)

    ray_error = RuntimeError(
        "Failure # 1\nTraceback (most recent call last):\n  ...\ngraphgrow.core.errors.SaveError: cannot write "
        "/s/model.pt: No space left on device (check free space)"
    )
    results = type("Results", (), {"errors": [ray_error], "__len__": lambda self: 4})()
    with pytest.raises(gg.SaveError, match=r"1 of 4 trials failed; the first: cannot write /s/model.pt: No space left"):
        _collect(results, SearchOptions(), tmp_path, 1.0)


def test_the_core_and_the_search_space_do_not_import_ray():
    import subprocess
    import sys

    code = (
        "import sys, graphgrow, graphgrow.search, graphgrow.cli; "
        "from graphgrow.search import MutationSpace; MutationSpace.parse('deepen;noop'); "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
