"""Issue 23, item 6: examples/grow_gpt.py in a few steps — the GPT grows mid-training (d 32 → 48, heads 2 → 3,
MLP 128 → 192, layers 2 → 3) with the loss unchanged by growth, and the grown model has the large architecture's
shapes."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import grow_gpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_growth_keeps_the_loss_and_reaches_the_large_shapes():
    summary = grow_gpt.run(None, steps=6, grow_at=3, every=3, limit=100_000, log=lambda *a: None)
    g = summary["growth"]
    assert g["step"] == 3 and g["params_before"] < g["params_after"]
    assert abs(g["train_after"] - g["train_before"]) < 1e-5 * g["train_before"]
    assert abs(g["val_after"] - g["val_before"]) < 1e-5 * g["val_before"]
    # the grown model is the large one, but for the inserted block's key projection, which has no bias
    assert summary["params"]["large"] - summary["params"]["grown_final"] == grow_gpt.LARGE["d"]
    assert set(summary["to_target"]) == {"grown", "large"}
