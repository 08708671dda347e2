"""The sweep worker opens a model once for all its passes (tools/sweep_worker.py): the same opened model for each
pass, a refusal to open repeated for each, and a pass that changes the model it was given is caught."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from sweep_worker import _OpenOnce  # noqa: E402


def opened_model() -> SimpleNamespace:
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    return SimpleNamespace(gm=torch.fx.symbolic_trace(module), loaded=SimpleNamespace(module=module))


def test_a_model_is_opened_once_and_a_pass_that_changes_it_is_caught():
    calls = []

    def open_fn(source, load, progress, max_memory, **extra):
        calls.append(source)
        return opened_model()

    opener = _OpenOnce(open_fn)
    first = opener("m", "load", None, None)
    assert opener("m", "load", None, None) is first and calls == ["m"]
    assert not opener.changed()
    with torch.no_grad():
        first.loaded.module[1].running_mean += 1e-3  # a buffer changed in place, as a train-mode forward would
    assert opener.changed()
    assert opener("m", "load", None, None) is not first and calls == ["m", "m"]  # dropped, opened afresh
    opener("m", "other load", None, None)
    assert calls == ["m", "m", "m"]


def test_a_refusal_to_open_is_given_to_every_pass_without_opening_again():
    calls = []

    def open_fn(source, load, progress, max_memory, **extra):
        calls.append(source)
        raise ValueError("cannot capture")

    opener = _OpenOnce(open_fn)
    for _ in range(3):
        with pytest.raises(ValueError, match="cannot capture"):
            opener("m", "load", None, None)
    assert calls == ["m"] and not opener.changed()
